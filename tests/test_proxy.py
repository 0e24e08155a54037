"""The proxy end to end: real mitmdump + the Steward addon, the official openai client, a real
`stw_` key in the test database, and the demo upstream as the (only) fake."""

from __future__ import annotations

import base64
import time
import uuid

import httpx
import openai
import orjson
import pytest

from tests.live import UPSTREAM_API_KEY, free_port, wait_for_key, wait_for_rejection
from wire.ids import session_trajectory_id

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def client_for(proxy, secret: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key=secret, max_retries=0, timeout=30,
                         default_headers=headers or None)


def b64(data: str | None) -> bytes:
    assert data is not None
    return base64.b64decode(data)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


# -- capture ----------------------------------------------------------------------------
def test_plain_chat_is_captured_and_credential_swapped(steward_proxy, proxy_key, fake_upstream):
    fake_upstream.clear()
    client = client_for(steward_proxy, proxy_key.secret, **{
        "X-Steward-Subject": "alice@example.com", "X-Steward-Consent": "no-train"})
    raw = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "what is 2+3?"}])
    completion = raw.parse()
    assert completion.choices[0].message.content == "2 + 3 = 5."
    trajectory, step = raw.headers["x-steward-trajectory"], raw.headers["x-steward-step"]
    uuid.UUID(trajectory), uuid.UUID(step)

    seen = fake_upstream.last_request()
    headers = {k.lower(): v for k, v in seen["headers"]}
    assert headers["authorization"] == f"Bearer {UPSTREAM_API_KEY}"
    assert not any(k.startswith("x-steward-") for k in headers)
    assert proxy_key.secret not in str(list(fake_upstream.requests))

    rec = steward_proxy.wait_for_record(step)
    assert rec["v"] == 1 and rec["trajectory_id"] == trajectory
    assert rec["trajectory_source"] == "new"
    assert (rec["tenant_id"], rec["agent_id"], rec["proxy_key_id"]) == (
        proxy_key.tenant.pk, proxy_key.agent.pk, proxy_key.key.pk)
    assert rec["endpoint"] == "chat.completions" and rec["method"] == "POST"
    assert rec["path"] == "/v1/chat/completions"
    assert rec["subject"] == "alice@example.com" and rec["consent"] == "no-train"
    assert rec["session_id"] is None
    assert rec["request_is_json"] is True and rec["is_stream"] is False
    assert rec["response_status"] == 200 and rec["error"] is None
    assert b64(rec["request_body"]) == seen["body"].encode()
    assert orjson.loads(b64(rec["response_body"]))["choices"][0]["message"]["content"] == \
        "2 + 3 = 5."
    recorded_names = {k.lower() for k, _ in rec["request_headers"]}
    assert "authorization" not in recorded_names and "x-steward-subject" in recorded_names
    assert proxy_key.secret not in orjson.dumps(rec).decode()
    assert rec["t_request"] <= rec["t_first_byte"] <= rec["t_end"]
    assert rec["proxy_instance"].endswith(f":{steward_proxy.port}")


def test_streamed_chat_bytes_are_identical(steward_proxy, proxy_key, fake_upstream):
    body = {"model": "demo-reasoner", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "what is 12 * 7?"}]}

    def fetch(url: str, auth: str) -> tuple[httpx.Headers, list[bytes]]:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": auth}) as r:
            assert r.status_code == 200
            return r.headers, list(r.iter_raw())

    direct_headers, direct = fetch(fake_upstream.url, "Bearer x")
    proxied_headers, proxied = fetch(steward_proxy.url, f"Bearer {proxy_key.secret}")
    assert b"".join(proxied) == b"".join(direct)
    assert b"data: [DONE]" in b"".join(direct)
    assert proxied_headers["content-type"].startswith("text/event-stream")

    rec = steward_proxy.wait_for_record(proxied_headers["x-steward-step"])
    assert rec["is_stream"] is True
    assert b64(rec["response_body"]) == b"".join(direct)

    # The official client parses the stream through the proxy too.
    client = client_for(steward_proxy, proxy_key.secret)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="demo-model", stream=True, messages=[{"role": "user", "content": "9-4"}])
        if chunk.choices)
    assert text == "9 - 4 = 5."


