"""Console pages: every role of the tenant sees them, an outsider never sees another tenant's
data, an anonymous visitor is sent to the login page."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

from governance.models import Agent, Trajectory

ROLES = ["admin", "steward", "compliance", "auditor"]
PAGES = ["/", "/trajectories/"]


@pytest.fixture
def trajectory(tenant):
    agent = Agent.objects.create(tenant=tenant, name="billing-bot")
    now = timezone.now()
    return Trajectory.objects.create(id=uuid.uuid4(), tenant=tenant, agent=agent,
                                     session_id="sess-1", started_at=now, last_step_at=now,
                                     step_count=0)


@pytest.mark.parametrize("page", PAGES)
def test_anonymous_is_sent_to_login(client, db, page):
    response = client.get(page)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


@pytest.mark.parametrize("role", ROLES)
def test_every_role_sees_its_tenant(client, make_member, trajectory, role):
    client.force_login(make_member(role))
    for page in PAGES + [f"/trajectories/{trajectory.id}/"]:
        response = client.get(page)
        assert response.status_code == 200, page
    body = client.get("/trajectories/").content.decode()
    assert str(trajectory.id) in body
    assert "billing-bot" in body


def test_outsider_sees_nothing_of_the_tenant(client, make_member, other_tenant, trajectory):
    outsider = make_member("admin", "outsider", on=other_tenant)
    client.force_login(outsider)
    assert str(trajectory.id) not in client.get("/trajectories/").content.decode()
    assert client.get(f"/trajectories/{trajectory.id}/").status_code == 404
    # Switching to a tenant they are not a member of is refused the same way.
    response = client.post("/tenant/switch/", {"tenant": trajectory.tenant_id})
    assert response.status_code == 404


def test_user_without_membership_gets_an_explanation(client, django_user_model, db):
    user = django_user_model.objects.create_user("lonely", password="x" * 12)
    client.force_login(user)
    response = client.get("/")
    assert response.status_code == 403
    assert b"not a member of any tenant" in response.content


def test_empty_overview_tells_how_to_point_an_agent(client, make_member):
    client.force_login(make_member("steward"))
    body = client.get("/").content.decode()
    assert "Nothing captured yet" in body
    assert "base_url=" in body and "create_proxy_key --tenant acme" in body


def test_login_with_password(client, make_member):
    make_member("compliance", "olivia")
    response = client.post("/login/", {"username": "olivia",
                                       "password": "correct horse battery staple"})
    assert response.status_code == 302
    assert client.get("/").status_code == 200
    client.logout()
    bad = client.post("/login/", {"username": "olivia", "password": "wrong"})
    assert b"didn&#x27;t match" in bad.content or b"didn't match" in bad.content


def test_tenant_switcher_changes_scope(client, make_member, other_tenant, trajectory):
    from governance.services import ensure_member

    user = make_member("admin", "multi")
    ensure_member("system:test", other_tenant, "multi", "auditor")
    client.force_login(user)
    assert str(trajectory.id) in client.get("/trajectories/").content.decode()
    client.post("/tenant/switch/", {"tenant": other_tenant.pk})
    assert str(trajectory.id) not in client.get("/trajectories/").content.decode()


@pytest.mark.parametrize("target", ["//evil.example/", "https://evil.example/x",
                                    "///evil.example", "/\\evil.example", "javascript:alert(1)",
                                    "http://testserver.evil.example/"])
def test_tenant_switch_never_redirects_off_site(client, make_member, other_tenant, target):
    from governance.services import ensure_member

    user = make_member("admin", "multi")
    ensure_member("system:test", other_tenant, "multi", "auditor")
    client.force_login(user)
    response = client.post("/tenant/switch/", {"tenant": other_tenant.pk, "next": target})
    assert response.status_code == 302 and response["Location"] == "/", response["Location"]
    # A path of this site is still followed.
    response = client.post("/tenant/switch/", {"tenant": other_tenant.pk,
                                               "next": "/trajectories/?page=2"})
    assert response["Location"] == "/trajectories/?page=2"


def test_anonymous_cannot_post_a_raw_read(client, db, trajectory):
    url = f"/trajectories/{trajectory.id}/steps/{uuid.uuid4()}/raw/"
    response = client.post(url, {"reason": "x"})
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.parametrize("role", ROLES)
def test_trajectory_detail_shows_its_governance_to_every_role(client, make_member, trajectory,
                                                               role):
    client.force_login(make_member(role))
    body = client.get(f"/trajectories/{trajectory.id}/").content.decode()
    assert "<h2>Governance</h2>" in body and "billing-bot" in body
    assert "No steps built yet" in body and "No rewards yet" in body
    assert ("Read raw payload" in body) is False  # no step, so no raw form either
