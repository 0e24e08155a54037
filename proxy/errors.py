"""OpenAI-shaped error responses, including for errors mitmproxy itself answers, and the limits
mitmproxy does not enforce on its own (header size, request body as it arrives).

Errors the addon decides after the request is read (400, 503, ...) are ordinary
`flow.response`s built by `error_response`.

Errors the addon decides at the request headers, before any body is read (401, 404, 413 for a
Content-Length over the limit, 400 for a bad X-Steward-* header): `refuse(flow, response)`.
mitmproxy would otherwise read (and buffer) the whole body before sending a response set in
`requestheaders`, so 800 MB without a key took 800 MB of memory to refuse. `refuse` kills the
flow (mitmproxy then stops reading the request) and leaves the response for the wrap below,
which sends it, half-closes the connection and drains — reads and drops — what the client is
still sending, up to `linger_bytes` or `linger_seconds`, then closes. Draining is what lets a
client that writes its whole body before reading (most HTTP clients) see the answer: closing
with unread data would reset the connection and lose it. A request without a body is refused
with an ordinary `flow.response` (nothing to buffer, the connection stays open).

Errors mitmproxy answers itself — upstream unreachable, upstream closed the connection, our
upstream timeout, a request body over the limit — go through `Http1Server.send(
ResponseProtocolError)`, which in mitmproxy 12 hard-codes an HTML page (`make_error_response`,
naming mitmproxy and its version in `Server:`). An agent's OpenAI client cannot parse that, so
`install()`:
- wraps `Http1Server.send`: for a ResponseProtocolError with no response head sent yet, it sends
  an OpenAI error JSON instead (same status; 504 when our upstream timeout fired for that client
  connection; the refusal stored by `refuse`), then closes the connection as mitmproxy does, or
  half-closes and drains when the request body is still arriving. Other events go to the
  original method untouched. Upstream addresses and socket errors are logged, not sent.
- replaces `_http1.make_error_response` (the malformed-request 400 page) with the JSON form.
- wraps `Http1Server.read_headers`: request head over `max_header_bytes` without its blank line
  -> 431 and close (mitmproxy buffers a head without bound: "FIXME: protect against header
  size DoS").
- wraps `HttpStream.check_body_size`: a request body that grows past `max_request_bytes` while
  it is read (chunked bodies have no Content-Length to refuse early) -> 413, buffer dropped.
  mitmproxy's own `body_size_limit` would do this but it is one option for requests and
  responses alike, and an upstream's answer may legitimately be larger than a request.
mitmproxy has no hooks for these; the wraps are the smallest changes that keep its state
machine intact, and they are checked at import time against the installed version (a missing
attribute fails loudly instead of silently serving HTML or buffering without bound).

HTTP/2 clients are not covered (OpenAI SDKs speak HTTP/1.1 to a plain-HTTP base_url).

The upstream timeout (mitmproxy has no upstream read timeout): the addon's `request` hook
records the flow's deadline (now + STEWARD_UPSTREAM_TIMEOUT; one sweep timer checks them all);
`responseheaders` removes it. When it passes, `mark_timed_out(client_conn_id)` is recorded and
the server connection's handler task is cancelled; mitmproxy then treats the upstream as closed
(ResponseProtocolError, normally a 502) and the wrap above turns it into 504.
"""

from __future__ import annotations

import logging
import time

import orjson
from mitmproxy import flow as mflow
from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers.http import HttpStream, SendHttp, _http1
from mitmproxy.proxy.layers.http._events import ErrorCode, ResponseProtocolError
from mitmproxy.proxy.layers.http._hooks import HttpErrorHook

log = logging.getLogger("steward.proxy")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 413: "invalid_request_error",
          431: "invalid_request_error", 429: "rate_limit_error"}
_CODES = {401: "invalid_api_key", 404: "unknown_url", 413: "request_too_large",
          431: "request_header_fields_too_large", 502: "upstream_unreachable",
          503: "service_unavailable", 504: "upstream_timeout"}
SERVER = "steward"  # never the mitmproxy version (it tells an attacker which CVEs apply)

# Limits, set by install() from the addon's settings.
max_header_bytes = 64 * 1024
max_request_bytes: int | None = None
linger_bytes = 10 * 1024 * 1024
linger_seconds = 10.0

# client connection id -> upstream timeout message, set when our timer fired for it.
_timed_out: dict[str, str] = {}
# client connection id -> the assembled response `refuse` decided, not sent yet.
_refusals: dict[str, bytes] = {}


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
    headers = {"Content-Type": "application/json", "Server": SERVER}
    if close:
        headers["Connection"] = "close"
    return http.Response.make(status, error_body(status, message, code, type_), headers)


def refuse(flow: http.HTTPFlow, response: http.Response) -> None:
    """Answer `response` from the requestheaders hook without reading the request body (see
    the module docstring). The connection is closed after the answer."""
    response.headers["Connection"] = "close"
    _refusals[flow.client_conn.id] = http1.assemble_response(response)
    flow.metadata["steward_refused"] = response.status_code
    flow.kill()


def mark_timed_out(client_conn_id: str, message: str) -> None:
    _timed_out[client_conn_id] = message


