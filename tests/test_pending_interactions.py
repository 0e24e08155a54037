"""What is not built yet lives in PendingInteraction, not in the interaction row (migration
0027, decision 39): building a step deletes the pending row and leaves the interaction exactly
as the shipper inserted it — no new row version, no new index entries."""

from __future__ import annotations

import os
import re
import time
import uuid

import pytest
from django.core.management import call_command
from django.db import connection

from governance.models import Interaction, PendingInteraction, Step
from governance.tenancy import tenant_context
from tests.pipeline import chat_response, make_record, ship_and_build


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "pending-bot")


def _ctid(pk: int) -> str:
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("SELECT ctid::text FROM governance_interaction WHERE id = %s", [pk])
        return cur.fetchone()[0]


def test_building_a_step_deletes_the_pending_row_and_never_rewrites_the_interaction(
        tenant, agent, tmp_path):
    from governance.capture.shipper import ship_once
    from governance.tasks import build_steps
    from tests.pipeline import write_records

    traj = str(uuid.uuid4())
    records = _calls(tenant, agent, traj)
    write_records(tmp_path, records)
    ship_once(tmp_path, enqueue=lambda ids: None)
    rows = {ia.flow_id: ia for ia in Interaction.objects.filter(trajectory_id=traj)}
    assert len(rows) == 3
    pending = dict(PendingInteraction.objects.filter(trajectory_id=traj)
                   .values_list("interaction_id", "state"))
    assert pending == {ia.pk: "captured" for ia in rows.values()}
    before = {ia.pk: _ctid(ia.pk) for ia in rows.values()}

    build_steps(sorted(before))
    after = {pk: _ctid(pk) for pk in before}
    assert after == before  # the same row versions: built without an UPDATE
    states = {flow: Interaction.objects.get(flow_id=flow).state for flow in rows}
    assert [states[r["flow_id"]] for r in records] == ["processed", "quarantined", "processed"]
    left = PendingInteraction.objects.get(trajectory_id=traj)
    assert left.state == "quarantined" and left.reason
    assert Interaction.objects.get(pk=left.interaction_id).state_reason == left.reason
    # Asked again: nothing is claimed (the built ones have no row, the quarantined one is
    # not waiting), nothing is built twice.
    assert build_steps(sorted(before))["skipped"] == 3
    assert Step.objects.filter(trajectory_id=traj).count() == 2


def test_a_built_batch_logs_its_tenant_ids_and_time_by_stage(tenant, agent, tmp_path, caplog):
    """One line per tenant group, after the commit: which interactions, and where the
    batch's time went (what tests/bench/long_sessions.py sums per run)."""
    import logging
    import re

    from governance.capture.shipper import ship_once
    from governance.tasks import build_steps
    from tests.pipeline import write_records

    traj = str(uuid.uuid4())
    write_records(tmp_path, _calls(tenant, agent, traj))
    ship_once(tmp_path, enqueue=lambda ids: None)
    ids = sorted(Interaction.objects.filter(trajectory_id=traj).values_list("pk", flat=True))
    built = [pk for pk in ids if pk != ids[1]]  # the second call is quarantined
    with caplog.at_level(logging.INFO, logger="steward.capture"):
        build_steps(ids)
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith(f"capture: tenant {tenant.pk}: built ")]
    assert len(lines) == 1, caplog.text
    assert re.fullmatch(
        rf"capture: tenant {tenant.pk}: built 2 steps \(interactions {built[0]}, {built[1]}\), "
        r"quarantined 1 in \d+ ms: claim \d+, open \d+, sanitize \d+, fields \d+, "
        r"store \d+ ms; 0 of 1 trajectories' last calls cached; \d+ of [1-9]\d* strings' "
        r"detection cached \(0 shared\)", lines[0]), lines[0]
    assert re.search(r"capture: built 2 steps, quarantined 1, skipped 0 .*; commit \d+ ms",
                     caplog.text)


