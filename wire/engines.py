"""The engines an operator configured: the only hosts Steward sends agent traffic, evaluation
prompts, weights or credentials to. No Django here — the proxy reads the same configuration
from its environment as the web and worker processes read from Django settings.

Why: a URL typed by a steward (a candidate's `upstream_url`, a job's `rollout_url`) used to be
fetched as given, carrying the upstream provider's key or the SGLang key; a hostile value made
the appliance send approved prompts, live agent calls and credentials to any host, or push
weights into the production engine (issue 12). Now such a field names an engine of the
operator's list (by name, or by the exact URL of a listed engine) and nothing else, and each
engine gets only its own credential.

Three lists:
- candidate engines (evolution: a candidate served elsewhere, the baseline, a canary arm):
  `STEWARD_ENGINE_ALLOWLIST` ("name=url" pairs, comma or whitespace separated) plus the two
  the operator configured anyway: `upstream` (STEWARD_UPSTREAM_URL, credential
  STEWARD_UPSTREAM_API_KEY) and `sglang-canary` (STEWARD_SGLANG_CANARY_URL, credential
  STEWARD_SGLANG_API_KEY);
- rollout engines (training jobs sample from them and push weights into them):
  `STEWARD_ROLLOUT_ENGINES`, same format; the first is the default. A rollout engine may never
  be an engine that serves agents (the upstream, STEWARD_SGLANG_URL, the canary engine, a
  candidate engine): a job must not be able to push weights into production;
- serving engines: those above that serve agent traffic.

A listed engine's credential is `STEWARD_ENGINE_<NAME>_API_KEY` (name upper-cased, every
character other than a letter or digit as `_`); none set: no Authorization header is sent. A
mapping instead of the string (Django settings, tests) may give `{"name": {"url": ...,
"api_key": ...}}` or `{"name": url}`.

`validate_http_url` is the one URL check: http or https, a host, no user info, no query or
fragment, no whitespace or control characters — `file://`, `gopher://` and the like are
refused wherever a URL is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

ALLOWLIST_SETTING = "STEWARD_ENGINE_ALLOWLIST"
ROLLOUT_SETTING = "STEWARD_ROLLOUT_ENGINES"
UPSTREAM_ENGINE = "upstream"
CANARY_ENGINE = "sglang-canary"
ENGINE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")


class EngineError(ValueError):
    """A URL or engine name that is not allowed; the message is safe to show to the caller."""


def validate_http_url(url: Any, what: str = "URL") -> str:
    """`url` without its trailing slashes, if it is an http(s) URL with a host and nothing
    that does not belong in an engine's address; else EngineError naming `what`."""
    text = url.strip() if isinstance(url, str) else ""
    if not text:
        raise EngineError(f"{what} is empty")
    if _UNSAFE.search(text):
        raise EngineError(f"{what} must not contain whitespace or control characters")
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 — raises ValueError for a port that is not a number
    except ValueError:
        raise EngineError(f"{what} is not a valid URL") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise EngineError(f"{what} must be an http(s) URL with a host (other schemes such as "
                          "file:// are refused)")
    if parts.username is not None or parts.password is not None:
        raise EngineError(f"{what} must not carry a user name or password")
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise EngineError(f"{what} must not carry a query or fragment")
    return text.rstrip("/")


