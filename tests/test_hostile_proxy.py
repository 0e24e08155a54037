"""Hostile input through the real proxy (mitmdump + the Steward addon, the demo upstream).

Every case ends one of two ways: the exchange is recorded (a spool record with its step id),
or it is refused in OpenAI's error shape with nothing forwarded. And the proxy stays up: each
test ends with an ordinary call through the same proxy. Raw sockets where an HTTP client would
refuse to send the bytes (or would normalise them).
"""

from __future__ import annotations

import base64
import http.client
import socket
import stat
import threading
import time
from pathlib import Path

import httpx
import openai
import orjson
import psutil
import pytest

from tests.live import free_port, wait_for_key

pytestmark = pytest.mark.timeout(180)

MB = 1024 * 1024


# -- helpers ----------------------------------------------------------------------------
def raw_exchange(port: int, data: bytes, timeout: float = 20.0
                 ) -> tuple[int, dict[str, str], bytes]:
    """Send `data` as is and read one HTTP response: (status, lower-cased headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        body = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def chat_request(path: bytes, secret: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: steward\r\n"
            + b"Authorization: Bearer " + secret.encode() + b"\r\n"
            + b"Content-Type: application/json\r\n" + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def chat_body(text: str = "what is 2+3?", **extra) -> bytes:
    return orjson.dumps({"model": "demo-model",
                         "messages": [{"role": "user", "content": text}], **extra})


def assert_openai_error(status: int, headers: dict, body: bytes, expected: int,
                        code: str | None = None) -> dict:
    assert status == expected, body[:500]
    assert headers["content-type"].startswith("application/json")
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    assert "mitmproxy" not in headers.get("server", "")
    return error


def assert_still_serving(proxy, secret: str) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key=secret, max_retries=0, timeout=30)
    answer = client.chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": "1+1"}])
    assert answer.choices[0].message.content == "1 + 1 = 2."


def rss(proxy) -> int:
    return psutil.Process(proxy.process.pid).memory_info().rss


def b64(data: str | None) -> bytes:
    assert data is not None
    return base64.b64decode(data)


# -- item 4: only the inference paths --------------------------------------------------
def test_a_proxy_key_opens_only_the_inference_paths(steward_proxy, proxy_key, fake_upstream):
    secret = proxy_key.secret
    auth = {"Authorization": f"Bearer {secret}"}
    # Someone's prompt is in the upstream's debug list (the upstream serves it directly) ...
    client = openai.OpenAI(base_url=steward_proxy.base_url, api_key=secret, max_retries=0)
    client.chat.completions.create(model="demo-model", messages=[
        {"role": "user", "content": "tenant A's secret prompt"}])
    assert "secret prompt" in httpx.get(fake_upstream.url + "/_debug/requests").text

    fake_upstream.clear()
    for method, path in [("GET", "/_debug/requests"), ("GET", "/_debug/last_request"),
                         ("DELETE", "/_debug/requests"), ("POST", "/update_weights_from_disk"),
                         ("POST", "/generate"), ("GET", "/health"), ("POST", "/v1/embeddings"),
                         ("GET", "/v1/chat/completions"), ("POST", "/v1/models"),
                         ("GET", "/v1/models/")]:
        r = httpx.request(method, steward_proxy.url + path, headers=auth, json={"x": 1})
        error = assert_openai_error(r.status_code, r.headers, r.content, 404, "unknown_url")
        assert "STEWARD_PROXY_ALLOWED_PATHS" in error["message"]
        assert "secret prompt" not in r.text
    # Spellings an upstream may normalise into a path that is not allowed (sent as is).
    for target in [b"/v1/models/../../_debug/requests", b"/v1/models/%2e%2e/%2e%2e/_debug/requests",
                   b"/v1/chat/completions/../../_debug/requests", b"/v1//chat/completions",
                   b"/v1/chat%2Fcompletions", b"/V1/chat/completions"]:
        status, headers, body = raw_exchange(steward_proxy.port, chat_request(
            target, secret, chat_body()))
        assert_openai_error(status, headers, body, 404, "unknown_url")
    assert len(fake_upstream.requests) == 0

    # A model by id is forwarded (the demo upstream has no such route: its own 404).
    r = httpx.get(steward_proxy.base_url + "/models/demo-model", headers=auth)
    assert r.status_code == 404 and r.text == "404: Not Found"  # aiohttp's, not Steward's
    assert_still_serving(steward_proxy, secret)


def test_operator_allow_list_adds_paths(start_proxy, fake_upstream, proxy_key):
    proxy = start_proxy(fake_upstream.url,
                        STEWARD_PROXY_ALLOWED_PATHS="/v1/embeddings, /v1/files/*")
    wait_for_key(proxy, proxy_key.secret)
    auth = {"Authorization": f"Bearer {proxy_key.secret}"}
    fake_upstream.clear()
    # Forwarded (the demo upstream has no such route: aiohttp's 404, not Steward's).
    for path in ["/v1/embeddings", "/v1/files/file-1/content"]:
        r = httpx.post(proxy.url + path, headers=auth, json={"input": "x"})
        assert r.status_code == 404 and r.text == "404: Not Found"
        assert "x-steward-step" not in r.headers
    for target in [b"/v1/files/../../_debug/requests", b"/v1/files/%2E%2E/x", b"/v1/files/",
                   b"/v1/embeddings/x"]:
        status, headers, body = raw_exchange(proxy.port, chat_request(
            target, proxy_key.secret, b"{}"))
        assert_openai_error(status, headers, body, 404, "unknown_url")
    assert len(fake_upstream.requests) == 0
    time.sleep(0.3)
    assert proxy.records() == []  # allow-listed paths pass uncaptured


def test_a_bad_allow_list_stops_the_proxy_closed(start_proxy, fake_upstream, proxy_key):
    try:
        proxy = start_proxy(fake_upstream.url, STEWARD_PROXY_ALLOWED_PATHS="v1/embeddings")
    except AssertionError as e:  # it shut down before it even listened: closed as well
        assert "STEWARD_PROXY_ALLOWED_PATHS" in str(e)
        return
    try:
        r = httpx.get(proxy.base_url + "/models",
                      headers={"Authorization": f"Bearer {proxy_key.secret}"}, timeout=10)
        assert r.status_code == 503
    except httpx.HTTPError:
        pass  # already shut down
    proxy.process.wait(20)
    assert "STEWARD_PROXY_ALLOWED_PATHS" in proxy.log()


def test_the_demo_upstream_serves_no_debug_path_under_steward_up():
    from proxy.demo_upstream import build_app

    routes = {r.resource.canonical for r in build_app().router.routes()}
    assert not any(p.startswith("/_debug") for p in routes)
    assert any(p.startswith("/_debug") for p in
               (r.resource.canonical for r in build_app(debug=True).router.routes()))


# -- item 5: what is captured is recorded, or refused ------------------------------------
def test_invalid_utf8_query_string_is_recorded(steward_proxy, proxy_key):
    status, headers, body = raw_exchange(steward_proxy.port, chat_request(
        b"/v1/chat/completions?tag=caf\xe9&x=\xff\xfe%ff", proxy_key.secret, chat_body()))
    # Forwarded as sent (aiohttp, the demo upstream, refuses such a URL with its own 400).
    rec = steward_proxy.wait_for_record(headers["x-steward-step"])
    assert rec["path"] == "/v1/chat/completions?tag=caf%E9&x=%FF%FE%ff"
    assert rec["response_status"] == status
    assert "spool: dropping" not in steward_proxy.log()
    assert_still_serving(steward_proxy, proxy_key.secret)


@pytest.mark.parametrize("messages", [
    [{"role": "assistant", "tool_calls": "not a list"}, {"role": "user", "content": "hi"}],
    [{"role": "assistant", "tool_calls": [{"id": "c1", "function": "calc"}]},
     {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "user", "content": "hi"}],
    [{"role": "assistant", "tool_calls": [None, 3, {"function": {"name": ["x"]}}]},
     {"role": "user", "content": [{"type": ["text"], "text": "hi"}]}],
    [{"role": {"nested": True}, "content": {"text": 1}, "tool_call_id": [1]},
     {"role": "user", "content": "hi"}],
], ids=["tool_calls-string", "function-string", "junk-calls-and-part-type", "junk-fields"])
def test_malformed_messages_are_captured(steward_proxy, proxy_key, fake_upstream, messages):
    fake_upstream.clear()
    r = httpx.post(steward_proxy.base_url + "/chat/completions",
                   headers={"Authorization": f"Bearer {proxy_key.secret}"},
                   json={"model": "demo-model", "messages": messages}, timeout=30)
    assert "x-steward-step" in r.headers, r.text  # captured, not passed through
    rec = steward_proxy.wait_for_record(r.headers["x-steward-step"])
    assert orjson.loads(b64(rec["request_body"]))["messages"] == messages
    assert rec["response_status"] == r.status_code
    assert "hook failed" not in steward_proxy.log()
    assert_still_serving(steward_proxy, proxy_key.secret)


FAULT_SCRIPT = '''
from mitmproxy import ctx


def running():
    steward = ctx.master.addons.get("steward")

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    steward._route = broken
'''


def test_a_hook_exception_fails_closed(start_proxy, fake_upstream, proxy_key, tmp_path):
    """mitmproxy logs an addon's exception and forwards the request anyway: the captured call
    would reach the upstream unrecorded. The hook answers 500 instead and names the flow."""
    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT)
    proxy = start_proxy(fake_upstream.url, scripts=(script,))
    wait_for_key(proxy, proxy_key.secret)
    fake_upstream.clear()
    r = httpx.post(proxy.base_url + "/chat/completions",
                   headers={"Authorization": f"Bearer {proxy_key.secret}"},
                   content=chat_body(), timeout=30)
    error = assert_openai_error(r.status_code, r.headers, r.content, 500,
                                "steward_internal_error")
    assert len(fake_upstream.requests) == 0
    log = proxy.log()
    flow_id = error["message"].split("logged as flow ")[1].split(")")[0]
    assert f"flow {flow_id} (tenant {proxy_key.tenant.pk}, agent {proxy_key.agent.pk}" in log
    assert "injected fault" in log
    # Uncaptured paths do not route: they still work.
    assert httpx.get(proxy.base_url + "/models", headers={
        "Authorization": f"Bearer {proxy_key.secret}"}).status_code == 200


# -- hostile headers ---------------------------------------------------------------------
HOSTILE_VALUES = [b"a\x00b", b"\x00", b"run\x01\x02", b"\x1b[31mred", b"caf\xe9", b"\xff\xfe",
                  b"a\x7fb", b"x" * 5000]


@pytest.mark.parametrize("header", [b"X-Steward-Session", b"X-Steward-Subject",
                                    b"X-Steward-Consent", b"X-Steward-Other"])
def test_hostile_steward_headers_are_recorded_or_refused(steward_proxy, proxy_key,
                                                         fake_upstream, header):
    for value in HOSTILE_VALUES:
        fake_upstream.clear()
        status, headers, body = raw_exchange(steward_proxy.port, chat_request(
            b"/v1/chat/completions", proxy_key.secret, chat_body(),
            header + b": " + value + b"\r\n"))
        known = header != b"X-Steward-Other"
        if status == 200:
            rec = steward_proxy.wait_for_record(headers["x-steward-step"])
            assert not any(k.lower().startswith("x-steward") for k, _ in
                           fake_upstream.last_request()["headers"])
            # What was kept as an identifier is text without control characters.
            for field in ("session_id", "subject"):
                assert rec[field] is None or not any(ord(c) < 32 for c in rec[field])
        else:
            assert_openai_error(status, headers, body, 400, "invalid_steward_header")
            assert len(fake_upstream.requests) == 0
        if known and value not in (b"x" * 5000,) and (
                any(c < 32 or c == 127 for c in value) or value in (b"caf\xe9", b"\xff\xfe")):
            assert status == 400, (header, value)  # control characters, invalid UTF-8
    assert_still_serving(steward_proxy, proxy_key.secret)


@pytest.mark.parametrize("line", [
    b"Authorization: Bearer \xff\xfe\r\n", b"Authorization: Bearer stw_\x00\r\n",
    b"Authorization: \x00\r\n"])
def test_hostile_authorization_gets_401(steward_proxy, proxy_key, fake_upstream, line):
    fake_upstream.clear()
    body = chat_body()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\n" + line
               + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    status, headers, data = raw_exchange(steward_proxy.port, request)
    assert_openai_error(status, headers, data, 401, "invalid_api_key")
    assert len(fake_upstream.requests) == 0
    assert_still_serving(steward_proxy, proxy_key.secret)


def test_control_characters_and_invalid_utf8_in_other_headers_are_recorded(
        steward_proxy, proxy_key):
    status, headers, body = raw_exchange(steward_proxy.port, chat_request(
        b"/v1/chat/completions", proxy_key.secret, chat_body(),
        b"User-Agent: agent\x00\x01\xff\r\nX-Custom: \xc3\x28\r\n"))
    # Forwarded as sent (the demo upstream refuses the NUL with its own 400): recorded.
    rec = steward_proxy.wait_for_record(headers["x-steward-step"])
    names = [k.lower() for k, _ in rec["request_headers"]]
    assert "user-agent" in names and "x-custom" in names


def test_malformed_request_line_gets_a_json_400(steward_proxy, proxy_key):
    status, headers, body = raw_exchange(steward_proxy.port, b"BLAH\x00 \xff HTTP/9\r\n\r\n")
    assert_openai_error(status, headers, body, 400)
    assert headers["server"] == "steward"
    assert_still_serving(steward_proxy, proxy_key.secret)


def test_invalid_utf8_and_nul_in_the_body_are_recorded(steward_proxy, proxy_key):
    for body in [b'{"model":"demo-model","messages":[{"role":"user","content":"\xff\xfe"}]}',
                 b'{"model":"demo-model","messages":[{"role":"user","content":"a\x00b"}]}',
                 b'{"model":"demo-model","messages":[{"role":"user","content":"a\\u0000b"}]}',
                 b"\x00\x01\x02\xff" * 100]:
        status, headers, data = raw_exchange(steward_proxy.port, chat_request(
            b"/v1/chat/completions", proxy_key.secret, body))
        rec = steward_proxy.wait_for_record(headers["x-steward-step"])
        assert b64(rec["request_body"]) == body
        assert rec["response_status"] == status
    assert_still_serving(steward_proxy, proxy_key.secret)


# -- item 10: refuse before buffering ----------------------------------------------------
def _upload(port: int, head: bytes, chunk: bytes, total: int) -> tuple[float | None, bytes]:
    """Send `head`, then `chunk` repeatedly (up to `total` bytes) while reading; returns
    (seconds from the head to the first response byte, or None, and what was read)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    got = bytearray()
    first: list[float] = []
    done = threading.Event()

    def reader() -> None:
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                if not first:
                    first.append(time.monotonic())
                got.extend(data)
        except OSError:
            pass
        done.set()

    started = time.monotonic()
    sock.sendall(head)
    threading.Thread(target=reader, daemon=True).start()
    sent = 0
    try:
        while sent < total and not done.is_set():
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass  # the proxy closed the connection after answering: expected
    done.wait(10)
    sock.close()
    return (first[0] - started if first else None), bytes(got)


