"""Numbers from the environment, read alike by config/settings.py and the proxy (which loads no
Django): unset or empty keeps the default, and a bad value names the variable, which int()'s
and float()'s own messages ("invalid literal for int()") do not."""

from __future__ import annotations

import os


def _number(name: str, default: float, kind: type, error: type[Exception]) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return kind(value)
    except ValueError:
        noun = "a whole number" if kind is int else "a number"
        raise error(f"{name}={value!r} is not {noun} (default {default})") from None


def env_int(name: str, default: int, error: type[Exception] = ValueError) -> int:
    return int(_number(name, default, int, error))


def env_float(name: str, default: float, error: type[Exception] = ValueError) -> float:
    return _number(name, default, float, error)
