"""A step stores only the metadata, versions and usage entries its row cannot give back
(governance/capture/steps.py, decision 39); `step_json` — what the ATDP document shows —
gives back exactly what the build made, for every shape of answer."""

from __future__ import annotations

import copy
import json

import pytest

from governance.capture.steps import (
    compact_step_json,
    fields_from_exchange,
    parse_exchange,
    step_json,
)
from governance.models import Step
from governance.sanitizing import SANITIZER_VERSION


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) \
        + b"data: [DONE]\n\n"


CHAT = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}
ANSWER = {"id": "chatcmpl-1", "model": "gpt-x-0601", "object": "chat.completion",
          "choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": "hello"}}],
          "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                    "prompt_tokens_details": {"cached_tokens": 1}}}
TWO = {**ANSWER, "choices": [ANSWER["choices"][0], {
    "index": 1, "finish_reason": "length", "message": {"role": "assistant", "content": "h"}}]}
RESPONSES = {"id": "resp_1", "object": "response", "model": "gpt-x", "status": "completed",
             "output": [{"type": "message", "role": "assistant",
                         "content": [{"type": "output_text", "text": "hello"}]}],
             "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}
CASES = {
    "chat": ("chat.completions", CHAT, ANSWER, 200, False),
    "two choices": ("chat.completions", {**CHAT, "n": 2}, TWO, 200, False),
    "stream": ("chat.completions", {**CHAT, "stream": True}, _sse(
        {"id": "chatcmpl-2", "model": "gpt-x", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": "he"}}]},
        {"id": "chatcmpl-2", "model": "gpt-x", "choices": [
            {"index": 0, "delta": {"content": "llo"}, "finish_reason": "stop"}]}), 200, True),
    "responses": ("responses", {"model": "gpt-x", "input": "hi"}, RESPONSES, 200, False),
    "upstream error": ("chat.completions", CHAT, {"error": {"message": "boom"}}, 500, False),
    "no model, no usage": ("chat.completions", {"messages": CHAT["messages"]},
                           {k: v for k, v in ANSWER.items() if k not in ("usage", "model")},
                           200, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_stored_json_gives_back_what_the_build_made(case):
    endpoint, request, response, status, stream = CASES[case]
    body = response if isinstance(response, bytes) else json.dumps(response).encode()
    ex = parse_exchange(endpoint=endpoint, request_body=json.dumps(request).encode(),
                        response_body=body, response_status=status, is_stream=stream)
    fields = fields_from_exchange(ex, t_request=1.0, t_first_byte=1.1, t_end=1.2,
                                  harness_version="steward-proxy/0.1")
    fields["metadata"]["steward.sanitizer.version"] = SANITIZER_VERSION  # as finish_fields
    step = Step(endpoint=endpoint, status_code=status, sanitizer_version=SANITIZER_VERSION,
                **fields)
    built = copy.deepcopy((step.usage, step.versions, step.metadata))
    compact_step_json(step)
    assert step_json(step) == built
    stored = len(json.dumps([step.usage, step.versions, step.metadata]))
    assert stored < len(json.dumps(built)) - 150, (step.metadata, step.versions, step.usage)


def test_a_value_that_differs_from_the_column_is_kept_and_wins():
    step = Step(endpoint="chat.completions", status_code=200, response_id="x" * 256,
                request_model="m", response_model="", sanitizer_version="v1",
                action={"finish_reason": "stop"},
                metadata={"gen_ai.response.id": "x" * 300, "http.response.status_code": 200,
                          "gen_ai.response.finish_reasons": ["stop", "length"]},
                versions={"gen_ai.request.model": "m", "gen_ai.response.model": ""},
                usage={"raw": {"prompt_tokens": 1}, "total_tokens": 9})
    built = copy.deepcopy((step.usage, step.versions, step.metadata))
    compact_step_json(step)
    assert step.metadata == {"gen_ai.response.id": "x" * 300,
                             "gen_ai.response.finish_reasons": ["stop", "length"]}
    assert step.versions == {"gen_ai.response.model": ""} and step.usage == built[0]
    usage, versions, metadata = step_json(step)
    # The observation hashes, which every build writes, are derived when a row lacks them
    # (decision 40): none here, the observation has no system prompt or tools.
    assert (usage, versions) == (built[0], {**built[1], "system_prompt_hash": None,
                                            "tool_schema_hash": None})
    assert {k: metadata[k] for k in built[2]} == built[2]


def test_observation_hashes_are_left_out_and_given_back_through_the_real_builder(
        tenant, tmp_path):
    """Decision 40: built through the conversation store, a step stores neither the system
    prompt's hash nor the tool schemas' — the ATDP document computes them again from the
    materialized observation, the same values the build made, for chat (system message) and
    Responses (instructions); a step whose request had neither stores and shows None."""
    import time
    import uuid

    from governance.capture.atdp import trajectory_document
    from governance.capture.steps import canonical_json, sha256_hex
    from governance.models import Trajectory
    from governance.services import ensure_agent
    from governance.tenancy import tenant_context
    from tests.pipeline import chat_response, make_record, ship_and_build

    agent = ensure_agent("system:test", tenant, "hash-bot")
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find an order",
                                               "parameters": {"type": "object"}}}]
    history = [{"role": "system", "content": "You track parcels."},
               {"role": "user", "content": "Where is order 7?"}]
    chat, bare, resp = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    t = time.time()
    records = [
        make_record(tenant.pk, agent.pk, trajectory_id=chat, t=t,
                    request={"model": "m", "messages": history, "tools": tools},
                    response=chat_response("Looking.")),
        make_record(tenant.pk, agent.pk, trajectory_id=chat, t=t + 1,
                    request={"model": "m", "tools": tools, "messages": history + [
                        {"role": "assistant", "content": "Looking."},
                        {"role": "user", "content": "Thanks"}]},
                    response=chat_response("ok")),
        make_record(tenant.pk, agent.pk, trajectory_id=bare, t=t + 2,
                    response=chat_response("hello")),
        make_record(tenant.pk, agent.pk, trajectory_id=resp, t=t + 3, endpoint="responses",
                    request={"model": "m", "instructions": "Be brief.", "input": "hi"},
                    response=RESPONSES),
    ]
    ship_and_build(tmp_path, records)
    expected = {
        chat: {"system_prompt_hash": sha256_hex("You track parcels."),
               "tool_schema_hash": sha256_hex(canonical_json(tools))},
        bare: {"system_prompt_hash": None, "tool_schema_hash": None},
        resp: {"system_prompt_hash": sha256_hex("Be brief."), "tool_schema_hash": None},
    }
    for traj_id, hashes in expected.items():
        with tenant_context(tenant):
            steps = list(Step.objects.filter(trajectory_id=traj_id))
            doc = trajectory_document(Trajectory.objects.select_related("tenant", "agent")
                                      .get(pk=traj_id))
        assert steps and doc["steps"]
        for step in steps:
            if step.history_digest or step.item_refs:  # stored through the store: left out
                assert not set(hashes) & set(step.versions), step.versions
        for s in doc["steps"]:
            assert {k: s["versions"][k] for k in hashes} == hashes, (traj_id, s["versions"])
