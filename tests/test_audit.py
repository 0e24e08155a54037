"""The audit chain: append-only by trigger and grants, tamper detection as a superuser would
tamper (triggers off, then edit / delete / reorder rows) through `manage.py verify_audit` and
`GET /api/v1/audit/verify/`, the tenant's event list, and pseudonymous payloads."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction

from governance import services
from governance.models import AuditEvent, Reward
from tests.govdata import make_trajectory
from tests.pipeline import chat_response, make_record, ship_and_build


@pytest.fixture
def clients(make_member, tenant, other_tenant, api_client_for):
    out = {role: api_client_for(make_member(role, f"{role}-1"), tenant)
           for role in ("admin", "steward", "compliance", "auditor")}
    out["outsider"] = api_client_for(make_member("admin", "outsider", on=other_tenant),
                                     other_tenant)
    return out


# Pending deferred FK checks would block TRUNCATE before the trigger runs; the test database
# allows TRUNCATE for Django's flush, production never sets steward.allow_truncate.
NO_TRUNCATE = "SET CONSTRAINTS ALL IMMEDIATE; SET LOCAL steward.allow_truncate = 'off'"


def refused(sql: str, params: list | None = None, *, setup: str = "") -> str:
    """Run `sql` in a savepoint; return the database's refusal message ("" if it passed)."""
    try:
        with transaction.atomic(), connection.cursor() as cur:
            if setup:
                cur.execute(setup)
            cur.execute(sql, params or [])
    except DatabaseError as exc:
        return str(exc)
    return ""


def test_triggers_refuse_update_delete_truncate(tenant):
    seq = AuditEvent.objects.order_by("seq").first().seq
    assert "append-only: UPDATE refused" in refused(
        "UPDATE governance_auditevent SET payload = '{}' WHERE seq = %s", [seq])
    assert "append-only: DELETE refused" in refused(
        "DELETE FROM governance_auditevent WHERE seq = %s", [seq])
    assert "append-only: TRUNCATE refused" in refused(
        "TRUNCATE governance_auditevent CASCADE",
        setup=NO_TRUNCATE)
    # Through the ORM too.
    ev = AuditEvent.objects.get(seq=seq)
    ev.action = "forged"
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        ev.save()
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.filter(seq=seq).delete()
    assert AuditEvent.objects.get(seq=seq).action == "tenant.created"


def test_public_holds_no_write_grant_on_the_audit_log(db):
    with connection.cursor() as cur:
        cur.execute("""
            SELECT a.privilege_type FROM pg_class c, aclexplode(c.relacl) a
            WHERE c.relname = 'governance_auditevent' AND a.grantee = 0""")
        assert cur.fetchall() == []  # PUBLIC (grantee 0): nothing at all
        cur.execute("SELECT has_table_privilege('public', 'governance_auditevent', 'UPDATE'),"
                    " has_table_privilege('public', 'governance_auditevent', 'DELETE'),"
                    " has_table_privilege('public', 'governance_auditevent', 'TRUNCATE')")
        assert cur.fetchone() == (False, False, False)


def test_rewards_are_append_only_except_inside_a_purge(tenant):
    reward = services.record_reward("system:test", tenant, value=1.0, response_id="r-1")
    assert "append-only: UPDATE refused" in refused(
        "UPDATE governance_reward SET value = 2 WHERE id = %s", [reward.pk])
    assert "append-only: DELETE refused" in refused(
        "DELETE FROM governance_reward WHERE id = %s", [reward.pk])
    assert "TRUNCATE refused" in refused(
        "TRUNCATE governance_reward", setup=NO_TRUNCATE)
    # Even with the purge switch on, UPDATE stays refused.
    assert "UPDATE refused" in refused(
        "UPDATE governance_reward SET value = 2 WHERE id = %s", [reward.pk],
        setup="SELECT set_config('steward.allow_purge', 'on', true)")
    with transaction.atomic():
        with services.purge_allowed():
            Reward.objects.filter(pk=reward.pk).delete()
        # Off again when the block ends, still in the same transaction.
        other = services.record_reward("system:test", tenant, value=1.0, response_id="r-2")
        assert "DELETE refused" in refused("DELETE FROM governance_reward WHERE id = %s",
                                           [other.pk])
    assert list(Reward.objects.values_list("response_id", flat=True)) == ["r-2"]


def _events(tenant, n: int = 5) -> list[int]:
    for i in range(n):
        services.record_reward("system:test", tenant, value=float(i), response_id=f"r-{i}")
    return list(AuditEvent.objects.order_by("seq").values_list("seq", flat=True))


def _verify(client, full: bool = False) -> dict:
    r = client.get("/api/v1/audit/verify/" + ("?full=true" if full else ""))
    assert r.status_code == 200, r.content
    return r.json()


