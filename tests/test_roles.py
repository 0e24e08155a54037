"""Roles: the one permission table, every REST action bound to a permission of it, and each
endpoint tried by a member of every role, the owner and an outsider."""

from __future__ import annotations

import pytest
from rest_framework import permissions as drf_permissions

from governance import services
from governance.api_urls import router
from governance.models import Role
from governance.permissions import (
    PERMISSIONS,
    ROLE_PERMISSIONS,
    HasTenantPermission,
    permission_for,
    permission_table_md,
    role_has,
)
from tests.govdata import make_trajectory

ROLES = [r.value for r in Role]


def test_table_covers_every_role_and_separates_duties():
    assert set(ROLE_PERMISSIONS) == set(ROLES)
    holders = {p: {r for r in ROLES if role_has(r, p)} for p in PERMISSIONS}
    assert holders["approve"] == {"compliance"}
    assert holders["read_raw_payloads"] == {"compliance"}
    assert holders["record_rewards"] == {"admin", "steward"}  # as before the table
    assert holders["manage_keys"] == holders["manage_members"] == {"admin"}
    assert holders["erase"] == {"admin", "compliance"}
    assert holders["launch_training"] == {"admin", "steward"}
    assert holders["manage_evolution"] == {"admin", "steward"}
    assert holders["rollback_policy"] == {"admin", "steward", "compliance"}
    # Whoever may request approval may not approve, and the auditor only reads.
    assert not holders["request_approval"] & holders["approve"]
    assert {p for p in PERMISSIONS if role_has("auditor", p)} == {
        "read_trajectories", "read_datasets", "read_training", "read_retention", "read_audit",
        "verify_audit"}
    assert all(role_has(r, "read_trajectories") for r in ROLES)
    assert not role_has("", "read_trajectories") and not role_has("owner", "approve")
    with pytest.raises(KeyError):
        role_has("admin", "no_such_permission")
    md = permission_table_md()
    assert md.count("\n") == len(PERMISSIONS) + 1
    assert all(f"`{p}`" in md for p in PERMISSIONS) and all(r in md for r in ROLES)


def _route_actions():
    """(viewset, action name, extra kwargs) of every routed action."""
    for _prefix, viewset, _basename in router.registry:
        for route in router.get_routes(viewset):
            for action_name in route.mapping.values():
                if hasattr(viewset, action_name):
                    yield viewset, action_name, route.initkwargs


def test_every_routed_action_needs_a_known_permission():
    seen = 0
    for viewset, action_name, initkwargs in _route_actions():
        view = viewset(**initkwargs)
        view.action = action_name
        needed = permission_for(view)
        assert needed in PERMISSIONS, f"{viewset.__name__}.{action_name}: {needed!r}"
        assert HasTenantPermission in viewset.permission_classes
        seen += 1
    assert seen >= 20


def test_an_action_without_a_permission_is_refused():
    class FakeMembership:
        role = "admin"

    class FakeRequest:
        tenant = object()
        membership = FakeMembership()

    class View:
        action = "list"

    assert HasTenantPermission().has_permission(FakeRequest(), View()) is False
    View.required_permission = "read_audit"
    assert HasTenantPermission().has_permission(FakeRequest(), View()) is True
    View.action_permissions = {"list": "approve"}
    assert HasTenantPermission().has_permission(FakeRequest(), View()) is False
    FakeRequest.membership = None
    View.action_permissions = {}
    assert HasTenantPermission().has_permission(FakeRequest(), View()) is False
    assert issubclass(HasTenantPermission, drf_permissions.BasePermission)


@pytest.fixture(autouse=True)
def fast_password_hasher(settings):
    # Seven members per test: the production PBKDF2 cost would dominate the run time.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def world(tenant, other_tenant, make_member, api_client_for):
    agent = services.ensure_agent("system:test", tenant, "bot")
    traj = make_trajectory(tenant, agent)
    stew = make_member("steward", "stew-seed")
    ds = services.create_dataset(stew, tenant, name="seed")
    version = services.freeze_dataset_version(stew, ds)
    policy = services.set_retention_policy("system:test", tenant, "public", steps_days=10,
                                           raw_days=1, findings_days=10, audit_days=100)
    clients = {role: api_client_for(make_member(role, f"{role}-x"), tenant) for role in ROLES}
    clients["owner"] = api_client_for(make_member("admin", "owner"), tenant)
    clients["outsider"] = api_client_for(make_member("admin", "outsider", on=other_tenant),
                                         other_tenant)
    return {"traj": traj, "ds": ds, "version": version, "policy": policy,
            "clients": clients}