def forget(client_conn_id: str) -> None:
    _timed_out.pop(client_conn_id, None)
    _refusals.pop(client_conn_id, None)


def timed_out(client_conn_id: str) -> str | None:
    return _timed_out.get(client_conn_id)


def _raw_error(status: int, message: str) -> bytes:
    return http1.assemble_response(error_response(status, message, close=True))


def _make_error_response(status_code: int, message: str = "") -> bytes:
    """Replaces mitmproxy's HTML error page (malformed request heads, see module docstring)."""
    return _raw_error(status_code, message or "Bad request.")


_original_send = _http1.Http1Server.send
_original_read_headers = _http1.Http1Server.read_headers
_original_check_body_size = HttpStream.check_body_size


def _send(self, event):
    # Called for every event the HTTP/1 server layer sends (each SSE chunk included) as
    # `yield from self.send(event)`: return mitmproxy's own generator untouched unless this is
    # an error, rather than wrapping every event in another generator frame.
    if (isinstance(event, ResponseProtocolError) and not self.response
            and self.conn.state & ConnectionState.CAN_WRITE):
        refusal = _refusals.pop(self.conn.id, None)
        if refusal is not None:
            return _send_and_linger(self, refusal)
        if event.code.http_status_code() is not None:
            return _send_error(self, event)
    return _original_send(self, event)


def _send_error(self, event: ResponseProtocolError):
    status = event.code.http_status_code()
    timeout_message = _timed_out.pop(self.conn.id, None)
    if timeout_message is not None:
        status, message = 504, timeout_message
    elif status == 502:
        # The detail names the upstream's address and the socket error: for the log only.
        log.warning("upstream unreachable for client %s: %s", self.conn.id, event.message)
        message = "Steward could not reach the upstream model server."
    else:
        message = event.message
    if self.request_done:
        yield commands.SendData(self.conn, _raw_error(status, message))
        yield commands.CloseConnection(self.conn)
    else:
        yield from _send_and_linger(self, _raw_error(status, message))


class _Drain:
    """Http1Server state after an early answer: drop what the client still sends (never
    buffer it), close when it is done, or after `linger_bytes` / `linger_seconds`."""

    __slots__ = ("server", "left", "until")

    def __init__(self, server) -> None:
        self.server = server
        self.left = linger_bytes
        self.until = time.monotonic() + linger_seconds

    def __call__(self, event):
        server = self.server
        if isinstance(event, events.DataReceived):
            server.buf = _http1.ReceiveBuffer()  # _handle_event appended the data already: drop it
            self.left -= len(event.data)
            if self.left < 0 or time.monotonic() > self.until:
                yield commands.CloseConnection(server.conn)
        elif isinstance(event, events.ConnectionClosed):
            yield commands.CloseConnection(server.conn)


def _send_and_linger(self, raw: bytes):
    yield commands.SendData(self.conn, raw)
    yield commands.CloseTcpConnection(self.conn, half_close=True)
    self.buf = _http1.ReceiveBuffer()
    self.state = _Drain(self)


def _read_headers(self, event):
    yield from _original_read_headers(self, event)
    if (self.state == self.read_headers and isinstance(event, events.DataReceived)
            and len(self.buf) > max_header_bytes):
        log.warning("request head from %s over %d bytes: 431", self.conn.peername,
                    max_header_bytes)
        self.state = self.done
        yield commands.SendData(self.conn, _raw_error(
            431, f"Request headers exceed Steward's limit of {max_header_bytes} bytes "
            "(STEWARD_MAX_HEADER_BYTES)."))
        yield commands.CloseConnection(self.conn)


def _check_body_size(self, request: bool):
    if (request and max_request_bytes is not None
            and len(self.request_body_buf) > max_request_bytes):
        return _request_too_large(self)
    return _original_check_body_size(self, request)


def _request_too_large(self):
    message = (f"Request body exceeds Steward's limit of {max_request_bytes} bytes "
               "(STEWARD_MAX_REQUEST_BYTES).")
    self.request_body_buf.clear()
    self.flow.error = mflow.Error(message)
    yield HttpErrorHook(self.flow)
    yield SendHttp(ResponseProtocolError(self.stream_id, message, ErrorCode.REQUEST_TOO_LARGE),
                   self.context.client)
    self.client_state = self.state_errored
    self.flow.live = False
    return True


def install(*, header_bytes: int | None = None, request_bytes: int | None = None,
            drain_bytes: int | None = None, drain_seconds: float | None = None) -> None:
    """Idempotent: wrap mitmproxy's HTTP/1 server layer once per process; the limits are
    (re)set on every call."""
    global max_header_bytes, max_request_bytes, linger_bytes, linger_seconds
    if header_bytes is not None:
        max_header_bytes = header_bytes
    if request_bytes is not None:
        max_request_bytes = request_bytes
    if drain_bytes is not None:
        linger_bytes = drain_bytes
    if drain_seconds is not None:
        linger_seconds = drain_seconds
    if _http1.Http1Server.send is not _send:
        _http1.Http1Server.send = _send
        _http1.Http1Server.read_headers = _read_headers
        _http1.make_error_response = _make_error_response
        HttpStream.check_body_size = _check_body_size