def _other_session():
    """A second connection to the test database (another worker's, as PostgreSQL sees it)."""
    import psycopg

    cfg = connection.settings_dict
    return psycopg.connect(dbname=cfg["NAME"], user=cfg["USER"] or None,
                           host=cfg["HOST"] or None, port=cfg["PORT"] or None,
                           password=cfg["PASSWORD"] or None, autocommit=True)


def test_a_trajectory_another_worker_is_building_is_deferred_not_built_twice(
        tenant, agent, tmp_path):
    """Decision 42: one builder per trajectory. While another session holds the trajectory's
    building lock, a batch of its calls claims nothing, builds nothing and hands the calls
    back; once the lock is gone the same call builds them."""
    from governance.capture.shipper import ship_once
    from governance.tasks import build_group, building_lock
    from tests.pipeline import write_records

    traj = str(uuid.uuid4())
    write_records(tmp_path, _calls(tenant, agent, traj))
    ship_once(tmp_path, enqueue=lambda ids: None)
    ids = sorted(Interaction.objects.filter(trajectory_id=traj).values_list("pk", flat=True))
    with _other_session() as other:
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [building_lock(traj)])
        done = build_group(tenant.pk, ids)
        assert done["deferred"] == ids and done["built"] == done["quarantined"] == [], done
        assert done["skipped"] == []
        assert not Step.objects.filter(trajectory_id=traj).exists()
        assert set(PendingInteraction.objects.filter(trajectory_id=traj)
                   .values_list("state", flat=True)) == {"captured"}
        other.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))",
                      [building_lock(traj)])
    done = build_group(tenant.pk, ids)
    assert (len(done["built"]), len(done["quarantined"]), done["deferred"]) == (2, 1, [])


def test_a_deferral_is_logged_at_info_only_first_and_last(tenant, agent, tmp_path, caplog):
    """A busy session's calls are retried twice a second for up to DEFER_MAX times: the first
    deferral and the last before the task waits are INFO lines, the ones between DEBUG."""
    import logging

    from governance.capture.shipper import ship_once
    from governance.tasks import DEFER_MAX, build_steps, building_lock
    from tests.pipeline import write_records

    traj = str(uuid.uuid4())
    write_records(tmp_path, _calls(tenant, agent, traj))
    ship_once(tmp_path, enqueue=lambda ids: None)
    ids = sorted(Interaction.objects.filter(trajectory_id=traj).values_list("pk", flat=True))
    levels = {}
    with _other_session() as other:
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [building_lock(traj)])
        for deferrals in (0, 5, DEFER_MAX - 1):
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="steward.capture"):
                assert build_steps(ids, deferrals=deferrals)["deferred"] == 3
            levels[deferrals] = [r.levelname for r in caplog.records
                                 if f"deferred ({deferrals + 1} of {DEFER_MAX})"
                                 in r.getMessage()]
    assert levels == {0: ["INFO"], 5: ["DEBUG"], DEFER_MAX - 1: ["INFO"]}
    assert not Step.objects.filter(trajectory_id=traj).exists()


def test_a_batch_leaves_further_sessions_to_another_task_and_takes_one_off_calls(db):
    """BatchPlan: trajectories oldest call first; once SPLIT_AT calls are held, a trajectory
    with several calls is split off (another worker builds it meanwhile); single calls and
    more calls of a held trajectory are always taken; without `split`, everything is."""
    from governance.tasks import SPLIT_AT, BatchPlan

    first, second, third = (str(uuid.uuid4()) for _ in range(3))
    calls = {pk: first for pk in range(1, SPLIT_AT + 1)}
    calls.update({100: second, 101: second, 102: third})
    plan = BatchPlan(split=True)
    take, busy, split = plan.choose(calls)
    assert (take, busy, split) == ([*range(1, SPLIT_AT + 1), 102], [], [100, 101])
    # Coalescing later: the held session's further calls are taken, the other still not.
    assert plan.choose({200: first, 201: second, 202: second}) == ([200], [], [201, 202])
    take, busy, split = BatchPlan(split=False).choose(calls)
    assert (sorted(take), busy, split) == (sorted(calls), [], [])


