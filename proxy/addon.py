"""Steward's mitmproxy addon: `mitmdump --mode reverse:<upstream> -s proxy/addon.py`.

What it does per request (hooks never block: no database, disk or network calls here — the key
table is refreshed by a thread, the spool is written by a thread):

- Decided at the request headers, before the body is read (a refusal never buffers a body:
  errors.refuse): every path requires `Authorization: Bearer stw_...`, a Steward proxy key
  that is known and not revoked, otherwise 401; only the OpenAI inference endpoints and the
  operator's STEWARD_PROXY_ALLOWED_PATHS are forwarded, anything else is 404 (proxy/paths.py:
  the upstream's own endpoints, e.g. SGLang's `/update_weights_from_disk` or a debug path,
  are never reachable with an agent key); Content-Length over STEWARD_MAX_REQUEST_BYTES ->
  413 (a chunked body is cut at the limit as it arrives, errors.py); X-Steward-* values that
  are not UTF-8 text without control characters -> 400; spool over STEWARD_SPOOL_MAX_BYTES ->
  503 (STEWARD_SPOOL_FULL_POLICY=reject, the default) or forwarded uncaptured (passthrough).
  All refusals are OpenAI error JSON and nothing is forwarded.
- The agent's key is replaced by `Bearer $STEWARD_UPSTREAM_API_KEY` (removed when unset), and
  `X-Steward-*` headers are stripped before forwarding. A canary route sends its sessions only
  to an engine the operator listed (wire/engines.py), with that engine's own credential; a
  route naming any other URL is not followed (its sessions stay on the control upstream).
- Captured (spooled) are only `POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`;
  `GET /v1/models` and allow-listed paths pass through uncaptured. On captured paths
  `Accept-Encoding` is forced to `identity` so the spooled body (and an SSE stream) is plain
  bytes; the recorded request headers are those the agent sent.
- An exception in Steward's own request hooks fails closed: 500 in OpenAI's shape, logged
  with flow, tenant and agent, nothing forwarded (mitmproxy alone would log it and forward
  the request uncaptured). Trajectory inference failing only means a new trajectory.
- The trajectory and step ids are chosen before forwarding (proxy/inference.py) and returned in
  `X-Steward-Trajectory` / `X-Steward-Step`. A call that names `X-Steward-Session` takes no
  prefix hashes before forwarding; after its response it feeds the inference index (hashes,
  the answer re-parsed from its SSE) only when its agent also sends calls without a session,
  the only calls the index can link.
- SSE responses are streamed to the agent as they arrive (a tee that keeps a reference to each
  chunk, no re-chunking); other responses are forwarded as mitmproxy does. A stream silent
  for STEWARD_STREAM_IDLE_TIMEOUT between chunks is closed (error kind stream_idle_timeout).
  The record keeps at most STEWARD_MAX_CAPTURE_BYTES of a response (`response_truncated`
  says how much came); the agent always gets all of it.
- When the exchange ends (`response` or `error`), one spool record (contract in wire/spool.py's
  reader and the shipper) is built and the inference index learns the exchange. That work
  runs in a `call_soon` callback, i.e. after mitmproxy has written the response to the agent;
  records reach the spool writer thread in bursts every 20 ms (one wake-up and fsync per burst).
  The record keeps the raw header fields and bodies; the header text is made on the writer
  thread (`spool_form`), so the event loop does not spend time on it, and the bodies are
  spooled as raw bytes (binary frames, wire/spool.py).
- Upstream unreachable -> 502, no response headers within STEWARD_UPSTREAM_TIMEOUT -> 504, both
  as OpenAI error JSON (mechanism in proxy/errors.py), and a failed step is spooled.

Configuration is read from the environment when the script loads (see `Settings`). A proxy that
cannot load its configuration (no master key, unwritable spool) answers 503 to everything and
asks mitmproxy to shut down, rather than forwarding uncaptured traffic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

# mitmdump imports this file as a script; make the repository root importable when the launcher
# did not put it on PYTHONPATH.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import orjson  # noqa: E402
from mitmproxy import ctx, http  # noqa: E402

from proxy import dispatch, errors  # noqa: E402
from proxy.inference import (  # noqa: E402
    NEW,
    Decision,
    TrajectoryIndex,
    canonical_item,
    decide,
    prefix_hashes,
    responses_items,
)
from proxy.keys import KeyInfo, KeyTable  # noqa: E402
from proxy.paths import PathPolicy  # noqa: E402
from proxy.routing import (  # noqa: E402
    ASSIGNMENT_KEY_PURPOSE,
    NO_PLAN,
    Plan,
    RoutingTable,
    apply_plan,
)
from proxy.spool import SpoolWriter  # noqa: E402
from wire.crypto import derive_key, load_master_key  # noqa: E402  (Django-free)
from wire.engines import Engine, Engines  # noqa: E402
from wire.env import env_float, env_int  # noqa: E402
from wire.ids import new_id  # noqa: E402
from wire.openai import chat_answer, response_id, responses_answer  # noqa: E402
from wire.rewrite import upstream_parts  # noqa: E402

log = logging.getLogger("steward.proxy")

MAX_SESSION_LENGTH = 256  # Trajectory.session_id
# Records are handed to the spool writer in bursts at most this old (see Steward._hand_off).
HANDOFF_SECONDS = 0.02


class Settings:
    """The proxy's configuration (from the environment; names in DESIGN.md)."""

    # Plain classes, not dataclasses: mitmdump executes this file outside sys.modules, which
    # dataclasses cannot handle under `from __future__ import annotations`.
    def __init__(self, **values: Any) -> None:
        self.spool_dir: Path = values["spool_dir"]
        self.spool_max_bytes: int = values["spool_max_bytes"]
        self.spool_full_policy: str = values["spool_full_policy"]
        self.max_request_bytes: int = values["max_request_bytes"]
        self.upstream_timeout: float = values["upstream_timeout"]
        self.upstream_api_key: str = values["upstream_api_key"]
        self.key_refresh_seconds: float = values["key_refresh_seconds"]
        self.routing_refresh_seconds: float = values.get("routing_refresh_seconds", 5.0)
        self.route_sticky_max: int = values.get("route_sticky_max", 200_000)
        self.database_url: str = values["database_url"]
        self.master_key_env: str = values["master_key_env"]
        self.master_key_file: str = values["master_key_file"]
        # The operator's candidate engines (wire/engines.py): a canary route is followed only
        # to one of them, with that engine's own credential.
        self.engines: Engines = values.get("engines") or Engines(lambda _name: None)

        self.allowed_paths: str = values.get("allowed_paths", "")
        self.max_header_bytes: int = values.get("max_header_bytes", 64 * 1024)
        self.stream_idle_timeout: float = values.get("stream_idle_timeout", 600.0)
        self.max_capture_bytes: int = values.get("max_capture_bytes", 64 * 1024 * 1024)

    @classmethod
    def from_env(cls) -> Settings:
        var_dir = Path(os.environ.get("STEWARD_VAR_DIR", Path(_ROOT) / "var"))
        policy = os.environ.get("STEWARD_SPOOL_FULL_POLICY", "reject").strip().lower()
        if policy not in ("reject", "passthrough"):
            raise ValueError("STEWARD_SPOOL_FULL_POLICY must be 'reject' or 'passthrough'")
        return cls(
            spool_dir=Path(os.environ.get("STEWARD_SPOOL_DIR", var_dir / "spool")),
            spool_max_bytes=env_int("STEWARD_SPOOL_MAX_BYTES", 1024**3),
            spool_full_policy=policy,
            max_request_bytes=env_int("STEWARD_MAX_REQUEST_BYTES", 10 * 1024 * 1024),
            upstream_timeout=env_float("STEWARD_UPSTREAM_TIMEOUT", 600.0),
            upstream_api_key=os.environ.get("STEWARD_UPSTREAM_API_KEY", "").strip(),
            key_refresh_seconds=env_float("STEWARD_KEY_REFRESH_SECONDS", 1.0),
            routing_refresh_seconds=env_float("STEWARD_ROUTING_REFRESH_SECONDS", 5.0),
            route_sticky_max=env_int("STEWARD_ROUTE_STICKY_MAX", 200_000),
            database_url=os.environ.get("DATABASE_URL", ""),
            master_key_env=os.environ.get("STEWARD_MASTER_KEY", ""),
            master_key_file=os.environ.get("STEWARD_MASTER_KEY_FILE",
                                           str(var_dir / "master.key")),
            engines=Engines(os.environ.get),

            allowed_paths=os.environ.get("STEWARD_PROXY_ALLOWED_PATHS", ""),
            max_header_bytes=env_int("STEWARD_MAX_HEADER_BYTES", 64 * 1024),
            stream_idle_timeout=env_float("STEWARD_STREAM_IDLE_TIMEOUT", 600.0),
            max_capture_bytes=env_int("STEWARD_MAX_CAPTURE_BYTES", 64 * 1024 * 1024),
        )


