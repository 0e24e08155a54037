"""The step builder's session memo (governance/capture/session_memo.py, decision 45): what a
worker process keeps between batches of a session must change nothing it builds — chains equal
conversation.chain_digests, states equal a read of every delta, parents and items equal a
lookup of everything — including after another process moved the session on, after retention
purged the step or the items it remembers, and after a batch rolled back."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from governance.capture import conversation
from governance.capture.conversation import chain_digests, observations, parent_candidates
from governance.capture.placeholders import keep_states, read_states, write_deltas
from governance.capture.session_memo import SESSION_MEMO, SessionMemo
from governance.models import ConversationItem, Interaction, PendingInteraction, Step, Trajectory
from governance.retention import purge_tenant
from governance.sanitizer import PlaceholderState
from governance.tenancy import tenant_context
from tests.pipeline import ship_and_build
from tests.test_conversation_store import SYSTEM, _assistant, _call, _steps, _user

SECRET = b"k" * 32


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "memo-bot")


# --- pure ------------------------------------------------------------------------------------


def test_chains_continue_from_the_last_history_and_equal_a_fresh_chain():
    memo = SessionMemo()
    digests = [f"m:{i:032x}" for i in range(12)]
    other = [f"m:{i:032x}" for i in range(100, 105)]
    for key, history in [("a", digests[:3]), ("a", digests[:8]), ("a", digests),  # grows
                         ("a", digests[:5]),  # truncated
                         ("a", digests[:4] + other),  # branched
                         ("a", other), ("a", []), ("a", digests),  # unrelated, empty, back
                         ("b", digests[:6])]:  # another trajectory
        assert memo.chains(key, history, 32) == chain_digests(history), (key, len(history))
    # A different length of digest is another chain (never continued from this one).
    assert memo.chains("a", digests, 16) == [c[:16] for c in chain_digests(digests)]
    # What is handed out is the caller's to change.
    out = memo.chains("c", digests, 32)
    out.append("x")
    assert memo.chains("c", digests, 32) == chain_digests(digests)


def test_parent_candidates_start_at_the_remembered_step_when_the_history_does():
    chains = chain_digests([f"m:{i:032x}" for i in range(6)])
    assert parent_candidates(chains, None) == chains
    assert parent_candidates(chains, (chains[3], 4)) == chains[3:]
    assert parent_candidates(chains, (chains[5], 6)) == chains[5:]
    # A hint the history does not start with, or longer than it: every prefix.
    assert parent_candidates(chains, ("f" * 32, 4)) == chains
    assert parent_candidates(chains[:3], (chains[3], 4)) == chains[:3]
    assert parent_candidates(chains, (chains[0], 0)) == chains


def test_digests_are_remembered_per_tenant():
    memo = SessionMemo()
    calls: list[bytes] = []

    def keyed(tag: str):
        def digest(content: bytes) -> str:
            calls.append(content)
            return tag + content.hex()
        return digest

    one, two = memo.digest(1, keyed("one:")), memo.digest(2, keyed("two:"))
    assert one(b"x") == "one:78" and one(b"x") == "one:78"
    assert two(b"x") == "two:78"
    assert calls == [b"x", b"x"]  # once per tenant


# --- placeholder states -------------------------------------------------------------------------


def _numbered(state: PlaceholderState, names: list[str]) -> None:
    for name in names:
        state.add_person_aliases(name, state.label("PERSON", name, SECRET), SECRET)


def test_a_kept_state_reads_on_with_deltas_another_process_wrote(tenant, agent):
    now = timezone.now()
    traj = Trajectory.objects.create(tenant=tenant, agent=agent, started_at=now,
                                     last_step_at=now)
    memo = SessionMemo()
    with tenant_context(tenant):
        # This process: batch 1, committed and kept.
        seq, state = read_states([traj.pk], memo, tenant.pk)[traj.pk]
        before = state.to_json()
        _numbered(state, ["Maria Garcia"])
        locked = {traj.pk: Trajectory.objects.get(pk=traj.pk)}
        write_deltas(locked, {traj.pk: state}, {traj.pk: before})
        keep_states(memo, tenant.pk, locked, {traj.pk: state})
        # Another process: batch 2, from the database.
        seq2, other = read_states([traj.pk])[traj.pk]
        assert seq2 == 1
        before = other.to_json()
        _numbered(other, ["Peter Novak"])
        locked = {traj.pk: Trajectory.objects.get(pk=traj.pk)}
        write_deltas(locked, {traj.pk: other}, {traj.pk: before})
        # This process again: its kept state plus the other's delta is the whole state.
        seq3, mine = read_states([traj.pk], memo, tenant.pk)[traj.pk]
        assert seq3 == 2
        assert mine.to_json() == read_states([traj.pk])[traj.pk][1].to_json() == \
            other.to_json()
        # Taken: the memo no longer holds it until it is kept again.
        assert memo.take_state((tenant.pk, traj.pk, locked[traj.pk].created_at)) is None
        # A trajectory made again under the same id (another created_at) never reads it.
        keep_states(memo, tenant.pk, locked, {traj.pk: PlaceholderState()})
        Trajectory.objects.filter(pk=traj.pk).update(created_at=now + timedelta(seconds=1))
        assert read_states([traj.pk], memo, tenant.pk)[traj.pk][1].to_json() == \
            other.to_json()


# --- through the real shipper and builder -------------------------------------------------


def _session(tenant, agent, traj: str, calls: int, t0: float) -> tuple[list[dict], list[list]]:
    """A growing session: each call appends a reply and a user message naming a person."""
    history = [SYSTEM, _user("Hello, I am Maria Garcia.")]
    records, histories = [], []
    for i in range(calls):
        records.append(_call(tenant, agent, traj, history, t0 + i))
        histories.append(history)
        history = history + [_assistant(f"Noted ({i})."),
                             _user(f"Please also ask Peter Novak about parcel {i}.")]
    return records, histories


def _layout(steps: list[Step]) -> list[tuple]:
    index = {s.pk: i for i, s in enumerate(steps)}
    return [(index.get(s.parent_step), s.kept, len(s.appended), s.history_length)
            for s in steps]


def test_a_session_built_with_the_memo_stores_what_one_built_without_it(
        tenant, agent, tmp_path, django_capture_on_commit_callbacks, monkeypatch):
    t0 = timezone.now().timestamp() - 100
    with_memo, without = str(uuid.uuid4()), str(uuid.uuid4())
    records, histories = _session(tenant, agent, with_memo, 9, t0)
    plain, _ = _session(tenant, agent, without, 9, t0)
    looked_up: list[int] = []
    real = conversation.known_histories

    def spy(tids, chains, version):
        chains = set(chains)
        looked_up.append(len(chains))
        return real(tids, chains, version)

    monkeypatch.setattr("governance.tasks.known_histories", spy)
    for i in range(0, 9, 3):  # three batches, each committed: the memo is kept after each
        with django_capture_on_commit_callbacks(execute=True):
            ship_and_build(tmp_path / f"m{i}", records[i:i + 3])
    # From the second batch on, the lookup starts at the remembered step: the prefixes of
    # three calls from it on, not every prefix of every call.
    assert looked_up[1] < sum(len(h) for h in histories[3:6])
    for i in range(0, 9, 3):  # the same, built without a memo (nothing kept)
        SESSION_MEMO.clear()
        ship_and_build(tmp_path / f"p{i}", plain[i:i + 3])

    mine, theirs = _steps(with_memo), _steps(without)
    assert _layout(mine) == _layout(theirs)
    with tenant_context(tenant):
        a, b = observations(mine), observations(theirs)
        state_a = read_states([uuid.UUID(with_memo)])[uuid.UUID(with_memo)][1]
        state_b = read_states([uuid.UUID(without)])[uuid.UUID(without)][1]
    assert [len(a[s.pk]["messages"]) for s in mine] == [len(h) for h in histories]
    assert [a[s.pk] for s in mine] == [b[s.pk] for s in theirs]
    assert "<PERSON_" in str(a[mine[-1].pk]["messages"])
    assert state_a.counters == state_b.counters
    assert ConversationItem.objects.filter(trajectory_id=with_memo).count() == \
        ConversationItem.objects.filter(trajectory_id=without).count()


def test_a_purged_step_and_its_items_are_not_taken_from_the_memo(
        tenant, agent, tmp_path, django_capture_on_commit_callbacks):
    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 100
    first = [SYSTEM, _user("Order 1")]
    second = first + [_assistant("Looking."), _user("A detour only this call made.")]
    branch = first + [_assistant("Looking."), _user("Back to order 1.")]
    with django_capture_on_commit_callbacks(execute=True):
        ship_and_build(tmp_path / "a", [_call(tenant, agent, traj, first, t0),
                                        _call(tenant, agent, traj, second, t0 + 1)])
    steps = _steps(traj)
    hint = SESSION_MEMO.parent_hint((tenant.pk, uuid.UUID(traj)), steps[1].sanitizer_version)
    assert hint == (steps[1].history_digest, 4)
    # The memo remembers the second step; retention purges it, and the item only it held.
    Step.objects.filter(pk=steps[1].pk).update(started_at=timezone.now() - timedelta(days=400))
    Interaction.objects.filter(step_id=steps[1].pk).update(
        started_at=timezone.now() - timedelta(days=400))
    detour = ConversationItem.objects.filter(trajectory_id=traj, first_step=steps[1].pk)
    assert detour.exists()
    detour_ids = set(detour.values_list("pk", flat=True))
    purge_tenant(tenant.pk)
    assert not Step.objects.filter(pk=steps[1].pk).exists()
    assert not ConversationItem.objects.filter(pk__in=detour_ids).exists()
    # The next calls: one resends the purged history whole, one branches off the first.
    third = second + [_assistant("Done."), _user("Thanks.")]
    for i, (history, t) in enumerate([(third, t0 + 2), (branch, t0 + 3)]):
        with django_capture_on_commit_callbacks(execute=True):
            ship_and_build(tmp_path / f"b{i}", [_call(tenant, agent, traj, history, t)])
    remaining = _steps(traj)
    assert len(remaining) == 3
    with tenant_context(tenant):
        full = observations(remaining)
    assert [full[s.pk]["messages"] for s in remaining] == [first, third, branch]
    # The purged step's messages were stored again, not referenced by their old ids.
    used = {i for s in remaining for i in s.appended}
    assert not used & detour_ids
    assert remaining[1].parent_step == remaining[0].pk and remaining[1].kept == 2
    assert not PendingInteraction.objects.exists()


def test_a_rolled_back_batch_leaves_its_numbering_out_of_the_memo(
        tenant, agent, tmp_path, django_capture_on_commit_callbacks):
    from governance.capture.shipper import ship_once
    from governance.tasks import build_group
    from tests.pipeline import write_records

    traj = str(uuid.uuid4())
    t0 = timezone.now().timestamp() - 100
    records, histories = _session(tenant, agent, traj, 4, t0)
    with django_capture_on_commit_callbacks(execute=True):
        ship_and_build(tmp_path / "a", records[:2])
    tid = uuid.UUID(traj)
    created = Trajectory.objects.get(pk=tid).created_at
    kept = SESSION_MEMO.take_state((tenant.pk, tid, created))
    assert kept is not None and kept[0] == Trajectory.objects.get(pk=tid).sanitizer_state_seq
    SESSION_MEMO.keep_state((tenant.pk, tid, created), *kept)

    write_records(tmp_path / "b", records[2:])
    ship_once(tmp_path / "b", enqueue=lambda ids: None)
    pending = list(PendingInteraction.objects.values_list("interaction_id", flat=True))

    class Undo(Exception):
        pass

    with pytest.raises(Undo), transaction.atomic():
        build_group(tenant.pk, pending)
        raise Undo
    # The batch took the state out and never committed: nothing of it is remembered.
    assert SESSION_MEMO.take_state((tenant.pk, tid, created)) is None
    with django_capture_on_commit_callbacks(execute=True):
        ship_and_build(tmp_path / "c", [])
    steps = _steps(traj)
    assert len(steps) == 4
    with tenant_context(tenant):
        full = observations(steps)
        seq, state = read_states([tid])[tid]
    assert [len(full[s.pk]["messages"]) for s in steps] == [len(h) for h in histories]
    assert seq == Trajectory.objects.get(pk=tid).sanitizer_state_seq
    assert SESSION_MEMO.take_state((tenant.pk, tid, created))[1].to_json() == state.to_json()


def test_the_memo_holds_no_more_than_its_bounds():
    memo = SessionMemo(max_trajectories=4, max_state_entries=10, max_chain_messages=6,
                       max_digest_bytes=1000, max_content_bytes=1000)
    digests = [f"m:{i:032x}" for i in range(5)]
    for key in "abc":
        assert memo.chains(key, digests, 32) == chain_digests(digests)
    # Five messages a chain, six at most: only the last trajectory's is kept (and one longer
    # than the bound is computed, never kept).
    assert list(memo._chains) == ["c"]
    assert memo.chains("d", digests * 2, 32) == chain_digests(digests * 2)
    assert "d" not in memo._chains
    big = PlaceholderState()
    _numbered(big, ["Maria Garcia", "Peter Novak", "Dana White"])  # 3 labels, 9 aliases
    small = PlaceholderState()
    _numbered(small, ["Lena"])
    memo.keep_state("big", 1, big)
    memo.keep_state("small", 1, small)
    assert memo.take_state("big") is None and memo.take_state("small") == (1, small)
    memo.keep_state("huge", 1, PlaceholderState.from_json(
        {"labels": {f"{i:016x}": "PERSON_1" for i in range(20)}}))
    assert memo.take_state("huge") is None
    for i in range(30):
        memo.keep_content(i, b"x" * 100)
    assert len(memo._content) < 30 and memo.content(29) == b"x" * 100
    seen: list[bytes] = []
    digest = memo.digest(1, lambda b: seen.append(b) or b.hex())
    for i in range(30):
        digest(bytes([i]) * 50)
    assert len(memo._digests) < 30 and digest(bytes([29]) * 50) == (bytes([29]) * 50).hex()