def test_a_backlog_of_two_sessions_is_split_even_when_few_of_their_calls_were_asked_for(db):
    """When the workers have fallen behind, a task asks for two calls of each of two
    sessions while sixty more of each wait: the first session's waiting calls (which
    coalescing takes along) count towards SPLIT_AT, so the second goes to another task and
    another worker builds it meanwhile, instead of one worker building both backlogs. A
    session with one waiting call, and a one-off call, are still taken."""
    from governance.tasks import BatchPlan

    first, second, one_off = (str(uuid.uuid4()) for _ in range(3))
    calls = {1: first, 2: second, 3: first, 4: second, 5: one_off}
    waiting = {first: 62, second: 62, one_off: 1}
    plan = BatchPlan(split=True, waiting=waiting)
    assert plan.choose(calls) == ([1, 3, 5], [], [2, 4])
    # Few calls waiting (the workers keep up): both sessions in one batch, as before.
    take, busy, split = BatchPlan(split=True, waiting={first: 2, second: 2}).choose(calls)
    assert (sorted(take), busy, split) == ([1, 2, 3, 4, 5], [], [])


def _shipped_sessions(tenant, agent, tmp_path, calls: int, interleaved: bool
                      ) -> tuple[tuple[str, str], dict[str, list[int]]]:
    """Two sessions of `calls` calls each, shipped (pending, nothing built): their calls
    alternate (`interleaved`, two agents sending at once) or the first session's all come
    first. Returns the two trajectory ids and each one's interaction ids in call order."""
    from governance.capture.shipper import ship_once
    from tests.pipeline import write_records

    trajectories = (str(uuid.uuid4()), str(uuid.uuid4()))
    t0 = time.time() - 60
    records = [make_record(tenant.pk, agent.pk, trajectory_id=traj,
                           t=t0 + (2 * i + k if interleaved else calls * k + i),
                           request={"model": "m", "messages": [
                               {"role": "user", "content": f"Question {i} of {k}"}]},
                           response=chat_response(f"Answer {i}"))
               for k, traj in enumerate(trajectories) for i in range(calls)]
    write_records(tmp_path, sorted(records, key=lambda r: r["t_request"]))
    ship_once(tmp_path, enqueue=lambda ids: None)
    return trajectories, {traj: sorted(Interaction.objects.filter(trajectory_id=traj)
                                       .values_list("pk", flat=True)) for traj in trajectories}


def test_a_worker_behind_two_sessions_leaves_the_second_to_another_task(
        tenant, agent, tmp_path, monkeypatch):
    """build_group as a worker's task runs it: asked for the first two calls of each of two
    sessions while eight of each wait, it builds the first session's eight (coalescing) and
    hands the second session's calls to a task of its own, at once."""
    from governance.tasks import build_group, build_steps

    (first, second), ids = _shipped_sessions(tenant, agent, tmp_path, calls=8, interleaved=True)
    asked: list[tuple] = []
    monkeypatch.setattr(build_steps, "apply_async",
                        lambda args, kwargs=None, **options: asked.append(args))
    done = build_group(tenant.pk, sorted(ids[first][:2] + ids[second][:2]), split=True)
    assert sorted(done["built"] + done["coalesced"]) == ids[first]
    assert asked == [(ids[second][:2],)]
    assert not Step.objects.filter(trajectory_id=second).exists()


def test_a_task_for_one_session_does_not_coalesce_an_older_waiting_session(
        tenant, agent, tmp_path, monkeypatch):
    """Asked for the newest call of one session while an older session has six calls waiting,
    a worker's batch builds its own session's waiting calls and leaves the older session to
    the tasks the shipper gave it (another worker builds it meanwhile)."""
    from governance.tasks import build_group, build_steps

    (older, newer), ids = _shipped_sessions(tenant, agent, tmp_path, calls=6,
                                            interleaved=False)
    monkeypatch.setattr(build_steps, "apply_async", lambda *a, **k: None)
    done = build_group(tenant.pk, ids[newer][-1:], split=True)
    assert sorted(done["built"] + done["coalesced"]) == ids[newer]
    assert not Step.objects.filter(trajectory_id=older).exists()


