"""The packed subject index (governance.models.SubjectIndex, migration 0018, decision 34): one
row per place identifiers were found, their keyed hashes (128-bit keys in a uuid[], migration
0023, decision 38) under a GIN index — written by the real step builder, found by erasure's
lookup, and migrated both ways from the row-per-identifier layout without losing a hash."""

from __future__ import annotations

import uuid

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from governance.erasure import lookup_hashes, post_condition
from governance.keyring import subject_hash
from governance.models import (
    ConversationItem,
    Interaction,
    PendingInteraction,
    Step,
    SubjectIndex,
    Trajectory,
)
from governance.sanitizer import normalize_identifier
from governance.subject_keys import OPCLASS
from governance.tenancy import tenant_context
from tests.pipeline import CUSTOMERS, chat_response, customer_session, make_record, ship_and_build


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "index-bot")


def _key(tenant, etype: str, value: str) -> int:
    return SubjectIndex.keys([subject_hash(tenant.pk, normalize_identifier(etype, value))])[0]


def test_builder_packs_one_row_per_place_and_erasure_finds_each_identifier(
        tenant, agent, tmp_path):
    traj = str(uuid.uuid4())
    first, second = customer_session(tenant.pk, agent.pk, traj, subject="maria@example.com")
    ship_and_build(tmp_path, [first, second])
    assert not PendingInteraction.objects.exists()  # every call built

    rows = list(SubjectIndex.objects.filter(trajectory_id=traj))
    by_source: dict[str, list[SubjectIndex]] = {}
    for r in rows:
        by_source.setdefault(r.source, []).append(r)
        assert len(r.hashes) == len(set(r.hashes)) >= 1
        assert all(isinstance(h, int) and -(1 << 63) <= h < (1 << 63) for h in r.hashes)
    # One header row per interaction, one row per conversation item with identifiers; the
    # customer message's identifiers share a row. The first response names Maria Garcia and
    # her email, which the customer message it answers holds: no row of its own for them
    # (decision 45).
    assert len(by_source["header"]) == 2
    assert "step" not in by_source
    item_rows = by_source["item"]
    assert len({r.item_id for r in item_rows}) == len(item_rows)
    customer_row = next(r for r in item_rows if _key(tenant, "EMAIL_ADDRESS",
                                                     "peter.novak@example.org") in r.hashes)
    # The customer's email, phone and name share the row of the message that named them.
    assert {_key(tenant, "PHONE_NUMBER", "+44 20 7946 0018"),
            _key(tenant, "PERSON", "Peter Novak")} <= set(customer_row.hashes)
    assert ConversationItem.objects.get(pk=customer_row.item_id).first_step == \
        Step.objects.get(interaction__flow_id=first["flow_id"]).pk

    # Erasure's lookup finds the trajectory by any identifier, and by the header subject.
    from governance.erasure import _find_trajectories

    for subject in ("dana.white@example.net", "+44 20 7946 0018", "maria@example.com",
                    "maria.garcia@example.com"):
        with tenant_context(tenant), connection.cursor() as cursor:
            assert _find_trajectories(cursor, tenant.pk, lookup_hashes(tenant.pk, subject),
                                      10) == [traj], subject
    assert post_condition(tenant.pk, lookup_hashes(tenant.pk, "peter.novak@example.org"))[
        "subject_index"] == 1
    assert post_condition(tenant.pk, lookup_hashes(tenant.pk, "nobody@example.com")) == {
        "trajectories": 0, "interactions": 0, "subject_index": 0, "live_data_keys": 0,
        "dead_letters": 0}
    # Not a hash: matches nothing, fails nothing.
    full = subject_hash(tenant.pk, normalize_identifier("EMAIL_ADDRESS",
                                                        "peter.novak@example.org"))
    assert SubjectIndex.keys(["zz", "", "g" * 64, full]) == [
        _key(tenant, "EMAIL_ADDRESS", "peter.novak@example.org")]

    # The GIN index writes straight into its tree (no uncompressed pending list, decision 34).
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'subjectindex_hashes'")
        assert "fastupdate=off" in (cursor.fetchone()[0] or [])

    # Building the same interactions again adds no row twice.
    from governance.tasks import build_steps

    PendingInteraction.objects.bulk_create([
        PendingInteraction(interaction=ia, tenant_id=ia.tenant_id,
                           trajectory_id=ia.trajectory_id, started_at=ia.started_at)
        for ia in Interaction.objects.all()])
    build_steps(list(Interaction.objects.values_list("pk", flat=True)))
    assert SubjectIndex.objects.filter(trajectory_id=traj).count() == len(rows)