def _edit_payload(seq: int) -> None:
    with connection.cursor() as cur:  # a superuser switches the trigger off and edits
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # (the test's own pending FK checks)
        cur.execute("ALTER TABLE governance_auditevent DISABLE TRIGGER auditevent_append_only")
        cur.execute("UPDATE governance_auditevent SET payload = jsonb_set(payload, '{value}', "
                    "'100') WHERE seq = %s", [seq])
        cur.execute("ALTER TABLE governance_auditevent ENABLE TRIGGER auditevent_append_only")


def test_edited_payload_is_detected(tenant, clients):
    seqs = _events(tenant)
    assert _verify(clients["auditor"]) == {
        "ok": True, "events": AuditEvent.objects.filter(tenant=tenant).count(),
        "first_bad_seq": None, "reason": "ok", "checked": len(seqs), "from_seq": 1,
        "full": True}
    target = seqs[3]
    _edit_payload(target)
    # An event before the last verified one: the full walk finds it (a click verifies only
    # what came since), and from then on every click says the chain is broken too.
    body = _verify(clients["compliance"], full=True)
    assert (body["ok"], body["first_bad_seq"]) == (False, target)
    assert "content" in body["reason"]
    assert (_verify(clients["auditor"])["ok"], _verify(clients["auditor"])["first_bad_seq"]) \
        == (False, target)
    with pytest.raises(CommandError, match=rf"seq {target}\b"):
        call_command("verify_audit")


def test_a_click_verifies_only_the_events_since_the_last_one(tenant, clients):
    seqs = _events(tenant, 3)
    first = _verify(clients["auditor"])
    assert (first["ok"], first["checked"], first["full"]) == (True, len(seqs), True)
    assert _verify(clients["auditor"])["checked"] == 0  # nothing new: nothing walked
    more = [e for e in _events(tenant, 4) if e not in seqs]
    body = _verify(clients["auditor"])
    assert (body["ok"], body["checked"], body["from_seq"], body["full"]) == (
        True, len(more), more[0], False)
    assert body["events"] == AuditEvent.objects.filter(tenant=tenant).count()
    # A new event edited after the checkpoint: the next click finds it.
    newest = [e for e in _events(tenant, 2) if e not in seqs + more]
    _edit_payload(newest[1])
    body = _verify(clients["auditor"])
    assert (body["ok"], body["first_bad_seq"], body["checked"]) == (False, newest[1], 2)


def test_a_click_notices_the_checkpoint_event_itself_changed(tenant, clients):
    seqs = _events(tenant, 3)
    assert _verify(clients["auditor"])["ok"]
    with connection.cursor() as cur:
        cur.execute("SET session_replication_role = replica")
        cur.execute("UPDATE governance_auditevent SET hash = repeat('0', 64) WHERE seq = %s",
                    [seqs[-1]])
        cur.execute("RESET session_replication_role")
    body = _verify(clients["auditor"])
    assert (body["ok"], body["first_bad_seq"]) == (False, seqs[-1])


def test_manage_verify_audit_walks_everything_whatever_the_checkpoint(tenant, clients):
    seqs = _events(tenant)
    assert _verify(clients["auditor"])["ok"]
    _edit_payload(seqs[0])
    with pytest.raises(CommandError, match=rf"seq {seqs[0]}\b"):
        call_command("verify_audit")


def test_the_verify_count_is_the_callers_tenant_only(tenant, other_tenant, clients):
    _events(tenant, 3)
    for i in range(4):
        services.record_reward("system:test", other_tenant, value=1.0, response_id=f"o-{i}")
    mine = AuditEvent.objects.filter(tenant=tenant).count()
    assert mine < AuditEvent.objects.count()
    assert _verify(clients["auditor"])["events"] == mine
    theirs = AuditEvent.objects.filter(tenant=other_tenant).count()
    assert _verify(clients["outsider"])["events"] == theirs


def test_deleted_row_is_detected(tenant, clients):
    seqs = _events(tenant)
    target = seqs[2]
    with connection.cursor() as cur:
        cur.execute("SET session_replication_role = replica")  # every trigger off
        cur.execute("DELETE FROM governance_auditevent WHERE seq = %s", [target])
        cur.execute("RESET session_replication_role")
    body = _verify(clients["admin"])
    assert (body["ok"], body["first_bad_seq"]) == (False, target)
    assert "gap" in body["reason"]
    assert body["events"] == AuditEvent.objects.filter(tenant=tenant).count()
    with pytest.raises(CommandError, match=rf"seq {target}\b"):
        call_command("verify_audit")


def test_reordered_rows_are_detected(tenant, clients):
    seqs = _events(tenant)
    a, b = seqs[1], seqs[4]
    with connection.cursor() as cur:
        cur.execute("SET session_replication_role = replica")
        cur.execute("UPDATE governance_auditevent SET seq = -1 WHERE seq = %s", [a])
        cur.execute("UPDATE governance_auditevent SET seq = %s WHERE seq = %s", [a, b])
        cur.execute("UPDATE governance_auditevent SET seq = %s WHERE seq = -1", [b])
        cur.execute("RESET session_replication_role")
    body = _verify(clients["auditor"])
    assert (body["ok"], body["first_bad_seq"]) == (False, a)
    with pytest.raises(CommandError, match=rf"seq {a}\b"):
        call_command("verify_audit")