class Admitted:
    """What `requestheaders` decided about a request it let through (in flow.metadata): the
    key, the captured endpoint (None: passed through uncaptured) and the validated
    X-Steward-* values; `request` does the rest once the body is read."""

    __slots__ = ("key", "endpoint", "session", "subject", "consent", "recorded",
                 "has_encoding")

    def __init__(self, key: KeyInfo, endpoint: str | None, session: str | None,
                 subject: str | None, consent: str,
                 recorded: tuple[tuple[bytes, bytes], ...], has_encoding: bool) -> None:
        self.key = key
        self.endpoint = endpoint
        self.session = session
        self.subject = subject
        self.consent = consent
        self.recorded = recorded
        self.has_encoding = has_encoding


class Capture:
    """What the addon remembers about one captured exchange (in flow.metadata)."""

    __slots__ = ("key", "endpoint", "decision", "step_id", "session", "subject", "consent",
                 "request_headers", "request_body", "request_json", "hashes", "chunks",
                 "t_first_byte", "finished", "routing", "stream_bytes", "truncated")

    def __init__(self, key: KeyInfo, endpoint: str, decision: Decision, step_id: str,
                 session: str | None, subject: str | None, consent: str,
                 request_headers: tuple[tuple[bytes, bytes], ...], request_body: bytes,
                 request_json: Any,
                 hashes: list[bytes] | None) -> None:
        self.key = key
        self.endpoint = endpoint
        self.decision = decision
        self.step_id = step_id
        self.session = session
        self.subject = subject
        self.consent = consent
        self.request_headers = request_headers  # as the agent sent them (raw fields)
        self.request_body = request_body
        self.request_json = request_json  # parsed body, None when not JSON
        self.hashes = hashes  # prefix hashes of chat messages
        self.chunks: list[bytes] | None = None  # SSE tee
        self.t_first_byte: float | None = None
        self.finished = False
        self.routing: dict | None = None  # route/arm and context updates applied (routing.py)
        self.stream_bytes = 0  # SSE bytes passed to the agent so far
        self.truncated = False  # the tee stopped keeping chunks at STEWARD_MAX_CAPTURE_BYTES