def test_a_step_row_keeps_only_what_no_item_of_its_own_holds(tenant, agent, tmp_path):
    """A reply naming someone its new tool result named adds no key twice; one naming
    someone else keeps that key in the step's row, and erasure finds the trajectory by
    either (decision 45). An item stored by an earlier call is not counted: only rows
    written with the step are."""
    from governance.erasure import _find_trajectories

    traj = str(uuid.uuid4())
    history = [{"role": "system", "content": "You look up customers."},
               {"role": "user", "content": CUSTOMERS}]
    first = make_record(tenant.pk, agent.pk, trajectory_id=traj,
                        request={"model": "m", "messages": history},
                        response=chat_response("Found Maria Garcia (maria.garcia@example.com); "
                                               "I will also copy lena.fischer@example.de."))
    second = make_record(tenant.pk, agent.pk, trajectory_id=traj,
                         request={"model": "m", "messages": history + [
                             {"role": "assistant", "content": "Which one?"},
                             {"role": "user", "content": "The other one."}]},
                         response=chat_response("Peter Novak, peter.novak@example.org."),
                         t=first["t_request"] + 1)
    ship_and_build(tmp_path, [first, second])
    assert not PendingInteraction.objects.exists()
    steps = {s.interaction.flow_id: s for s in Step.objects.filter(trajectory_id=traj)
             .select_related("interaction")}
    step_rows = {r.step_id: r for r in SubjectIndex.objects.filter(trajectory_id=traj,
                                                                  source="step")}
    # The first reply: only the address no item of its own holds.
    assert step_rows[steps[first["flow_id"]].pk].hashes == [
        _key(tenant, "EMAIL_ADDRESS", "lena.fischer@example.de")]
    # The second reply names who an item of the first call holds: kept (that item's row
    # was not written with this step).
    assert _key(tenant, "EMAIL_ADDRESS", "peter.novak@example.org") in \
        step_rows[steps[second["flow_id"]].pk].hashes
    for subject in ("lena.fischer@example.de", "maria.garcia@example.com",
                    "peter.novak@example.org"):
        with tenant_context(tenant), connection.cursor() as cursor:
            assert _find_trajectories(cursor, tenant.pk, lookup_hashes(tenant.pk, subject),
                                      10) == [traj], subject