def _wait_for(predicate, timeout: float, what: str, log) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.25)


def test_a_real_worker_builds_at_a_lower_cpu_priority_than_the_proxy(transactional_db,
                                                                     tmp_path):
    """Decision 53: a real worker lowers its CPU priority by STEWARD_WORKER_NICE as it starts,
    so a proxy on the same host goes first when the cores are busy; 0 leaves it as started."""
    from tests.live import celery_worker

    ours = os.getpriority(os.PRIO_PROCESS, 0)
    for asked, expected in (("7", min(ours + 7, 19)), ("0", ours)):
        log = tmp_path / f"worker-nice-{asked}.log"
        with celery_worker("capture", log, f"nice-{asked}", STEWARD_WORKER_NICE=asked,
                           STEWARD_SANITIZER_PRELOAD="0") as worker:
            _wait_for(lambda path=log: re.search(r"@\S+ ready\.", path.read_text()), 120,
                      "the worker did not start", log)
            assert os.getpriority(os.PRIO_PROCESS, worker.pid) == expected
        lowered = re.search(r"CPU priority lowered to nice (\d+)", log.read_text())
        assert (int(lowered[1]) if lowered else ours) == expected, log.read_text()[-2000:]


def test_a_real_worker_defers_a_busy_session_and_splits_off_the_next(transactional_db, tmp_path):
    """Decision 42 through a real Celery worker: one task asks for three sessions of five
    calls. The first session's building lock is held elsewhere (another worker building it):
    its calls are deferred and retried, not built twice; the second is built by the task; the
    third, beyond SPLIT_AT calls, goes to a task of its own. Once the lock is gone, the retry
    builds the first — every call ends up a step."""
    from governance.capture.shipper import ship_once
    from governance.services import create_tenant, ensure_agent
    from governance.tasks import SPLIT_AT, build_steps, building_lock
    from tests.live import celery_worker
    from tests.pipeline import write_records

    assert SPLIT_AT <= 5
    tenant = create_tenant("system:test", "defer", "Defer Bank")[0]
    agent = ensure_agent("system:test", tenant, "defer-bot")
    busy, built, split = (str(uuid.uuid4()) for _ in range(3))
    t0 = time.time() - 60
    records = [make_record(tenant.pk, agent.pk, trajectory_id=traj, t=t0 + 10 * k + i,
                           request={"model": "m", "messages": [
                               {"role": "user", "content": f"Question {i} of {k}"}]},
                           response=chat_response(f"Answer {i}"))
               for k, traj in enumerate((busy, built, split)) for i in range(5)]
    write_records(tmp_path / "spool", records)
    collected: list[int] = []
    ship_once(tmp_path / "spool", enqueue=collected.extend)
    assert len(collected) == 15

    def steps(traj: str) -> int:
        return Step.objects.filter(trajectory_id=traj).count()

    log = tmp_path / "worker.log"
    with _other_session() as other, celery_worker("capture", log, "defer-test"):
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [building_lock(busy)])
        build_steps.delay(sorted(collected), tenant_id=tenant.pk)
        _wait_for(lambda: steps(built) == 5 and steps(split) == 5, 180,
                  "the free sessions were not built", log)
        assert steps(busy) == 0
        other.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))",
                      [building_lock(busy)])
        _wait_for(lambda: steps(busy) == 5, 60, "the deferred session was not built", log)
    text = log.read_text()
    assert re.search(rf"tenant {tenant.pk}: interactions \d+-\d+ deferred \(1 of 20\)", text)
    assert re.search(rf"tenant {tenant.pk}: interactions \d+-\d+ left to another task", text)
    # Every call once: no step built twice, no pending row left.
    assert Step.objects.filter(trajectory_id__in=[busy, built, split]).count() == 15
    assert not PendingInteraction.objects.filter(trajectory_id__in=[busy, built, split]).exists()


