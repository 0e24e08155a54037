"""Datasets, frozen versions and four-eyes approval: eligibility (never no-train, quarantined,
unsanitized, empty), filters, the content hash and sample, the approval flow over REST with
every role and an outsider, the server-side four-eyes refusal, invalidation."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from governance import services
from governance.datasets import content_hash, version_content_hash
from governance.models import (
    Approval,
    AuditEvent,
    Dataset,
    DatasetVersion,
    DatasetVersionMember,
    Step,
)
from tests.govdata import make_trajectory


@pytest.fixture
def agents(tenant, other_tenant):
    return {
        "support": services.ensure_agent("system:test", tenant, "support-bot"),
        "billing": services.ensure_agent("system:test", tenant, "billing-bot"),
        "foreign": services.ensure_agent("system:test", other_tenant, "support-bot"),
    }


def test_eligibility_never_includes_no_train_quarantined_unsanitized_or_empty(tenant, agents):
    a = agents["support"]
    good = make_trajectory(tenant, a)
    make_trajectory(tenant, a, consent="no-train")
    make_trajectory(tenant, a, step_consent="no-train")  # one consent flag on the steps only
    make_trajectory(tenant, a, sanitized=False)
    make_trajectory(tenant, a, steps=2, state="quarantined")  # one step, one quarantined call
    make_trajectory(tenant, a, steps=2, state="captured")  # a call not built yet
    make_trajectory(tenant, a, steps=0)
    make_trajectory(tenant, a, classification="confidential")
    make_trajectory(agents["foreign"].tenant, agents["foreign"])  # another tenant's
    ds = services.create_dataset("system:test", tenant, name="all")
    assert services.preview_dataset_count(ds) == 1
    version = services.freeze_dataset_version("system:test", ds)
    assert list(version.members.values_list("trajectory_id", flat=True)) == [good.pk]

    # Half sanitized is not sanitized.
    mixed = make_trajectory(tenant, a, steps=2)
    Step.objects.filter(pk=Step.objects.filter(trajectory=mixed).first().pk).update(
        training_eligible=False)
    assert services.preview_dataset_count(ds) == 1

    # A dataset that admits confidential data takes the confidential trajectory too.
    ds2 = services.create_dataset("system:test", tenant, name="conf",
                                  classification="confidential")
    assert services.preview_dataset_count(ds2) == 2


def test_filters_agents_time_and_reward(tenant, agents):
    now = timezone.now()
    s_old = make_trajectory(tenant, agents["support"], started=now - timedelta(days=10),
                            response_ids=["chatcmpl-old", ""])
    s_new = make_trajectory(tenant, agents["support"], started=now - timedelta(days=1))
    b_new = make_trajectory(tenant, agents["billing"], started=now - timedelta(days=1))

    def count(**kw):
        return services.preview_dataset_count(Dataset(tenant=tenant, name="x", **kw))

    assert count() == 3
    assert count(agent_ids=[agents["billing"].pk]) == 1
    assert count(since=now - timedelta(days=2)) == 2
    assert count(until=now - timedelta(days=2)) == 1
    # Rewards: by trajectory id or by a step's response id; the latest final one counts.
    services.record_reward("system:test", tenant, value=0.2, trajectory_id=s_new.pk,
                           name="judge")
    services.record_reward("system:test", tenant, value=0.9, trajectory_id=s_new.pk,
                           name="judge")
    services.record_reward("system:test", tenant, value=0.1, trajectory_id=s_new.pk,
                           name="judge", final=False)  # provisional: ignored
    services.record_reward("system:test", tenant, value=0.7, response_id="chatcmpl-old",
                           name="judge")
    services.record_reward("system:test", tenant, value=1.0, trajectory_id=b_new.pk,
                           name="other")
    assert count(reward_name="judge", reward_min=0.5) == 2
    assert count(reward_name="judge", reward_min=0.8) == 1
    assert count(reward_name="judge", reward_max=0.8) == 1
    assert count(reward_name="judge", reward_min=0.0, reward_max=1.0) == 2  # b_new has none
    ds = services.create_dataset("system:test", tenant, name="judged",
                                 reward_name="judge", reward_min=0.8)
    v = services.freeze_dataset_version("system:test", ds)
    assert [str(t) for t in v.members.values_list("trajectory_id", flat=True)] == [str(s_new.pk)]
    assert s_old.pk != s_new.pk


def test_freeze_hash_sample_numbering_and_pinning(tenant, agents):
    trajs = [make_trajectory(tenant, agents["support"], steps=3) for _ in range(25)]
    ds = services.create_dataset("system:steward", tenant, name="big")
    v1 = services.freeze_dataset_version("system:steward", ds)
    assert (v1.number, v1.size, v1.step_count, v1.status) == (1, 25, 75, "draft")
    steps = Step.objects.filter(trajectory__in=trajs).values_list(
        "trajectory_id", "id", "sanitizer_version")
    assert v1.content_hash == content_hash([t.pk for t in trajs], steps)
    assert len(v1.sample_ids) == 20 and set(v1.sample_ids) <= {str(t.pk) for t in trajs}
    assert v1.filter["classification"] == "internal"
    ev = AuditEvent.objects.get(action="dataset_version.frozen", object_id=str(v1.pk))
    assert ev.payload["content_hash"] == v1.content_hash and ev.payload["size"] == 25

    # Same content: same hash and the same sample; numbering goes on.
    v2 = services.freeze_dataset_version("system:steward", ds)
    assert (v2.number, v2.content_hash, v2.sample_ids) == (2, v1.content_hash, v1.sample_ids)

    # A session that goes on after the freeze does not change the frozen version.
    more = make_trajectory(tenant, agents["support"], steps=1)
    Step.objects.filter(trajectory=more).update(trajectory=trajs[0])
    assert version_content_hash(v1) == (v1.content_hash, 75)
    v3 = services.freeze_dataset_version("system:steward", ds)
    assert v3.content_hash != v1.content_hash and v3.step_count == 76

    # Nothing eligible: a clear refusal, nothing written.
    empty = services.create_dataset("system:steward", tenant, name="none",
                                    agent_ids=[agents["billing"].pk])
    with pytest.raises(services.ServiceError, match="no eligible trajectories"):
        services.freeze_dataset_version("system:steward", empty)
    assert not DatasetVersion.objects.filter(dataset=empty).exists()


def test_rest_flow_with_four_eyes(tenant, agents, people):
    users, c = people
    make_trajectory(tenant, agents["support"])
    make_trajectory(tenant, agents["billing"])
    r = c["steward"].post("/api/v1/datasets/", {
        "name": "support Q3", "agent_ids": [agents["support"].pk],
        "description": "only the support bot"}, format="json")
    assert r.status_code == 201, r.content
    ds_id = r.json()["id"]
    assert c["auditor"].get(f"/api/v1/datasets/{ds_id}/preview/").json() == {"count": 1}
    r = c["steward"].post(f"/api/v1/datasets/{ds_id}/freeze/")
    assert r.status_code == 201, r.content
    v = r.json()
    assert (v["status"], v["size"], v["number"], v["approval"]) == ("draft", 1, 1, None)
    vid = v["id"]
    detail = c["compliance"].get(f"/api/v1/dataset-versions/{vid}/").json()
    assert [s["id"] for s in detail["sample"]] == v["sample_ids"]
    assert detail["sample"][0]["agent"]["name"] == "support-bot"

    # Approving a draft: not yet requested.
    r = c["compliance"].post(f"/api/v1/dataset-versions/{vid}/approve/", {"reason": "ok"},
                             format="json")
    assert r.status_code == 409 and "pending approval" in r.json()["detail"]
    # Roles without `request_approval` / `approve`.
    for name in ("auditor", "compliance"):
        assert c[name].post(f"/api/v1/dataset-versions/{vid}/request-approval/"
                            ).status_code == 403
    assert c["steward"].post(f"/api/v1/dataset-versions/{vid}/request-approval/"
                             ).json()["status"] == "pending_approval"
    assert c["steward"].post(f"/api/v1/dataset-versions/{vid}/request-approval/"
                             ).status_code == 409
    for name in ("steward", "admin", "auditor"):
        r = c[name].post(f"/api/v1/dataset-versions/{vid}/approve/", {"reason": "mine"},
                         format="json")
        assert r.status_code == 403, name
    # A reason is required.
    r = c["compliance"].post(f"/api/v1/dataset-versions/{vid}/approve/", {"reason": "  "},
                             format="json")
    assert r.status_code == 400 and "reason" in r.json()
    r = c["compliance"].post(f"/api/v1/dataset-versions/{vid}/approve/",
                             {"reason": "checked the sample; Bob Jones agreed"}, format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["status"] == "approved"
    assert body["approval"]["decision"] == "approve"
    assert body["approval"]["decided_by"] == users["compliance"].pk
    assert c["compliance2"].post(f"/api/v1/dataset-versions/{vid}/reject/", {"reason": "no"},
                                 format="json").status_code == 409
    ev = AuditEvent.objects.get(action="dataset_version.approved")
    assert "Bob" not in str(ev.payload) and len(ev.payload["reason_sha256"]) == 64
    listed = c["auditor"].get("/api/v1/dataset-versions/", {"status": "approved"}).json()
    assert [x["id"] for x in listed["results"]] == [vid]
    assert c["auditor"].get("/api/v1/dataset-versions/", {"dataset": 999999}
                            ).json()["results"] == []


def test_four_eyes_is_enforced_in_the_service(tenant, agents, make_member):
    make_trajectory(tenant, agents["support"])
    stew = make_member("steward", "stew")
    ds = services.create_dataset(stew, tenant, name="d")
    v = services.freeze_dataset_version(stew, ds)
    services.request_approval(stew, v)
    # The requester is later made a compliance officer: still never their own approver.
    make_member("compliance", "stew")
    with pytest.raises(services.ServiceForbidden, match="four eyes"):
        services.approve_version(stew, v, "looks fine to me")
    with pytest.raises(services.ServiceForbidden, match="four eyes"):
        services.reject_version(stew, v, "changed my mind")
    # Whoever froze it neither (a compliance officer freezing through the service).
    comp = make_member("compliance", "comp")
    v2 = services.freeze_dataset_version(comp, ds)
    services.request_approval(make_member("steward", "stew2"), v2)
    with pytest.raises(services.ServiceForbidden, match="four eyes"):
        services.approve_version(comp, v2, "mine")
    # A system actor never decides; a steward's role does not allow it.
    with pytest.raises(services.ServiceForbidden):
        services.approve_version("system:test", v, "auto")
    with pytest.raises(services.ServiceForbidden, match="compliance officer"):
        services.approve_version(make_member("steward", "stew3"), v, "ok")
    assert not Approval.objects.exists()
    approval = services.reject_version(comp, v, "sample shows unredacted names")
    assert approval.decision == "reject"
    v.refresh_from_db()
    assert v.status == "rejected"


def test_approval_refuses_drifted_content_and_invalidation(tenant, agents, make_member):
    t1 = make_trajectory(tenant, agents["support"])
    t2 = make_trajectory(tenant, agents["support"])
    stew, comp = make_member("steward", "stew"), make_member("compliance", "comp")
    ds = services.create_dataset(stew, tenant, name="d")
    v = services.freeze_dataset_version(stew, ds)
    services.request_approval(stew, v)
    # A step of a member disappears behind the service's back (as a superuser could).
    with connection.cursor() as cur:
        cur.execute("DELETE FROM governance_step WHERE id = %s",
                    [Step.objects.filter(trajectory=t1).values_list("pk", flat=True)[0]])
    with pytest.raises(services.ServiceConflict, match="content changed"):
        services.approve_version(comp, v, "ok")

    v2 = services.freeze_dataset_version(stew, ds)
    services.request_approval(stew, v2)
    services.approve_version(comp, v2, "ok")
    v3 = services.freeze_dataset_version(stew, ds)
    services.request_approval(stew, v3)
    services.reject_version(comp, v3, "no")
    other = services.create_dataset(stew, tenant, name="other")
    v4 = services.freeze_dataset_version(stew, other)
    assert DatasetVersionMember.objects.filter(version=v4).count() == 2

    done = services.invalidate_versions_containing("system:erasure", tenant, [t2.pk],
                                                   "erasure request 7")
    assert sorted(done) == sorted([v.pk, v2.pk, v4.pk])  # the rejected one stays rejected
    statuses = dict(DatasetVersion.objects.values_list("pk", "status"))
    assert statuses[v2.pk] == "invalidated" and statuses[v3.pk] == "rejected"
    v2.refresh_from_db()
    assert v2.invalidated_reason == "erasure request 7" and v2.invalidated_at
    ev = AuditEvent.objects.filter(action="dataset_version.invalidated",
                                   object_id=str(v2.pk)).get()
    assert ev.payload["was"] == "approved" and ev.actor == "system:erasure"
    # Scoped: another tenant's call invalidates nothing here.
    assert services.invalidate_versions_containing("system:x", agents["foreign"].tenant,
                                                   [t1.pk], "x") == []


def test_validation_and_outsider(tenant, agents, people):
    _, c = people
    make_trajectory(tenant, agents["support"])
    foreign_agent = agents["foreign"].pk
    r = c["steward"].post("/api/v1/datasets/", {"name": "x", "agent_ids": [foreign_agent]},
                          format="json")
    assert r.status_code == 400 and "unknown agent" in str(r.json())
    r = c["steward"].post("/api/v1/datasets/", {"name": "x", "reward_min": 0.5},
                          format="json")
    assert r.status_code == 400 and "reward_name" in str(r.json())
    r = c["steward"].post("/api/v1/datasets/", {"name": "x", "classification": "secret"},
                          format="json")
    assert r.status_code == 400 and "classification" in r.json()
    r = c["steward"].post("/api/v1/datasets/", {"name": "x", "since": "2026-02-01T00:00:00Z",
                                                "until": "2026-01-01T00:00:00Z"},
                          format="json")
    assert r.status_code == 400
    assert c["auditor"].post("/api/v1/datasets/", {"name": "x"}, format="json"
                             ).status_code == 403
    assert c["compliance"].post("/api/v1/datasets/", {"name": "x"}, format="json"
                                ).status_code == 403
    r = c["admin"].post("/api/v1/datasets/", {"name": "x"}, format="json")
    assert r.status_code == 201
    ds_id = r.json()["id"]
    assert c["steward"].post("/api/v1/datasets/", {"name": "x"}, format="json"
                             ).status_code == 409
    vid = c["steward"].post(f"/api/v1/datasets/{ds_id}/freeze/").json()["id"]
    c["steward"].post(f"/api/v1/dataset-versions/{vid}/request-approval/")

    out = c["outsider"]
    assert out.get("/api/v1/datasets/").json()["results"] == []
    assert out.get("/api/v1/dataset-versions/").json()["results"] == []
    assert out.get(f"/api/v1/datasets/{ds_id}/").status_code == 404
    assert out.get(f"/api/v1/datasets/{ds_id}/preview/").status_code == 404
    assert out.post(f"/api/v1/datasets/{ds_id}/freeze/").status_code == 404
    assert out.get(f"/api/v1/dataset-versions/{vid}/").status_code == 404
    assert out.post(f"/api/v1/dataset-versions/{vid}/request-approval/").status_code == 404
    # The outsider is a compliance officer elsewhere: still a 404 here.
    from governance.services import ensure_member

    ensure_member("system:test", agents["foreign"].tenant, "outsider", "compliance")
    assert out.post(f"/api/v1/dataset-versions/{vid}/approve/", {"reason": "x"},
                    format="json").status_code == 404
    assert DatasetVersion.objects.get(pk=vid).status == "pending_approval"