def test_tool_call_continuation_keeps_the_trajectory(steward_proxy, proxy_key):
    client = client_for(steward_proxy, proxy_key.secret)
    messages = [{"role": "system", "content": "You are a calculator."},
                {"role": "user", "content": "what is 6*7?"}]
    first = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=messages, tools=TOOLS)
    call = first.parse().choices[0].message.tool_calls[0]
    assert call.function.name == "calculator"
    assert orjson.loads(call.function.arguments) == {"expression": "6*7"}

    # The agent appends the assistant message as the SDK returned it (extra fields and all)
    # and the tool result: an inferred continuation of the same trajectory.
    messages.append(first.parse().choices[0].message.model_dump())
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
    second = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=messages, tools=TOOLS)
    assert second.parse().choices[0].message.content == "The tool returned: 42"
    assert second.headers["x-steward-trajectory"] == first.headers["x-steward-trajectory"]
    assert second.headers["x-steward-step"] != first.headers["x-steward-step"]
    rec = steward_proxy.wait_for_record(second.headers["x-steward-step"])
    assert rec["trajectory_source"] == "prefix"

    # The same opening in an unrelated call is a different trajectory.
    other = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=messages[:2], tools=TOOLS)
    assert other.headers["x-steward-trajectory"] != first.headers["x-steward-trajectory"]


def test_a_sliding_window_that_dropped_the_first_message_keeps_the_trajectory(
        steward_proxy, proxy_key):
    """Proxy inference rule 4 through the real proxy and the official client: the third call
    drops the first user message (its window is full), so no earlier request is a prefix of
    it, but it carries the second call's tool result and the answer to it."""
    client = client_for(steward_proxy, proxy_key.secret)
    system = {"role": "system", "content": "You are a calculator."}
    user = {"role": "user", "content": "what is 6*7?"}
    first = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[system, user], tools=TOOLS)
    answer = first.parse().choices[0].message
    result = {"role": "tool", "tool_call_id": answer.tool_calls[0].id, "content": "42"}
    second = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[system, user, answer.model_dump(), result], tools=TOOLS)
    window = [system, answer.model_dump(), result, second.parse().choices[0].message.model_dump(),
              {"role": "user", "content": "and 8*9?"}]
    third = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=window, tools=TOOLS)
    trajectory = first.headers["x-steward-trajectory"]
    assert second.headers["x-steward-trajectory"] == trajectory
    assert third.headers["x-steward-trajectory"] == trajectory
    assert steward_proxy.wait_for_record(third.headers["x-steward-step"])[
        "trajectory_source"] == "window"
    # The window alone, nothing after the answer: not a continuation.
    again = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=window[:4], tools=TOOLS)
    assert again.headers["x-steward-trajectory"] != trajectory


def test_streamed_answer_is_learned_for_inference(steward_proxy, proxy_key):
    client = client_for(steward_proxy, proxy_key.secret)
    messages = [{"role": "user", "content": "hello there"}]
    with client.chat.completions.with_streaming_response.create(
            model="demo-model", messages=messages, stream=True) as response:
        trajectory = response.headers["x-steward-trajectory"]
        text = "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices)
    # The agent serialises the answer its own way (content parts instead of a string).
    messages += [{"role": "assistant", "content": [{"type": "text", "text": text}]},
                 {"role": "user", "content": "and again"}]
    again = client.chat.completions.with_raw_response.create(model="demo-model",
                                                             messages=messages)
    assert again.headers["x-steward-trajectory"] == trajectory


def test_multipart_content(steward_proxy, proxy_key):
    client = client_for(steward_proxy, proxy_key.secret)
    completion = client.chat.completions.create(model="demo-model", messages=[{
        "role": "user", "content": [{"type": "text", "text": "what is "},
                                    {"type": "text", "text": "8 / 2?"}]}])
    assert completion.choices[0].message.content == "8 / 2 = 4."


def test_session_header_groups_calls(steward_proxy, proxy_key):
    session = f"run-{uuid.uuid4()}"
    client = client_for(steward_proxy, proxy_key.secret, **{"X-Steward-Session": session})
    a = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "first"}])
    b = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "something unrelated"}])
    expected = session_trajectory_id(proxy_key.tenant.pk, proxy_key.agent.pk, session)
    assert a.headers["x-steward-trajectory"] == b.headers["x-steward-trajectory"] == expected
    rec = steward_proxy.wait_for_record(b.headers["x-steward-step"])
    assert rec["trajectory_source"] == "session" and rec["session_id"] == session

    plain = client_for(steward_proxy, proxy_key.secret)
    c = plain.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "first"}])
    d = plain.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "something unrelated"}])
    assert len({expected, c.headers["x-steward-trajectory"],
                d.headers["x-steward-trajectory"]}) == 3


