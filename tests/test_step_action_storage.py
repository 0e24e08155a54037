"""A Responses API step stores its answer's native `output` items and not the chat-style
`messages` read from them (governance.models.ActionField, decision 55): what the column holds,
what every reader gets back, and the rows the field must leave whole."""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import connection

from governance.capture.atdp import trajectory_document
from governance.models import Finding, Step, StepJSONField, Trajectory
from governance.tenancy import tenant_context
from tests.govdata import make_trajectory
from tests.pipeline import chat_response, make_record, ship_and_build
from wire.openai import responses_message

ANSWER = {"id": "resp_a1", "object": "response", "model": "m-2", "status": "completed",
          "output": [
              {"type": "reasoning", "id": "rs_1", "summary": [
                  {"type": "summary_text", "text": "look the customer up"}]},
              {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Checking ", "annotations": []},
                           {"type": "output_text", "text": "now.", "annotations": []}]},
              {"type": "function_call", "id": "fc_1", "call_id": "call_7", "status": "completed",
               "name": "lookup", "arguments": "{\"email\": \"maria.garcia@example.com\"}"}],
          "usage": {"input_tokens": 20, "output_tokens": 9, "total_tokens": 29}}


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "action-bot")


def stored_action(step_id: uuid.UUID) -> dict:
    """The column as PostgreSQL holds it, unpacked (decision 60) but past ActionField's
    reading."""
    with connection.cursor() as cur:
        cur.execute("SELECT action FROM governance_step WHERE id = %s", [step_id])
        return StepJSONField.unpack(cur.fetchone()[0])


def build_one(tenant, agent, tmp_path, endpoint: str, request: dict, response: dict) -> Step:
    traj = str(uuid.uuid4())
    ship_and_build(tmp_path, [make_record(tenant.pk, agent.pk, endpoint=endpoint,
                                          trajectory_id=traj, request=request,
                                          response=response)])
    with tenant_context(tenant.pk):
        return Step.objects.get(trajectory_id=traj)


def test_a_responses_step_stores_the_items_and_reads_the_messages_back(tenant, agent, tmp_path):
    step = build_one(tenant, agent, tmp_path, "responses",
                     {"model": "m", "input": [{"role": "user", "content": "Who is Maria?"}],
                      "store": False}, ANSWER)
    column = stored_action(step.pk)
    assert "messages" not in column
    assert [i["type"] for i in column["output"]] == ["reasoning", "message", "function_call"]
    # The sanitized answer: the email is a placeholder in the items, so in the reading too.
    message = step.action["messages"][0]
    assert message == {"role": "assistant", "content": "Checking now.", "tool_calls": [
        {"id": "call_7", "type": "function",
         "function": {"name": "lookup", "arguments": "{\"email\": \"<EMAIL_ADDRESS_1>\"}"}}]}
    assert step.action["finish_reason"] == "tool_calls"
    # Every way a reader gets the column: .values(), .only(), the ATDP document.
    with tenant_context(tenant.pk):
        assert Step.objects.values_list("action", flat=True).get(pk=step.pk) == step.action
        assert Step.objects.only("action").get(pk=step.pk).action == step.action
        doc = trajectory_document(Trajectory.objects.get(pk=step.trajectory_id))
    assert doc["steps"][0]["action"]["messages"] == [message]


def test_a_chat_step_is_stored_whole(tenant, agent, tmp_path):
    step = build_one(tenant, agent, tmp_path, "chat.completions",
                     {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                     chat_response("hello"))
    column = stored_action(step.pk)
    assert column["messages"] == [{"role": "assistant", "content": "hello"}]
    assert step.action == column


def test_messages_that_are_not_the_reading_of_the_items_are_kept(tenant, agent):
    """Only an exact reading is dropped: an action whose messages say something else (built by
    other code, or by a later parser) round-trips unchanged."""
    other = {"output": ANSWER["output"], "status": "completed", "finish_reason": "stop",
             "messages": [{"role": "assistant", "content": "something else"}]}
    exact = {"output": ANSWER["output"], "status": "completed", "finish_reason": "tool_calls",
             "messages": [responses_message(ANSWER["output"])]}
    with tenant_context(tenant.pk):
        traj = make_trajectory(tenant, agent, steps=0)
        ids = []
        for action in (other, exact):
            step = Step.objects.create(id=uuid.uuid4(), tenant=tenant, trajectory=traj,
                                       endpoint="responses", started_at=traj.started_at,
                                       action=action)
            ids.append(step.pk)
        assert stored_action(ids[0]) == other
        assert "messages" not in stored_action(ids[1])
        assert [Step.objects.get(pk=i).action for i in ids] == [other, exact]


def test_a_step_stored_whole_before_reads_as_it_was(tenant, agent):
    """Rows written before decision 55 hold both forms; they are read as they are."""
    before = {"output": ANSWER["output"], "status": "completed", "finish_reason": "tool_calls",
              "messages": [responses_message(ANSWER["output"])]}
    with tenant_context(tenant.pk):
        traj = make_trajectory(tenant, agent, steps=0)
        step = Step.objects.create(id=uuid.uuid4(), tenant=tenant, trajectory=traj,
                                   endpoint="responses", started_at=traj.started_at, action={})
        with connection.cursor() as cur:
            # As migration 0036 left such a row: its JSON text.
            cur.execute("UPDATE governance_step SET action = convert_to(%s, 'UTF8') "
                        "WHERE id = %s", [json.dumps(before), step.pk])
        assert Step.objects.get(pk=step.pk).action == before


@pytest.mark.parametrize("output, message", [
    ([], {"role": "assistant", "content": None}),
    ([{"type": "message", "content": [{"type": "refusal", "refusal": "No."}]}],
     {"role": "assistant", "content": None, "refusal": "No."}),
    (["not an item", {"type": "function_call", "id": "fc_2"}],
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "fc_2", "type": "function", "function": {"name": "", "arguments": ""}}]}),
])
def test_the_reading_of_odd_items(output, message):
    assert responses_message(output) == message


def test_the_request_a_responses_answer_echoes_is_not_sanitized_again(tenant, agent, tmp_path):
    """The Responses API's `response` object repeats the request's instructions and tools:
    the step reads neither from it, and the sanitizer does not find their identifiers again
    in every answer (decision 57). The request side finds them, once."""
    instructions = "You help Maria Garcia (maria.garcia@example.com) with her bookings."
    tools = [{"type": "function", "name": "lookup", "description": "Look up Peter Novak's "
              "orders (peter.novak@example.org).", "parameters": {"type": "object"}}]
    answer = {**ANSWER, "instructions": instructions, "tools": tools,
              "metadata": {"owner": "maria.garcia@example.com"},
              "output": [{"type": "message", "id": "msg_9", "role": "assistant",
                          "status": "completed",
                          "content": [{"type": "output_text", "text": "Done.",
                                       "annotations": []}]}]}
    step = build_one(tenant, agent, tmp_path, "responses",
                     {"model": "m", "instructions": instructions, "tools": tools,
                      "input": [{"role": "user", "content": "Book it."}], "store": False},
                     answer)
    with tenant_context(tenant.pk):
        found = {side: sum(f.total for f in Finding.objects.filter(step_id=step.pk, side=side))
                 for side in ("request", "response")}
    assert found["response"] == 0, found
    assert found["request"] >= 3, found  # the instructions' and the tools' identifiers
    assert step.action["messages"][0]["content"] == "Done."
    assert step.response_id == "resp_a1" and step.response_model == "m-2"