def test_migration_0018_packs_and_unpacks_rows_of_the_old_layout(tenant, agent,
                                                                 transactional_db):
    """Rows written in the row-per-identifier layout (hex hash, entity type) are packed by
    0018 and restored exactly by its reverse."""
    now = timezone.now()
    traj = Trajectory.objects.create(tenant=tenant, agent=agent, started_at=now,
                                     last_step_at=now)
    call_command("migrate", "governance", "0017", verbosity=0)
    ia_id = _old_interaction(tenant.pk, agent.pk, traj.pk)
    h = [uuid.uuid4().hex * 2 for _ in range(6)]
    old_rows = {
        # (step, interaction, item, entity type, hash)
        (None, ia_id, None, "SUBJECT_HEADER", h[0]),
        (None, ia_id, None, "EMAIL_ADDRESS", h[1]),
        (None, ia_id, None, "PHONE_NUMBER", h[2]),
        (None, ia_id, None, "ERASURE_SCAN", h[3]),
        (None, ia_id, None, "ERASURE_SCAN", h[4]),
    }
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        for step, ia, item, etype, hx in old_rows:
            cur.execute(
                "INSERT INTO governance_subjectindex (tenant_id, trajectory_id, step_id, "
                "interaction_id, item_id, entity_type, hash, created_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, now())",
                [tenant.pk, traj.pk, step, ia, item, etype, hx])
    call_command("migrate", "governance", "0018", verbosity=0)
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("SELECT source, entity_types, hashes FROM governance_subjectindex "
                    "WHERE trajectory_id = %s ORDER BY source, id", [traj.pk])
        rows = [(source, tuple(types), [bytes(x).hex() for x in hashes])
                for source, types, hashes in cur.fetchall()]
    assert sorted((source, types) for source, types, _ in rows) == [
        ("header", ("SUBJECT_HEADER",)), ("scan", ("ERASURE_SCAN",)),
        ("scan", ("ERASURE_SCAN",)), ("step", ("EMAIL_ADDRESS", "PHONE_NUMBER"))]
    assert next(hx for source, _, hx in rows if source == "step") == [h[1], h[2]]
    call_command("migrate", "governance", "0017", verbosity=0)
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("SELECT step_id, interaction_id, item_id, entity_type, hash "
                    "FROM governance_subjectindex WHERE trajectory_id = %s", [traj.pk])
        back = set(cur.fetchall())
    assert back == old_rows
    call_command("migrate", "governance", verbosity=0)


