"""Time partitions of interactions, steps and findings (migration 0017, docs/decisions.md 33):
partitions made ahead and for rows that landed in the DEFAULT one, ids unique across
partitions, retention dropping whole months (and only those whose every row expired) with
nothing left behind, erasure on partitioned tables, and the migration both ways on a database
filled through the old schema."""

from __future__ import annotations

import copy
import subprocess
import uuid
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone

from governance.capture.conversation import observations
from governance.models import (
    AuditEvent,
    ConversationItem,
    Finding,
    Interaction,
    Step,
    SubjectIndex,
    Trajectory,
)
from governance.partitions import PARTITIONED, Month, ensure_partitions, monthly_partitions
from governance.retention import drop_expired_partitions, purge_expired
from governance.tenancy import tenant_context
from tests.govdata import add_findings
from tests.pipeline import chat_response, make_record, ship_and_build

EMAIL = "maria.garcia@example.com"
SYSTEM = {"role": "system", "content": "You are a support agent for an online bookshop."}


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "part-bot")


def _months_ago(n: int) -> Month:
    now = timezone.now().astimezone(UTC)
    index = now.year * 12 + now.month - 1 - n
    return Month.of(index // 12, index % 12 + 1)


def _partition_of(table: str, pk_col: str, pk) -> str:
    with connection.cursor() as cur:
        cur.execute(f"SELECT tableoid::regclass::text FROM {table} "  # noqa: S608
                    f"WHERE {pk_col} = %s", [pk])
        return cur.fetchone()[0]


def _call(tenant, agent, traj: str, messages: list, t: float, subject: str | None = None
          ) -> dict:
    return make_record(tenant.pk, agent.pk, trajectory_id=traj, request={
        "model": "m", "messages": copy.deepcopy(messages)}, response=chat_response("ok"), t=t,
        subject=subject)


def _pg_dump_text() -> str:
    from pgserver._commands import POSTGRES_BIN_PATH

    s = connection.settings_dict
    out = subprocess.run(
        [str(POSTGRES_BIN_PATH / "pg_dump"), "--data-only", "-h", s["HOST"] or "127.0.0.1",
         "-p", str(s["PORT"] or 5432), "-U", s["USER"], s["NAME"]],
        capture_output=True, check=True, env={"PGPASSWORD": s["PASSWORD"] or ""})
    return out.stdout.decode("utf-8", "replace")


# --- partitions ahead, and rows in the DEFAULT partition ---------------------------------------


def test_partitions_are_made_ahead_idempotently_with_rls(db):
    made = ensure_partitions(3, first=date(2030, 1, 15))
    assert sorted(p["partition"] for p in made) == sorted(
        f"{t}_p2030_0{m}" for t in PARTITIONED for m in (1, 2, 3))
    assert ensure_partitions(3, first=date(2030, 1, 15)) == []
    for table in PARTITIONED:
        assert Month.of(2030, 2) in monthly_partitions(table)
    with connection.cursor() as cur:
        cur.execute("SELECT relrowsecurity, relforcerowsecurity, "
                    "(SELECT count(*) FROM pg_policies WHERE tablename = relname) "
                    "FROM pg_class WHERE relname = 'governance_step_p2030_02'")
        assert cur.fetchone() == (True, True, 1)
    # The app role (owns nothing) makes them through the function, and can drop only a
    # monthly partition of the three tables whose month is over.
    from tests.conftest import APP_ROLE

    now = timezone.now().astimezone(UTC)
    current = f"governance_step_p{now:%Y_%m}"
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(f"SET LOCAL ROLE {APP_ROLE}")
        cur.execute("SELECT count(*) FROM steward_ensure_partitions(%s, 1)", [date(2030, 6, 1)])
        assert cur.fetchone()[0] == 3
        for statement in ("DROP TABLE governance_step_p2030_06",
                          "SELECT steward_drop_partition('governance_step_default')",
                          f"SELECT steward_drop_partition('{current}')",
                          "SELECT steward_drop_partition('governance_auditevent')"):
            with pytest.raises(DatabaseError), transaction.atomic():
                cur.execute(statement)
    # The beat task, for this month and the next two: made by the migration already.
    from governance.tasks import ensure_partitions as task

    assert task() == []
    assert Month.of(now.year, now.month) in monthly_partitions("governance_step")


def test_rows_in_the_default_partition_move_into_the_month_made_later(tenant, agent, tmp_path):
    far = datetime(2035, 7, 3, 12, tzinfo=UTC)
    traj = str(uuid.uuid4())
    ship_and_build(tmp_path, [_call(tenant, agent, traj, [_user(f"I am {EMAIL}")],
                                    far.timestamp())])
    step = Step.objects.get(trajectory_id=traj)
    assert _partition_of("governance_step", "id", step.pk) == "governance_step_default"
    made = ensure_partitions(1, first=far.date())
    moved = {p["partition"]: p["moved_rows"] for p in made}
    assert moved["governance_step_p2035_07"] == 1
    assert moved["governance_interaction_p2035_07"] == 1
    assert _partition_of("governance_step", "id", step.pk) == "governance_step_p2035_07"
    with tenant_context(tenant):  # read through the parent, under the tenant's policy
        assert Step.objects.filter(pk=step.pk).exists()


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


# --- ids unique across partitions ----------------------------------------------------------------


def test_flow_and_step_ids_stay_unique_across_partitions(tenant, agent, transactional_db):
    from tests.govdata import make_trajectory

    traj = make_trajectory(tenant, agent, steps=1)
    ia = Interaction.objects.get(trajectory=traj)
    later = ia.started_at + timedelta(days=40)  # another month's partition
    for clash in ({"step_id": ia.step_id}, {"flow_id": ia.flow_id}):
        fields = {"flow_id": uuid.uuid4().hex, "step_id": uuid.uuid4(), **clash}
        with pytest.raises(IntegrityError), transaction.atomic():
            Interaction.objects.create(
                tenant=tenant, agent=agent, trajectory=traj, endpoint="chat.completions",
                method="POST", path="/v1/chat/completions", started_at=later, **fields)
    # The same started_at: the composite unique constraint, so ON CONFLICT DO NOTHING holds.
    with pytest.raises(IntegrityError), transaction.atomic():
        Interaction.objects.create(
            tenant=tenant, agent=agent, trajectory=traj, endpoint="chat.completions",
            method="POST", path="/v1/chat/completions", started_at=ia.started_at,
            flow_id=uuid.uuid4().hex, step_id=ia.step_id)


def test_a_record_without_a_request_time_ships_once(tenant, agent, tmp_path):
    """started_at is part of the unique keys now: the fallback for a record without a valid
    t_request must be the same on every read, or a re-shipped record would be refused."""
    from governance.capture.shipper import ship_once
    from governance.models import DeadLetter
    from tests.pipeline import write_records

    rec = make_record(tenant.pk, agent.pk, response=chat_response())
    rec["t_request"] = "not a time"
    for where in ("a", "b"):  # the same record read twice (two segments)
        write_records(tmp_path / where, [rec])
        counts = ship_once(tmp_path / where, enqueue=None)
    assert (counts["inserted"], counts["duplicates"], counts["dead_lettered"]) == (0, 1, 0)
    ia = Interaction.objects.get(flow_id=rec["flow_id"])
    assert ia.state == "quarantined" and ia.started_at.timestamp() == pytest.approx(rec["t_end"])
    assert not DeadLetter.objects.exists()


# --- retention: whole months ---------------------------------------------------------------------


def _old_month_with_a_session(tenant, agent, tmp_path, *, months: int = 14,
                              echoed: bool = False):
    """A session whose first calls fall in a month `months` ago (its own partition) and whose
    last call is recent: the later step extends the old ones and its raw request is a delta of
    the previous call's. `echoed`: each call sends back the answer it was given ("ok"), which
    the store keeps as a reference to the old step's answer (decision 62)."""
    month = _months_ago(months)
    ensure_partitions(1, first=month.start.date())
    traj = str(uuid.uuid4())
    t0 = month.start + timedelta(days=3)
    history = [SYSTEM]
    records = []
    for i in range(3):
        if echoed:  # the call, then the answer it got ("ok") in the next call's history
            history = history + [_user(f"Question {i} from {EMAIL}")]
        else:
            history = history + [_user(f"Question {i} from {EMAIL}"),
                                 {"role": "assistant", "content": f"Answer {i}"}]
        records.append(_call(tenant, agent, traj, history,
                             (t0 + timedelta(hours=i)).timestamp(), subject=EMAIL))
        if echoed:
            history = history + [{"role": "assistant", "content": "ok"}]
    history = history + [_user("And one more thing, today.")]
    records.append(_call(tenant, agent, traj, history, timezone.now().timestamp() - 60,
                         subject=EMAIL))
    ship_and_build(tmp_path, records)
    return month, traj, records


@pytest.mark.parametrize("echoed", [False, True], ids=["answers not sent back", "sent back"])
def test_retention_drops_an_expired_month_and_keeps_what_depends_on_it_whole(
        tenant, agent, tmp_path, transactional_db, echoed):
    from governance.capture.rawstore import decode_body, open_raw
    from governance.models import ANSWER_REF_FORMAT

    def references() -> list:
        with connection.cursor() as cur:
            cur.execute("SELECT set_config('steward.system', 'on', false)")
            cur.execute("SELECT id FROM governance_conversationitem WHERE trajectory_id = %s "
                        "AND substring(content from 1 for 1) = %s", [traj, ANSWER_REF_FORMAT])
            return [row[0] for row in cur.fetchall()]

    month, traj, records = _old_month_with_a_session(tenant, agent, tmp_path, echoed=echoed)
    # Sent back, the answer is one item ("ok" each time) pointing at the first old step's.
    assert len(references()) == (1 if echoed else 0)
    steps = list(Step.objects.filter(trajectory_id=traj).order_by("started_at"))
    assert len(steps) == 4 and steps[3].parent_step == steps[2].pk
    assert {_partition_of("governance_step", "id", s.pk) for s in steps[:3]} == {
        month.partition("governance_step")}
    last = Interaction.objects.select_related("data_key").get(step_id=steps[3].pk)
    assert last.raw_base_flow == records[2]["flow_id"]  # a delta of an old call's payload
    with tenant_context(tenant):
        expected = observations([steps[3]])[steps[3].pk]
    assert Finding.objects.filter(step_id__in=[s.pk for s in steps[:3]]).exists()
    assert SubjectIndex.objects.filter(step_id__in=[s.pk for s in steps[:3]]).exists()

    results = purge_expired()
    assert results[tenant.pk]["complete"] == 1
    for table in PARTITIONED:
        assert month not in monthly_partitions(table)
    # Nothing of the old month is left, in any table.
    assert list(Step.objects.filter(trajectory_id=traj)) == [steps[3]]
    assert not Interaction.objects.filter(step_id__in=[s.pk for s in steps[:3]]).exists()
    assert not Finding.objects.filter(step_id__in=[s.pk for s in steps[:3]]).exists()
    assert not SubjectIndex.objects.filter(step_id__in=[s.pk for s in steps[:3]]).exists()
    # The remaining step was re-rooted first: it materializes exactly as before ...
    kept = Step.objects.get(pk=steps[3].pk)
    assert kept.parent_step is None
    with tenant_context(tenant):
        assert observations([kept])[kept.pk] == expected
    assert references() == []  # the item holds the answer itself now
    # ... and its raw payload, sealed whole again, still opens to what was sent.
    last = Interaction.objects.select_related("data_key").get(pk=last.pk)
    assert last.raw_base_flow == ""
    with tenant_context(tenant):
        assert decode_body(open_raw(last)["request_body"]) == decode_body(
            records[3]["request_body"])
    assert Trajectory.objects.get(pk=traj).step_count == 1
    # Conversation items only the dropped steps held went with them.
    assert ConversationItem.objects.filter(trajectory_id=traj).count() >= 1
    event = AuditEvent.objects.filter(action="retention.partition_dropped").get()
    assert event.tenant_id == tenant.pk
    assert event.payload["steps"] == 3 and event.payload["interactions"] == 3
    assert event.payload["month"] == f"{month.start:%Y-%m}"
    # Idempotent: nothing more to drop.
    assert drop_expired_partitions() == []


def test_a_month_with_one_live_row_is_purged_row_by_row_not_dropped(
        tenant, agent, tmp_path, transactional_db):
    from governance import services
    from tests.govdata import make_trajectory

    month = _months_ago(14)
    ensure_partitions(1, first=month.start.date())
    expired = make_trajectory(tenant, agent, steps=2, started=month.start + timedelta(days=1))
    # Restricted data kept five years by policy: the month must stay.
    services.set_retention_policy("system:test", tenant, "restricted", steps_days=5 * 365,
                                  raw_days=7, findings_days=5 * 365, audit_days=3650)
    live = make_trajectory(tenant, agent, steps=1, classification="restricted",
                           started=month.start + timedelta(days=2))
    assert drop_expired_partitions() == []
    totals = purge_expired()[tenant.pk]
    assert totals["steps"] == 2
    assert month in monthly_partitions("governance_step")
    assert not Step.objects.filter(trajectory=expired).exists()
    assert Step.objects.filter(trajectory=live).count() == 1


def test_a_month_goes_only_when_every_tenants_rows_expired_with_an_audit_event_each(
        tenant, other_tenant, agent, make_member, transactional_db):
    from governance import services
    from governance.models import DatasetVersion
    from tests.govdata import make_trajectory

    other_agent = services.ensure_agent("system:test", other_tenant, "other-bot")
    month = _months_ago(14)
    ensure_partitions(1, first=month.start.date())
    make_trajectory(tenant, agent, steps=2, started=month.start + timedelta(days=1))
    # An approved version holding that trajectory is invalidated by the drop.
    stew, comp = make_member("steward", "stew"), make_member("compliance", "comp")
    version = services.freeze_dataset_version(stew, services.create_dataset(stew, tenant,
                                                                           name="d"))
    services.request_approval(stew, version)
    services.approve_version(comp, version, "fine")
    make_trajectory(other_tenant, other_agent, steps=1, started=month.start + timedelta(days=5))
    # The other tenant keeps everything for two years: the month stays for both.
    services.set_retention_policy("system:test", other_tenant, "*", steps_days=730,
                                  raw_days=7, findings_days=730, audit_days=3650)
    assert drop_expired_partitions() == []
    services.set_retention_policy("system:test", other_tenant, "*", steps_days=300,
                                  raw_days=7, findings_days=300, audit_days=3650)
    [dropped] = drop_expired_partitions()
    assert dropped["tenants"] == [tenant.pk, other_tenant.pk]
    events = {e.tenant_id: e.payload for e in AuditEvent.objects.filter(
        action="retention.partition_dropped")}
    assert (events[tenant.pk]["steps"], events[other_tenant.pk]["steps"]) == (2, 1)
    assert events[other_tenant.pk]["policies"]["*"]["steps_days"] == 300
    assert events[tenant.pk]["invalidated_versions"] == 1
    version = DatasetVersion.objects.get(pk=version.pk)
    assert version.status == "invalidated" and version.invalidated_reason.startswith("retention")
    assert not Step.objects.filter(started_at__gte=month.start, started_at__lt=month.end).exists()


def test_findings_of_an_older_kept_step_keep_their_month(tenant, other_tenant, agent,
                                                         transactional_db):
    """A finding is created when its step is built, possibly in the next month: dropping that
    month's steps must not drop the findings month while an older kept step — here another
    tenant's, with no step in that month — has findings there."""
    from governance import services
    from tests.govdata import make_trajectory

    older, month = _months_ago(15), _months_ago(14)
    ensure_partitions(2, first=older.start.date())
    services.set_retention_policy("system:test", other_tenant, "restricted",
                                  steps_days=5 * 365, raw_days=7, findings_days=5 * 365,
                                  audit_days=3650)
    kept = make_trajectory(other_tenant, services.ensure_agent("system:test", other_tenant, "o"),
                           steps=1, classification="restricted",
                           started=month.start - timedelta(hours=1))
    gone = make_trajectory(tenant, agent, steps=1, started=month.start + timedelta(days=2))
    findings = {}
    for traj in (kept, gone):
        step = Step.objects.get(trajectory=traj)
        f = add_findings(traj.tenant, step, ["PERSON"], path="$.x")
        # Built after midnight on the 1st: in `month`'s findings partition for both.
        Finding.objects.filter(pk=f.pk).update(created_at=month.start + timedelta(days=3))
        findings[traj.pk] = f.pk
    [dropped] = drop_expired_partitions()
    assert dropped["partitions"] == [month.partition("governance_step"),
                                     month.partition("governance_interaction")]
    assert month in monthly_partitions("governance_finding")
    assert not Finding.objects.filter(pk=findings[gone.pk]).exists()
    assert Finding.objects.filter(pk=findings[kept.pk]).exists()
    assert Step.objects.filter(trajectory=kept).exists()


def test_nothing_of_a_dropped_month_is_left_in_a_dump_or_var(tenant, agent, tmp_path,
                                                              transactional_db, settings):
    month, traj, records = _old_month_with_a_session(tenant, agent, tmp_path / "spool")
    # The subject's email only ever sat in the old calls (the recent one resends the history
    # but is sealed: ciphertext); plain text of it exists in the database before the purge.
    old_ids = list(Step.objects.filter(trajectory_id=traj, started_at__lt=month.end)
                   .values_list("pk", flat=True))
    assert len(old_ids) == 3
    before = _pg_dump_text()
    assert all(str(pk) in before for pk in old_ids)
    purge_expired()
    after = _pg_dump_text()
    # Conversation items the recent step still holds keep naming the first step that carried
    # them (`first_step`, a plain id, as after a row-by-row purge); nothing else does.
    items = after.split("COPY public.governance_conversationitem ")
    assert len(items) == 2
    rest = items[0] + items[1].split("\n\\.\n", 1)[1]
    for pk in old_ids:
        assert str(pk) not in rest
    for rec in records[:3]:
        assert rec["flow_id"] not in after
    assert EMAIL not in after.lower()
    var = Path(settings.VAR_DIR)
    if var.exists():
        hits = [p for p in var.rglob("*") if p.is_file() and "PG_VERSION" not in p.name
                and not any(part.startswith("pg") for part in p.parts[-3:])
                and EMAIL.encode() in p.read_bytes().lower()]
        assert hits == []


# --- erasure on partitioned tables ---------------------------------------------------------------


def test_erasure_touches_only_the_subjects_rows_in_every_month(tenant, agent, tmp_path,
                                                                transactional_db, settings):
    from governance.erasure import erase_subject, request_erasure

    settings.STEWARD_SPOOL_DIR = tmp_path / "spool"
    settings.VAR_DIR = tmp_path / "var"
    settings.STEWARD_ERASURE_SPOOL_WAIT_S = 2
    month, traj, _ = _old_month_with_a_session(tenant, agent, tmp_path / "a")
    other = str(uuid.uuid4())
    ship_and_build(tmp_path / "b", [
        _call(tenant, agent, other, [_user("Opening hours?")],
              (month.start + timedelta(days=4)).timestamp()),
        _call(tenant, agent, other, [_user("Opening hours?"), {"role": "assistant",
                                      "content": "9-5"}, _user("Thanks")],
              timezone.now().timestamp() - 30)])
    others = {table: list(model.objects.filter(trajectory_id=other).values_list("pk", flat=True))
              for table, model in (("step", Step), ("interaction", Interaction))}
    other_findings = Finding.objects.filter(step__trajectory_id=other).count()
    gone = [str(pk) for pk in Step.objects.filter(trajectory_id=traj).values_list("pk",
                                                                                 flat=True)]
    gone += list(Interaction.objects.filter(trajectory_id=traj).values_list("flow_id",
                                                                            flat=True))
    assert len(gone) == 8 and all(g in _pg_dump_text() for g in gone)
    req, _ = request_erasure("system:test", tenant, EMAIL)
    assert erase_subject(req.pk, tenant.pk)["status"] == "completed"
    # Nothing of the subject's session in any partition, or anywhere else in the database.
    dump = _pg_dump_text()
    assert [g for g in gone if g in dump] == [] and EMAIL not in dump.lower()
    var = Path(settings.VAR_DIR)
    assert not var.exists() or [p for p in var.rglob("*") if p.is_file()
                                and EMAIL.encode() in p.read_bytes().lower()] == []
    assert not Step.objects.filter(trajectory_id=traj).exists()
    assert not Interaction.objects.filter(trajectory_id=traj).exists()
    assert not Finding.objects.filter(step__trajectory_id=traj).exists()
    assert not SubjectIndex.objects.filter(trajectory_id=traj).exists()
    assert sorted(Step.objects.filter(trajectory_id=other).values_list("pk", flat=True)) == \
        sorted(others["step"])
    assert sorted(Interaction.objects.filter(trajectory_id=other)
                  .values_list("pk", flat=True)) == sorted(others["interaction"])
    assert Finding.objects.filter(step__trajectory_id=other).count() == other_findings


def test_interactions_are_indexed_only_for_what_is_looked_up(tenant):
    """Decision 38 (migration 0024): no agent, data-key or delta-base index. Decision 39
    (migration 0027): no state at all — what is not built yet is a PendingInteraction row,
    looked up by tenant and state through its own index."""
    with connection.cursor() as cur:
        cur.execute("SELECT indexname, indexdef FROM pg_indexes "
                    "WHERE tablename = 'governance_interaction'")
        defs = dict(cur.fetchall())
        assert not [n for n in defs if any(c in n for c in ("agent", "data_key", "raw_base"))]
        assert not [n for n in defs if "state" in defs[n] and "started_at" not in defs[n]]
        cur.execute("SELECT attname FROM pg_attribute WHERE attnum > 0 AND NOT attisdropped "
                    "AND attrelid = 'governance_interaction'::regclass")
        assert not {"state", "state_reason"} & {r[0] for r in cur.fetchall()}
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("EXPLAIN SELECT interaction_id FROM governance_pendinginteraction "
                    "WHERE tenant_id = 1 AND state = 'captured' ORDER BY interaction_id")
        plan = "\n".join(r[0] for r in cur.fetchall())
    assert "pending_tenant_state" in plan, plan


# --- the migration, both ways ----------------------------------------------------------------


def _schema(tables: tuple[str, ...]) -> dict[str, list]:
    """Indexes, constraints, columns and row-level security of these tables, comparable."""
    out: dict[str, list] = {}
    with connection.cursor() as cur:
        for table in tables:
            cur.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s "
                        "ORDER BY 1", [table])
            rows = cur.fetchall()
            cur.execute("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                        "WHERE conrelid = %s::regclass ORDER BY 1", [table])
            rows += cur.fetchall()
            cur.execute("SELECT attname, format_type(atttypid, atttypmod), attnotnull "
                        "FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                        "AND NOT attisdropped ORDER BY 1", [table])
            rows += cur.fetchall()
            cur.execute("SELECT relkind, relrowsecurity, relforcerowsecurity FROM pg_class "
                        "WHERE relname = %s", [table])
            rows += cur.fetchall()
            out[table] = rows
    return out


def test_migration_round_trip_on_a_database_filled_by_the_old_code(tenant, agent,
                                                                     transactional_db,
                                                                     monkeypatch):
    """Rows written through the 0016 schema (plain tables, findings with an interaction) are
    copied into monthly partitions (older than two years: the DEFAULT one), read through the
    ORM as before, and the reverse gives back the plain tables, the same schema and rows."""
    from django.core.management import call_command
    from django.db.migrations.executor import MigrationExecutor

    tables = (*PARTITIONED, "governance_subjectindex")
    call_command("migrate", "governance", "0016", verbosity=0)
    old_schema = _schema(tables)
    executor = MigrationExecutor(connection)
    old = executor.loader.project_state(("governance", "0016_raw_request_deltas")).apps
    OldInteraction, OldStep = old.get_model("governance", "Interaction"), old.get_model(
        "governance", "Step")
    OldFinding, OldSubjectIndex = old.get_model("governance", "Finding"), old.get_model(
        "governance", "SubjectIndex")
    OldTrajectory = old.get_model("governance", "Trajectory")
    now = timezone.now()
    traj = OldTrajectory.objects.create(id=uuid.uuid4(), tenant_id=tenant.pk, agent_id=agent.pk,
                                        started_at=now, last_step_at=now)
    times = [now - timedelta(days=900), now - timedelta(days=150), now - timedelta(days=1), now]
    written = []
    for i, at in enumerate(times):
        ia = OldInteraction.objects.create(
            flow_id=f"flow-{i}", tenant_id=tenant.pk, agent_id=agent.pk, trajectory=traj,
            step_id=uuid.uuid4(), endpoint="chat.completions", method="POST",
            path="/v1/chat/completions", started_at=at, raw_ciphertext=b"sealed",
            subject_hash="h" if i % 2 else "")
        step = OldStep.objects.create(id=ia.step_id, tenant_id=tenant.pk, trajectory=traj,
                                      interaction=ia, endpoint="chat.completions",
                                      started_at=at, observation_rest={"n": i})
        finding = OldFinding.objects.create(
            tenant_id=tenant.pk, step=step, interaction=ia, side="request",
            entity_type="EMAIL_ADDRESS", path="$.x", start=0, end=1, score=0.9,
            recognizer="email", operator="placeholder", sanitizer_version="v")
        OldSubjectIndex.objects.create(tenant_id=tenant.pk, trajectory=traj, step=step,
                                       interaction=ia, entity_type="SUBJECT_HEADER", hash="h")
        written.append((ia.pk, step.pk, finding.pk))

    call_command("migrate", "governance", verbosity=0)
    with connection.cursor() as cur:
        cur.execute("SELECT relkind FROM pg_class WHERE relname = 'governance_step'")
        assert cur.fetchone()[0] == "p"
    steps = list(Step.objects.filter(trajectory_id=traj.pk).order_by("started_at"))
    assert [s.pk for s in steps] == [w[1] for w in written]
    assert [s.observation_rest for s in steps] == [{"n": i} for i in range(4)]
    assert [s.interaction_id for s in steps] == [w[0] for w in written]
    assert sorted(Finding.objects.filter(step__trajectory_id=traj.pk)
                  .values_list("pk", flat=True)) == sorted(w[2] for w in written)
    assert SubjectIndex.objects.filter(trajectory_id=traj.pk).count() == 4
    assert _partition_of("governance_step", "id", steps[0].pk) == "governance_step_default"
    month = Month.of(times[1].year, times[1].month)
    assert _partition_of("governance_interaction", "id", written[1][0]) == month.partition(
        "governance_interaction")
    # New rows get new ids (the identity continues after the copied ones).
    ia = Interaction.objects.create(
        flow_id="flow-new", tenant=tenant, agent=agent, trajectory_id=traj.pk,
        step_id=uuid.uuid4(), endpoint="chat.completions", method="POST",
        path="/v1/chat/completions", started_at=now)
    assert ia.pk > max(w[0] for w in written)
    ia.delete()

    # Back past 0031 and 0023, whose reverses keep shorter subject keys (decisions 38, 40).
    monkeypatch.setenv("STEWARD_MIGRATION_ACCEPT_LOSS", "subject-index-keys64,subject-index-keys")
    call_command("migrate", "governance", "0016", verbosity=0)
    assert _schema(tables) == old_schema
    with connection.cursor() as cur:
        cur.execute("SELECT id, interaction_id FROM governance_finding ORDER BY id")
        assert cur.fetchall() == sorted((f, i) for i, _, f in written)
        cur.execute("SELECT count(*) FROM governance_step WHERE trajectory_id = %s", [traj.pk])
        assert cur.fetchone()[0] == 4
    call_command("migrate", "governance", verbosity=0)
    assert Step.objects.filter(trajectory_id=traj.pk).count() == 4
