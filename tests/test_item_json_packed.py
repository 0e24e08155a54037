"""Conversation items' content is stored compressed against a preset dictionary
(governance.models.ItemJSONField, decision 61): what the column holds for built items, that
every format reads back, what is refused, and migration 0037 both ways."""

from __future__ import annotations

import uuid
import zlib

import orjson
import pytest
from django.db import DataError, connection

from governance.capture.conversation import observations
from governance.models import (
    ITEM_JSON_FORMAT_1,
    ConversationItem,
    ItemJSONField,
    PackedJSONField,
    Step,
)
from governance.tenancy import tenant_context
from tests.pipeline import chat_response, make_record, ship_and_build

# A recorded support session's shapes (tau-bench's airline agent, chat form): a tool call, its
# result, a text answer, the customer.
TOOLS = [{"type": "function", "function": {
    "name": "get_reservation_details", "description": "Get the details of a reservation.",
    "parameters": {"type": "object", "properties": {"reservation_id": {
        "type": "string", "description": "The reservation id, such as '8JX2WO'."}},
        "required": ["reservation_id"]}}}]
HISTORY = [
    {"role": "system", "content": "You are an airline agent. Be brief."},
    {"role": "user", "content": "Hi, I want to change my flight. My reservation is JG7FMM."},
    {"content": None, "role": "assistant", "tool_calls": [{"function": {
        "arguments": "{\"reservation_id\": \"JG7FMM\"}", "name": "get_reservation_details"},
        "id": "call_5jQdSXVBGc9unuJOdSZlau1r", "type": "function"}]},
    {"role": "tool", "tool_call_id": "call_5jQdSXVBGc9unuJOdSZlau1r", "name":
     "get_reservation_details", "content": "{\"reservation_id\": \"JG7FMM\", \"origin\": "
     "\"SFO\", \"destination\": \"JFK\", \"cabin\": \"economy\", \"flights\": [{\"flight_number"
     "\": \"HAT034\", \"date\": \"2024-05-20\", \"price\": 143}]}"},
    {"content": "Your flight HAT034 on May 20th is in economy. What would you like to change?",
     "role": "assistant"},
]


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "item-packed-bot")


def _stored(trajectory_id: str) -> list[bytes]:
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("SELECT content FROM governance_conversationitem WHERE trajectory_id = %s "
                    "ORDER BY id", [trajectory_id])
        return [bytes(r[0]) for r in cur.fetchall()]


def test_built_items_are_packed_smaller_than_zlib_and_read_back_whole(tenant, agent, tmp_path):
    traj = str(uuid.uuid4())
    request = {"model": "m", "messages": HISTORY, "tools": TOOLS}
    ship_and_build(tmp_path, [make_record(tenant.pk, agent.pk, trajectory_id=traj,
                                          request=request, response=chat_response("ok"))])
    blobs = _stored(traj)
    assert len(blobs) == len(HISTORY) + 1  # each message, and the tool schemas
    assert all(b[:1] == ITEM_JSON_FORMAT_1 for b in blobs)
    # Every item smaller than zlib made it (migration 0033's format), in all ~25 % smaller here.
    values = [ItemJSONField.unpack(b) for b in blobs]
    zlibbed = [len(zlib.compress(orjson.dumps(v), 6)) for v in values]
    assert all(len(b) < z for b, z in zip(blobs, zlibbed, strict=True))
    assert sum(map(len, blobs)) < 0.8 * sum(zlibbed)
    with tenant_context(tenant):
        step = Step.objects.get(trajectory_id=traj)
        obs = observations([step])[step.pk]
    assert obs["tools"] == TOOLS
    assert [m["role"] for m in obs["messages"]] == [m["role"] for m in HISTORY]
    assert obs["messages"][2]["tool_calls"][0]["id"] == "call_5jQdSXVBGc9unuJOdSZlau1r"


