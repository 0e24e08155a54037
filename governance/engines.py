"""The operator's engines as the web and worker processes see them (wire/engines.py has the
rules and the settings' format): Django settings first, the environment behind them."""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings

from governance.services import ServiceError
from wire.engines import Engine, EngineError, Engines, validate_http_url

__all__ = ["Engine", "EngineError", "checked_url", "engines", "validate_http_url"]


def _lookup(name: str) -> Any:
    # A setting Django has (even empty) wins, so a test or deployment that clears it clears it.
    if hasattr(settings, name):
        return getattr(settings, name)
    return os.environ.get(name)


def engines() -> Engines:
    """Read on every call (cheap): an operator's change applies without a restart of the
    caller's code path, and tests can change settings."""
    try:
        return Engines(_lookup)
    except EngineError as exc:
        raise ServiceError(f"the engine configuration is invalid: {exc}") from None


def checked_url(url: Any, what: str = "URL") -> str:
    """validate_http_url with the services' error type (the one URL check of the apps)."""
    try:
        return validate_http_url(url, what)
    except EngineError as exc:
        raise ServiceError(str(exc)) from None


def candidate_engine(value: Any, what: str = "upstream_url") -> Engine:
    """The operator's candidate engine `value` names (its name, or its exact URL), else
    ServiceError. Used for every URL a person gives the control plane (a candidate's
    upstream, the baseline, a canary route): the gates send approved prompts and the engine's
    credential there, and a canary sends live, unsanitized agent calls."""
    registry = engines()
    try:
        return registry.candidate(value, what)
    except EngineError as exc:
        raise ServiceError(str(exc)) from None


def candidate_engine_url(value: Any, what: str = "upstream_url") -> str:
    """"" for an empty value, else candidate_engine(value).url (what gets stored)."""
    if not (isinstance(value, str) and value.strip()):
        return ""
    return candidate_engine(value, what).url
