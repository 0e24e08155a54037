"""The conversation store (issue 16, governance/capture/conversation.py) through the real
shipper and step builder on PostgreSQL: each distinct message of a trajectory is stored and
sanitized once, a step names the step it extends and what it appends, and every reader still
sees exactly what each call sent (sanitized)."""

from __future__ import annotations

import copy
import uuid
from datetime import timedelta

import orjson
import pytest
from django.db import connection
from django.utils import timezone

from governance.capture.atdp import trajectory_document
from governance.capture.conversation import (
    Layout,
    chain_digests,
    choose_parent,
    materialize,
    observations,
)
from governance.models import ConversationItem, Finding, Step, SubjectIndex, Tenant, Trajectory
from governance.retention import purge_tenant
from governance.sanitizer import SANITIZER_VERSION
from governance.sanitizer.core import Sanitizer
from governance.sanitizing import clear_cache
from governance.tenancy import tenant_context
from tests.pipeline import chat_response, make_record, ship_and_build
from tests.test_sanitize_pipeline import all_rows_text

TOOLS = [{"type": "function", "function": {
    "name": "lookup_order", "description": "Find an order by its number.",
    "parameters": {"type": "object", "properties": {"order": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": "You are a support agent for an online bookshop."}


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "store-bot")


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _call(tenant, agent, traj: str, messages: list, t: float, tools=TOOLS) -> dict:
    request = {"model": "m", "messages": copy.deepcopy(messages), "temperature": 0.2}
    if tools is not None:
        request["tools"] = tools
    return make_record(tenant.pk, agent.pk, trajectory_id=traj, request=request,
                       response=chat_response("ok"), t=t)


def _steps(traj: str) -> list[Step]:
    return list(Step.objects.filter(trajectory_id=traj).order_by("started_at", "id"))


# --- the pure parts --------------------------------------------------------------------------

def test_parent_is_the_longest_stored_prefix():
    chains = chain_digests(["a", "b", "c", "d"])
    assert len(set(chains)) == 4
    assert chain_digests(["a", "b"]) == chains[:2]  # a prefix's chain is the chain's prefix
    assert chain_digests(["a", "x"])[1] != chains[1]
    known = {chains[0]: ("s1", 1), chains[2]: ("s3", 3)}
    assert choose_parent(chains, known) == ("s3", 3)
    assert choose_parent(chains[:2], known) == ("s1", 1)
    assert choose_parent(chain_digests(["z"]), known) == (None, 0)


def test_materialize_follows_parents_cut_and_extended():
    layouts = {"s1": Layout(None, 0, (1, 2)), "s2": Layout("s1", 2, (3, 4)),
               "s3": Layout("s2", 3, (5,)), "s4": Layout("s1", 1, ())}
    assert materialize(layouts) == {"s1": [1, 2], "s2": [1, 2, 3, 4], "s3": [1, 2, 3, 5],
                                    "s4": [1]}
    # A long chain is no recursion limit.
    long = {0: Layout(None, 0, (0,))} | {i: Layout(i - 1, i, (i,)) for i in range(1, 3000)}
    assert materialize(long)[2999] == list(range(3000))


# --- through the pipeline --------------------------------------------------------------------

def test_branches_materialize_exactly_what_each_call_sent(tenant, agent, tmp_path):
    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 100
    u1, a1 = _user("Where is my order 1234?"), _assistant("Let me look that up.")
    u2, u2_edited = _user("It was a gift."), _user("It was a birthday gift.")
    a2, u3 = _assistant("It ships tomorrow."), _user("Thanks!")
    histories = [
        [SYSTEM, u1],                      # 0
        [SYSTEM, u1, a1, u2],              # 1 extends 0
        [SYSTEM, u1, a1, u2_edited],       # 2 an edited last message: a branch off 0
        [SYSTEM, u1],                      # 3 a retry of 0
        [SYSTEM, u1, a1],                  # 4 truncated where no step ended
        [SYSTEM, u1, a1, u2, a2, u3],      # 5 extends 1
        [SYSTEM, u1, u1],                  # 6 one message twice
        [],                                # 7 no history at all
    ]
    records = [_call(tenant, agent, traj, h, t0 + i) for i, h in enumerate(histories)]
    records[7] = _call(tenant, agent, traj, [], t0 + 7, tools=None)
    ship_and_build(tmp_path / "a", records[:3])  # one batch: parents inside it
    for i, rec in enumerate(records[3:]):  # then one by one: parents from the database
        ship_and_build(tmp_path / f"b{i}", [rec])

    steps = _steps(traj)
    assert len(steps) == 8
    with tenant_context(tenant):
        full = observations(steps)
    for step, history in zip(steps, histories, strict=True):
        assert full[step.pk]["messages"] == history  # nothing here the sanitizer changes
        assert step.observation["messages"] == history
    assert full[steps[0].pk]["tools"] == TOOLS and full[steps[0].pk]["params"] == {
        "temperature": 0.2}
    assert "tools" not in full[steps[7].pk]
    by_index = {i: s for i, s in enumerate(steps)}
    parent = {i: (s.parent_step, s.kept, len(s.appended)) for i, s in by_index.items()}
    ids = {i: s.pk for i, s in by_index.items()}
    assert parent[0] == (None, 0, 2)
    assert parent[1] == (ids[0], 2, 2)
    assert parent[2] == (ids[0], 2, 2)  # [a1, u2_edited]: a1 referenced, not copied
    # Equal histories (0 and its retry 3): either may be the parent; the newest is taken.
    assert parent[3] == (ids[0], 2, 0)
    assert parent[4] == (ids[3], 2, 1)
    assert parent[5] == (ids[1], 4, 2)
    # Stored once each: system, u1, a1, u2, u2 edited, a2, u3 and the tool schemas.
    assert ConversationItem.objects.filter(trajectory_id=traj).count() == 8
    assert len({s.item_refs["tools"] for s in steps[:7]}) == 1
    # Stored rows hold no history: it is in the items (an empty one stays as it was).
    for step in steps[:7]:
        assert "messages" not in step.observation_rest
    assert steps[7].observation_rest["messages"] == [] and not steps[7].history_digest

    # ATDP: the full document and the compact one describe the same histories.
    with tenant_context(tenant):
        traj_obj = Trajectory.objects.select_related("tenant", "agent").get(pk=traj)
        doc = trajectory_document(traj_obj)
        compact = trajectory_document(traj_obj, compact=True)
    assert [s["observation"]["messages"] for s in doc["steps"]] == histories
    rebuilt: dict[str, list] = {}
    for s in compact["steps"]:
        if "history" not in s:  # a step with no history keeps it in its observation
            rebuilt[s["id"]] = s["observation"]["messages"]
            continue
        h = s["history"]
        base = rebuilt[h["parent_step"]][:h["kept"]] if h["parent_step"] else []
        rebuilt[s["id"]] = base + h["appended"]
        assert "messages" not in s["observation"]
    assert [rebuilt[s["id"]] for s in compact["steps"]] == histories


def test_each_message_sanitized_once_and_placeholders_hold_across_200_steps(
        tenant, agent, tmp_path, monkeypatch):
    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 1000
    sanitized_bytes: list[int] = []
    real = Sanitizer.sanitize_bodies

    def counting(self, items, state=None):
        sanitized_bytes.append(sum(len(orjson.dumps(body)) for _, body in items))
        return real(self, items, state)

    monkeypatch.setattr(Sanitizer, "sanitize_bodies", counting)
    history = [SYSTEM, _user("My name is Maria Garcia, email maria.garcia@example.com.")]
    records, new_bytes = [], 0
    for i in range(200):
        records.append(_call(tenant, agent, traj, history, t0 + i))
        reply = _assistant(f"Noted, step {i}.")
        tool = {"role": "tool", "tool_call_id": f"c{i}", "content":
                f"Order {1000 + i} for Maria Garcia (maria.garcia@example.com) is packed."}
        new_bytes += len(orjson.dumps(reply)) + len(orjson.dumps(tool))
        history = history + [reply, tool]
    for start in range(0, 200, 50):
        ship_and_build(tmp_path / f"s{start}", records[start:start + 50])
    steps = _steps(traj)
    assert len(steps) == 200
    # What went through the sanitizer is the new content, not 200 growing histories (those
    # were ~40 MB of JSON; the new messages are ~30 KB, plus each call's response and params).
    assert sum(sanitized_bytes) < 3 * new_bytes + 200 * 600, sum(sanitized_bytes)
    assert ConversationItem.objects.filter(trajectory_id=traj).count() == 2 + 2 * 199 + 1
    text = all_rows_text([traj]).casefold()
    assert "maria.garcia@example.com" not in text and "garcia" not in text
    with tenant_context(tenant):
        last = observations([steps[-1]])[steps[-1].pk]["messages"]
    user = last[1]["content"]
    person = user.split("My name is ")[1].split(",")[0]
    email = user.split("email ")[1].rstrip(".")
    assert person.startswith("<PERSON_") and email.startswith("<EMAIL_ADDRESS_")
    for m in last[3::2]:  # every tool result names the same person by the same placeholders
        assert person in m["content"] and email in m["content"], m
    # Findings per message: one set per item, on the step that first carried it.
    tool_findings = Finding.objects.filter(step__trajectory_id=traj, item__isnull=False)
    assert tool_findings.values("item_id").distinct().count() >= 200
    for f in tool_findings.select_related("item"):
        assert f.step_id == f.item.first_step


def test_a_policy_change_resanitizes_lazily_and_says_so(tenant, agent, tmp_path):
    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 100
    first = [SYSTEM, _user("Write to maria.garcia@example.com please.")]
    ship_and_build(tmp_path / "a", [_call(tenant, agent, traj, first, t0)])
    Tenant.objects.filter(pk=tenant.pk).update(
        sanitizer_policy={"operators": {"EMAIL_ADDRESS": "redact"}})
    clear_cache()
    second = first + [_assistant("Done."), _user("Thanks.")]
    ship_and_build(tmp_path / "b", [_call(tenant, agent, traj, second, t0 + 1)])
    s1, s2 = _steps(traj)
    assert s1.sanitizer_version == SANITIZER_VERSION
    assert s2.sanitizer_version.startswith(SANITIZER_VERSION + "+p.")
    with tenant_context(tenant):
        full = observations([s1, s2])
    assert "<EMAIL_ADDRESS_1>" in full[s1.pk]["messages"][1]["content"]
    assert "<EMAIL_ADDRESS_1>" not in full[s2.pk]["messages"][1]["content"]
    assert "maria.garcia" not in full[s2.pk]["messages"][1]["content"]
    # The old items stay for the old step; the new step's history was sanitized again.
    versions = set(ConversationItem.objects.filter(trajectory_id=traj)
                   .values_list("sanitizer_version", flat=True))
    assert versions == {s1.sanitizer_version, s2.sanitizer_version}
    assert s2.parent_step is None  # nothing stored under its policy to extend


def test_retention_keeps_later_steps_whole_and_drops_what_no_step_holds(
        tenant, agent, tmp_path):
    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 100
    history = [SYSTEM]
    records = []
    for i in range(5):
        history = history + [_user(f"Question {i} from maria.garcia@example.com"),
                             _assistant(f"Answer {i}")]
        records.append(_call(tenant, agent, traj, history, t0 + i))
    ship_and_build(tmp_path / "a", records)
    steps = _steps(traj)
    with tenant_context(tenant):
        before = observations(steps)
    # The first two calls are past the steps retention.
    Step.objects.filter(pk__in=[s.pk for s in steps[:2]]).update(
        started_at=timezone.now() - timedelta(days=400))
    items_before = ConversationItem.objects.filter(trajectory_id=traj).count()
    totals = purge_tenant(tenant.pk)
    assert totals["steps"] == 2
    remaining = _steps(traj)
    assert [s.pk for s in remaining] == [s.pk for s in steps[2:]]
    with tenant_context(tenant):
        after = observations(remaining)
    for s in remaining:
        assert after[s.pk] == before[s.pk]
    assert remaining[0].parent_step is None  # re-rooted: it holds its whole history now
    # Every item is still referenced by a remaining step (this session only grows), so none
    # went; a step that alone held an item takes it with it:
    assert ConversationItem.objects.filter(trajectory_id=traj).count() == items_before
    lone = make_record(tenant.pk, agent.pk, trajectory_id=traj, t=t0 + 10, request={
        "model": "m", "messages": [_user("a one-off about nothing else")]},
        response=chat_response("ok"))
    ship_and_build(tmp_path / "b", [lone])
    Step.objects.filter(pk=lone["step_id"]).update(
        started_at=timezone.now() - timedelta(days=400))
    purge_tenant(tenant.pk)
    assert ConversationItem.objects.filter(trajectory_id=traj).count() == items_before
    # Subject-index rows of an item live with the item, not with its first step.
    assert SubjectIndex.objects.filter(trajectory_id=traj, item__isnull=False).exists()


def test_migration_round_trip_on_steps_built_the_old_way(tenant, agent, transactional_db):
    """Steps stored whole (the layout before the store) are moved into items by migration
    0015 and materialize to the same observations; migrating back restores the columns."""
    from django.core.management import call_command

    traj = Trajectory.objects.create(tenant=tenant, agent=agent, started_at=timezone.now(),
                                     last_step_at=timezone.now())
    history = [SYSTEM, _user("Hello")]
    stored = []
    for i in range(4):
        obs = {"messages": copy.deepcopy(history), "tools": TOOLS, "params": {"n": 1}}
        stored.append(Step.objects.create(
            id=uuid.uuid4(), tenant=tenant, trajectory=traj, endpoint="chat.completions",
            started_at=timezone.now() + timedelta(seconds=i), observation=obs,
            sanitizer_version=SANITIZER_VERSION))
        history = history + [_assistant(f"a{i}"), _user(f"u{i}")]
    expected = {s.pk: s.observation_rest for s in stored}
    call_command("migrate", "governance", "0014", verbosity=0)
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM governance_step WHERE history_digest <> ''")
        assert cur.fetchone()[0] == 0
    call_command("migrate", "governance", verbosity=0)
    steps = list(Step.objects.filter(trajectory=traj).order_by("started_at"))
    assert all(s.history_digest for s in steps)
    assert all("messages" not in s.observation_rest for s in steps)
    with tenant_context(tenant):
        full = observations(steps)
    assert {pk: obs for pk, obs in full.items()} == expected
    assert steps[1].parent_step == steps[0].pk and steps[1].kept == 2
    assert ConversationItem.objects.filter(trajectory=traj).count() == 2 + 2 * 3 + 1
    call_command("migrate", "governance", "0014", verbosity=0)
    with connection.cursor() as cur:
        cur.execute("SELECT id, observation FROM governance_step WHERE trajectory_id = %s",
                    [traj.pk])
        back = {row[0]: orjson.loads(row[1]) if isinstance(row[1], str) else row[1]
                for row in cur.fetchall()}
    assert back == expected
    call_command("migrate", "governance", verbosity=0)


def _long_session(tenant, agent, calls: int) -> tuple[str, list[dict]]:
    """A trajectory id and the spool records of `calls` calls resending a growing history."""
    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 100
    history = [SYSTEM]
    records = []
    for i in range(calls):
        history = history + [_user(f"Question {i}: " + "lorem ipsum " * 40),
                             _assistant(f"Answer {i}")]
        records.append(_call(tenant, agent, traj, history, t0 + i))
    return traj, records


def test_raw_requests_are_deltas_that_open_whole_and_survive_retention(tenant, agent, tmp_path):
    import zlib

    from governance.capture.rawstore import (
        RAW5_MAGIC,
        decode_body,
        open_raw,
        packed_base,
        unpack_raw,
    )
    from governance.models import Interaction

    traj, records = _long_session(tenant, agent, 40)
    ship_and_build(tmp_path / "a", records[:25])
    ship_and_build(tmp_path / "b", records[25:])
    sent = {r["flow_id"]: decode_body(r["request_body"]) for r in records}
    rows = list(Interaction.objects.filter(trajectory_id=traj).select_related("data_key")
                .order_by("started_at"))
    assert all(r.state == "processed" for r in rows)
    with tenant_context(tenant):
        for row in rows:  # each opened alone: its base chain from the database
            assert decode_body(open_raw(row)["request_body"]) == sent[row.flow_id]
    deltas = [r for r in rows if r.raw_base_flow]
    assert len(deltas) == 40 - 2  # each batch starts whole
    # Each delta is compressed against its base (format 5, decisions 39 and 41) and opens only
    # with that base's dictionary.
    for row in deltas:
        plaintext = _plaintext(row)
        assert plaintext.startswith(RAW5_MAGIC) and packed_base(plaintext) == row.raw_base_flow
    with pytest.raises(ValueError):
        unpack_raw(_plaintext(deltas[-1]))
    with pytest.raises(zlib.error):
        unpack_raw(_plaintext(deltas[-1]), b"not the base")
    stored = sum(len(bytes(r.raw_ciphertext)) for r in rows)
    whole = sum(len(b) for b in sent.values())
    assert stored < whole / 4, (stored, whole)
    # Retention destroys the first ten payloads: the ones built on them are sealed whole
    # first, and every remaining one still opens to exactly what was sent.
    Interaction.objects.filter(pk__in=[r.pk for r in rows[:10]]).update(
        raw_expires_at=timezone.now() - timedelta(minutes=1))
    assert purge_tenant(tenant.pk)["raw_payloads"] == 10
    left = list(Interaction.objects.filter(trajectory_id=traj, raw_ciphertext__isnull=False)
                .select_related("data_key").order_by("started_at"))
    assert len(left) == 30 and not left[0].raw_base_flow
    assert packed_base(_plaintext(left[0])) is None  # sealed whole again (format 3)
    with tenant_context(tenant):
        for row in left:
            assert decode_body(open_raw(row)["request_body"]) == sent[row.flow_id]


def test_a_system_prompt_that_changes_every_call_is_still_stored_as_deltas(tenant, agent,
                                                                           tmp_path):
    """An agent that puts the time in its system prompt changes the first message of every
    call: the raw requests are still deltas (copies of the conversation's blocks around the
    change, decision 48), each opening to exactly what was sent."""
    from governance.capture.rawstore import decode_body, open_raw
    from governance.models import Interaction

    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 100
    history: list[dict] = []
    records = []
    for i in range(12):
        history = history + [_user(f"Question {i}: " + "lorem ipsum " * 40),
                             _assistant(f"Answer {i}")]
        system = {"role": "system", "content": SYSTEM["content"] + f" It is 09:{i:02d}."}
        records.append(_call(tenant, agent, traj, [system, *history], t0 + i))
    ship_and_build(tmp_path, records)
    sent = {r["flow_id"]: decode_body(r["request_body"]) for r in records}
    rows = list(Interaction.objects.filter(trajectory_id=traj).select_related("data_key")
                .order_by("started_at"))
    assert len(rows) == 12 and all(r.state == "processed" for r in rows)
    assert sum(1 for r in rows if not r.raw_base_flow) == 1
    with tenant_context(tenant):
        for row in rows:
            assert decode_body(open_raw(row)["request_body"]) == sent[row.flow_id]
    stored = sum(len(bytes(r.raw_ciphertext)) for r in rows)
    assert stored < sum(len(b) for b in sent.values()) / 4


def test_a_session_that_drops_its_oldest_turns_stores_each_message_once(tenant, agent,
                                                                         tmp_path):
    """An agent that keeps its context under a budget drops its oldest turns after the first
    user message: from then on every call's history truncates the previous one's instead of
    extending it. Each message is still stored (and sanitized) once, every step materializes
    exactly what its call sent, and the raw requests stay deltas (a copy of the kept turns)."""
    from governance.capture.rawstore import decode_body, open_raw
    from governance.models import Interaction

    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 100
    task = _user("Go through the open tickets one by one and answer each.")
    turns = [[_user(f"Ticket {i}: " + "the parcel has not arrived " * 30),
              _assistant(f"Answered ticket {i}.")] for i in range(14)]
    histories = [[SYSTEM, task, *[m for t in turns[max(0, i - 3):i + 1] for m in t]]
                 for i in range(14)]
    records = [_call(tenant, agent, traj, h, t0 + i) for i, h in enumerate(histories)]
    ship_and_build(tmp_path / "a", records[:6])
    ship_and_build(tmp_path / "b", records[6:])  # parents from the database too

    steps = _steps(traj)
    assert len(steps) == 14
    with tenant_context(tenant):
        full = observations(steps)
    assert [full[s.pk]["messages"] for s in steps] == histories
    # system, task, each turn's two messages, the tool schemas: once each.
    assert ConversationItem.objects.filter(trajectory_id=traj).count() == 2 + 2 * 14 + 1
    # Past the window no stored history is a prefix of a call's (no step ended at the task):
    # the step lists its window's items by id, each stored once above.
    assert [(s.kept, len(s.appended)) for s in steps[4:]] == [(0, 10)] * 10
    rows = list(Interaction.objects.filter(trajectory_id=traj).select_related("data_key")
                .order_by("started_at"))
    sent = {r["flow_id"]: decode_body(r["request_body"]) for r in records}
    assert sum(1 for r in rows if not r.raw_base_flow) == 2  # the first call of each batch
    with tenant_context(tenant):
        for row in rows:
            assert decode_body(open_raw(row)["request_body"]) == sent[row.flow_id]
    stored = sum(len(bytes(r.raw_ciphertext)) for r in rows)
    assert stored < sum(len(b) for b in sent.values()) / 4


def test_a_chain_restarts_whole_at_its_rebuild_budget_and_its_link_limit(
        tenant, agent, tmp_path, monkeypatch):
    """A chain of deltas restarts with a whole copy when opening its next link would rebuild
    more than DELTA_REBUILD_MAX bytes of bodies, or when it would pass DELTA_CHAIN_MAX links
    (decision 41); every call still opens to exactly what was sent."""
    from governance.capture import shipper
    from governance.capture.rawstore import decode_body, open_raw
    from governance.models import Interaction

    traj, records = _long_session(tenant, agent, 12)
    sent = [decode_body(r["request_body"]) for r in records]
    # A budget that the first three bodies fit and the first four do not.
    monkeypatch.setattr(shipper, "DELTA_REBUILD_MAX", sum(len(b) for b in sent[:3]))
    ship_and_build(tmp_path / "a", records[:8])
    monkeypatch.setattr(shipper, "DELTA_REBUILD_MAX", 1 << 40)
    monkeypatch.setattr(shipper, "DELTA_CHAIN_MAX", 2)
    ship_and_build(tmp_path / "b", records[8:])
    rows = list(Interaction.objects.filter(trajectory_id=traj).select_related("data_key")
                .order_by("started_at"))
    whole = [i for i, r in enumerate(rows) if not r.raw_base_flow]
    # Rebuild budget: 0 whole, 1-2 deltas, 3 whole (0-3 would rebuild too much), 4 whole
    # (3-4 would: bodies grow), ...; then a new batch starts whole and links at most twice.
    rebuilt, expected = 0, []
    for i, body in enumerate(sent[:8]):
        if i == 0 or rebuilt + len(body) > sum(len(b) for b in sent[:3]):
            expected.append(i)
            rebuilt = 0
        rebuilt += len(body)
    expected += [8, 10]
    assert whole == expected, (whole, expected)
    with tenant_context(tenant):
        for row, body in zip(rows, sent, strict=True):
            assert decode_body(open_raw(row)["request_body"]) == body


def test_a_format_4_delta_still_opens(tenant, agent, tmp_path):
    """Payloads sealed as format 4 (a delta compressed against its base's bodies only, before
    decision 41) open as they did, beside format 5 ones of the same chain."""
    import zlib

    from governance.capture.rawstore import (
        RAW4_MAGIC,
        RAW5_MAGIC,
        _base_bodies,
        decode_body,
        delta_dictionary,
        open_raw,
        packed_base,
        seal_raw,
        unwrap,
    )
    from governance.models import Interaction

    traj, records, sent, rows = _shipped_session(tenant, agent, tmp_path, 4)
    row = rows[2]
    plaintext = _plaintext(row)
    base = packed_base(plaintext)
    assert plaintext.startswith(RAW5_MAGIC) and base == rows[1].flow_id
    with tenant_context(tenant):
        request, response, head = _base_bodies(row, base, {}, None)
    start = len(RAW5_MAGIC) + 1 + len(base)
    inflater = zlib.decompressobj(zdict=delta_dictionary(request, response, head))
    payload = inflater.decompress(plaintext[start:])
    packer = zlib.compressobj(6, zdict=delta_dictionary(request, response))
    old = RAW4_MAGIC + plaintext[len(RAW5_MAGIC):start] + packer.compress(payload) \
        + packer.flush()
    Interaction.objects.filter(pk=row.pk).update(
        raw_ciphertext=seal_raw(unwrap(row.data_key), row.flow_id, old))
    rows = list(Interaction.objects.filter(trajectory_id=traj).select_related("data_key")
                .order_by("started_at"))
    assert _plaintext(rows[2]).startswith(RAW4_MAGIC)
    with tenant_context(tenant):
        for r, body in zip(rows, sent, strict=True):  # each alone, and as one batch
            assert decode_body(open_raw(r)["request_body"]) == body
        bodies: dict[str, bytes] = {}
        assert [decode_body(open_raw(r, bodies)["request_body"]) for r in rows] == sent


def test_a_long_chain_opens_cold_without_recursion(tenant, agent, tmp_path):
    """A call at the end of a chain opens with nothing opened before it, however long the
    chain: the links are opened in a loop (a chain may be longer than Python's recursion
    limit; here the limit is made tighter than three frames a link)."""
    import sys

    from governance.capture.rawstore import decode_body, open_raw

    traj, records, sent, rows = _shipped_session(tenant, agent, tmp_path, 40)
    assert sum(1 for r in rows if not r.raw_base_flow) == 1
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 60)
    try:
        with tenant_context(tenant):
            body = decode_body(open_raw(rows[-1])["request_body"])
    finally:
        sys.setrecursionlimit(limit)
    assert body == sent[-1]


def test_a_batch_chain_ends_at_the_last_call_this_process_opened(
        tenant, agent, tmp_path, django_assert_num_queries):
    """RecentBodies (decision 41): the step builder keeps each trajectory's last opened call,
    so the next batch of that trajectory reads and rebuilds only its own links; it is bounded
    in bytes, least recently used first, and forgets a trajectory on request."""
    from governance.capture.rawstore import (
        RecentBodies,
        decode_body,
        delta_bases,
        known_flows,
        open_raw,
    )

    traj, records, sent, rows = _shipped_session(tenant, agent, tmp_path, 10)
    recent, key = RecentBodies(), (tenant.pk, traj)
    with tenant_context(tenant):
        bodies: dict[str, bytes] = {}
        for row in rows[:5]:
            open_raw(row, bodies)
        recent.remember(key, rows[4].flow_id, bodies)
        seeded = recent.seed({key, (tenant.pk, "another")})
        assert known_flows(seeded) == {rows[4].flow_id}
        with django_assert_num_queries(0):  # no walk, no base looked up
            bases = delta_bases(rows[5:], known_flows(seeded))
            opened = [decode_body(open_raw(r, seeded, bases)["request_body"])
                      for r in rows[5:]]
        assert bases == {} and opened == sent[5:]
    recent.forget(key)
    assert recent.seed({key}) == {}
    def size(row) -> int:  # what the cache holds of a call: its three parts
        return sum(len(v) for k, v in bodies.items() if k.split("#")[0] == row.flow_id)

    recent = RecentBodies(max_bytes=size(rows[4]) + size(rows[3]))
    recent.remember(key, rows[4].flow_id, bodies)
    recent.remember((tenant.pk, "other"), rows[3].flow_id, bodies)
    recent.remember((tenant.pk, "third"), rows[2].flow_id, bodies)
    assert recent.seed({key}) == {}  # the least recently used went first
    assert known_flows(recent.seed({(tenant.pk, "third")})) == {rows[2].flow_id}


def test_the_step_builder_opens_a_batch_from_the_last_call_it_opened(tenant, agent, tmp_path):
    """The step builder keeps each trajectory's last opened call (tasks.RECENT_BODIES): a second
    batch of the same trajectory rebuilds from it, not from the chain's start — here the
    chain's first calls no longer open at all, and the second batch still builds."""
    from governance.capture.shipper import ship_once
    from governance.models import Interaction, Step
    from governance.tasks import build_group
    from tests.pipeline import write_records

    traj, records = _long_session(tenant, agent, 10)
    write_records(tmp_path, records)
    shipped: list[int] = []
    ship_once(tmp_path, enqueue=shipped.extend)
    ids = list(Interaction.objects.filter(trajectory_id=traj).order_by("started_at")
               .values_list("pk", flat=True))
    assert len(ids) == 10  # one chain: a whole copy, then nine deltas
    assert Interaction.objects.filter(trajectory_id=traj, raw_base_flow="").count() == 1
    build_group(tenant.pk, ids[:5], coalesce=False)  # two batches, not one coalesced
    assert Step.objects.filter(trajectory_id=traj).count() == 5
    # What a cold open of call 5 would need first: calls 0-3 (4 is kept by the builder).
    Interaction.objects.filter(pk__in=ids[:4]).update(raw_ciphertext=None)
    build_group(tenant.pk, ids[5:], coalesce=False)
    assert Step.objects.filter(trajectory_id=traj).count() == 10
    assert all(r.state == "processed" for r in Interaction.objects.filter(pk__in=ids))


def _shipped_session(tenant, agent, tmp_path, calls: int
                     ) -> tuple[str, list[dict], list[bytes], list]:
    """`_long_session` shipped and built in one batch: the trajectory id, the records, the
    request bodies sent, and the Interaction rows in call order (with their data keys)."""
    from governance.capture.rawstore import decode_body
    from governance.models import Interaction

    traj, records = _long_session(tenant, agent, calls)
    ship_and_build(tmp_path / "a", records)
    rows = list(Interaction.objects.filter(trajectory_id=traj).select_related("data_key")
                .order_by("started_at"))
    return traj, records, [decode_body(r["request_body"]) for r in records], rows


def _plaintext(row) -> bytes:
    from governance.capture.rawstore import raw_aad, unwrap
    from wire.crypto import open_sealed

    return open_sealed(unwrap(row.data_key), bytes(row.raw_ciphertext), raw_aad(row.flow_id))


def test_a_batch_reads_the_delta_bases_of_its_calls_a_chain_level_at_a_time(
        tenant, agent, tmp_path, django_assert_num_queries):
    """The step builder reads the bases of a batch's deltas beforehand (rawstore.delta_bases:
    two queries whatever the chains' depth, not one per base), and open_raw then needs none."""
    from governance.capture.rawstore import decode_body, delta_bases, open_raw
    from governance.models import Interaction

    traj, records = _long_session(tenant, agent, 14)
    ship_and_build(tmp_path / "a", records)
    sent = {r["flow_id"]: decode_body(r["request_body"]) for r in records}
    rows = list(Interaction.objects.filter(trajectory_id=traj).select_related("data_key")
                .order_by("started_at"))
    batch = rows[-2:]
    assert all(r.raw_base_flow for r in batch)
    with tenant_context(tenant):
        with django_assert_num_queries(2):
            bases = delta_bases(batch)
        # The chain down to the whole copy; not the batch's own calls.
        assert rows[-3].flow_id in bases and rows[0].flow_id in bases
        assert not {r.flow_id for r in batch} & set(bases)
        bodies: dict[str, bytes] = {}
        with django_assert_num_queries(0):
            opened = [open_raw(row, bodies, bases) for row in batch]
    assert [decode_body(o["request_body"]) for o in opened] == [sent[r.flow_id] for r in batch]


def test_items_are_indexed_by_trajectory_only_through_their_unique_index(db):
    """Decision 39 (migration 0028): no tenant or trajectory index of their own; a lookup or
    delete by trajectory uses the (trajectory, digest, sanitizer_version) index."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT indexname FROM pg_indexes "
                    "WHERE tablename = 'governance_conversationitem'")
        assert {r[0] for r in cur.fetchall()} == {"governance_conversationitem_pkey",
                                                  "convitem_traj_digest_version"}
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("EXPLAIN DELETE FROM governance_conversationitem "
                    "WHERE trajectory_id = ANY(%s::uuid[])", [[str(uuid.uuid4())]])
        plan = "\n".join(r[0] for r in cur.fetchall())
    assert "convitem_traj_digest_version" in plan, plan


def test_migration_0032_cuts_digests_and_a_live_trajectory_goes_on(tenant, agent, tmp_path,
                                                                  transactional_db):
    """Decision 40: item digests keep 128 bits (prefix + 32 hex digits), history digests too.
    0032 cuts rows stored with 64 digits (simulated: today's digests, lengthened), and a call
    of the trajectory after it finds every stored item again: it appends only its new
    message and extends the last step."""
    from django.core.management import call_command

    traj = str(uuid.uuid4())
    t = timezone.now().timestamp()
    history = [SYSTEM, _user("Where is order 12?")]
    ship_and_build(tmp_path / "a", [_call(tenant, agent, traj, history, t)])
    history = history + [_assistant("ok"), _user("And order 13?")]
    ship_and_build(tmp_path / "b", [_call(tenant, agent, traj, history, t + 1)])
    items = dict(ConversationItem.objects.filter(trajectory_id=traj)
                 .values_list("pk", "digest"))
    chains = dict(Step.objects.filter(trajectory_id=traj).values_list("pk", "history_digest"))
    assert {len(d) for d in items.values()} == {34}
    assert {len(d) for d in chains.values()} == {32}
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("UPDATE governance_conversationitem SET digest = digest || md5(digest) "
                    "WHERE trajectory_id = %s", [traj])
        cur.execute("UPDATE governance_step SET history_digest = history_digest "
                    "|| md5(history_digest) WHERE trajectory_id = %s", [traj])
    call_command("migrate", "governance", "0031", verbosity=0)  # the reverse changes nothing
    assert {len(d) for d in ConversationItem.objects.filter(trajectory_id=traj)
            .values_list("digest", flat=True)} == {66}
    call_command("migrate", "governance", verbosity=0)
    assert dict(ConversationItem.objects.filter(trajectory_id=traj)
                .values_list("pk", "digest")) == items
    assert dict(Step.objects.filter(trajectory_id=traj)
                .values_list("pk", "history_digest")) == chains

    history = history + [_assistant("Both shipped."), _user("Thanks")]
    ship_and_build(tmp_path / "c", [_call(tenant, agent, traj, history, t + 2)])
    steps = _steps(traj)
    assert len(steps) == 3 and steps[2].parent_step == steps[1].pk and steps[2].kept == 4
    assert ConversationItem.objects.filter(trajectory_id=traj).count() == len(items) + 2
    with tenant_context(tenant):
        assert observations([steps[2]])[steps[2].pk]["messages"] == history


def test_items_hold_packed_json_and_migration_0033_converts_both_ways(tenant, agent, tmp_path,
                                                                   transactional_db):
    """Decision 40: an item's content is stored compressed in a bytea (zlib'd JSON, since
    decision 61 against a preset dictionary: format 2), read back as the same value by every
    reader; 0033 converts JSONB rows to zlib'd JSON and back, exactly (0037's reverse first
    turns format 2 back into what 0033 reads)."""
    from django.core.management import call_command

    from governance.models import ITEM_JSON_FORMAT_1, ItemJSONField

    traj = str(uuid.uuid4())
    notes = _user("Notes: " + "; ".join(f"order {i} shipped to the warehouse" for i in range(40)))
    history = [SYSTEM, notes]
    ship_and_build(tmp_path, [_call(tenant, agent, traj, history, timezone.now().timestamp())])
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("SELECT content FROM governance_conversationitem WHERE trajectory_id = %s",
                    [traj])
        blobs = [bytes(r[0]) for r in cur.fetchall()]
    assert blobs and all(b[:1] == ITEM_JSON_FORMAT_1 for b in blobs)
    longest = max(blobs, key=len)
    assert len(longest) < 0.5 * len(orjson.dumps(ItemJSONField.unpack(longest)))
    with tenant_context(tenant):
        assert observations(_steps(traj))[_steps(traj)[0].pk]["messages"] == history

    # What JSONB refuses stays refused (the step builder quarantines such a call); a literal
    # backslash-u0000 is text like any other.
    from django.db import DataError

    from governance.models import PackedJSONField

    for refused in ("a\x00b", {"k": ["\\\x00"]}):
        with pytest.raises(DataError):
            PackedJSONField.pack(refused)
    for text in ("\\u0000", {"path": "C:\\\\u0000"}):
        assert PackedJSONField.unpack(PackedJSONField.pack(text)) == text

    values = [{"role": "user", "content": "naïve ☃ <PERSON_1>", "n": [1, 2.5, None, True]},
              [{"type": "function", "function": {"name": "f"}}], "Be brief."]
    call_command("migrate", "governance", "0032", verbosity=0)
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT set_config('steward.system', 'on', false)")
            cur.execute("SELECT pg_typeof(content)::text FROM governance_conversationitem "
                        "WHERE trajectory_id = %s LIMIT 1", [traj])
            assert cur.fetchone()[0] == "jsonb"  # the built items, converted back
            for i, value in enumerate(values):
                cur.execute("INSERT INTO governance_conversationitem (tenant_id, trajectory_id, "
                            "kind, digest, sanitizer_version, content, created_at) VALUES "
                            "(%s, %s, 'message', %s, 'v', %s::jsonb, now())",
                            [tenant.pk, traj, f"m:old{i}", orjson.dumps(value).decode()])
    finally:
        call_command("migrate", "governance", verbosity=0)
    stored = dict(ConversationItem.objects.filter(trajectory_id=traj, digest__startswith="m:old")
                  .values_list("digest", "content"))
    assert stored == {f"m:old{i}": v for i, v in enumerate(values)}
    with tenant_context(tenant):
        assert observations(_steps(traj))[_steps(traj)[0].pk]["messages"] == history
    call_command("migrate", "governance", "0032", verbosity=0)
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT set_config('steward.system', 'on', false)")
            cur.execute("SELECT digest, content::text FROM governance_conversationitem "
                        "WHERE digest LIKE 'm:old%%'")
            back = {d: orjson.loads(c) for d, c in cur.fetchall()}
        assert back == stored
    finally:
        call_command("migrate", "governance", verbosity=0)