@pytest.mark.parametrize("value", [
    {"role": "user", "content": "naïve ☃ <PERSON_1> \\u0000 literal"},
    [{"type": "function", "function": {"name": "f"}}], "Be brief.", "", {}, [], None, 3.5,
    {"type": "function_call_output", "call_id": "call_1", "output": "x" * 5000},
])
def test_every_json_value_round_trips(value):
    assert ItemJSONField.unpack(ItemJSONField.pack(value)) == value


def test_the_formats_read_and_what_is_refused():
    value = {"role": "user", "content": "Where is my bag?"}
    # Migration 0033's zlib rows, JSON text (a value the dictionary does not make smaller,
    # instructions included), StepJSONField's format 1: all read as they are.
    assert ItemJSONField.unpack(PackedJSONField.pack(value)) == value
    assert ItemJSONField.unpack(b'"Hi"') == "Hi"
    assert ItemJSONField.pack("Hi") == b'"Hi"'
    assert ItemJSONField.unpack(b'{"a":1}') == {"a": 1}
    from governance.models import StepJSONField

    assert ItemJSONField.unpack(StepJSONField.pack(value)) == value
    with pytest.raises(ValueError, match="unknown format"):
        ItemJSONField.unpack(b"\x04abc")
    # Format 3: a reference to a step's answer message (decision 62), 19 bytes exactly.
    import uuid

    from governance.models import AnswerRef

    ref = AnswerRef(uuid.uuid4(), 2)
    assert ItemJSONField.pack(ref) == b"\x03" + ref.step_id.bytes + b"\x00\x02"
    assert ItemJSONField.unpack(ItemJSONField.pack(ref)) == ref
    with pytest.raises(ValueError, match="damaged answer reference"):
        ItemJSONField.unpack(ItemJSONField.pack(ref)[:-1])
    packed = ItemJSONField.pack(value)
    with pytest.raises(ValueError, match="conversation item"):
        ItemJSONField.unpack(packed[:-2])
    with pytest.raises(ValueError, match="conversation item"):
        ItemJSONField.unpack(packed + b"\x00")
    # What JSONB refuses stays refused, as before (the step builder quarantines such a call).
    with pytest.raises(DataError):
        ItemJSONField.pack({"content": "a\x00b"})


def test_migration_0037_converts_back_to_zlib_and_forward_reads_both(tenant, agent, tmp_path,
                                                                      transactional_db):
    """Forward changes no row (zlib'd items stay, read as they are); the reverse rewrites
    format-2 and JSON-text items as zlib'd JSON, the only format 0033's reverse reads."""
    from django.core.management import call_command

    traj = str(uuid.uuid4())
    request = {"model": "m", "messages": HISTORY, "tools": TOOLS}
    ship_and_build(tmp_path, [make_record(tenant.pk, agent.pk, trajectory_id=traj,
                                          request=request, response=chat_response("ok"))])
    before = dict(ConversationItem.objects.filter(trajectory_id=traj)
                  .values_list("pk", "content"))
    assert {b[:1] for b in _stored(traj)} == {ITEM_JSON_FORMAT_1}
    with connection.cursor() as cur:  # one item as JSON text, as pack keeps a tiny value
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        pk = min(before)
        cur.execute("UPDATE governance_conversationitem SET content = %s WHERE id = %s",
                    [orjson.dumps(before[pk]), pk])
    call_command("migrate", "governance", "0036", verbosity=0)
    try:
        blobs = _stored(traj)
        assert blobs and all(b[:1] == b"\x78" for b in blobs)
        assert sorted(orjson.dumps(orjson.loads(zlib.decompress(b))) for b in blobs) == sorted(
            orjson.dumps(v) for v in before.values())
    finally:
        call_command("migrate", "governance", verbosity=0)
    assert dict(ConversationItem.objects.filter(trajectory_id=traj)
                .values_list("pk", "content")) == before
    assert {b[:1] for b in _stored(traj)} == {b"\x78"}  # forward rewrites nothing