def _status_of(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head


@pytest.mark.parametrize("with_key", [False, True])
def test_a_huge_chunked_body_is_refused_before_it_is_buffered(start_proxy, fake_upstream,
                                                               proxy_key, with_key):
    proxy = start_proxy(fake_upstream.url, STEWARD_MAX_REQUEST_BYTES=str(MB))
    wait_for_key(proxy, proxy_key.secret)
    fake_upstream.clear()
    before = rss(proxy)
    auth = f"Authorization: Bearer {proxy_key.secret}\r\n".encode() if with_key else b""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\n" + auth
            + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 65536
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    took, raw = _upload(proxy.port, head, chunk, 120 * MB)
    assert took is not None and took < 10, took
    status, response_head = _status_of(raw)
    assert status == (413 if with_key else 401)
    assert b"mitmproxy" not in response_head
    assert rss(proxy) - before < 40 * MB, (rss(proxy) - before) / MB
    assert len(fake_upstream.requests) == 0
    assert_still_serving(proxy, proxy_key.secret)


@pytest.mark.parametrize("with_key", [False, True])
def test_a_huge_content_length_is_answered_at_once(steward_proxy, proxy_key, fake_upstream,
                                                   with_key):
    auth = f"Authorization: Bearer {proxy_key.secret}\r\n".encode() if with_key else b""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\n" + auth
            + b"Content-Length: 800000000\r\n\r\n")
    fake_upstream.clear()
    before = rss(steward_proxy)
    took, raw = _upload(steward_proxy.port, head, b"y" * 65536, 120 * MB)
    assert took is not None and took < 10
    assert _status_of(raw)[0] == (413 if with_key else 401)
    assert rss(steward_proxy) - before < 40 * MB
    assert len(fake_upstream.requests) == 0
    assert_still_serving(steward_proxy, proxy_key.secret)