def test_migration_0023_keys_rows_by_128_bits_and_reverses_only_when_told(
        tenant, agent, transactional_db, monkeypatch):
    """Rows of the bytea[] layout (0022: 32-byte hashes, parallel entity types) get the first
    128 bits of each hash as a uuid key, which erasure's lookup then finds; the reverse refuses
    while rows exist (the previous release's 256-bit lookups would miss them), and with the
    loss accepted gives back bytea[] keys and entity types that the next upgrade keys again."""
    from governance.erasure import _find_trajectories

    monkeypatch.delenv("STEWARD_MIGRATION_ACCEPT_LOSS", raising=False)
    now = timezone.now()
    traj = Trajectory.objects.create(tenant=tenant, agent=agent, started_at=now,
                                     last_step_at=now)
    call_command("migrate", "governance", "0022", verbosity=0)
    ia_id = _old_interaction(tenant.pk, agent.pk, traj.pk)
    email = subject_hash(tenant.pk, normalize_identifier("EMAIL_ADDRESS", "ana@example.com"))
    phone = subject_hash(tenant.pk, normalize_identifier("PHONE_NUMBER", "+1 415 555 0199"))
    header = subject_hash(tenant.pk, "ana")
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        for source, types, hx in (("step", ["EMAIL_ADDRESS", "PHONE_NUMBER"], [email, phone]),
                                  ("header", ["SUBJECT_HEADER"], [header]),
                                  ("scan", [], [])):
            cur.execute(
                "INSERT INTO governance_subjectindex (tenant_id, trajectory_id, "
                "interaction_id, source, entity_types, hashes, created_at) "
                "VALUES (%s, %s, %s, %s, %s, %s::bytea[], now())",
                [tenant.pk, traj.pk, ia_id if source != "scan" else None, source, types,
                 [bytes.fromhex(x) for x in hx]])
    call_command("migrate", "governance", verbosity=0)

    with tenant_context(tenant):
        keyed = {r.source: r.hashes for r in SubjectIndex.objects.filter(trajectory=traj)}
        with connection.cursor() as cursor:
            for subject in ("ana@example.com", "+1 415 555 0199"):
                assert _find_trajectories(cursor, tenant.pk, lookup_hashes(tenant.pk, subject),
                                          10) == [str(traj.pk)], subject
    # Keyed by 128 bits at 0023, by their first 64 at 0031 (decision 40).
    assert keyed == {"step": SubjectIndex.keys([email, phone]),
                     "header": SubjectIndex.keys([header]), "scan": []}
    assert keyed["step"] == [int.from_bytes(bytes.fromhex(h[:16]), "big", signed=True)
                             for h in (email, phone)]

    def column_type() -> str:
        with connection.cursor() as cur:
            cur.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE "
                        "attrelid = 'governance_subjectindex'::regclass AND attname = 'hashes'")
            return cur.fetchone()[0]

    with pytest.raises(RuntimeError, match="governance 0031 .*STEWARD_MIGRATION_ACCEPT_LOSS"):
        call_command("migrate", "governance", "0022", verbosity=0)
    assert column_type() == "bigint[]"  # refused before anything changed
    monkeypatch.setenv("STEWARD_MIGRATION_ACCEPT_LOSS", "subject-index-keys64")
    with pytest.raises(RuntimeError, match="governance 0023 .*STEWARD_MIGRATION_ACCEPT_LOSS"):
        call_command("migrate", "governance", "0022", verbosity=0)
    assert column_type() == "uuid[]"  # 0031 reversed, 0023 refused before anything changed

    monkeypatch.setenv("STEWARD_MIGRATION_ACCEPT_LOSS", "subject-index-keys64,subject-index-keys")
    call_command("migrate", "governance", "0022", verbosity=0)
    assert column_type() == "bytea[]"
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("SELECT source, entity_types, hashes FROM governance_subjectindex "
                    "WHERE trajectory_id = %s", [traj.pk])
        back = {source: (types, [bytes(x).hex() for x in hashes])
                for source, types, hashes in cur.fetchall()}
    # 64 bits kept, then zeros: what 0031's reverse could give back.
    assert back == {"step": (["UNKNOWN", "UNKNOWN"], [email[:16] + "0" * 16,
                                                      phone[:16] + "0" * 16]),
                    "header": (["SUBJECT_HEADER"], [header[:16] + "0" * 16]), "scan": ([], [])}
    call_command("migrate", "governance", verbosity=0)
    with tenant_context(tenant):
        assert {r.source: r.hashes for r in SubjectIndex.objects.filter(trajectory=traj)} \
            == keyed


def _old_interaction(tenant_id: int, agent_id: int, traj_id) -> int:
    """An interaction row inserted with SQL (the model may be ahead of the schema)."""
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute(
            "INSERT INTO governance_interaction (flow_id, tenant_id, agent_id, trajectory_id, "
            "step_id, endpoint, method, path, is_stream, request_is_json, error_kind, "
            "error_message, subject_hash, consent, started_at, raw_base_flow, state, "
            "state_reason, proxy_instance, shipped_at) VALUES (%s, %s, %s, %s, %s, "
            "'chat.completions', 'POST', '/v1/chat/completions', false, true, '', '', '', "
            "'train', now(), '', 'processed', '', '', now()) RETURNING id",
            [uuid.uuid4().hex, tenant_id, agent_id, traj_id, uuid.uuid4()])
        return cur.fetchone()[0]


def _plan(sql: str, params: list) -> str:
    with connection.cursor() as cur:
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("EXPLAIN " + sql, params)
        return "\n".join(r[0] for r in cur.fetchall())


