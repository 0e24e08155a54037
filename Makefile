# Steward — `make up` runs the appliance on embedded defaults, `make test` runs ruff + pytest.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Python 3.12 (mitmproxy 12 and Django 6 need 3.12+; the pgserver wheel exists for 3.12 only).
PYTHON312 ?= $(shell if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1; \
	  then command -v python3.12; else ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 \
	  /usr/local/bin/python3.12 /usr/bin/python3.12 2>/dev/null | tail -n 1; fi)
UV ?= $(shell command -v uv 2>/dev/null || echo $$HOME/.local/bin/uv)
VENV := .venv
EXTRAS ?= --extra train

.PHONY: help install up down test lint bench clean browser

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(UV):
	python3 -m pip install --user --quiet uv || python3 -m pip install --quiet uv

$(VENV)/.installed: pyproject.toml uv.lock | $(UV)
	@test -n "$(PYTHON312)" || { echo "Python 3.12+ is required (set PYTHON312=/path/to/python3.12)"; exit 1; }
	$(UV) sync --frozen --python "$(PYTHON312)" $(EXTRAS)
	touch $@

install: $(VENV)/.installed  ## create .venv from uv.lock (training extra included)

up: install  ## run the whole appliance on embedded defaults (Ctrl-C stops it)
	$(VENV)/bin/steward up

down:  ## stop a left-over embedded PostgreSQL
	$(VENV)/bin/steward down

lint: install  ## ruff
	$(VENV)/bin/ruff check .

# The console's browser tests drive Debian's Chromium through Playwright (no browser download).
CHROMIUM ?= /usr/bin/chromium
browser:  ## install Debian's chromium for the browser tests (needs root or sudo)
	@test -x $(CHROMIUM) || { SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium \
	  || { $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; }; }

test: install browser  ## ruff, then the whole pytest suite
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest

bench: install  ## benchmarks (tests/bench), figures go to stdout
	$(VENV)/bin/python tests/bench/proxy_overhead.py
	$(VENV)/bin/python -m tests.bench.sanitize_eval
	$(VENV)/bin/python tests/bench/grpo_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