def test_a_small_body_without_a_key_still_sees_its_401(steward_proxy):
    """The early answer drains what the client still sends: a client that writes its whole
    body before reading (httpx does) gets the 401, not a reset connection."""
    r = httpx.post(steward_proxy.base_url + "/chat/completions", content=b"z" * (2 * MB),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert_openai_error(r.status_code, r.headers, r.content, 401, "invalid_api_key")


def test_a_huge_header_is_refused_with_431(steward_proxy, proxy_key):
    before = rss(steward_proxy)
    head = b"GET /v1/models HTTP/1.1\r\nHost: s\r\nX-Big: "
    took, raw = _upload(steward_proxy.port, head, b"a" * 65536, 120 * MB)
    assert took is not None and took < 10
    status, _ = _status_of(raw)
    assert status == 431
    assert orjson.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == \
        "request_header_fields_too_large"
    assert rss(steward_proxy) - before < 40 * MB
    assert_still_serving(steward_proxy, proxy_key.secret)


# -- item 11: streams with bounds --------------------------------------------------------
def test_a_stalled_stream_times_out(start_proxy, fake_upstream, proxy_key):
    proxy = start_proxy(fake_upstream.url, STEWARD_STREAM_IDLE_TIMEOUT="1")
    wait_for_key(proxy, proxy_key.secret)
    started = time.monotonic()
    received = b""
    with httpx.stream("POST", proxy.base_url + "/chat/completions", timeout=30,
                      content=chat_body(stream=True),
                      headers={"Authorization": f"Bearer {proxy_key.secret}",
                               "X-Demo-Stall": "60"}) as r:
        step = r.headers["x-steward-step"]
        try:
            for data in r.iter_raw():
                received += data
        except httpx.HTTPError:
            pass  # the stream ends early, as it should
    assert time.monotonic() - started < 8
    assert b'"role":"assistant"' in received
    rec = proxy.wait_for_record(step)
    assert rec["error"]["kind"] == "stream_idle_timeout"
    assert "STEWARD_STREAM_IDLE_TIMEOUT" in rec["error"]["message"]
    assert b64(rec["response_body"]) == received
    assert_still_serving(proxy, proxy_key.secret)


def test_capture_cap_truncates_the_record_not_the_answer(start_proxy, fake_upstream,
                                                         proxy_key):
    proxy = start_proxy(fake_upstream.url, STEWARD_MAX_CAPTURE_BYTES="20000")
    wait_for_key(proxy, proxy_key.secret)
    words = " ".join(f"word{i:05d}" for i in range(4000))  # ~40 KB of answer
    auth = {"Authorization": f"Bearer {proxy_key.secret}"}
    for stream in (True, False):
        body = chat_body(words, stream=stream)
        direct = httpx.post(fake_upstream.url + "/v1/chat/completions", content=body).content
        r = httpx.post(proxy.base_url + "/chat/completions", content=body, headers=auth,
                       timeout=30)
        assert r.status_code == 200 and r.content == direct  # the agent gets all of it
        rec = proxy.wait_for_record(r.headers["x-steward-step"])
        assert b64(rec["response_body"]) == direct[:20000]
        assert rec["response_truncated"] == {"captured_bytes": 20000,
                                             "total_bytes": len(direct)}
    small = httpx.post(proxy.base_url + "/chat/completions", content=chat_body("2+2"),
                       headers=auth, timeout=30)
    assert proxy.wait_for_record(small.headers["x-steward-step"])["response_truncated"] is None


def test_a_client_that_closes_at_done_made_a_complete_call(start_proxy, fake_upstream,
                                                           proxy_key):
    """openai-python closes a stream's response as soon as it reads `data: [DONE]`. An
    upstream that ends its body later (X-Demo-Linger) makes mitmproxy see the client leave
    first: the record says client_disconnected, and the step built from it is complete — no
    error, so it stays training-eligible (decision 50; CI of a9cadea lost a step's
    eligibility to this race)."""
    from governance.capture.steps import build_step_fields

    proxy = start_proxy(fake_upstream.url)
    wait_for_key(proxy, proxy_key.secret)
    client = openai.OpenAI(base_url=proxy.base_url, api_key=proxy_key.secret, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "Say hello"}], stream=True,
        extra_headers={"X-Demo-Linger": "3"})
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text
    rec = proxy.wait_for_record(raw.headers["x-steward-step"], timeout=20)
    assert rec["error"]["kind"] == "client_disconnected", rec["error"]
    fields = build_step_fields(
        endpoint="chat.completions", request_body=b64(rec["request_body"]),
        response_body=b64(rec["response_body"]), response_status=rec["response_status"],
        is_stream=True, error=rec["error"])
    assert fields["error"] is None
    assert fields["action"]["messages"][0]["content"] == text
    assert fields["metadata"]["steward.client_closed_after_end"] is True


