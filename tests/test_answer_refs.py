"""An answer sent back is stored as a reference to it (decision 62), through the real shipper
and step builder on PostgreSQL: the agent's next call carries the answer it was given, and the
conversation item for it points at the answering step's message instead of holding it again.
Every reader still sees exactly what each call sent (sanitized); the answer's findings are
counted once; erasure finds the trajectory by it; retention and a refused answering step give
the item the message itself; migration 0038's reverse does too."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from governance.capture.conversation import observations
from governance.erasure import lookup_hashes
from governance.models import (
    ANSWER_REF_FORMAT,
    ConversationItem,
    Finding,
    Interaction,
    ItemJSONField,
    Step,
    SubjectIndex,
)
from governance.retention import purge_tenant
from governance.tenancy import tenant_context
from tests.pipeline import chat_response, make_record, ship_and_build

SYSTEM = {"role": "system", "content": "You are a support agent for an online bookshop."}
ANSWERS = ["Your order ships to Maria Garcia, maria.garcia@example.com, on Monday.",
           "I have noted the new address for Maria Garcia.",
           "Anything else, Maria?"]


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "store-bot")


def _session(tenant, agent, traj: str, t0: float, first_reasoning: str | None = None
             ) -> list[dict]:
    """Three calls, each sending back the answer the one before it was given (as the openai
    client's users do: the assistant message appended to `messages`)."""
    history = [SYSTEM, {"role": "user", "content": "Where does order 1042 ship to?"}]
    records = []
    for i, answer in enumerate(ANSWERS):
        request = {"model": "m", "messages": list(history), "temperature": 0.2}
        response = chat_response(answer)
        if i == 0 and first_reasoning is not None:
            response["choices"][0]["message"]["reasoning_content"] = first_reasoning
        records.append(make_record(tenant.pk, agent.pk, trajectory_id=traj, request=request,
                                   response=response, t=t0 + i))
        history += [{"role": "assistant", "content": answer},
                    {"role": "user", "content": f"Follow-up {i}."}]
    return records


def _steps(traj: str) -> list[Step]:
    return list(Step.objects.filter(trajectory_id=traj).order_by("started_at"))


def _blobs(traj: str) -> dict[int, bytes]:
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("SELECT id, content FROM governance_conversationitem "
                    "WHERE trajectory_id = %s", [traj])
        return {pk: bytes(blob) for pk, blob in cur.fetchall()}


def _pointing(traj: str) -> dict[int, object]:
    return {pk: ItemJSONField.unpack(b) for pk, b in _blobs(traj).items()
            if b[:1] == ANSWER_REF_FORMAT}


def _sent(records: list[dict], tenant) -> list[list]:
    """What each call sent, as the store materializes it."""
    steps = _steps(records[0]["trajectory_id"])
    with tenant_context(tenant):
        full = observations(steps)
    return [full[s.pk]["messages"] for s in steps]


@pytest.mark.parametrize("batches", ["one batch", "a batch a call"])
def test_an_answer_sent_back_is_a_reference_and_reads_as_the_message(tenant, agent, tmp_path,
                                                                      monkeypatch, batches):
    pointed, whole = str(uuid.uuid4()), str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 50
    records = _session(tenant, agent, pointed, t0)
    if batches == "one batch":  # the parents are built alongside
        ship_and_build(tmp_path / "a", records)
    else:  # the parents come from the database
        for i, rec in enumerate(records):
            ship_and_build(tmp_path / f"a{i}", [rec])
    # The same session stored the way it was before decision 62: every message an item.
    monkeypatch.setattr("governance.tasks.answer_index", lambda content, answer: None)
    ship_and_build(tmp_path / "b", _session(tenant, agent, whole, t0 + 10))
    monkeypatch.undo()

    steps = _steps(pointed)
    refs = _pointing(pointed)
    assert len(refs) == 2 and not _pointing(whole)
    # Each points at the answer of the step before the one that first carried it.
    assert sorted((r.step_id, r.index) for r in refs.values()) == sorted(
        (s.pk, 0) for s in steps[:2])
    assert all(len(_blobs(pointed)[pk]) == 19 for pk in refs)
    # Every call reads exactly what it sent, placeholders included, as the whole store reads.
    assert _sent(records, tenant) == _sent(_session(tenant, agent, whole, t0 + 10), tenant)
    sent = _sent(records, tenant)
    with tenant_context(tenant):
        assert sent[1][2] == steps[0].action["messages"][0]
        assert "<EMAIL_ADDRESS_1>" in sent[2][2]["content"]
    # The answers' findings are counted once, with their steps; the references hold none.
    assert not Finding.objects.filter(item_id__in=list(refs)).exists()
    totals = [sum(f.total for f in Finding.objects.filter(step__trajectory_id=t))
              for t in (pointed, whole)]
    assert totals[0] < totals[1]
    # Erasure still finds the trajectory by what the answer named, through the reference's
    # own subject-index row.
    assert SubjectIndex.objects.filter(item_id__in=list(refs)).exists()
    wanted = SubjectIndex.keys(lookup_hashes(tenant.pk, "maria.garcia@example.com"))
    assert uuid.UUID(pointed) in set(SubjectIndex.objects.filter(
        hashes__keys_overlap=wanted, item_id__in=list(refs))
        .values_list("trajectory_id", flat=True))


def test_retention_gives_the_answer_to_the_item_before_its_step_goes(tenant, agent, tmp_path):
    traj = str(uuid.uuid4())
    records = _session(tenant, agent, traj, timezone.now().timestamp() - 50)
    ship_and_build(tmp_path, records)
    steps = _steps(traj)
    before = _sent(records, tenant)
    assert len(_pointing(traj)) == 2
    # The first call is past the steps retention: the item repeating its answer keeps the
    # message; the one repeating the second answer still points (its step stays).
    Step.objects.filter(pk=steps[0].pk).update(started_at=timezone.now() - timedelta(days=400))
    assert purge_tenant(tenant.pk)["steps"] == 1
    left = _pointing(traj)
    assert [r.step_id for r in left.values()] == [steps[1].pk]
    assert _sent(records, tenant) == before[1:]


def test_a_refused_answering_step_gives_its_answer_to_the_item(tenant, agent, tmp_path):
    """The database refuses the first call's step (a NUL in its reasoning, which the step
    keeps apart from the answer as jsonb: jsonb holds none) while its answer and the next call
    are fine: the next call's item for that answer
    must not point at a step that was never stored."""
    traj = str(uuid.uuid4())
    records = _session(tenant, agent, traj, timezone.now().timestamp() - 50,
                       first_reasoning="th\u0000ink")
    ship_and_build(tmp_path, records)  # one batch
    assert Interaction.objects.get(flow_id=records[0]["flow_id"]).state == "quarantined"
    assert not Step.objects.filter(pk=records[0]["step_id"]).exists()
    stored = _steps(traj)
    assert len(stored) == 2
    assert [r.step_id for r in _pointing(traj).values()] == [stored[0].pk]
    sent = _sent(records, tenant)
    assert sent[0][2]["content"].startswith("Your order ships to <PERSON_1>")


def test_migration_0038_gives_every_item_its_message_and_back(tenant, agent, tmp_path,
                                                              transactional_db):
    from django.core.management import call_command

    traj = str(uuid.uuid4())
    records = _session(tenant, agent, traj, timezone.now().timestamp() - 50)
    ship_and_build(tmp_path, records)
    before = _sent(records, tenant)
    refs = _pointing(traj)
    assert len(refs) == 2
    call_command("migrate", "governance", "0037", verbosity=0)
    try:
        assert not _pointing(traj)
        blobs = _blobs(traj)
        assert all(blobs[pk][:1] == b"\x02" for pk in refs)
    finally:
        call_command("migrate", "governance", verbosity=0)
    assert ConversationItem.objects.filter(pk__in=list(refs)).count() == 2
    assert _sent(records, tenant) == before


def test_only_references_a_remaining_step_reads_are_given_their_message(tenant, agent,
                                                                        tmp_path):
    """A month's drop must not rewrite every reference of the month: an item that only doomed
    steps reference is left to delete_unreferenced_items."""
    from governance.capture.conversation import keep_answers_of, reroot_children

    traj = str(uuid.uuid4())
    ship_and_build(tmp_path, _session(tenant, agent, traj, timezone.now().timestamp() - 50))
    steps = _steps(traj)
    with tenant_context(tenant):
        every = Step.objects.filter(trajectory_id=traj)
        assert keep_answers_of([traj], every) == 0
        assert len(_pointing(traj)) == 2
        reroot_children([steps[0].pk])
        assert keep_answers_of([traj], Step.objects.filter(pk=steps[0].pk)) == 1
    assert [r.step_id for r in _pointing(traj).values()] == [steps[1].pk]


def test_an_answering_step_dropped_with_a_refused_item_gives_its_answer_back(tenant, agent,
                                                                            tmp_path):
    """The first call carries a message the database refuses (a NUL): it is dropped, and the
    next call, which keeps that message, with it. The item repeating the first call's answer
    (no identifiers in it: no rows that would take it along) must not point at the step that
    was never stored, or the next batch reading it by digest would fail."""
    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 50
    history = [SYSTEM, {"role": "user", "content": "a\u0000b"}]
    first = make_record(tenant.pk, agent.pk, trajectory_id=traj, t=t0,
                        request={"model": "m", "messages": list(history)},
                        response=chat_response("Noted."))
    history += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Go."}]
    second = make_record(tenant.pk, agent.pk, trajectory_id=traj, t=t0 + 1,
                         request={"model": "m", "messages": list(history)},
                         response=chat_response("Done."))
    ship_and_build(tmp_path / "a", [first, second])  # one batch
    assert not Step.objects.filter(trajectory_id=traj).exists()
    assert not _pointing(traj)
    # A later call sending the answer again reads the item by its digest.
    third = make_record(tenant.pk, agent.pk, trajectory_id=traj, t=t0 + 2, request={
        "model": "m", "messages": [SYSTEM, {"role": "assistant", "content": "Noted."},
                                   {"role": "user", "content": "Again."}]},
        response=chat_response("ok"))
    ship_and_build(tmp_path / "b", [third])
    with tenant_context(tenant):
        step = Step.objects.get(pk=third["step_id"])
        assert observations([step])[step.pk]["messages"][1] == {"role": "assistant",
                                                                "content": "Noted."}