# (method, url template, body, permission). Writes that succeed change state, so each one is
# tried by a role that lacks the permission (403) and by one that has it.
ENDPOINTS = [
    ("get", "/api/v1/trajectories/", None, "read_trajectories"),
    ("get", "/api/v1/trajectories/{traj}/", None, "read_trajectories"),
    ("get", "/api/v1/rewards/", None, "read_trajectories"),
    ("post", "/api/v1/rewards/", {"response_id": "r", "value": 1}, "record_rewards"),
    ("get", "/api/v1/datasets/", None, "read_datasets"),
    ("get", "/api/v1/datasets/{ds}/", None, "read_datasets"),
    ("get", "/api/v1/datasets/{ds}/preview/", None, "read_datasets"),
    ("post", "/api/v1/datasets/", {"name": "n-{role}"}, "manage_datasets"),
    ("post", "/api/v1/datasets/{ds}/freeze/", None, "manage_datasets"),
    ("get", "/api/v1/dataset-versions/", None, "read_datasets"),
    ("get", "/api/v1/dataset-versions/{version}/", None, "read_datasets"),
    ("get", "/api/v1/retention-policies/", None, "read_retention"),
    ("get", "/api/v1/retention-policies/{policy}/", None, "read_retention"),
    ("get", "/api/v1/retention-policies/effective/", None, "read_retention"),
    ("patch", "/api/v1/retention-policies/{policy}/", {"steps_days": 20}, "manage_retention"),
    ("get", "/api/v1/audit/", None, "read_audit"),
    ("get", "/api/v1/audit/verify/", None, "verify_audit"),
]


@pytest.mark.parametrize("method,template,body,permission", ENDPOINTS,
                         ids=[f"{m} {t}" for m, t, _, _ in ENDPOINTS])
def test_every_role_owner_and_outsider(world, method, template, body, permission):
    ids = {"traj": world["traj"].pk, "ds": world["ds"].pk, "version": world["version"].pk,
           "policy": world["policy"].pk}
    url = template.format(**ids)
    for who, client in world["clients"].items():
        data = {k: (v.format(role=who) if isinstance(v, str) else v)
                for k, v in (body or {}).items()}
        resp = getattr(client, method)(url, data or None, format="json")
        if who == "outsider":
            # Another tenant's object is not found; a list of its own is fine (and empty).
            expected = {404} if "{" in template else {200, 201}
        elif role_has("admin" if who == "owner" else who, permission):
            expected = {200, 201}
        else:
            expected = {403}
        assert resp.status_code in expected, (who, method, url, resp.status_code,
                                              resp.content[:300])


def test_approval_endpoints_by_role(world):
    c, version = world["clients"], world["version"]
    url = f"/api/v1/dataset-versions/{version.pk}/"
    for who in ("compliance", "auditor", "outsider"):
        expected = 404 if who == "outsider" else 403
        assert c[who].post(url + "request-approval/").status_code == expected
    assert c["steward"].post(url + "request-approval/").status_code == 200
    for who in ("steward", "admin", "owner", "auditor"):
        assert c[who].post(url + "approve/", {"reason": "x"}, format="json"
                           ).status_code == 403
        assert c[who].post(url + "reject/", {"reason": "x"}, format="json").status_code == 403
    # The outsider is no compliance officer anywhere: refused before any lookup, so the
    # answer is the same for an id that exists elsewhere and for one that does not.
    assert c["outsider"].post(url + "approve/", {"reason": "x"}, format="json"
                              ).status_code == 403
    assert c["outsider"].post("/api/v1/dataset-versions/999999/approve/", {"reason": "x"},
                              format="json").status_code == 403
    assert c["compliance"].post(url + "reject/", {"reason": "too small"}, format="json"
                                ).json()["status"] == "rejected"