def _canonical(url: str) -> str:
    """How engine URLs are compared: lower-case scheme and host, no trailing slash, no
    trailing /v1 (an OpenAI base URL and its root are the same engine)."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    netloc = parts.netloc.lower()
    return f"{parts.scheme.lower()}://{netloc}{path}"


def key_setting(name: str) -> str:
    return "STEWARD_ENGINE_" + re.sub(r"[^A-Z0-9]", "_", name.upper()) + "_API_KEY"


class Engine:
    """One operator-configured engine. The credential stays out of repr()."""

    __slots__ = ("api_key", "name", "url")

    def __init__(self, name: str, url: str, api_key: str = "") -> None:
        self.name = name
        self.url = url
        self.api_key = api_key

    @property
    def canonical(self) -> str:
        return _canonical(self.url)

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, {self.url!r})"


def parse_engines(spec: Any, lookup: Callable[[str], Any], what: str) -> dict[str, Engine]:
    """{name: Engine} from an operator's list (the string form or a mapping, see the module
    docstring). A malformed list is an EngineError naming the setting: a configuration
    mistake is loud, never a silently empty list."""
    if not spec:
        return {}
    items: list[tuple[str, Any]]
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for entry in re.split(r"[,\s]+", spec.strip()):
            if not entry:
                continue
            name, sep, url = entry.partition("=")
            if not sep:
                raise EngineError(f"{what}: {entry!r} is not name=url")
            items.append((name, url))
    else:
        raise EngineError(f"{what} must be a string of name=url pairs or a mapping")
    engines: dict[str, Engine] = {}
    seen: dict[str, str] = {}
    for raw_name, value in items:
        name = str(raw_name).strip().lower()
        if not ENGINE_NAME.match(name):
            raise EngineError(f"{what}: engine name {raw_name!r} must be lower-case letters, "
                              "digits, '.', '_' or '-'")
        if name in engines:
            raise EngineError(f"{what}: engine {name!r} is listed twice")
        url, api_key = (value.get("url"), value.get("api_key")) if isinstance(
            value, Mapping) else (value, None)
        engine = Engine(name, validate_http_url(url, f"{what}: the URL of engine {name!r}"),
                        str(api_key if api_key is not None else lookup(key_setting(name)) or ""))
        if engine.canonical in seen:
            raise EngineError(f"{what}: engines {seen[engine.canonical]!r} and {name!r} have the "
                              "same URL")
        seen[engine.canonical] = name
        engines[name] = engine
    return engines


class Engines:
    """The operator's engines, read through `lookup(setting name) -> value or None` (Django
    settings with the environment behind them, or os.environ.get in the proxy)."""

    def __init__(self, lookup: Callable[[str], Any]) -> None:
        def text(name: str) -> str:
            value = lookup(name)
            return value.strip() if isinstance(value, str) else ""

        self.candidates = parse_engines(lookup(ALLOWLIST_SETTING), lookup, ALLOWLIST_SETTING)
        for name, setting, key in ((UPSTREAM_ENGINE, "STEWARD_UPSTREAM_URL",
                                    "STEWARD_UPSTREAM_API_KEY"),
                                   (CANARY_ENGINE, "STEWARD_SGLANG_CANARY_URL",
                                    "STEWARD_SGLANG_API_KEY")):
            if text(setting) and name not in self.candidates:
                engine = Engine(name, validate_http_url(text(setting), setting), text(key))
                if any(e.canonical == engine.canonical for e in self.candidates.values()):
                    continue  # listed under another name already (with its own credential)
                self.candidates[name] = engine
        self.rollout = parse_engines(lookup(ROLLOUT_SETTING), lookup, ROLLOUT_SETTING)
        serving = {e.canonical for e in self.candidates.values()}
        if text("STEWARD_SGLANG_URL"):
            serving.add(_canonical(validate_http_url(text("STEWARD_SGLANG_URL"),
                                                     "STEWARD_SGLANG_URL")))
        self.serving = frozenset(serving)

    @staticmethod
    def _find(engines: dict[str, Engine], value: Any) -> Engine | None:
        text = value.strip() if isinstance(value, str) else ""
        if text.lower() in engines:
            return engines[text.lower()]
        try:
            wanted = _canonical(validate_http_url(text))
        except EngineError:
            return None
        return next((e for e in engines.values() if e.canonical == wanted), None)

    def for_url(self, url: str) -> Engine | None:
        """The candidate engine at `url` (None: not one the operator listed)."""
        return self._find(self.candidates, url)

    @classmethod
    def _named(cls, engines: dict[str, Engine], value: Any, what: str, kind: str,
               setting: str) -> Engine:
        """The engine of `engines` that `value` names (its name, or its exact URL); else
        EngineError — a free-text URL is never used."""
        if isinstance(value, str) and "://" in value:
            validate_http_url(value, what)  # a bad scheme says so before "not listed"
        engine = cls._find(engines, value)
        if engine is None:
            names = ", ".join(sorted(engines)) or f"none: the operator sets {setting}"
            raise EngineError(f"{what} must name {kind} the operator configured ({names}), "
                              "not a free URL")
        return engine

    def candidate(self, value: Any, what: str = "upstream_url") -> Engine:
        """The candidate engine `value` names (its name, or its exact URL)."""
        return self._named(self.candidates, value, what, "an engine", ALLOWLIST_SETTING)

    def rollout_engine(self, value: Any, what: str = "rollout_url") -> Engine:
        """The rollout engine `value` names ("" or None: the first listed); EngineError for
        anything else, and for an engine that also serves agents."""
        if not (isinstance(value, str) and value.strip()):
            if not self.rollout:
                raise EngineError(f"no rollout engine is configured: the operator lists the "
                                  f"SGLang servers training may use in {ROLLOUT_SETTING}")
            engine = next(iter(self.rollout.values()))
        else:
            engine = self._named(self.rollout, value, what, "a rollout engine",
                                 ROLLOUT_SETTING)
        if engine.canonical in self.serving:
            raise EngineError(f"rollout engine {engine.name!r} also serves agents (upstream, "
                              "STEWARD_SGLANG_URL or a canary engine): a training job never "
                              "pushes weights into a serving engine")
        return engine
