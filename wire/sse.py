"""Server-sent events (`text/event-stream`) as the OpenAI endpoints send them.

Two readers, one per need: `iter_sse` follows the WHATWG rules that matter (CRLF or LF, several
`data:` lines of one event, comments, a cut-off last event) and is what the step builder and
erasure read; `data_payloads` is the proxy's hot-path reader (one JSON parse for the whole
stream, on the event loop), best effort by design.
"""

from __future__ import annotations

from typing import Any

import orjson


def iter_sse(data: bytes) -> list[tuple[str | None, str]]:
    """Parse a `text/event-stream` body into (event name, data) pairs, per the WHATWG rules that
    matter here: CRLF or LF line ends, several `data:` lines joined by newlines, comments
    ignored, a trailing event without its blank line still counted (a cut-off stream)."""
    events: list[tuple[str | None, str]] = []
    event: str | None = None
    data_lines: list[str] = []
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    for line in text.split("\n"):
        if line == "":
            if data_lines:
                events.append((event, "\n".join(data_lines)))
            event, data_lines = None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data_lines.append(value)
        elif field == "event":
            event = value
    if data_lines:
        events.append((event, "\n".join(data_lines)))
    return events


def sse_json_events(data: bytes) -> tuple[list[tuple[str | None, dict]], int, bool]:
    """JSON objects of a stream, the number of data payloads that were not JSON, and whether
    the `[DONE]` terminator arrived."""
    out: list[tuple[str | None, dict]] = []
    bad = 0
    done = False
    for event, payload in iter_sse(data):
        if payload.strip() == "[DONE]":
            done = True
            continue
        try:
            value = orjson.loads(payload)
        except orjson.JSONDecodeError:
            bad += 1
            continue
        if isinstance(value, dict):
            out.append((event, value))
        else:
            bad += 1
    return out, bad, done


def data_payloads(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body's `data:` lines (skips `[DONE]` and junk).

    This runs on the proxy's event loop once per streamed answer (trajectory inference), and a
    real stream has one event per token: the payloads are parsed as one JSON array, one C call
    instead of one per event (~25% less time on 200 events). A payload that is not JSON makes
    that parse fail or yield a different count, and then each is parsed on its own. (Invalid
    payloads crafted to pair up into valid JSON could still fool the count; inference is best
    effort, and such a stream is one the agent's own client could not read either.)"""
    payloads = [data for line in body.splitlines() if line.startswith(b"data:")
                if (data := line[5:].strip()) and data != b"[DONE]"]
    if not payloads:
        return []
    try:
        docs = orjson.loads(b"[" + b",".join(payloads) + b"]")
        if len(docs) == len(payloads):
            return docs
    except orjson.JSONDecodeError:
        pass
    docs = []
    for data in payloads:
        try:
            docs.append(orjson.loads(data))
        except orjson.JSONDecodeError:
            continue
    return docs
