"""Refusing hostile input at the edge of the REST API, in DRF's error shape.

Two places see everything a REST client sends besides headers (governance/auth.py handles the
Authorization header, gunicorn's parser refuses NUL and line breaks in any header):

- `QueryStringCheckMiddleware`: an /api/ query string whose percent-escapes are not UTF-8
  (`%ff`, an encoded surrogate `%ed%a0%80`, an overlong `%c0%80`) or that holds a control
  character (NUL, ESC, DEL, ...) in a name or value is answered 400 `{"detail": ...}` before any
  view runs. Django would otherwise replace the bad bytes with U+FFFD and pass NUL on to
  PostgreSQL (which refuses it in text: a 500), and a control character in a filter is never a
  real search.
- `StrictJSONParser` (DEFAULT_PARSER_CLASSES): a JSON body nested deeper than Python's
  recursion limit is a 400 instead of a RecursionError (500), and a string (key or value) with
  a control character other than tab, newline and carriage return, or with a lone surrogate
  (which no UTF-8 encoder, PostgreSQL's included, accepts), is a 400 naming where it is.

Both refuse the whole request; nothing of it is stored, and nothing stored before is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

# Control characters a text field may carry: tab, newline, carriage return.
ALLOWED_CONTROLS = frozenset("\t\n\r")


def bad_character(text: str, *, allow_layout: bool = True) -> str | None:
    """A description of the first character of `text` no text field may hold — a C0/C1 control
    character (NUL included; tab/newline/CR allowed when `allow_layout`) or a lone surrogate —
    or None."""
    for ch in text:
        code = ord(ch)
        if code < 0x20 or 0x7F <= code < 0xA0:
            if allow_layout and ch in ALLOWED_CONTROLS:
                continue
            return f"control character U+{code:04X}"
        if 0xD800 <= code < 0xE000:
            return f"lone surrogate U+{code:04X}"
    return None


def query_string_problem(raw: bytes) -> str | None:
    """Why a query string (the bytes the server received, before any decoding) is refused, or
    None."""
    if not raw:
        return None
    for pair in raw.replace(b";", b"&").split(b"&"):
        for part in pair.split(b"=", 1):
            try:
                text = unquote_to_bytes(part.replace(b"+", b" ")).decode("utf-8")
            except UnicodeDecodeError:
                return "the query string is not valid UTF-8"
            found = bad_character(text, allow_layout=False)
            if found:
                return f"the query string holds a {found}"
    return None


class QueryStringCheckMiddleware:
    """400 in DRF's shape for a hostile query string on the REST API (see the module doc)."""

    prefix = "/api/"

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path_info.startswith(self.prefix):
            # WSGI passes the bytes the server received as latin-1 text (as Django reads them:
            # django.core.handlers.wsgi.get_bytes_from_wsgi).
            raw = request.META.get("QUERY_STRING", "")
            try:
                data = raw.encode("iso-8859-1")
            except UnicodeEncodeError:  # not from a WSGI server: text already
                data = raw.encode("utf-8", "surrogatepass")
            problem = query_string_problem(data)
            if problem:
                return JsonResponse({"detail": f"Malformed request: {problem}."}, status=400)
        return self.get_response(request)


def _first_bad_string(data: Any) -> tuple[str, str] | None:
    """(path, problem) of the first string in a parsed JSON document that bad_character
    refuses; keys count too. Iterative: the document may be as deep as the parser allowed."""
    stack: list[tuple[str, Any]] = [("$", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = bad_character(value)
            if found:
                return path, found
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                found = bad_character(key)
                if found:
                    return f"{path} (a key)", found
                stack.append((f"{path}.{key}", item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


class StrictJSONParser(JSONParser):
    """DRF's JSON parser, plus the refusals of the module doc."""

    def parse(self, stream: Any, media_type: str | None = None,
              parser_context: dict | None = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the document is nested too deeply.") from None
        found = _first_bad_string(data)
        if found:
            path, problem = found
            raise ParseError(f"JSON parse error - {problem} in {path[2:] or 'the body'}: "
                             "text may hold tab, newline and carriage return, no other "
                             "control character and no lone surrogate.")
        return data