def test_completions_plain_and_stream(steward_proxy, proxy_key):
    client = client_for(steward_proxy, proxy_key.secret)
    raw = client.completions.with_raw_response.create(model="demo-model", prompt="5+5",
                                                      logprobs=1)
    completion = raw.parse()
    assert completion.choices[0].text == " 5 + 5 = 10."
    rec = steward_proxy.wait_for_record(raw.headers["x-steward-step"])
    assert rec["endpoint"] == "completions"
    logprobs = orjson.loads(b64(rec["response_body"]))["choices"][0]["logprobs"]
    assert len(logprobs["token_ids"]) == len(logprobs["tokens"]) == 5

    text = "".join(c.choices[0].text for c in client.completions.create(
        model="demo-model", prompt="5+5", stream=True) if c.choices)
    assert text == " 5 + 5 = 10."


def test_responses_plain_stream_and_previous_response(steward_proxy, proxy_key):
    client = client_for(steward_proxy, proxy_key.secret)
    raw = client.responses.with_raw_response.create(model="demo-model", input="what is 3*3?")
    first = raw.parse()
    assert first.output_text == "3 * 3 = 9."
    trajectory = raw.headers["x-steward-trajectory"]
    assert steward_proxy.wait_for_record(raw.headers["x-steward-step"])["endpoint"] == \
        "responses"

    with client.responses.with_streaming_response.create(
            model="demo-model", input="and 4*4?", previous_response_id=first.id,
            stream=True) as streamed:
        assert streamed.headers["x-steward-trajectory"] == trajectory
        step = streamed.headers["x-steward-step"]
        events = list(streamed.parse())
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "4 * 4 = 16." and events[-1].type == "response.completed"
    rec = steward_proxy.wait_for_record(step)
    assert rec["trajectory_source"] == "previous_response" and rec["is_stream"] is True

    # A streamed response id is learned too.
    third = client.responses.with_raw_response.create(
        model="demo-model", input="5*5?", previous_response_id=events[-1].response.id)
    assert third.headers["x-steward-trajectory"] == trajectory


def test_logprobs_and_token_ids_are_spooled(steward_proxy, proxy_key):
    client = client_for(steward_proxy, proxy_key.secret)
    raw = client.chat.completions.with_raw_response.create(
        model="demo-model", logprobs=True, messages=[{"role": "user", "content": "7+1"}])
    content = raw.parse().choices[0].logprobs.content
    assert [t.token for t in content] == ["7", " +", " 1", " =", " 8."]
    rec = steward_proxy.wait_for_record(raw.headers["x-steward-step"])
    spooled = orjson.loads(b64(rec["response_body"]))["choices"][0]["logprobs"]["content"]
    assert [t["token_id"] for t in spooled] == [t.model_extra["token_id"] for t in content]
    assert all(isinstance(t["token_id"], int) and t["logprob"] < 0 for t in spooled)


def test_models_pass_through_uncaptured(steward_proxy, proxy_key):
    client = client_for(steward_proxy, proxy_key.secret)
    before = len(steward_proxy.records())
    assert {m.id for m in client.models.list()} == {"demo-model", "demo-reasoner"}
    time.sleep(0.3)
    assert len(steward_proxy.records()) == before


def test_steward_headers_are_validated(steward_proxy, proxy_key, fake_upstream):
    fake_upstream.clear()
    r = httpx.post(steward_proxy.base_url + "/chat/completions", json={"messages": []},
                   headers={"Authorization": f"Bearer {proxy_key.secret}",
                            "X-Steward-Consent": "maybe"})
    assert_openai_error(r, 400, "invalid_steward_header")
    assert len(fake_upstream.requests) == 0