def test_a_recomputed_forgery_still_breaks_the_next_link(tenant, clients):
    """Editing a row and recomputing its own hash is caught at the next event."""
    from governance.audit import canonical_event, chain_hash

    seqs = _events(tenant)
    ev = AuditEvent.objects.get(seq=seqs[2])
    payload = {**ev.payload, "value": 42.0}
    new_hash = chain_hash(ev.prev_hash, canonical_event(
        ev.seq, ev.tenant_id, ev.actor, ev.action, ev.object_type, ev.object_id, payload,
        ev.created_at))
    with connection.cursor() as cur:
        cur.execute("SET session_replication_role = replica")
        cur.execute("UPDATE governance_auditevent SET payload = %s, hash = %s WHERE seq = %s",
                    [json.dumps(payload), new_hash, ev.seq])
        cur.execute("RESET session_replication_role")
    body = _verify(clients["auditor"])
    assert (body["ok"], body["first_bad_seq"]) == (False, seqs[3])


def test_verify_and_list_permissions(tenant, clients):
    _events(tenant, 1)
    assert clients["steward"].get("/api/v1/audit/verify/").status_code == 403
    assert clients["steward"].get("/api/v1/audit/").status_code == 403
    for role in ("admin", "compliance", "auditor"):
        assert clients[role].get("/api/v1/audit/").status_code == 200
    from rest_framework.test import APIClient

    assert APIClient().get("/api/v1/audit/verify/").status_code == 401


def test_list_is_scoped_filtered_and_paginated(tenant, other_tenant, clients):
    _events(tenant, 3)
    services.record_reward("system:test", other_tenant, value=1.0, response_id="foreign")
    own = clients["auditor"].get("/api/v1/audit/", {"page_size": 500}).json()["results"]
    assert own
    seqs = [e["seq"] for e in own]
    assert seqs == sorted(seqs, reverse=True)
    tenant_seqs = set(AuditEvent.objects.for_tenant(tenant).values_list("seq", flat=True))
    assert set(seqs) == tenant_seqs
    foreign = clients["outsider"].get("/api/v1/audit/", {"page_size": 500}).json()["results"]
    assert not set(e["seq"] for e in foreign) & tenant_seqs
    assert any(e["payload"].get("response_id") == "foreign" for e in foreign)

    c = clients["auditor"]
    rewards = c.get("/api/v1/audit/", {"action": "reward.recorded"}).json()["results"]
    assert [e["payload"]["response_id"] for e in rewards] == ["r-2", "r-1", "r-0"]
    assert len(c.get("/api/v1/audit/", {"action": "reward."}).json()["results"]) == 3
    assert c.get("/api/v1/audit/", {"action": "reward"}).json()["results"] == []
    one = rewards[0]
    assert [e["seq"] for e in c.get("/api/v1/audit/", {
        "object_type": "reward", "object_id": one["object_id"]}).json()["results"]] == \
        [one["seq"]]
    assert len(c.get("/api/v1/audit/", {"actor": "system:test"}).json()["results"]) >= 4
    assert c.get("/api/v1/audit/", {"actor": "user:0"}).json()["results"] == []
    assert c.get("/api/v1/audit/", {"since": "nope"}).status_code == 400
    # Cursor pagination walks every event once.
    seen, resp = [], c.get("/api/v1/audit/", {"page_size": 2})
    while True:
        body = resp.json()
        seen += [e["seq"] for e in body["results"]]
        if not body["next"]:
            break
        resp = c.get(body["next"])
    assert seen == seqs


def test_audit_payloads_are_pseudonymous(tenant, tmp_path, make_member):
    """The subject and free text (reward comments, approval reasons) never enter the chain."""
    agent = services.ensure_agent("system:test", tenant, "support-bot")
    subject = "alice.liddell@example.com"
    rec = make_record(tenant.pk, agent.pk, subject=subject,
                      response=chat_response(rid="chatcmpl-7f3a"))
    ship_and_build(tmp_path / "spool", [rec])
    services.record_reward(make_member("steward", "s"), tenant, value=1.0,
                           response_id="chatcmpl-7f3a",
                           comment="Alice Liddell from Oxford was happy")
    make_trajectory(tenant, agent)
    stew, comp = make_member("steward", "stew"), make_member("compliance", "comp")
    ds = services.create_dataset(stew, tenant, name="d", description="Alice's calls")
    v = services.freeze_dataset_version(stew, ds)
    services.request_approval(stew, v)
    services.approve_version(comp, v, "Alice Liddell consented by phone")
    dump = json.dumps(list(AuditEvent.objects.values("actor", "action", "object_type",
                                                     "object_id", "payload")))
    assert "alice" not in dump.lower() and "oxford" not in dump.lower()
    assert AuditEvent.objects.filter(action="reward.recorded").exists()
    assert AuditEvent.objects.filter(action="dataset_version.approved").exists()
