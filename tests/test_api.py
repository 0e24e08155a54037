"""REST API /api/v1/: tenant scoping (owner, member, outsider), filters, cursor pagination,
late rewards, validation errors, authentication, OpenAPI."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import pytest
from rest_framework.test import APIClient

from governance.models import AuditEvent, Reward
from tests.pipeline import chat_response, make_record, ship_and_build


@pytest.fixture
def world(tenant, other_tenant, tmp_path):
    """Tenant acme: 3 trajectories of support-bot (one with session s-1), 1 of billing-bot;
    tenant globex: 1 trajectory."""
    from governance.services import ensure_agent

    support = ensure_agent("system:test", tenant, "support-bot")
    billing = ensure_agent("system:test", tenant, "billing-bot")
    foreign = ensure_agent("system:test", other_tenant, "support-bot")
    base = time.time() - 3600
    trajs = {name: str(uuid.uuid4()) for name in ("s1", "s2", "s3", "b1", "foreign")}
    records = [
        make_record(tenant.pk, support.pk, trajectory_id=trajs["s1"], session="s-1",
                    source="session", t=base, response=chat_response("a", rid="chatcmpl-s1a")),
        make_record(tenant.pk, support.pk, trajectory_id=trajs["s1"], session="s-1",
                    source="session", t=base + 5, response=chat_response("b")),
        make_record(tenant.pk, support.pk, trajectory_id=trajs["s2"], t=base + 600,
                    response=chat_response()),
        make_record(tenant.pk, support.pk, trajectory_id=trajs["s3"], t=base + 1200,
                    response=chat_response()),
        make_record(tenant.pk, billing.pk, trajectory_id=trajs["b1"], t=base + 1800,
                    consent="no-train", response=chat_response()),
        make_record(other_tenant.pk, foreign.pk, trajectory_id=trajs["foreign"], t=base + 60,
                    response=chat_response(rid="chatcmpl-foreign")),
    ]
    ship_and_build(tmp_path / "spool", records)
    return {"trajs": trajs, "base": base, "support": support, "billing": billing,
            "spool": tmp_path / "spool"}


@pytest.fixture
def owner(make_member, tenant, api_client_for):
    return api_client_for(make_member("admin", "owner"), tenant)


@pytest.fixture
def auditor(make_member, tenant, api_client_for):
    return api_client_for(make_member("auditor", "auditor"), tenant)


@pytest.fixture
def outsider(make_member, other_tenant, api_client_for):
    return api_client_for(make_member("admin", "outsider", on=other_tenant), other_tenant)


def ids(resp) -> list[str]:
    assert resp.status_code == 200, resp.content
    return [item["id"] for item in resp.json()["results"]]


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat()


def test_list_is_scoped_newest_first_with_summaries(world, owner, auditor, outsider):
    t = world["trajs"]
    expected = [t["b1"], t["s3"], t["s2"], t["s1"]]
    assert ids(owner.get("/api/v1/trajectories/")) == expected
    assert ids(auditor.get("/api/v1/trajectories/")) == expected
    assert ids(outsider.get("/api/v1/trajectories/")) == [t["foreign"]]
    item = owner.get("/api/v1/trajectories/").json()["results"][-1]
    assert item["agent"] == {"id": world["support"].pk, "name": "support-bot"}
    assert (item["session_id"], item["source"], item["step_count"], item["consent"]) == (
        "s-1", "session", 2, "train")
    assert set(item) == {"id", "agent", "session_id", "source", "started_at", "last_step_at",
                         "step_count", "status", "consent"}
    assert item["status"] == "complete"


def test_other_tenants_objects_answer_404(world, owner, outsider):
    foreign = world["trajs"]["foreign"]
    assert owner.get(f"/api/v1/trajectories/{foreign}/").status_code == 404
    assert owner.get(f"/api/v1/trajectories/{foreign}/rewards/").status_code == 404
    assert outsider.get(f"/api/v1/trajectories/{foreign}/").status_code == 200
    mine = world["trajs"]["s1"]
    assert outsider.get(f"/api/v1/trajectories/{mine}/").status_code == 404
    assert owner.get("/api/v1/trajectories/not-a-uuid/").status_code == 404
    # A reward of the other tenant is invisible too.
    created = outsider.post("/api/v1/rewards/", {"trajectory_id": foreign, "value": 1},
                            format="json")
    assert created.status_code == 201
    rid = created.json()["id"]
    assert owner.get(f"/api/v1/rewards/{rid}/").status_code == 404
    assert rid not in [r["id"] for r in owner.get("/api/v1/rewards/").json()["results"]]
    # Rewards naming a foreign response id never join across tenants.
    owner.post("/api/v1/rewards/", {"response_id": "chatcmpl-foreign", "value": 5},
               format="json")
    doc = outsider.get(f"/api/v1/trajectories/{foreign}/").json()
    assert [r["value"] for r in doc["rewards"]] == [1.0]


def test_filters(world, owner):
    t, base = world["trajs"], world["base"]
    url = "/api/v1/trajectories/"
    assert ids(owner.get(url, {"agent": "billing-bot"})) == [t["b1"]]
    assert ids(owner.get(url, {"agent": str(world["billing"].pk)})) == [t["b1"]]
    assert ids(owner.get(url, {"agent": "nobody"})) == []
    assert ids(owner.get(url, {"session": "s-1"})) == [t["s1"]]
    assert ids(owner.get(url, {"since": iso(base + 600)})) == [t["b1"], t["s3"], t["s2"]]
    assert ids(owner.get(url, {"until": iso(base + 600)})) == [t["s1"]]
    assert ids(owner.get(url, {"since": iso(base + 1), "until": iso(base + 1201),
                               "agent": "support-bot"})) == [t["s3"], t["s2"]]
    bad = owner.get(url, {"since": "yesterday"})
    assert bad.status_code == 400 and "since" in bad.json()
    bad = owner.get(url, {"since": iso(base + 10), "until": iso(base)})
    assert bad.status_code == 400 and "until" in bad.json()


def test_cursor_pagination_walks_every_trajectory_once(world, owner):
    seen: list[str] = []
    resp = owner.get("/api/v1/trajectories/", {"page_size": 1})
    pages = 0
    while True:
        body = resp.json()
        assert len(body["results"]) <= 1
        seen += [r["id"] for r in body["results"]]
        pages += 1
        if not body["next"]:
            break
        resp = owner.get(body["next"])
    t = world["trajs"]
    assert seen == [t["b1"], t["s3"], t["s2"], t["s1"]] and pages == 4
    assert body["previous"]


def test_reward_before_capture_is_attached_in_the_document(world, owner, tenant):
    late_traj = str(uuid.uuid4())
    r1 = owner.post("/api/v1/rewards/", {"response_id": "chatcmpl-late", "value": 0.75,
                                         "name": "judge", "final": False,
                                         "comment": "partial credit"}, format="json")
    r2 = owner.post("/api/v1/rewards/", {"trajectory_id": late_traj, "value": -1},
                    format="json")
    assert r1.status_code == 201 and r2.status_code == 201
    body = r1.json()
    assert (body["response_id"], body["value"], body["name"], body["final"], body["source"]) \
        == ("chatcmpl-late", 0.75, "judge", False, "api")
    assert owner.get(f"/api/v1/trajectories/{late_traj}/").status_code == 404  # not yet

    # The capture arrives later.
    agent = world["support"]
    rec = make_record(tenant.pk, agent.pk, trajectory_id=late_traj,
                      response=chat_response("late", rid="chatcmpl-late"))
    ship_and_build(world["spool"], [rec])
    doc = owner.get(f"/api/v1/trajectories/{late_traj}/").json()
    by_value = {r["value"]: r for r in doc["rewards"]}
    assert set(by_value) == {0.75, -1.0}
    assert by_value[0.75]["step_id"] == rec["step_id"] and by_value[0.75]["step_index"] == 0
    listed = owner.get(f"/api/v1/trajectories/{late_traj}/rewards/").json()
    assert sorted(r["value"] for r in listed) == [-1.0, 0.75]
    # Rewards are rows of their own; the audit log names them without the free-text comment.
    ev = AuditEvent.objects.filter(action="reward.recorded").order_by("seq").first()
    assert ev.payload["response_id"] == "chatcmpl-late" and "comment" not in ev.payload
    assert Reward.objects.get(pk=body["id"]).tenant_id == tenant.pk


def test_reward_list_filters(world, owner):
    s1 = world["trajs"]["s1"]
    owner.post("/api/v1/rewards/", {"trajectory_id": s1, "value": 1}, format="json")
    owner.post("/api/v1/rewards/", {"response_id": "chatcmpl-s1a", "value": 2}, format="json")
    owner.post("/api/v1/rewards/", {"response_id": "other", "value": 3}, format="json")
    values = lambda r: sorted(x["value"] for x in r.json()["results"])  # noqa: E731
    assert values(owner.get("/api/v1/rewards/")) == [1.0, 2.0, 3.0]
    assert values(owner.get("/api/v1/rewards/", {"trajectory_id": s1})) == [1.0]
    assert values(owner.get("/api/v1/rewards/", {"response_id": "chatcmpl-s1a"})) == [2.0]
    assert owner.get("/api/v1/rewards/", {"trajectory_id": "zzz"}).status_code == 400
    # The trajectory's rewards join by trajectory id and by its steps' response ids.
    joined = owner.get(f"/api/v1/trajectories/{s1}/rewards/").json()
    assert sorted(r["value"] for r in joined) == [1.0, 2.0]


@pytest.mark.parametrize("payload,fields", [
    ({"value": 1}, {"response_id", "trajectory_id"}),
    ({"value": 1, "response_id": "x", "trajectory_id": str(uuid.uuid4())},
     {"response_id", "trajectory_id"}),
    ({"response_id": "x"}, {"value"}),
    ({"response_id": "x", "value": "NaN"}, {"value"}),
    ({"response_id": "x", "value": "inf"}, {"value"}),
    ({"response_id": "x", "value": "high"}, {"value"}),
    ({"trajectory_id": "not-a-uuid", "value": 1}, {"trajectory_id"}),
    ({"response_id": "x" * 300, "value": 1}, {"response_id"}),
    ({"response_id": "x", "value": 1, "name": "n" * 65}, {"name"}),
])
def test_reward_validation_errors(owner, payload, fields):
    resp = owner.post("/api/v1/rewards/", payload, format="json")
    assert resp.status_code == 400
    assert fields <= set(resp.json()), resp.json()
    assert Reward.objects.count() == 0


def test_roles_and_authentication(world, auditor, make_member, tenant, api_client_for):
    payload = {"response_id": "chatcmpl-x", "value": 1}
    assert auditor.post("/api/v1/rewards/", payload, format="json").status_code == 403
    steward = api_client_for(make_member("steward", "stew"), tenant)
    assert steward.post("/api/v1/rewards/", payload, format="json").status_code == 201
    anon = APIClient()
    for url in ("/api/v1/trajectories/", f"/api/v1/trajectories/{world['trajs']['s1']}/",
                "/api/v1/rewards/"):
        assert anon.get(url).status_code == 401
    assert anon.post("/api/v1/rewards/", payload, format="json").status_code == 401
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Bearer stwt_not-a-real-token")
    assert bad.get("/api/v1/trajectories/").status_code == 401
    assert anon.get("/api/v1/atdp/schema/").status_code == 200  # public format description
    # The OpenAPI document maps every operation: a token's, like the API.
    schema = anon.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 401 and "detail" in schema.json()
    assert bad.get("/api/schema/").status_code == 401


def test_openapi_schema_lists_the_endpoints(owner):
    resp = owner.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert resp.status_code == 200
    paths = resp.json()["paths"]
    for p in ("/api/v1/trajectories/", "/api/v1/trajectories/{id}/",
              "/api/v1/trajectories/{id}/rewards/", "/api/v1/rewards/",
              "/api/v1/atdp/schema/"):
        assert p in paths
    params = {p["name"] for p in paths["/api/v1/trajectories/"]["get"]["parameters"]}
    assert {"agent", "session", "since", "until", "cursor"} <= params


def test_scoping_cannot_be_bypassed_by_a_subclass():
    from governance.api import TenantScopedViewSet
    from governance.models import Trajectory

    with pytest.raises(TypeError):
        class Leaky(TenantScopedViewSet):  # noqa: F841
            model = Trajectory

            def get_queryset(self):
                return Trajectory.objects.all()
    with pytest.raises(TypeError):
        class Leaky2(TenantScopedViewSet):  # noqa: F841
            queryset = Trajectory.objects.all()


def test_a_trajectory_whose_steps_are_not_built_yet_says_processing(
        tenant, make_member, api_client_for, client, tmp_path):
    """Issue 13.3: shipped, no step built yet (the worker is warming up or behind): REST list,
    the ATDP document and both console pages say "processing"; once built, "complete"; a call
    that cannot become a step, "quarantined"."""
    from governance.capture.shipper import ship_once
    from governance.models import Interaction
    from governance.services import ensure_agent
    from governance.tasks import build_steps
    from tests.pipeline import write_records

    agent = ensure_agent("system:test", tenant, "support-bot")
    traj, bad = str(uuid.uuid4()), str(uuid.uuid4())
    write_records(tmp_path, [
        make_record(tenant.pk, agent.pk, trajectory_id=traj, response=chat_response("hi")),
        make_record(tenant.pk, agent.pk, trajectory_id=bad, response=b"\x89PNG not json"),
    ])
    ship_once(tmp_path, enqueue=None)  # shipped; no worker has built anything yet
    user = make_member("steward", "stew")
    api = api_client_for(user, tenant)
    client.force_login(user)

    def statuses() -> dict[str, str]:
        listed = {t["id"]: t["status"] for t in api.get("/api/v1/trajectories/").json()["results"]}
        for tid in (traj, bad):
            assert api.get(f"/api/v1/trajectories/{tid}/").json()["status"] == listed[tid]
        return listed

    assert statuses() == {traj: "processing", bad: "processing"}
    doc = api.get(f"/api/v1/trajectories/{traj}/").json()
    assert doc["steps"] == [] and doc["governance"]["quarantined"][0]["state"] == "captured"
    listing = client.get("/trajectories/").content.decode()
    assert listing.count(">processing ×1</span>") == 2
    page = client.get(f"/trajectories/{traj}/").content.decode()
    assert 'id="capture-status">processing' in page and "1 call waiting" in page

    build_steps(list(Interaction.objects.values_list("pk", flat=True)))
    assert statuses() == {traj: "complete", bad: "quarantined"}
    listing = client.get("/trajectories/").content.decode()
    assert ">processing ×" not in listing and ">quarantined ×1</span>" in listing
    assert 'id="capture-status"' not in client.get(f"/trajectories/{traj}/").content.decode()
