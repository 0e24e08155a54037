"""A step's action, usage, timings and versions are stored compressed against a preset
dictionary (governance.models.StepJSONField, decision 60): what the columns hold, that every
reader gets the built values back, the formats read, and migration 0036 both ways."""

from __future__ import annotations

import uuid

import orjson
import pytest
from django.db import DataError, connection

from governance.capture.atdp import trajectory_document
from governance.models import STEP_JSON_FORMAT_1, Step, StepJSONField, Trajectory
from governance.tenancy import tenant_context
from tests.govdata import make_trajectory
from tests.pipeline import make_record, ship_and_build

COLUMNS = ("action", "usage", "timings", "versions")
TOOL_ANSWER = {
    "id": "chatcmpl-9", "object": "chat.completion", "model": "gpt-x-0601",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_5jQdSXVBGc9unuJOdSZlau1r", "type": "function", "function": {
                "name": "get_reservation_details",
                "arguments": "{\"reservation_id\": \"JG7FMM\"}"}}]}}],
    "usage": {"prompt_tokens": 812, "completion_tokens": 21, "total_tokens": 833,
              "prompt_tokens_details": {"cached_tokens": 768}}}


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "packed-bot")


def stored(step_id: uuid.UUID) -> dict[str, bytes]:
    """The four columns' bytes as PostgreSQL holds them."""
    with connection.cursor() as cur:
        cur.execute(f"SELECT {', '.join(COLUMNS)} FROM governance_step WHERE id = %s",
                    [step_id])
        return dict(zip(COLUMNS, (bytes(v) for v in cur.fetchone()), strict=True))


def test_a_built_step_stores_its_json_packed_and_every_reader_gets_it_back(tenant, agent,
                                                                           tmp_path):
    traj = str(uuid.uuid4())
    ship_and_build(tmp_path, [make_record(
        tenant.pk, agent.pk, trajectory_id=traj, response=TOOL_ANSWER,
        request={"model": "gpt-x", "messages": [{"role": "user", "content": "Where is JG7FMM?"}]})])
    with tenant_context(tenant.pk):
        step = Step.objects.get(trajectory_id=traj)
    blobs = stored(step.pk)
    values = {c: getattr(step, c) for c in COLUMNS}
    assert values["action"]["messages"][0]["tool_calls"][0]["function"]["name"] \
        == "get_reservation_details"
    assert values["usage"]["raw"]["prompt_tokens"] == 812
    assert set(values["timings"]) == {"ttfb_ms", "duration_ms"}
    # Format 1 where it is smaller than the JSON text, and much smaller on the action and
    # usage (JSONB kept them at 403 and 113 bytes a step on tau-bench's sessions).
    for column, blob in blobs.items():
        text = orjson.dumps(values[column])
        assert blob[:1] == STEP_JSON_FORMAT_1 or blob == text, column
        assert StepJSONField.unpack(blob) == values[column] or column == "action"
    assert len(blobs["action"]) < 0.7 * len(orjson.dumps(values["action"]))
    assert len(blobs["usage"]) < 0.5 * len(orjson.dumps(values["usage"]))
    with tenant_context(tenant.pk):
        assert dict(zip(COLUMNS, Step.objects.values_list(*COLUMNS).get(pk=step.pk),
                        strict=True)) == values
        assert {c: getattr(Step.objects.only(*COLUMNS).get(pk=step.pk), c)
                for c in COLUMNS} == values
        doc = trajectory_document(Trajectory.objects.get(pk=traj))
    assert doc["steps"][0]["action"] == values["action"]
    assert doc["steps"][0]["usage"]["gen_ai.usage.input_tokens"] == 812
    assert doc["steps"][0]["timings"] == values["timings"]


@pytest.mark.parametrize("value", [
    {}, [], "", None, 0, -2.5, True, {"k": "naïve ☃ <PERSON_1>", "n": [1, 2.5, None, False]},
    {"messages": [{"role": "assistant", "content": "x" * 5000}], "finish_reason": "length"},
    {"path": "C:\\\\u0000"}, "\\u0000",
])
def test_every_json_value_round_trips(value):
    blob = StepJSONField.pack(value)
    assert StepJSONField.unpack(blob) == value
    assert len(blob) <= len(orjson.dumps(value))