def test_an_endless_stream_keeps_memory_bounded(start_proxy, fake_upstream, proxy_key):
    proxy = start_proxy(fake_upstream.url, STEWARD_MAX_CAPTURE_BYTES=str(MB))
    wait_for_key(proxy, proxy_key.secret)
    before = rss(proxy)
    received = 0
    with httpx.stream("POST", proxy.base_url + "/chat/completions", timeout=30,
                      content=chat_body(stream=True),
                      headers={"Authorization": f"Bearer {proxy_key.secret}",
                               "X-Demo-Endless": "1"}) as r:
        step = r.headers["x-steward-step"]
        for data in r.iter_raw():
            received += len(data)
            if received > 80 * MB:
                break
    grown = rss(proxy) - before
    assert grown < 40 * MB, grown / MB
    rec = proxy.wait_for_record(step, timeout=20)
    assert rec["response_truncated"]["captured_bytes"] == MB
    assert rec["response_truncated"]["total_bytes"] >= 80 * MB
    assert rec["error"]["kind"] == "client_disconnected"
    assert_still_serving(proxy, proxy_key.secret)


# -- lows ---------------------------------------------------------------------------------
def test_errors_name_neither_mitmproxy_nor_the_upstream(start_proxy, proxy_key):
    port = free_port()
    proxy = start_proxy(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 20
    while True:
        r = httpx.post(proxy.base_url + "/chat/completions", content=chat_body(),
                       headers={"Authorization": f"Bearer {proxy_key.secret}"}, timeout=30)
        if r.status_code != 401 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert_openai_error(r.status_code, r.headers, r.content, 502, "upstream_unreachable")
    assert r.headers["server"] == "steward"
    assert str(port) not in r.text and "127.0.0.1" not in r.text
    assert str(port) in proxy.log()  # the detail is for the operator


def test_spool_files_are_private(steward_proxy, proxy_key):
    client = openai.OpenAI(base_url=steward_proxy.base_url, api_key=proxy_key.secret,
                           max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "3+3"}])
    steward_proxy.wait_for_record(raw.headers["x-steward-step"])
    spool = Path(steward_proxy.spool_dir)
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700
    files = [p for p in spool.iterdir() if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)