# -- authentication ---------------------------------------------------------------------
def test_unknown_missing_and_revoked_keys_get_401(steward_proxy, proxy_key, fake_upstream):
    from governance.services import revoke_proxy_key

    fake_upstream.clear()
    url = steward_proxy.base_url + "/chat/completions"
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}
    error = assert_openai_error(httpx.post(url, json=body), 401, "invalid_api_key")
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert_openai_error(httpx.post(url, json=body, headers={
        "Authorization": "Bearer stw_not-a-real-key"}), 401, "invalid_api_key")
    assert_openai_error(httpx.get(steward_proxy.base_url + "/models", headers={
        "Authorization": "Bearer stw_not-a-real-key"}), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        client_for(steward_proxy, "stw_wrong").chat.completions.create(**body)
    assert len(fake_upstream.requests) == 0

    revoke_proxy_key("system:test", proxy_key.key)
    took = wait_for_rejection(steward_proxy, proxy_key.secret)
    assert took < 5  # the refresh interval is 0.2 s in tests
    fake_upstream.clear()
    error = assert_openai_error(httpx.post(url, json=body, headers={
        "Authorization": f"Bearer {proxy_key.secret}"}), 401, "invalid_api_key")
    assert "revoked" in error["message"]
    assert len(fake_upstream.requests) == 0


def test_known_keys_survive_a_database_outage(start_proxy, fake_upstream, tmp_path):
    from governance.services import create_proxy_key, create_tenant

    tenant = create_tenant("system:test", "acme", "Acme")[0]
    secret = create_proxy_key("system:test", tenant, "agent-1").secret
    first = start_proxy(fake_upstream.url, spool_dir=tmp_path / "var" / "spool")
    wait_for_key(first, secret)
    first.stop()
    snapshot = (tmp_path / "var" / "proxy-keys.json").read_text()
    assert secret not in snapshot  # hashes only

    dead_db = f"postgresql://postgres@127.0.0.1:{free_port()}/steward"
    second = start_proxy(fake_upstream.url, spool_dir=tmp_path / "var" / "spool",
                         DATABASE_URL=dead_db)
    r = httpx.post(second.base_url + "/chat/completions", headers={
        "Authorization": f"Bearer {secret}"}, json={"model": "demo-model", "messages": [
            {"role": "user", "content": "1+1"}]}, timeout=30)
    assert r.status_code == 200, r.text
    assert second.wait_for_record(r.headers["x-steward-step"])["response_status"] == 200
    deadline = time.monotonic() + 10
    while "database unreachable" not in second.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert second.log().count("database unreachable") == 1  # logged once per outage


# -- limits and failures ----------------------------------------------------------------
def test_request_over_the_limit_gets_413(start_proxy, fake_upstream, proxy_key):
    proxy = start_proxy(fake_upstream.url, STEWARD_MAX_REQUEST_BYTES="2000")
    wait_for_key(proxy, proxy_key.secret)
    fake_upstream.clear()
    r = httpx.post(proxy.base_url + "/chat/completions", json={
        "model": "demo-model", "messages": [{"role": "user", "content": "x" * 5000}]},
        headers={"Authorization": f"Bearer {proxy_key.secret}"})
    assert "2000" in assert_openai_error(r, 413, "request_too_large")["message"]
    assert len(fake_upstream.requests) == 0


def test_non_json_body_passes_through_and_is_recorded(steward_proxy, proxy_key,
                                                      fake_upstream):
    r = httpx.post(steward_proxy.base_url + "/chat/completions", content=b"not json {",
                   headers={"Authorization": f"Bearer {proxy_key.secret}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400  # the upstream's answer, forwarded
    assert fake_upstream.last_request()["body"] == "not json {"
    rec = steward_proxy.wait_for_record(r.headers["x-steward-step"])
    assert rec["request_is_json"] is False and b64(rec["request_body"]) == b"not json {"
    assert rec["response_status"] == 400


def test_upstream_error_is_forwarded_and_marked(steward_proxy, proxy_key):
    client = client_for(steward_proxy, proxy_key.secret)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="fail-500",
                                       messages=[{"role": "user", "content": "x"}])
    step = e.value.response.headers["x-steward-step"]
    rec = steward_proxy.wait_for_record(step)
    assert rec["response_status"] == 500 and rec["error"]["kind"] == "upstream_error"


def test_upstream_down_gives_502_and_a_failed_step(start_proxy, proxy_key):
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}")
    wait_for_key_through_error(proxy, proxy_key.secret)
    r = httpx.post(proxy.base_url + "/chat/completions", json={
        "model": "demo-model", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {proxy_key.secret}"}, timeout=30)
    assert_openai_error(r, 502, "upstream_unreachable")
    records = [r for r in proxy.wait_for_records(1) if r["endpoint"] == "chat.completions"]
    assert len(records) == 1
    assert records[0]["error"]["kind"] == "upstream_unreachable"
    assert records[0]["response_status"] is None and records[0]["response_body"] is None
    with pytest.raises(openai.APIStatusError) as e:
        client_for(proxy, proxy_key.secret).chat.completions.create(
            model="demo-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 502


def wait_for_key_through_error(proxy, secret: str, timeout: float = 20.0) -> None:
    """Like wait_for_key, for a proxy whose upstream is down (accepted = 502, not 401)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(proxy.base_url + "/models", headers={"Authorization": f"Bearer {secret}"})
        if r.status_code != 401:
            return
        time.sleep(0.1)
    raise AssertionError("key never accepted")


def test_slow_upstream_gives_504_and_a_failed_step(start_proxy, fake_upstream, proxy_key):
    proxy = start_proxy(fake_upstream.url, STEWARD_UPSTREAM_TIMEOUT="1")
    wait_for_key(proxy, proxy_key.secret)
    started = time.monotonic()
    r = httpx.post(proxy.base_url + "/chat/completions", json={
        "model": "demo-model", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {proxy_key.secret}", "X-Demo-Sleep": "4"},
        timeout=30)
    assert time.monotonic() - started < 3.5
    assert "STEWARD_UPSTREAM_TIMEOUT" in assert_openai_error(r, 504, "upstream_timeout")[
        "message"]
    records = [r for r in proxy.wait_for_records(1) if r["endpoint"] == "chat.completions"]
    assert [r["error"]["kind"] for r in records] == ["upstream_timeout"]

    # The proxy keeps serving normally afterwards; the model-name control times out too.
    client = client_for(proxy, proxy_key.secret)
    assert client.chat.completions.create(model="demo-model", messages=[
        {"role": "user", "content": "1+2"}]).choices[0].message.content == "1 + 2 = 3."
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="sleep-3", messages=[
            {"role": "user", "content": "1+2"}])
    assert e.value.status_code == 504


@pytest.mark.parametrize("policy", ["reject", "passthrough"])
def test_spool_full_policy(start_proxy, fake_upstream, proxy_key, tmp_path, policy):
    spool = tmp_path / f"full-{policy}" / "spool"
    spool.mkdir(parents=True)
    (spool / "seg-1-1-1.log").write_bytes(b"x" * 4096)  # unshipped data over the limit
    proxy = start_proxy(fake_upstream.url, spool_dir=spool, STEWARD_SPOOL_MAX_BYTES="1024",
                        STEWARD_SPOOL_FULL_POLICY=policy)
    wait_for_key(proxy, proxy_key.secret)
    fake_upstream.clear()
    r = httpx.post(proxy.base_url + "/chat/completions", json={
        "model": "demo-model", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {proxy_key.secret}"})
    if policy == "reject":
        assert_openai_error(r, 503, "spool_full")
        assert len(fake_upstream.requests) == 0
    else:
        assert r.status_code == 200 and "x-steward-step" not in r.headers
        time.sleep(0.3)
        assert proxy.records() == []


def test_a_known_key_works_on_the_first_request_after_start(start_proxy, fake_upstream,
                                                            transactional_db):
    """The key table is loaded before the proxy serves, and the first connection already
    uses the lazy upstream strategy (a reset connection here would break agents that start
    together with the appliance)."""
    from governance.services import create_proxy_key, create_tenant

    tenant = create_tenant("system:test", "acme", "Acme Bank")[0]
    issued = create_proxy_key("system:test", tenant, "agent-1")
    proxy = start_proxy(fake_upstream.url)
    r = httpx.post(proxy.base_url + "/chat/completions", json={
        "model": "demo-model", "messages": [{"role": "user", "content": "2+2?"}]},
        headers={"Authorization": f"Bearer {issued.secret}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-steward-trajectory"]


def test_the_running_proxy_uses_stewards_hook_dispatch(steward_proxy):
    """decision 13: the addon installs proxy/dispatch.py on load; a silent fallback to
    mitmproxy's dispatch (e.g. after a mitmproxy upgrade) would cost ~1 ms per request."""
    deadline = time.monotonic() + 20
    while "ready (" not in steward_proxy.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = steward_proxy.log()
    assert "hook dispatch: steward" in log, log
    assert "fast hook dispatch not installed" not in log

