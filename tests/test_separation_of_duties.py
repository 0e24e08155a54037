"""Separation of duties (issue 12, item 1): an API token is issued only to the person it acts
as (an admin may revoke anyone's), and four eyes compares people, not tokens. The attack this
holds: an admin mints a token for a compliance officer, then reads raw payloads and approves a
version the admin froze, with the audit log blaming the officer."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from governance import services
from governance.models import ApiToken, Approval, AuditEvent, DatasetVersion
from tests.govdata import make_trajectory


def _rest(secret: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_the_service_issues_a_token_only_to_oneself(tenant, make_member):
    admin = make_member("admin", "owner")
    officer = make_member("compliance", "comp")
    with pytest.raises(services.ServiceForbidden, match="only to yourself"):
        services.create_api_token(admin, tenant, officer)
    assert not ApiToken.objects.filter(user=officer).exists()
    assert not AuditEvent.objects.filter(action="api_token.created").exists()
    # Oneself: yes, and the audit event names the person who asked.
    mine = services.create_api_token(officer, tenant, officer)
    assert mine.record.user == officer
    assert AuditEvent.objects.get(action="api_token.created").actor == f"user:{officer.pk}"
    # The operator's bootstrap tools (a system actor, `manage.py create_api_token`) still may.
    assert services.create_api_token("system:cli", tenant, admin).record.user == admin


def test_an_admin_may_revoke_anyones_token(tenant, make_member):
    admin = make_member("admin", "owner")
    officer = make_member("compliance", "comp")
    theirs = services.create_api_token(officer, tenant, officer)
    assert _rest(theirs.secret).get("/api/v1/trajectories/").status_code == 200
    services.revoke_api_token(admin, theirs.record)
    assert _rest(theirs.secret).get("/api/v1/trajectories/").status_code == 401
    event = AuditEvent.objects.get(action="api_token.revoked")
    assert event.actor == f"user:{admin.pk}" and event.payload["user"] == officer.pk


@pytest.fixture
def pending_version_of_the_admin(tenant, make_member):
    """A version the admin froze and submitted over REST with the admin's own token."""
    agent = services.ensure_agent("system:test", tenant, "support-bot")
    make_trajectory(tenant, agent)
    admin = make_member("admin", "owner")
    rest = _rest(services.create_api_token(admin, tenant, admin).secret)
    r = rest.post("/api/v1/datasets/", {"name": "mine"}, format="json")
    assert r.status_code == 201, r.content
    r = rest.post(f"/api/v1/datasets/{r.json()['id']}/freeze/")
    assert r.status_code == 201, r.content
    vid = r.json()["id"]
    r = rest.post(f"/api/v1/dataset-versions/{vid}/request-approval/")
    assert r.json()["status"] == "pending_approval", r.content
    return admin, rest, vid


def test_admin_cannot_mint_an_officers_token_to_approve_their_own_version(
        client, tenant, make_member, pending_version_of_the_admin):
    admin, admin_rest, vid = pending_version_of_the_admin
    officer = make_member("compliance", "comp")
    # The console refuses to mint the officer's token for the admin ...
    client.force_login(admin)
    page = client.post("/keys/api-tokens/", {"user": str(officer.pk)}, follow=True)
    assert "only to yourself" in page.content.decode()
    assert not ApiToken.objects.filter(user=officer).exists()
    # ... so all the admin holds is their own token, which may not decide.
    r = admin_rest.post(f"/api/v1/dataset-versions/{vid}/approve/", {"reason": "fine"},
                        format="json")
    assert r.status_code == 403
    assert DatasetVersion.objects.get(pk=vid).status == "pending_approval"
    assert not Approval.objects.exists()
    # The officer, with a token of their own, decides — and is the one the approval names.
    officer_rest = _rest(services.create_api_token(officer, tenant, officer).secret)
    r = officer_rest.post(f"/api/v1/dataset-versions/{vid}/approve/",
                          {"reason": "read the sample"}, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["approval"]["decided_by"] == officer.pk


def test_four_eyes_compares_the_person_behind_every_token(tenant, make_member,
                                                          pending_version_of_the_admin):
    """The admin who froze and requested is later made a compliance officer: a fresh token of
    their own (another token than the one that froze) still never approves their version."""
    admin, _, vid = pending_version_of_the_admin
    make_member("compliance", "owner")  # same person, new role
    fresh = _rest(services.create_api_token(admin, tenant, admin).secret)
    for decision in ("approve", "reject"):
        r = fresh.post(f"/api/v1/dataset-versions/{vid}/{decision}/", {"reason": "mine"},
                       format="json")
        assert r.status_code == 403 and "four eyes" in r.json()["detail"], r.content
    assert DatasetVersion.objects.get(pk=vid).status == "pending_approval"