def test_id_ranges_are_short_for_a_log_line():
    from governance.tasks import _id_ranges

    assert _id_ranges([9, 3, 4, 5, 5, 11, 12]) == "3-5, 9, 11-12"
    assert _id_ranges([]) == "-"


def test_a_pending_row_whose_interaction_is_gone_is_dropped_when_claimed(tenant, agent):
    from governance.tasks import build_steps
    from tests.govdata import make_trajectory

    traj = make_trajectory(tenant, agent, steps=1, state="captured")
    row = PendingInteraction.objects.get(trajectory=traj)
    with connection.cursor() as cur:  # deleted behind the ORM's back
        cur.execute("DELETE FROM governance_interaction WHERE id = %s", [row.interaction_id])
    # As the sweeper asks (by tenant): the row is claimed, its interaction is not there.
    assert build_steps([row.interaction_id], tenant_id=tenant.pk) == {
        "built": 0, "quarantined": 0, "skipped": 1}
    assert not PendingInteraction.objects.filter(trajectory=traj).exists()


def test_retention_takes_the_pending_rows_with_their_interactions(tenant, agent):
    from datetime import timedelta

    from django.utils import timezone

    from governance.retention import purge_tenant
    from tests.govdata import make_trajectory

    old = make_trajectory(tenant, agent, steps=2, state="quarantined",
                          started=timezone.now() - timedelta(days=800))
    assert PendingInteraction.objects.filter(trajectory=old).count() == 1
    purge_tenant(tenant.pk)
    assert not Interaction.objects.filter(trajectory_id=old.pk).exists()
    assert not PendingInteraction.objects.filter(trajectory_id=old.pk).exists()


def test_migration_0027_moves_the_states_and_back(tenant, agent, transactional_db, monkeypatch):
    traj = ship_and_build_session(tenant, agent)
    # Back past 0031, whose reverse keeps 64-bit subject keys (decision 40).
    monkeypatch.setenv("STEWARD_MIGRATION_ACCEPT_LOSS", "subject-index-keys64")
    call_command("migrate", "governance", "0026", verbosity=0)
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT set_config('steward.system', 'on', false)")
            cur.execute("SELECT state, state_reason FROM governance_interaction "
                        "WHERE trajectory_id = %s ORDER BY id", [traj])
            states = cur.fetchall()
            assert [s for s, _ in states] == ["processed", "quarantined", "processed"]
            assert states[1][1]  # its reason came back
            # A call left waiting by the old code, to move forward.
            cur.execute("UPDATE governance_interaction SET state = 'captured' WHERE id = ("
                        "SELECT max(id) FROM governance_interaction WHERE trajectory_id = %s)",
                        [traj])
    finally:
        call_command("migrate", "governance", verbosity=0)
    with tenant_context(tenant):
        rows = list(Interaction.objects.filter(trajectory_id=traj).order_by("pk"))
        assert [ia.state for ia in rows] == ["processed", "quarantined", "captured"]
        assert rows[1].state_reason == states[1][1]
        assert PendingInteraction.objects.filter(trajectory_id=traj).count() == 2


def _calls(tenant, agent, traj: str) -> list[dict]:
    """Three calls of one trajectory; the second one's response is not JSON (quarantined)."""
    t0 = time.time() - 60
    return [make_record(tenant.pk, agent.pk, trajectory_id=traj, t=t0 + i,
                        request={"model": "m", "messages": [
                            {"role": "user", "content": f"Question {i}"}]},
                        response=b"<html>not json</html>" if i == 1 else chat_response(f"A {i}"))
            for i in range(3)]


def ship_and_build_session(tenant, agent) -> str:
    import tempfile
    from pathlib import Path

    traj = str(uuid.uuid4())
    with tempfile.TemporaryDirectory() as spool:
        ship_and_build(Path(spool), _calls(tenant, agent, traj))
    return traj
