"""Retention: defaults and per-classification policies, bounded audited batches, idempotence,
per-tenant scope, rewards and dataset versions of purged trajectories, the REST API."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from governance import services
from governance.models import AuditEvent, Interaction, Reward, Step, Trajectory
from governance.retention import purge_expired
from tests.govdata import make_trajectory

DAY = timedelta(days=1)


@pytest.fixture
def agent(tenant):
    return services.ensure_agent("system:test", tenant, "support-bot")


def raw_left(traj) -> int:
    return Interaction.objects.filter(trajectory=traj, raw_ciphertext__isnull=False).count()


def test_defaults_raw_payloads_then_steps(tenant, agent, settings):
    settings.STEWARD_RAW_RETENTION_DAYS = 7
    now = timezone.now()
    fresh = make_trajectory(tenant, agent, started=now - 2 * DAY)
    shipped_expiry = make_trajectory(tenant, agent, started=now - 2 * DAY,
                                     raw_expires_at=now - timedelta(minutes=1))
    week_old = make_trajectory(tenant, agent, started=now - 8 * DAY)
    year_old = make_trajectory(tenant, agent, started=now - 400 * DAY)
    services.record_reward("system:test", tenant, value=1.0, trajectory_id=year_old.pk)
    services.record_reward("system:test", tenant, value=1.0, trajectory_id=fresh.pk)

    result = purge_expired(tenant.pk, now=now)[tenant.pk]
    assert result["complete"] == 1 and result["batches"] == 1
    assert (result["raw_payloads"], result["steps"], result["interactions"],
            result["trajectories"], result["rewards"]) == (6, 2, 2, 1, 1)
    assert raw_left(fresh) == 2 and raw_left(shipped_expiry) == 0 and raw_left(week_old) == 0
    # The metadata and the sanitized steps stay until the steps' retention.
    assert Step.objects.filter(trajectory=week_old).count() == 2
    assert not Trajectory.objects.filter(pk=year_old.pk).exists()
    assert not Interaction.objects.filter(trajectory_id=year_old.pk).exists()
    assert list(Reward.objects.values_list("trajectory_id", flat=True)) == [fresh.pk]
    ev = AuditEvent.objects.get(action="retention.purged")
    assert (ev.actor, ev.tenant_id, ev.payload["steps"]) == ("system:retention", tenant.pk, 2)
    assert ev.payload["policies"]["*"]["source"] == "default"

    # Idempotent: a second run finds nothing and writes nothing.
    events = AuditEvent.objects.count()
    again = purge_expired(tenant.pk, now=now)[tenant.pk]
    assert again == {"batches": 0, "complete": 1}
    assert AuditEvent.objects.count() == events


def test_policies_per_classification(tenant, agent, make_member):
    now = timezone.now()
    admin = make_member("admin", "owner")
    services.set_retention_policy(admin, tenant, "restricted", steps_days=30, raw_days=1,
                                  findings_days=30, audit_days=3650)
    services.set_retention_policy(admin, tenant, "*", steps_days=90, raw_days=3,
                                  findings_days=90, audit_days=3650)
    restricted_40 = make_trajectory(tenant, agent, classification="restricted",
                                    started=now - 40 * DAY)
    restricted_20 = make_trajectory(tenant, agent, classification="restricted",
                                    started=now - 20 * DAY)
    internal_40 = make_trajectory(tenant, agent, started=now - 40 * DAY)
    internal_100 = make_trajectory(tenant, agent, started=now - 100 * DAY)
    internal_2 = make_trajectory(tenant, agent, started=now - 2 * DAY)
    odd_label = make_trajectory(tenant, agent, classification="secret-x",
                                started=now - 100 * DAY)
    purge_expired(tenant.pk, now=now)
    left = set(Trajectory.objects.values_list("pk", flat=True))
    assert left == {restricted_20.pk, internal_40.pk, internal_2.pk}
    assert raw_left(restricted_20) == 0 and raw_left(internal_40) == 0
    assert raw_left(internal_2) == 2
    assert not {restricted_40.pk, internal_100.pk, odd_label.pk} & left


def test_bounded_batches_time_budget_and_partial_trajectories(tenant, agent):
    now = timezone.now()
    for _ in range(5):
        make_trajectory(tenant, agent, steps=1, started=now - 400 * DAY, raw=None)
    # A long session: its first step expired, its second is recent.
    partial = make_trajectory(tenant, agent, steps=2, started=now - 400 * DAY, raw=None)
    recent = Step.objects.filter(trajectory=partial).order_by("started_at").last()
    Step.objects.filter(pk=recent.pk).update(started_at=now - DAY)
    Trajectory.objects.filter(pk=partial.pk).update(last_step_at=now - DAY)

    # No time left after the first batch: it stops there, the rest is for the next run.
    first = purge_expired(tenant.pk, now=now, batch_size=2, time_budget_s=0)[tenant.pk]
    assert (first["batches"], first["steps"], first["complete"]) == (1, 2, 0)
    rest = purge_expired(tenant.pk, now=now, batch_size=2)[tenant.pk]
    assert (rest["batches"], rest["steps"], rest["complete"]) == (2, 4, 1)
    assert AuditEvent.objects.filter(action="retention.purged").count() == 3
    assert all(ev.payload["steps"] <= 2 for ev in AuditEvent.objects.filter(
        action="retention.purged"))
    # The trajectory that kept a recent step stays, with its summary updated.
    assert list(Trajectory.objects.values_list("pk", "step_count")) == [(partial.pk, 1)]


def test_scoped_to_one_tenant_and_all_tenants(tenant, other_tenant, agent):
    now = timezone.now()
    foreign_agent = services.ensure_agent("system:test", other_tenant, "bot")
    mine = make_trajectory(tenant, agent, started=now - 400 * DAY)
    theirs = make_trajectory(other_tenant, foreign_agent, started=now - 400 * DAY)
    purge_expired(other_tenant.pk, now=now)
    assert Trajectory.objects.filter(pk=mine.pk).exists()
    assert not Trajectory.objects.filter(pk=theirs.pk).exists()
    assert AuditEvent.objects.get(action="retention.purged").tenant_id == other_tenant.pk
    from governance.tasks import purge_expired as task

    out = task.apply().get()  # the Celery task, run locally: every tenant
    assert out[str(tenant.pk)]["trajectories"] == 1
    assert not Trajectory.objects.exists()


def test_purge_invalidates_dataset_versions(tenant, agent, make_member):
    now = timezone.now()
    old = make_trajectory(tenant, agent, started=now - 400 * DAY)
    make_trajectory(tenant, agent, started=now - DAY)
    stew, comp = make_member("steward", "stew"), make_member("compliance", "comp")
    ds = services.create_dataset(stew, tenant, name="d")
    v = services.freeze_dataset_version(stew, ds)
    services.request_approval(stew, v)
    services.approve_version(comp, v, "fine")
    result = purge_expired(tenant.pk, now=now)[tenant.pk]
    assert result["invalidated_versions"] == 1
    v.refresh_from_db()
    assert v.status == "invalidated" and v.invalidated_reason.startswith("retention")
    assert not Trajectory.objects.filter(pk=old.pk).exists()


@pytest.fixture
def clients(make_member, tenant, other_tenant, api_client_for):
    out = {role: api_client_for(make_member(role, f"{role}-1"), tenant)
           for role in ("admin", "steward", "compliance", "auditor")}
    out["outsider"] = api_client_for(make_member("admin", "outsider", on=other_tenant),
                                     other_tenant)
    return out


def test_rest_retention_policies(tenant, clients, settings):
    settings.STEWARD_RAW_RETENTION_DAYS = 7
    url = "/api/v1/retention-policies/"
    body = {"classification": "restricted", "steps_days": 30, "raw_days": 1,
            "findings_days": 30, "audit_days": 3650}
    for role in ("steward", "auditor"):
        assert clients[role].post(url, body, format="json").status_code == 403
    r = clients["compliance"].post(url, body, format="json")
    assert r.status_code == 201, r.content
    pid = r.json()["id"]
    assert clients["admin"].post(url, body, format="json").status_code == 409
    for bad, field in (({"audit_days": 10}, "audit_days"), ({"raw_days": 60}, "raw_days"),
                       ({"steps_days": 0}, "steps_days"),
                       ({"classification": "secret"}, "classification")):
        r = clients["admin"].post(url, {**body, "classification": "*", **bad}, format="json")
        assert r.status_code == 400 and field in str(r.json()), (bad, r.json())
    for role in ("steward", "auditor", "compliance", "admin"):
        listed = clients[role].get(url)
        assert listed.status_code == 200 and [p["id"] for p in listed.json()] == [pid]
    r = clients["admin"].patch(f"{url}{pid}/", {"steps_days": 60, "findings_days": 60},
                               format="json")
    assert r.status_code == 200 and r.json()["steps_days"] == 60, r.content
    assert clients["admin"].patch(f"{url}{pid}/", {"classification": "public"},
                                  format="json").status_code == 400
    eff = {p["classification"]: p for p in clients["auditor"].get(f"{url}effective/").json()}
    assert eff["restricted"]["steps_days"] == 60 and eff["restricted"]["source"] == \
        f"policy:{pid}"
    assert (eff["internal"]["raw_days"], eff["internal"]["steps_days"],
            eff["internal"]["source"]) == (7, 365, "default")
    assert eff["*"]["audit_days"] == 3650

    out = clients["outsider"]
    assert out.get(url).json() == []
    assert out.get(f"{url}{pid}/").status_code == 404
    assert out.delete(f"{url}{pid}/").status_code == 404
    assert clients["steward"].delete(f"{url}{pid}/").status_code == 403
    assert clients["admin"].delete(f"{url}{pid}/").status_code == 204
    actions = list(AuditEvent.objects.filter(object_type="retention_policy")
                   .values_list("action", flat=True))
    assert actions == ["retention_policy.created", "retention_policy.updated",
                       "retention_policy.deleted"]