def test_the_formats_read_and_what_is_refused():
    value = {"raw": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}
    # JSON text (migration 0036's conversion, JSONB's spacing) and a zlib stream.
    assert StepJSONField.unpack(b'{"raw": {"prompt_tokens": 5, "completion_tokens": 2, '
                                b'"total_tokens": 7}}') == value
    import zlib

    assert StepJSONField.unpack(zlib.compress(orjson.dumps(value))) == value
    assert StepJSONField.pack({}) == b"{}"
    # Both preset formats are read by either field (one unpack, decision 61).
    from governance.models import ItemJSONField

    assert StepJSONField.unpack(ItemJSONField.pack(value)) == value
    with pytest.raises(ValueError, match="unknown format"):
        StepJSONField.unpack(b"\x03abc")
    with pytest.raises(ValueError, match="unknown format"):
        StepJSONField.unpack(b"")
    # A packed value cut short, or with bytes after its end, says so (not a JSON error).
    packed = StepJSONField.pack(value)
    with pytest.raises(ValueError, match="truncated step JSON value"):
        StepJSONField.unpack(packed[:-2])
    with pytest.raises(ValueError, match="bytes after its end"):
        StepJSONField.unpack(packed + b"\x00")
    # What JSONB refuses stays refused: the step builder quarantines such a call.
    with pytest.raises(DataError):
        StepJSONField.pack({"messages": [{"content": "a\x00b"}]})


def test_migration_0036_converts_both_ways(tenant, agent, transactional_db):
    """Forward: JSONB rows become their JSON text, read as they were; backward: packed rows
    become JSONB of the same values (a Responses action stays without its `messages`, as
    0035's field stores it)."""
    from django.core.management import call_command

    output = [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Done.", "annotations": []}]}]
    built = {"action": {"finish_reason": "stop", "status": "completed", "output": output},
             "usage": {"raw": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}},
             "timings": {"ttfb_ms": 1.5, "duration_ms": 2.25},
             "versions": {"harness_version": "steward-proxy/0.1",
                          "route": {"id": 3, "arm": "canary"}}}
    with tenant_context(tenant.pk):
        traj = make_trajectory(tenant, agent, steps=0)
        new = Step.objects.create(id=uuid.uuid4(), tenant=tenant, trajectory=traj,
                                  endpoint="responses", started_at=traj.started_at, **built)
        full = Step.objects.get(pk=new.pk)
    assert all(stored(new.pk)[c][:1] == STEP_JSON_FORMAT_1 for c in COLUMNS)
    assert full.action["messages"][0]["content"] == "Done."

    old_id = uuid.uuid4()
    old = {"action": {"messages": [{"role": "assistant", "content": "Hi ☃"}],
                      "finish_reason": "stop"},
           "usage": {"gen_ai.usage.input_tokens": 9}, "timings": {},
           "versions": {"system_prompt_hash": "ab" * 32}}
    call_command("migrate", "governance", "0035", verbosity=0)
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT set_config('steward.system', 'on', false)")
            cur.execute("SELECT pg_typeof(action)::text, action::text, usage::text, "
                        "timings::text, versions::text FROM governance_step WHERE id = %s",
                        [new.pk])
            kind, *back = cur.fetchone()
            assert kind == "jsonb"
            assert dict(zip(COLUMNS, map(orjson.loads, back), strict=True)) == built
            cur.execute("INSERT INTO governance_step (id, tenant_id, trajectory_id, endpoint, "
                        "started_at, status_code, request_model, response_model, response_id, "
                        "observation, hidden_state, action, tokens, usage, timings, versions, "
                        "metadata, classification, consent, sanitizer_version, "
                        "training_eligible, created_at, kept, appended, item_refs, "
                        "history_digest, history_length) VALUES (%s, %s, %s, "
                        "'chat.completions', %s, 200, '', '', '', '{}', '{}', %s::jsonb, "
                        "'{}', %s::jsonb, %s::jsonb, %s::jsonb, '{}', 'internal', 'train', "
                        "'', false, now(), 0, '{}', '{}', '', 0)",
                        [old_id, tenant.pk, traj.pk, traj.started_at,
                         *(orjson.dumps(old[c]).decode() for c in COLUMNS)])
    finally:
        call_command("migrate", "governance", verbosity=0)
    with tenant_context(tenant.pk):
        read = {s.pk: s for s in Step.objects.filter(pk__in=[new.pk, old_id])}
    assert {c: getattr(read[old_id], c) for c in COLUMNS} == old
    assert {c: getattr(read[new.pk], c) for c in COLUMNS} == {c: getattr(full, c)
                                                              for c in COLUMNS}
    assert stored(old_id)["timings"] == b"{}"