def _header_text(value: bytes | None) -> str:
    # Lossy for invalid UTF-8 on purpose: the record must stay JSON-serialisable.
    return value.decode("utf-8", "replace").strip() if value else ""


_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")
_CONTROL_OR_SPACE = re.compile(rb"[\x00-\x20\x7f]")


def _steward_value(name: str, value: bytes | None) -> str | None:
    """A validated X-Steward-* value: None when absent or blank; ValueError (-> 400) when it
    is not UTF-8 text without control characters. These values become identifiers (session,
    subject hash) and database columns, where a NUL or an undecodable byte has no meaning."""
    if not value:
        return None
    try:
        text = value.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{name} is not valid UTF-8.") from None
    if _CONTROL.search(value):
        raise ValueError(f"{name} contains a control character.")
    return text or None


def _path_text(raw: bytes) -> str:
    """The request target as recorded: UTF-8 text, with every byte that is not valid UTF-8 or
    is a control character (or a space) percent-encoded — the URL's own escape, so an
    invalid-UTF-8 query string is recorded exactly instead of making the record
    unserialisable."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and not _CONTROL_OR_SPACE.search(raw):
        return text
    out = []
    for ch in raw.decode("utf-8", "surrogateescape"):
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte
            out.append(f"%{code - 0xDC00:02X}")
        elif code <= 0x20 or code == 0x7F:
            out.append(f"%{code:02X}")
        else:
            out.append(ch)
    return "".join(out)


def _header_list(fields: tuple[tuple[bytes, bytes], ...]) -> list[list[str]]:
    return [[k.decode("utf-8", "replace"), v.decode("utf-8", "replace")] for k, v in fields]


def spool_form(record: dict[str, Any]) -> dict[str, Any]:
    """The spool form of a record built by `Steward._finish` (runs on the spool writer thread):
    header fields as [name, value] text pairs, without the agent's Authorization (its proxy
    key is never stored); the bodies stay bytes (the spool frames them raw, wire/spool.py)."""
    record["request_headers"] = [[_header_text(k), _header_text(v)]
                                 for k, v in record["request_headers"]
                                 if k.lower() != b"authorization"]
    response_headers = record["response_headers"]
    if response_headers is not None:
        record["response_headers"] = _header_list(response_headers)
    record["path"] = _path_text(record["path"])
    return record


def _routing_record(plan: Plan, applied: list) -> dict | None:
    if plan.route_id is None and not applied:
        return None
    return {"route": {"id": plan.route_id, "arm": plan.arm} if plan.route_id else None,
            "context_updates": [u.version_info() for u in applied]}


class Steward:
    def __init__(self) -> None:
        self.settings: Settings | None = None
        self.spool: SpoolWriter | None = None
        self.keys: KeyTable | None = None
        self.routing: RoutingTable | None = None
        self.index = TrajectoryIndex()
        self.paths = PathPolicy()
        self.broken: str | None = None
        self.instance = f"{socket.gethostname()}:?"
        self._upstream_auth = b""
        self._pending: list[dict] = []  # finished records not yet handed to the spool writer
        # (tenant, agent) scopes that sent a captured call without X-Steward-Session. Only
        # there can the trajectory index link a call, so only there do session-named calls
        # feed it (prefix hashes, the answer's SSE re-parse); an agent that always names its
        # sessions costs neither (docs/decisions.md, decision 26).
        self._inferring: set[tuple[int, int]] = set()
        self._handoff: asyncio.TimerHandle | None = None
        # flow id -> (loop deadline, flow) of forwarded requests awaiting response headers
        self._deadlines: dict[str, tuple[float, http.HTTPFlow]] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._unknown_engine_routes: set[int | None] = set()  # logged once each

        # flow id -> [flow, capture, bytes at the last look, loop time they last grew] of SSE
        # streams in progress, for the idle timeout between chunks
        self._streams: dict[str, list] = {}
        self._stream_sweep: asyncio.TimerHandle | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def load(self, loader) -> None:
        errors.install()  # before anything can fail: a broken proxy answers JSON too
        try:
            dispatch.install(ctx.master.addons)
        except Exception as e:  # only a speed-up: mitmproxy's own dispatch still works
            log.warning("fast hook dispatch not installed: %s", e)
        try:
            s = self.settings = Settings.from_env()
            self.paths = PathPolicy(s.allowed_paths)
            errors.install(header_bytes=s.max_header_bytes, request_bytes=s.max_request_bytes,
                           drain_bytes=max(s.max_request_bytes, 1024 * 1024))
            master = load_master_key(s.master_key_env, s.master_key_file, create=False)
            self.spool = SpoolWriter(s.spool_dir, master, max_bytes=s.spool_max_bytes,
                                     prepare=spool_form)
            if not s.database_url:
                log.warning("DATABASE_URL is unset: only keys in the snapshot are accepted")
            self.keys = KeyTable(s.database_url, s.spool_dir.parent / "proxy-keys.json",
                                 s.key_refresh_seconds)
            if s.database_url:
                # Load the table once before serving, so a just-started proxy does not answer
                # 401 to valid keys; bounded by the connect timeout, and a database that is
                # down only means we start from the snapshot (a warning: mitmdump treats
                # errors logged at start-up as fatal).
                try:
                    self.keys.refresh()
                except Exception as e:
                    self.keys.drop_connection()
                    log.warning("key table: initial load failed, starting from %s: %s",
                                self.keys.loaded_from, e)
                self.keys.start()
            # Canary routes and context updates (issue 7): loaded before serving like the keys;
            # a database that is down only means the last snapshot file applies.
            self.routing = RoutingTable(
                s.database_url, s.spool_dir.parent / "proxy-routes.json",
                s.spool_dir.parent / "proxy-route-assignments.jsonl",
                s.routing_refresh_seconds, s.route_sticky_max,
                assignment_key=derive_key(master, ASSIGNMENT_KEY_PURPOSE))
            if s.database_url:
                self.routing.load_initial()
                self.routing.start()
            self._upstream_auth = b"Bearer " + s.upstream_api_key.encode()
        except Exception as e:  # fail closed: never forward uncaptured traffic
            self.broken = f"Steward proxy is misconfigured: {e}"
            log.error(self.broken)
            try:
                ctx.master.shutdown()
            except Exception:  # not running under a master (unit use)
                pass

    def configure(self, updated: set[str]) -> None:
        # Reverse mode connects to the upstream as soon as a client connects ("eager"); when
        # the upstream is down the agent would then see a reset connection instead of a 502,
        # and unauthenticated clients would open upstream connections. Connect per request.
        # Set here, not in `running`: clients may connect before `running` fires.
        if ctx.options.connection_strategy != "lazy":
            ctx.options.update(connection_strategy="lazy")

    def running(self) -> None:
        port = getattr(ctx.options, "listen_port", None) or os.environ.get(
            "STEWARD_PROXY_PORT", "8080")
        self.instance = f"{socket.gethostname()}:{port}"
        if self.routing is not None:
            self.routing.attach_loop(asyncio.get_running_loop())
        log.info("steward proxy %s ready (%d keys from %s; hook dispatch: %s)", self.instance,
                 len(self.keys.table) if self.keys else 0,
                 self.keys.loaded_from if self.keys else "-",
                 "steward" if dispatch.installed(ctx.master.addons) else "mitmproxy")

    def done(self) -> None:
        if self.keys is not None:
            self.keys.stop()
        if self.routing is not None:
            self.routing.stop()
        if self.spool is not None:
            self._hand_off()
            self.spool.close()

    def _hand_off(self) -> None:
        """Pass the finished records to the spool writer thread in one burst: it wakes (and
        fsyncs) once per burst instead of once per record, which keeps it off the GIL."""
        self._handoff = None
        pending, self._pending = self._pending, []
        if self.spool is not None:
            for record in pending:
                self.spool.append(record)

    # -- hooks --------------------------------------------------------------------------
    # The request is decided in two steps. `requestheaders` (before mitmproxy reads the body)
    # checks everything the headers tell: the key, the path, the size, the X-Steward-* values,
    # the spool; a refusal there never reads the body (errors.refuse). `request` (body read)
    # parses, infers the trajectory, routes and captures. Both fail closed: an exception in
    # either answers 500 in OpenAI's shape and is logged with the flow, tenant and agent; it
    # never lets a request through unrecorded (mitmproxy itself would log it and forward).
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self.broken:
            flow.response = errors.error_response(503, self.broken)
            return
        try:
            self._admit(flow)
        except Exception:
            self._fail_closed(flow, "requestheaders")

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:  # answered in requestheaders
            return
        admitted: Admitted | None = flow.metadata.get("steward_admitted")
        if admitted is None:  # not decided by requestheaders: never forward it
            self._fail_closed(flow, "request")
            return
        try:
            self._capture_request(flow, admitted)
        except Exception:
            self._fail_closed(flow, "request")

    def _fail_closed(self, flow: http.HTTPFlow, hook: str) -> None:
        admitted = flow.metadata.get("steward_admitted")
        key = admitted.key if admitted is not None else None
        log.exception("%s hook failed for flow %s (tenant %s, agent %s, %s %s): answered 500, "
                      "not forwarded", hook, flow.id, key.tenant_id if key else "-",
                      key.agent_id if key else "-", flow.request.method,
                      _path_text(flow.request.data.path)[:200])
        flow.metadata.pop("steward", None)
        self._disarm_timeout(flow)
        response = errors.error_response(
            500, f"Steward could not process this request (logged as flow {flow.id}); it was "
            "not forwarded.", code="steward_internal_error")
        if flow.live and flow.request.timestamp_end is None:  # body not read yet
            errors.refuse(flow, response)
        else:
            flow.response = response

    def _refuse(self, flow: http.HTTPFlow, has_body: bool, response: http.Response) -> None:
        if has_body:  # answer now, never read (buffer) the body
            errors.refuse(flow, response)
        else:
            flow.response = response

    def _admit(self, flow: http.HTTPFlow) -> None:
        assert self.settings is not None and self.keys is not None and self.spool is not None
        req = flow.request
        # One pass over the raw header fields (mitmproxy's Headers accessors rescan and decode
        # every field on each call; this is the proxy's hot path).
        auth = b""
        steward: dict[bytes, bytes] = {}
        forwarded: list[tuple[bytes, bytes]] = []
        has_encoding = chunked = False
        length = b""
        for name, value in req.headers.fields:
            lname = name.lower()
            if lname == b"authorization":
                auth = value
                continue
            if lname.startswith(b"x-steward-"):
                steward[lname] = value
                continue
            if lname == b"content-length":
                length = value
            elif lname == b"content-encoding":
                has_encoding = True
            elif lname == b"transfer-encoding":
                chunked = True
            forwarded.append((name, value))
        has_body = chunked or (bool(length) and length.strip() != b"0")

        key = None
        if auth[:7].lower() == b"bearer ":
            key = self.keys.lookup(auth[7:].strip().decode("utf-8", "replace"))
        if key is None or key.revoked:
            if not auth:
                msg = ("You didn't provide an API key. Send a Steward proxy key as "
                       "'Authorization: Bearer stw_...'.")
            elif key is not None:
                msg = "This Steward proxy key has been revoked."
            else:
                msg = "Incorrect API key provided: not a known Steward proxy key."
            self._refuse(flow, has_body, errors.error_response(401, msg))
            return
        if length.isdigit() and int(length) > self.settings.max_request_bytes:
            self._refuse(flow, True, self._too_large(int(length)))
            return

        method = req.method
        path = req.path.split("?", 1)[0]
        allowed, endpoint = self.paths.check(method, path)
        if not allowed:
            self._refuse(flow, has_body, errors.error_response(
                404, f"Invalid URL ({method} {_path_text(req.data.path.split(b'?')[0])[:200]}): "
                "Steward forwards the OpenAI inference endpoints and the paths its operator "
                "allow-lists (STEWARD_PROXY_ALLOWED_PATHS), nothing else."))
            return
        capture = endpoint is not None
        if capture and self.spool.is_full():
            if self.settings.spool_full_policy == "reject":
                self._refuse(flow, has_body, errors.error_response(
                    503, "Steward's capture spool is full; the call was not forwarded. "
                    "Retry later.", code="spool_full"))
                return
            log.warning("spool full: forwarding %s uncaptured (policy passthrough)", flow.id)
            capture = False
            endpoint = None

        session = subject = None
        consent = "train"
        recorded = req.headers.fields  # decoded on the spool writer thread (spool_form)
        if capture:
            try:
                session = _steward_value("X-Steward-Session", steward.get(b"x-steward-session"))
                subject = _steward_value("X-Steward-Subject", steward.get(b"x-steward-subject"))
                consent = (_steward_value("X-Steward-Consent",
                                          steward.get(b"x-steward-consent")) or "train").lower()
            except ValueError as e:
                self._refuse(flow, has_body, errors.error_response(
                    400, str(e), code="invalid_steward_header"))
                return
            if session is not None and len(session) > MAX_SESSION_LENGTH:
                self._refuse(flow, has_body, errors.error_response(
                    400, f"X-Steward-Session is longer than {MAX_SESSION_LENGTH} characters.",
                    code="invalid_steward_header"))
                return
            if consent not in ("train", "no-train"):
                self._refuse(flow, has_body, errors.error_response(
                    400, "X-Steward-Consent must be 'train' or 'no-train'.",
                    code="invalid_steward_header"))
                return
            # Plain bytes in the spool (and a parseable SSE tee): ask for no compression.
            forwarded = [f for f in forwarded if f[0].lower() != b"accept-encoding"]
            forwarded.append((b"accept-encoding", b"identity"))
        if self.settings.upstream_api_key:
            forwarded.append((b"authorization", self._upstream_auth))
        req.headers.fields = tuple(forwarded)
        flow.metadata["steward_admitted"] = Admitted(key, endpoint, session, subject, consent,
                                                     recorded, has_encoding)

    def _too_large(self, size: int) -> http.Response:
        assert self.settings is not None
        return errors.error_response(
            413, f"Request body of {size} bytes exceeds Steward's limit of "
            f"{self.settings.max_request_bytes} bytes (STEWARD_MAX_REQUEST_BYTES).", close=True)

    def _capture_request(self, flow: http.HTTPFlow, admitted: Admitted) -> None:
        assert self.settings is not None
        req = flow.request
        raw = req.raw_content or b""
        if len(raw) > self.settings.max_request_bytes:  # errors.py refuses it as it grows
            flow.response = self._too_large(len(raw))
            return
        self._arm_timeout(flow)
        endpoint = admitted.endpoint
        if endpoint is None:
            return
        key = admitted.key
        try:
            body = orjson.loads(req.content if admitted.has_encoding else raw)
        except (orjson.JSONDecodeError, ValueError):
            body = None
        is_json = body is not None
        scope = (key.tenant_id, key.agent_id)
        hashes = None
        try:
            # A named session is its own trajectory (inference rule 1): its prefix hashes
            # would only serve the index, so they are not taken here, before forwarding
            # (_learn takes them after the response where the index can use them).
            if admitted.session is None:
                self._inferring.add(scope)
                if endpoint == "chat.completions" and isinstance(body, dict) and isinstance(
                        body.get("messages"), list) and body["messages"]:
                    hashes = prefix_hashes(body["messages"])
                elif endpoint == "responses" and isinstance(body, dict):
                    items = responses_items(body)
                    hashes = prefix_hashes(items, canonical_item) if items else None
            decision = decide(self.index, scope, endpoint, body, admitted.session, hashes)
        except Exception:  # inference is best effort: a new trajectory, still captured
            log.exception("trajectory inference failed for flow %s (tenant %s, agent %s): "
                          "new trajectory", flow.id, key.tenant_id, key.agent_id)
            hashes = None
            decision = Decision(new_id(), NEW)
        routing, raw = self._route(flow, endpoint, key, decision, body, raw)
        flow.metadata["steward"] = cap = Capture(
            key=key, endpoint=endpoint, decision=decision, step_id=new_id(),
            session=admitted.session, subject=admitted.subject, consent=admitted.consent,
            request_headers=admitted.recorded, request_body=raw,
            request_json=body if is_json else None, hashes=hashes,
        )
        cap.routing = routing

    def _route(self, flow: http.HTTPFlow, endpoint: str, key: KeyInfo, decision: Decision,
               body: Any, raw: bytes) -> tuple[dict | None, bytes]:
        """Apply the session's canary arm and the context updates in force (proxy/routing.py):
        another upstream and/or model, a rewritten body. Returns the record's `routing` and
        the body as forwarded (what the spool records: what the upstream received). The
        prefix hashes were taken from the agent's own messages, so inference is unaffected."""
        if self.routing is None:
            return None, raw
        try:
            plan = self.routing.plan(key.tenant_id, key.agent_id, decision.trajectory_id,
                                     decision.source)
        except Exception:  # routing must never take the proxy down: fall back to control
            log.exception("routing: plan failed for %s", flow.id)
            plan = NO_PLAN
        if plan is NO_PLAN:
            return None, raw
        engine = None
        if plan.upstream_url:
            engine = self.settings.engines.for_url(plan.upstream_url)
            if engine is None or upstream_parts(engine.url) is None:
                # Fail mode: a route to an engine this proxy's operator did not list (a row
                # written before the allow-list, or an engine removed since) is not followed;
                # the call goes to the control upstream untouched and untagged.
                self._warn_unknown_engine(plan)
                return None, raw
        applied = apply_plan(endpoint, body, plan) if plan.changes_request else []
        req = flow.request
        if applied or (plan.model and isinstance(body, dict) and "model" in body):
            raw = orjson.dumps(body)
            req.content = raw
        if engine is not None:
            self._send_to(req, engine)
        return _routing_record(plan, applied), raw

    def _send_to(self, req: http.Request, engine: Engine) -> None:
        """Point the request at a candidate engine with that engine's credential only (the
        upstream provider's key never leaves for another host)."""
        scheme, host, port, prefix = upstream_parts(engine.url)  # type: ignore[misc]
        req.scheme, req.host, req.port = scheme, host, port
        if prefix:
            req.path = prefix + req.path
        fields = [f for f in req.headers.fields if f[0].lower() != b"authorization"]
        if engine.api_key:
            fields.append((b"authorization", b"Bearer " + engine.api_key.encode()))
        req.headers.fields = tuple(fields)

    def _warn_unknown_engine(self, plan: Plan) -> None:
        if plan.route_id in self._unknown_engine_routes:
            return  # once per route, not once per request
        self._unknown_engine_routes.add(plan.route_id)
        log.error("routing: route %s names an engine that is not in STEWARD_ENGINE_ALLOWLIST "
                  "(or STEWARD_UPSTREAM_URL / STEWARD_SGLANG_CANARY_URL) of this proxy; its "
                  "sessions stay on the control upstream", plan.route_id)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._disarm_timeout(flow)
        cap: Capture | None = flow.metadata.get("steward")
        if cap is None or flow.response is None:
            return
        resp = flow.response
        cap.t_first_byte = resp.timestamp_start or time.time()
        fields = resp.headers.fields
        resp.headers.fields = fields + (
            (b"X-Steward-Trajectory", cap.decision.trajectory_id.encode()),
            (b"X-Steward-Step", cap.step_id.encode()))
        content_type = next((v for k, v in fields if k.lower() == b"content-type"), b"")
        if content_type.startswith(b"text/event-stream"):
            chunks = cap.chunks = []
            append = chunks.append
            assert self.settings is not None
            limit = self.settings.max_capture_bytes

            def tee(data: bytes) -> bytes:
                # Everything goes on to the agent; the record keeps the first `limit` bytes.
                if data:
                    before = cap.stream_bytes
                    cap.stream_bytes = before + len(data)
                    if cap.stream_bytes <= limit:
                        append(data)
                    elif not cap.truncated:
                        cap.truncated = True
                        if before < limit:
                            append(data[:limit - before])
                return data

            resp.stream = tee
            self._watch_stream(flow, cap)

    def response(self, flow: http.HTTPFlow) -> None:
        cap: Capture | None = flow.metadata.get("steward")
        if cap is None or cap.finished:
            return
        cap.finished = True
        self._streams.pop(flow.id, None)
        resp = flow.response
        assert resp is not None
        if cap.chunks is not None:
            body = b"".join(cap.chunks)
        else:
            body = resp.raw_content
            cap.stream_bytes = len(body) if body else 0
            assert self.settings is not None
            if body and len(body) > self.settings.max_capture_bytes:
                cap.truncated = True
                body = body[:self.settings.max_capture_bytes]
        error = None
        idle = flow.metadata.get("steward_stream_idle")
        if idle:  # the upstream stalled and we closed it; it may have looked like a clean end
            error = {"kind": "stream_idle_timeout", "message": idle}
        elif resp.status_code >= 500:
            error = {"kind": "upstream_error",
                     "message": f"upstream answered HTTP {resp.status_code}"}
        # After mitmproxy has written the response (this hook runs before a buffered response
        # is sent): build the record and update the index on the next loop iteration.
        asyncio.get_running_loop().call_soon(self._finish, flow, cap, resp.status_code,
                                             resp.headers.fields, body,
                                             cap.chunks is not None, error,
                                             resp.timestamp_end or time.time())

    def error(self, flow: http.HTTPFlow) -> None:
        self._disarm_timeout(flow)
        cap: Capture | None = flow.metadata.get("steward")
        if cap is None or cap.finished:
            return
        cap.finished = True
        self._streams.pop(flow.id, None)
        msg = flow.error.msg if flow.error else "unknown error"
        timeout = flow.metadata.get("steward_timeout")
        idle = flow.metadata.get("steward_stream_idle")
        if timeout:
            kind, msg = "upstream_timeout", timeout
        elif idle:
            kind, msg = "stream_idle_timeout", idle
        elif "client disconnected" in msg.lower():
            kind = "client_disconnected"
        elif flow.response is None and not flow.server_conn.timestamp_tcp_setup:
            kind = "upstream_unreachable"
        else:
            kind = "upstream_error"
        resp = flow.response
        body = b"".join(cap.chunks) if cap.chunks is not None else None
        self._finish(
            flow, cap, resp.status_code if resp else None,
            resp.headers.fields if resp else None,
            body, cap.chunks is not None, {"kind": kind, "message": msg}, time.time())

    def client_disconnected(self, client) -> None:
        errors.forget(client.id)

    # -- upstream timeout ---------------------------------------------------------------
    # One sweep timer for all in-flight flows instead of a loop timer per request (creating
    # and cancelling a TimerHandle per request measured ~25 µs in the running proxy). Every
    # flow has the same timeout, so insertion order is deadline order: the sweep stops at the
    # first flow not yet due. A timeout fires between STEWARD_UPSTREAM_TIMEOUT and
    # STEWARD_UPSTREAM_TIMEOUT + a tenth of it (at most 1 s) after the request was forwarded.
    def _arm_timeout(self, flow: http.HTTPFlow) -> None:
        assert self.settings is not None
        if self.settings.upstream_timeout <= 0:
            return
        loop = asyncio.get_running_loop()
        self._deadlines[flow.id] = (loop.time() + self.settings.upstream_timeout, flow)
        if self._sweep is None:
            self._sweep = loop.call_later(self._sweep_interval(), self._sweep_timeouts)

    def _disarm_timeout(self, flow: http.HTTPFlow) -> None:
        self._deadlines.pop(flow.id, None)

    def _sweep_interval(self) -> float:
        assert self.settings is not None
        return min(1.0, self.settings.upstream_timeout / 10)

    def _sweep_timeouts(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = []
        for flow_id, (deadline, flow) in self._deadlines.items():
            if deadline > now:
                break
            due.append((flow_id, flow))
        for flow_id, flow in due:
            del self._deadlines[flow_id]
            try:
                self._on_timeout(flow)
            except Exception:  # one flow's failure must not stop the others' timeouts
                log.exception("upstream timeout handling failed for %s", flow_id)
        self._sweep = (loop.call_later(self._sweep_interval(), self._sweep_timeouts)
                       if self._deadlines else None)

    def _on_timeout(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.error is not None:
            return
        assert self.settings is not None
        message = (f"The upstream model server did not answer within "
                   f"{self.settings.upstream_timeout:g} s (STEWARD_UPSTREAM_TIMEOUT).")
        flow.metadata["steward_timeout"] = message
        errors.mark_timed_out(flow.client_conn.id, message)
        # mitmproxy has no upstream read timeout: cancel the task that reads the server
        # connection; mitmproxy sees the upstream as closed and answers (504, see errors.py).
        self._cancel_upstream(flow)

    def _cancel_upstream(self, flow: http.HTTPFlow) -> None:
        try:
            handler = ctx.master.addons.get("proxyserver").connections[flow.client_conn.id]
            io = handler.transports.get(flow.server_conn)
        except (KeyError, AttributeError):
            io = None
        if io is not None and io.handler is not None:
            io.handler.cancel()
        else:
            log.warning("upstream timeout for %s but no server connection to cancel", flow.id)

    # -- stream idle timeout ------------------------------------------------------------
    # STEWARD_STREAM_IDLE_TIMEOUT bounds the silence between two chunks of an SSE stream
    # (STEWARD_UPSTREAM_TIMEOUT only covers the wait for the response headers). The tee only
    # counts bytes; one sweep timer, while streams are open, compares each stream's count
    # with the last look. A stream silent for the timeout gets its upstream connection closed:
    # the agent's stream ends there, and the record keeps what came with error kind
    # `stream_idle_timeout`. Fires between the timeout and a tenth of it (at most 1 s) later.
    def _watch_stream(self, flow: http.HTTPFlow, cap: Capture) -> None:
        assert self.settings is not None
        timeout = self.settings.stream_idle_timeout
        if timeout <= 0:
            return
        loop = asyncio.get_running_loop()
        self._streams[flow.id] = [flow, cap, -1, loop.time()]
        if self._stream_sweep is None:
            self._stream_sweep = loop.call_later(min(1.0, timeout / 10), self._sweep_streams)

    def _sweep_streams(self) -> None:
        assert self.settings is not None
        timeout = self.settings.stream_idle_timeout
        loop = asyncio.get_running_loop()
        now = loop.time()
        idle = []
        for flow_id, entry in self._streams.items():
            seen = entry[1].stream_bytes
            if seen != entry[2]:
                entry[2], entry[3] = seen, now
            elif now - entry[3] >= timeout:
                idle.append(flow_id)
        for flow_id in idle:
            flow = self._streams.pop(flow_id)[0]
            try:
                message = (f"The upstream stream sent nothing for {timeout:g} s "
                           "(STEWARD_STREAM_IDLE_TIMEOUT); Steward closed it.")
                flow.metadata["steward_stream_idle"] = message
                log.warning("flow %s: %s", flow_id, message)
                self._cancel_upstream(flow)
            except Exception:  # one flow's failure must not stop the others' timeouts
                log.exception("stream idle timeout handling failed for %s", flow_id)
        self._stream_sweep = (loop.call_later(min(1.0, timeout / 10), self._sweep_streams)
                              if self._streams else None)

    # -- record -------------------------------------------------------------------------
    def _finish(self, flow: http.HTTPFlow, cap: Capture, status: int | None,
                response_headers: tuple[tuple[bytes, bytes], ...] | None, body: bytes | None,
                is_stream: bool, error: dict | None, t_end: float) -> None:
        assert self.spool is not None
        record = {  # raw fields and bodies: spool_form makes the JSON form on the writer thread
            "v": 1,
            "flow_id": flow.id,
            "proxy_instance": self.instance,
            "tenant_id": cap.key.tenant_id,
            "agent_id": cap.key.agent_id,
            "proxy_key_id": cap.key.key_id,
            "trajectory_id": cap.decision.trajectory_id,
            "trajectory_source": cap.decision.source,
            "step_id": cap.step_id,
            "session_id": cap.session,
            "subject": cap.subject,
            "consent": cap.consent,
            "endpoint": cap.endpoint,
            "method": flow.request.method,
            "path": flow.request.data.path,  # raw bytes; spool_form makes the text
            "request_headers": cap.request_headers,
            "request_body": cap.request_body,
            "request_is_json": cap.request_json is not None,
            "response_status": status,
            "response_headers": response_headers,
            "response_body": body,
            # None, or what the record kept of a response over STEWARD_MAX_CAPTURE_BYTES (the
            # agent received all of it)
            "response_truncated": {"captured_bytes": len(body) if body else 0,
                                   "total_bytes": cap.stream_bytes} if cap.truncated else None,
            "is_stream": is_stream,
            "error": error,
            "routing": cap.routing,
            "t_request": flow.request.timestamp_start,
            "t_first_byte": cap.t_first_byte,
            "t_end": t_end,
        }
        self._pending.append(record)
        if self._handoff is None:
            self._handoff = asyncio.get_running_loop().call_later(HANDOFF_SECONDS,
                                                                  self._hand_off)
        if status is not None and 200 <= status < 300 and body and (
                cap.session is None or (cap.key.tenant_id, cap.key.agent_id) in self._inferring):
            try:
                self._learn(cap, body, is_stream)
            except Exception:  # inference is best effort; the record is already spooled
                log.exception("trajectory index update failed for %s", flow.id)

    def _learn(self, cap: Capture, body: bytes, is_stream: bool) -> None:
        scope = (cap.key.tenant_id, cap.key.agent_id)
        req = cap.request_json
        if not isinstance(req, dict):
            return
        hashes = cap.hashes
        if cap.endpoint == "chat.completions" and hashes is None and cap.session is not None:
            messages = req.get("messages")
            if isinstance(messages, list) and messages:
                hashes = prefix_hashes(messages)
        if cap.endpoint == "chat.completions" and hashes:
            self.index.record_chat(scope, req["messages"], chat_answer(body, is_stream),
                                   cap.decision.trajectory_id, hashes)
        elif cap.endpoint == "responses":
            items = responses_items(req)
            # Rule 3b needs the output items too (a stateless agent resends them): one parse
            # of the body gives both.
            rid, output = responses_answer(body, is_stream) if items else (
                response_id(body, is_stream), None)
            if rid:
                self.index.record_response(scope, rid, cap.decision.trajectory_id)
            if items:
                self.index.record_items(scope, items, output, cap.decision.trajectory_id,
                                        hashes or prefix_hashes(items, canonical_item))


addons = [Steward()]