def test_the_step_metadata_says_the_capture_was_truncated():
    """The record's `response_truncated` reaches the step (raw payload -> parse_exchange ->
    metadata), and a JSON answer cut at the cap is no answer rather than a capture error."""
    from governance.capture.rawstore import RAW_FIELDS
    from governance.capture.steps import fields_from_exchange, parse_exchange

    assert "response_truncated" in RAW_FIELDS
    full = orjson.dumps({"id": "c1", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "x" * 500},
         "finish_reason": "stop"}]})
    truncated = {"captured_bytes": 100, "total_bytes": len(full)}
    ex = parse_exchange(endpoint="chat.completions", request_body=chat_body(),
                        response_body=full[:100], response_status=200, is_stream=False,
                        truncated=truncated)
    assert ex.response is None
    metadata = fields_from_exchange(ex)["metadata"]
    assert metadata["steward.response.truncated"] == truncated


def test_path_policy_unit():
    from proxy.paths import PathPolicy

    policy = PathPolicy("/v1/embeddings,/v1/files/*")
    assert policy.check("POST", "/v1/chat/completions") == (True, "chat.completions")
    assert policy.check("POST", "/v1/responses") == (True, "responses")
    assert policy.check("GET", "/v1/models") == (True, None)
    assert policy.check("GET", "/v1/models/org/model-1") == (True, None)
    assert policy.check("PUT", "/v1/embeddings") == (True, None)
    assert policy.check("GET", "/v1/files/a/b") == (True, None)
    for method, path in [("GET", "/v1/responses"), ("GET", "/v1/models/.."),
                         ("GET", "/v1/models/a/%2E%2e/b"), ("GET", "/v1/files/a\\b"),
                         ("GET", "/v1/files/%00"), ("GET", "/v1/files"), ("POST", "/generate"),
                         ("GET", "/v1/embeddings/"), ("POST", "/v1/chat/completions/")]:
        assert policy.check(method, path) == (False, None), (method, path)
    for bad in ["v1/x", "/v1/*x", "/v1/a?b", "/v1/a b"]:
        with pytest.raises(ValueError):
            PathPolicy(bad)
