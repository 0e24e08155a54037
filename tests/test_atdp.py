"""ATDP v1: every served trajectory document validates against the published JSON Schema,
across all endpoint kinds, streams, failed steps; action results and rewards are joined when
served."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from jsonschema import Draft202012Validator, FormatChecker

from governance.capture.atdp import SCHEMA_PATH, trajectory_document
from governance.models import Trajectory
from governance.sanitizer import SANITIZER_VERSION
from governance.services import record_reward
from governance.tenancy import tenant_context
from tests.pipeline import chat_response, make_record, ship_and_build


def sse(*events, named: bool = False) -> bytes:
    out = []
    for ev in events:
        if named:
            out.append(f"event: {ev['type']}\n")
        out.append(f"data: {json.dumps(ev)}\n\n")
    if not named:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode()


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "atdp-bot")


@pytest.fixture
def validator():
    schema = json.loads(SCHEMA_PATH.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=FormatChecker())


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def tool_conversation(tenant, agent, traj: str, t0: float) -> list[dict]:
    """A chat stream with a tool call, then the request carrying the tool result."""
    sys_msg = {"role": "system", "content": "You are a bank assistant."}
    user = {"role": "user", "content": "Balance of account 42?"}
    stream = sse(
        {"id": "chatcmpl-t1", "model": "m-1", "choices": [{"index": 0, "delta": {
            "role": "assistant", "reasoning_content": "need lookup"}}]},
        {"id": "chatcmpl-t1", "model": "m-1", "choices": [{"index": 0, "delta": {
            "tool_calls": [{"index": 0, "id": "call_42", "type": "function",
                            "function": {"name": "lookup", "arguments": "{\"acc"}}]},
            "logprobs": {"content": [{"token": "x", "logprob": -0.1, "top_logprobs": [],
                                      "token_id": 87}]}}]},
        {"id": "chatcmpl-t1", "model": "m-1", "choices": [{"index": 0, "delta": {
            "tool_calls": [{"index": 0, "function": {"arguments": "\": 42}"}}]},
            "finish_reason": "tool_calls"}]},
        {"id": "chatcmpl-t1", "choices": [], "usage": {"prompt_tokens": 9,
                                                       "completion_tokens": 4}},
    )
    first = make_record(tenant.pk, agent.pk, trajectory_id=traj, session="conv",
                        source="session", request={"model": "m", "messages": [sys_msg, user],
                                                   "tools": TOOLS, "stream": True,
                                                   "logprobs": True},
                        response=stream, stream=True, t=t0)
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_42", "type": "function",
         "function": {"name": "lookup", "arguments": "{\"acc\": 42}"}}]}
    tool_msg = {"role": "tool", "tool_call_id": "call_42", "content": "{\"balance\": 10}"}
    second = make_record(tenant.pk, agent.pk, trajectory_id=traj, session="conv",
                         source="session",
                         request={"model": "m", "messages": [sys_msg, user, assistant,
                                                             tool_msg], "tools": TOOLS},
                         response=chat_response("Your balance is 10.", rid="chatcmpl-t2"),
                         t=t0 + 1)
    return [first, second]


def all_kinds(tenant, agent, traj: str, t0: float) -> list[dict]:
    def rec(endpoint, request, response, **kw):
        kw.setdefault("t", t0 + 10 + len(out))
        out.append(make_record(tenant.pk, agent.pk, endpoint=endpoint, trajectory_id=traj,
                               request=request, response=response, **kw))

    out: list[dict] = []
    rec("completions", {"model": "m", "prompt": "1+1="},
        {"id": "cmpl-1", "model": "m", "choices": [{"index": 0, "text": "2",
                                                     "finish_reason": "stop"}]})
    rec("completions", {"model": "m", "prompt": "1+1=", "stream": True},
        sse({"id": "cmpl-2", "model": "m", "choices": [{"index": 0, "text": "2",
                                                         "finish_reason": None}]},
            {"id": "cmpl-2", "model": "m", "choices": [{"index": 0, "text": "",
                                                         "finish_reason": "stop"}]}),
        stream=True)
    response_obj = {"id": "resp_1", "model": "m", "status": "completed", "output": [
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "hey"}]}],
        "usage": {"input_tokens": 2, "output_tokens": 1}}
    rec("responses", {"model": "m", "input": "hi", "instructions": "Be nice."}, response_obj)
    rec("responses", {"model": "m", "input": [{"role": "user", "content": "hi"}],
                      "stream": True},
        sse({"type": "response.created", "response": {"id": "resp_2", "model": "m",
                                                      "status": "in_progress", "output": []}},
            {"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
             "delta": "he"},
            {"type": "response.completed", "response": {**response_obj, "id": "resp_2"}},
            named=True), stream=True)
    rec("chat.completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]},
        {"error": {"message": "overloaded", "type": "server_error"}}, status=503)
    rec("chat.completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]},
        {"error": {"message": "upstream unreachable", "type": "steward_error"}}, status=502,
        error={"kind": "upstream_unreachable", "message": "connection refused"})
    rec("chat.completions", {"model": "m", "messages": []}, None, status=None,
        error={"kind": "client_disconnected", "message": "agent went away"})
    rec("chat.completions", b"this is not json", {"error": {"message": "bad json"}},
        status=400)
    rec("chat.completions", {"model": "m", "messages": [{"role": "user", "content": "n"}],
                             "n": 2},
        {"id": "chatcmpl-n", "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "a"},
             "finish_reason": "stop"},
            {"index": 1, "message": {"role": "assistant", "content": "b"},
             "finish_reason": "length"}]})
    return out


def test_documents_validate_across_endpoints_and_failures(tenant, agent, tmp_path, validator,
                                                          django_assert_max_num_queries):
    traj = str(uuid.uuid4())
    t0 = time.time() - 100
    records = tool_conversation(tenant, agent, traj, t0) + all_kinds(tenant, agent, traj, t0)
    # A reward that arrives before its capture, one by trajectory, one for another response.
    record_reward("system:test", tenant, value=1.0, response_id="chatcmpl-t2", name="correct")
    record_reward("system:test", tenant, value=0.5, trajectory_id=uuid.UUID(traj))
    record_reward("system:test", tenant, value=9.0, response_id="chatcmpl-elsewhere")
    counts = ship_and_build(tmp_path / "spool", records)
    assert counts["inserted"] == len(records)

    t = Trajectory.objects.select_related("tenant", "agent").get(pk=traj)
    # steps + finding counts, their conversation items, rewards, unbuilt calls
    with tenant_context(tenant), django_assert_max_num_queries(4):
        doc = trajectory_document(t)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])

    steps = doc["steps"]
    assert len(steps) == len(records) == doc["step_count"]
    assert [s["id"] for s in steps] == [r["step_id"] for r in records]
    assert {s["endpoint"] for s in steps} == {"chat.completions", "completions", "responses"}
    first = steps[0]
    assert first["action"]["messages"][0]["tool_calls"][0]["function"]["arguments"] == \
        "{\"acc\": 42}"
    assert first["hidden_state"] == {"reasoning_content": "need lookup"}
    assert first["tokens"]["token_ids"] == [87]
    assert first["usage"]["gen_ai.usage.input_tokens"] == 9
    # The tool result that arrived in the next request, joined at serve time.
    assert first["action_result"] == {
        "tool_results": [{"tool_call_id": "call_42", "content": "{\"balance\": 10}"}],
        "source_step_id": steps[1]["id"], "source_step_index": 1}
    assert steps[1]["action_result"] is None
    kinds = [s["error"]["kind"] for s in steps if s["error"]]
    assert kinds == ["http_error", "upstream_unreachable", "client_disconnected",
                     "http_error"]
    assert steps[-2]["observation"] == {"non_json": True, "bytes": 16}
    # Every step sanitized by the pipeline; not eligible: some steps failed.
    assert doc["governance"] == {
        "consent": "train", "subject_hash_present": False, "classification": "internal",
        "retention": {"until": None}, "sanitizer_version": SANITIZER_VERSION,
        "training_eligible": False, "findings": {}, "quarantined": [], "approval": None}
    assert all(s["governance"]["sanitizer_version"] == SANITIZER_VERSION for s in steps)
    assert [s["governance"]["training_eligible"] for s in steps][:2] == [True, True]

    rewards = {r["value"]: r for r in doc["rewards"]}
    assert set(rewards) == {1.0, 0.5}
    assert rewards[1.0]["step_index"] == 1 and rewards[1.0]["step_id"] == steps[1]["id"]
    assert rewards[0.5]["trajectory_id"] == traj and rewards[0.5]["step_index"] is None


def test_served_documents_validate(tenant, agent, make_member, api_client_for, tmp_path,
                                   validator):
    """Through the API too: the detail endpoint serves documents that validate, including an
    empty trajectory (only a quarantined call) and a no-train one with a subject."""
    client = api_client_for(make_member("auditor"), tenant)
    t0 = time.time() - 50
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    records = tool_conversation(tenant, agent, a, t0) + [
        make_record(tenant.pk, agent.pk, trajectory_id=b, response=b"garbage", status=200),
        make_record(tenant.pk, agent.pk, trajectory_id=c, consent="no-train", subject="carol",
                    response=chat_response()),
    ]
    ship_and_build(tmp_path / "spool", records)
    for traj in (a, b, c):
        resp = client.get(f"/api/v1/trajectories/{traj}/")
        assert resp.status_code == 200
        errors = list(validator.iter_errors(resp.json()))
        assert not errors, [e.message for e in errors[:5]]
    doc_b = client.get(f"/api/v1/trajectories/{b}/").json()
    assert doc_b["steps"] == [] and doc_b["governance"]["training_eligible"] is False
    # The quarantined call is visible (its reason, never its content).
    [q] = doc_b["governance"]["quarantined"]
    assert q["state"] == "quarantined" and "not a JSON object" in q["reason"]
    doc_c = client.get(f"/api/v1/trajectories/{c}/").json()
    assert doc_c["governance"]["consent"] == "no-train"
    assert doc_c["governance"]["subject_hash_present"] is True
    assert doc_c["steps"][0]["governance"]["consent"] == "no-train"

    public = client.__class__().get("/api/v1/atdp/schema/")
    assert public.status_code == 200
    assert public.json() == json.loads(SCHEMA_PATH.read_text())


def test_schema_rejects_a_broken_document(validator, tenant, agent, tmp_path):
    """The schema has teeth: the same document with a field broken no longer validates."""
    traj = str(uuid.uuid4())
    ship_and_build(tmp_path / "spool", tool_conversation(tenant, agent, traj, time.time()))
    with tenant_context(tenant):
        doc = trajectory_document(Trajectory.objects.get(pk=traj))
    assert validator.is_valid(doc)
    for breaker in (lambda d: d.update(atdp_version="2.0"),
                    lambda d: d["steps"][0].pop("observation"),
                    lambda d: d["steps"][0]["usage"].update({"gen_ai.usage.input_tokens": -1}),
                    lambda d: d["steps"][0]["versions"].update(system_prompt_hash="abc"),
                    lambda d: d["governance"].pop("training_eligible")):
        broken = json.loads(json.dumps(doc))
        breaker(broken)
        assert not validator.is_valid(broken)