def test_lookups_use_the_gin_index_under_row_level_security(tenant, agent, tmp_path,
                                                            transactional_db):
    """Decisions 38 and 40, migrations 0025 and 0031: under the services' role (forced
    row-level security) a non-leakproof `&&` can never be an index condition — every lookup
    read the whole subject index — while the leakproof `&&&` uses subjectindex_hashes. With the
    index built without the class (a role that may not declare LEAKPROOF) the lookups fall
    back to `&&` with the same answers."""
    from governance.erasure import _find_trajectories
    from governance.models import subject_keys_operator

    traj = str(uuid.uuid4())
    ship_and_build(tmp_path, customer_session(tenant.pk, agent.pk, traj))
    keys = SubjectIndex.keys(lookup_hashes(tenant.pk, "dana.white@example.net"))
    sql = "SELECT trajectory_id FROM governance_subjectindex WHERE tenant_id = %s AND hashes {} %s"
    assert subject_keys_operator() == "&&&"
    with tenant_context(tenant):
        fast = _plan(sql.format("&&&"), [tenant.pk, keys])
    with tenant_context(tenant):
        slow = _plan(sql.format("&&"), [tenant.pk, keys])
    assert "subjectindex_hashes" in fast and "Seq Scan" not in fast, fast
    assert "Seq Scan" in slow, slow  # the policy's condition first, the leaky one after it

    def found() -> tuple[list[str], list[str]]:
        with tenant_context(tenant), connection.cursor() as cursor:
            by_sql = _find_trajectories(cursor, tenant.pk,
                                        lookup_hashes(tenant.pk, "dana.white@example.net"), 10)
            by_orm = [str(t) for t in SubjectIndex.objects.filter(
                hashes__keys_overlap=keys).values_list("trajectory_id", flat=True)]
        return by_sql, by_orm

    assert found() == ([traj], [traj])
    # The index as a role that may not declare LEAKPROOF builds it (0025, 0031 without a
    # superuser): the default operator class.
    index = ("CREATE INDEX subjectindex_hashes ON governance_subjectindex USING gin "
             "(hashes{}) WITH (fastupdate = off)")
    with connection.cursor() as cur:
        cur.execute("DROP INDEX subjectindex_hashes")
        cur.execute(index.format(""))
    try:
        assert subject_keys_operator() == "&&"
        assert found() == ([traj], [traj])
    finally:
        with connection.cursor() as cur:
            cur.execute("DROP INDEX subjectindex_hashes")
            cur.execute(index.format(f" {OPCLASS}"))
    assert subject_keys_operator() == "&&&"


def test_step_and_interaction_lookups_use_the_partial_indexes(tenant, agent, tmp_path):
    """Migration 0030 (decision 40): item rows (no step, no interaction) are left out of the
    step and interaction indexes; what reads rows by them (Django's cascade, retention's month
    release) still finds them through the partial indexes, and finds every row."""
    traj = str(uuid.uuid4())
    # With a header subject: the header rows carry a step and an interaction.
    ship_and_build(tmp_path, customer_session(tenant.pk, agent.pk, traj,
                                              subject="maria@example.com"))
    with tenant_context(tenant):
        rows = list(SubjectIndex.objects.filter(trajectory_id=traj))
        assert any(r.step_id for r in rows) and any(r.interaction_id for r in rows)
        by_step = SubjectIndex.objects.filter(step_id__in=[r.step_id for r in rows if r.step_id])
        by_ia = SubjectIndex.objects.filter(
            interaction_id__in=[r.interaction_id for r in rows if r.interaction_id])
        assert any(r.item_id and not r.step_id and not r.interaction_id for r in rows)
        assert {r.pk for r in by_step} == {r.pk for r in rows if r.step_id}
        assert {r.pk for r in by_ia} == {r.pk for r in rows if r.interaction_id}
        for qs, index in ((by_step, "subjectindex_step"), (by_ia, "subjectindex_interaction")):
            sql, params = qs.query.sql_with_params()
            plan = _plan(sql, list(params))
            assert index in plan and "Seq Scan" not in plan, plan
    with connection.cursor() as cur:
        cur.execute("SELECT indexdef FROM pg_indexes WHERE indexname IN "
                    "('subjectindex_step', 'subjectindex_interaction')")
        defs = [r[0] for r in cur.fetchall()]
    assert len(defs) == 2 and all("IS NOT NULL" in d for d in defs), defs
