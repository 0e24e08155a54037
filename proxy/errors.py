"""OpenAI-shaped error responses, including for errors mitmproxy itself answers.

Errors the addon decides (401, 413, 503) are ordinary `flow.response`s built by `error_response`.

Errors mitmproxy answers itself — upstream unreachable, upstream closed the connection, our
upstream timeout — go through `Http1Server.send(ResponseProtocolError)`, which in mitmproxy 12
hard-codes an HTML page (`make_error_response`). An agent's OpenAI client cannot parse that, so
`install()` wraps `Http1Server.send`: for a ResponseProtocolError with no response head sent
yet, it sends an OpenAI error JSON instead (same status; 504 when our upstream timeout fired for
that client connection), then closes the connection exactly as mitmproxy does. Other events go
to the original method untouched. mitmproxy has no hook for this; the wrap is the smallest
change that keeps its state machine intact, and it is checked at import time against the
installed version (a missing attribute fails loudly instead of silently serving HTML).

HTTP/2 clients are not covered (OpenAI SDKs speak HTTP/1.1 to a plain-HTTP base_url).

The upstream timeout (mitmproxy has no upstream read timeout): the addon's `request` hook
records the flow's deadline (now + STEWARD_UPSTREAM_TIMEOUT; one sweep timer checks them all);
`responseheaders` removes it. When it passes, `mark_timed_out(client_conn_id)` is recorded and
the server connection's handler task is cancelled; mitmproxy then treats the upstream as closed
(ResponseProtocolError, normally a 502) and the wrap above turns it into 504.
"""

from __future__ import annotations

import orjson
from mitmproxy import http, version
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands
from mitmproxy.proxy.layers.http import _http1
from mitmproxy.proxy.layers.http._events import ResponseProtocolError

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error"}
_CODES = {401: "invalid_api_key", 413: "request_too_large", 502: "upstream_unreachable",
          503: "service_unavailable", 504: "upstream_timeout"}

# client connection id -> upstream timeout message, set when our timer fired for it.
_timed_out: dict[str, str] = {}


def error_body(status: int, message: str, code: str | None = None,
               type_: str | None = None) -> bytes:
    return orjson.dumps({"error": {
        "message": message,
        "type": type_ or _TYPES.get(status, "api_error" if status >= 500 else
                                    "invalid_request_error"),
        "param": None,
        "code": code if code is not None else _CODES.get(status),
    }})


def error_response(status: int, message: str, code: str | None = None,
                   type_: str | None = None, close: bool = False) -> http.Response:
    headers = {"Content-Type": "application/json", "Server": "steward"}
    if close:
        headers["Connection"] = "close"
    return http.Response.make(status, error_body(status, message, code, type_), headers)


def mark_timed_out(client_conn_id: str, message: str) -> None:
    _timed_out[client_conn_id] = message


def forget(client_conn_id: str) -> None:
    _timed_out.pop(client_conn_id, None)


def timed_out(client_conn_id: str) -> str | None:
    return _timed_out.get(client_conn_id)


def _raw_error(status: int, message: str) -> bytes:
    resp = error_response(status, message, close=True)
    resp.headers["Server"] = f"steward ({version.MITMPROXY})"
    return http1.assemble_response(resp)


_original_send = _http1.Http1Server.send


def _send(self, event):
    # Called for every event the HTTP/1 server layer sends (each SSE chunk included) as
    # `yield from self.send(event)`: return mitmproxy's own generator untouched unless this is
    # the error page, rather than wrapping every event in another generator frame.
    if (isinstance(event, ResponseProtocolError) and not self.response
            and self.conn.state & ConnectionState.CAN_WRITE
            and event.code.http_status_code() is not None):
        return _send_error(self, event)
    return _original_send(self, event)


def _send_error(self, event: ResponseProtocolError):
    status = event.code.http_status_code()
    timeout_message = _timed_out.pop(self.conn.id, None)
    if timeout_message is not None:
        status, message = 504, timeout_message
    elif status == 502:
        message = f"Steward could not reach the upstream model server: {event.message}"
    else:
        message = event.message
    yield commands.SendData(self.conn, _raw_error(status, message))
    yield commands.CloseConnection(self.conn)


def install() -> None:
    """Idempotent: wrap Http1Server.send once per process."""
    if _http1.Http1Server.send is not _send:
        _http1.Http1Server.send = _send
