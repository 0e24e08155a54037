"""Roles and what they may do: ONE table (`ROLE_PERMISSIONS`), used by the REST API
(`HasTenantPermission`), the services that enforce rules server-side (four eyes) and the console.

A viewset names the permission an action needs:
- `required_permission = "read_trajectories"` on the class (every action), and/or
- `action_permissions = {"create": "record_rewards"}` (per standard action), and/or
- `@action(..., required_permission="approve")` on an extra action.
An action without a resolvable permission is refused (fail closed).

Separation of duties: the admin runs the tenant (keys, members, retention) and may define
datasets, but neither the admin nor the steward may approve a dataset version — only a
compliance officer, who is never its requester. Raw (unsanitized) payloads are readable by the
compliance officer only, and every such read is audited.
"""

from __future__ import annotations

from typing import Any

from rest_framework import permissions
from rest_framework.request import Request

from governance.models import Role

# name -> what it allows (the README's table is rendered from this by `permission_table_md`).
PERMISSIONS: dict[str, str] = {
    "read_trajectories": "read sanitized trajectories, steps and rewards",
    "read_raw_payloads": "decrypt and read a raw, unsanitized captured payload (audited)",
    "record_rewards": "post late-bound rewards",
    "read_datasets": "list datasets, frozen versions, samples and approvals",
    "manage_datasets": "define datasets and freeze versions",
    "request_approval": "submit a frozen version for approval",
    "approve": "approve or reject a version — never one they froze or requested",
    "erase": "file GDPR Art. 17 erasure requests and read their certificates",
    "read_training": "see training jobs, their curves and checkpoints with lineage",
    "launch_training": "start, cancel and resume training jobs on approved versions",
    "manage_evolution": "start candidates, promote and roll back policies",
    "rollback_policy": "roll back a promoted or canary policy",
    "manage_keys": "create and revoke proxy keys and API tokens",
    "manage_members": "add members and change their roles",
    "read_retention": "read retention policies",
    "manage_retention": "create, change and delete retention policies",
    "manage_sanitizer": "change the tenant's sanitizer policy (operator per entity type)",
    "read_audit": "list the tenant's audit events",
    "verify_audit": "verify the audit hash chain",
}

_ALL = frozenset(PERMISSIONS)

ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    Role.ADMIN: _ALL - {"approve", "read_raw_payloads"},
    Role.STEWARD: frozenset({
        "read_trajectories", "record_rewards", "read_datasets", "manage_datasets",
        "request_approval", "read_training", "launch_training", "read_retention",
        "manage_evolution", "rollback_policy",
    }),
    Role.COMPLIANCE: frozenset({
        "read_trajectories", "read_raw_payloads", "read_datasets", "approve", "erase",
        "read_training", "read_retention", "manage_retention", "manage_sanitizer",
        "read_audit", "verify_audit", "rollback_policy",
    }),
    Role.AUDITOR: frozenset({
        "read_trajectories", "read_datasets", "read_training", "read_retention", "read_audit",
        "verify_audit",
    }),
}

assert all(p <= _ALL for p in ROLE_PERMISSIONS.values()), "unknown permission in the table"


def role_has(role: str | None, permission: str) -> bool:
    if permission not in PERMISSIONS:
        raise KeyError(f"unknown permission {permission!r}")
    return permission in ROLE_PERMISSIONS.get(role or "", frozenset())


def member_can(membership: Any, permission: str) -> bool:
    """True when this Membership's role grants `permission` (False for no membership)."""
    return membership is not None and role_has(membership.role, permission)


def permission_for(view: Any) -> str | None:
    """The permission the view's current action needs (None: none declared -> refused)."""
    action = getattr(view, "action", None)
    mapping = getattr(view, "action_permissions", None) or {}
    if action in mapping:
        return mapping[action]
    return getattr(view, "required_permission", None)


class HasTenantPermission(permissions.BasePermission):
    """Authenticated through an API token (so `request.tenant` and `request.membership` are
    set) and the member's role grants the permission the action needs."""

    message = "Your role in this tenant may not do this."

    def has_permission(self, request: Request, view: Any) -> bool:
        membership = getattr(request, "membership", None)
        if getattr(request, "tenant", None) is None or membership is None:
            return False
        needed = permission_for(view)
        if needed is None:
            return False
        return role_has(membership.role, needed)


def permission_table_md() -> str:
    """The role/permission table as markdown (the README's copy)."""
    roles = list(ROLE_PERMISSIONS)
    head = "| permission | allows | " + " | ".join(str(r) for r in roles) + " |"
    sep = "| --- | --- |" + " :-: |" * len(roles)
    rows = [
        f"| `{p}` | {desc} | " + " | ".join("✓" if p in ROLE_PERMISSIONS[r] else ""
                                            for r in roles) + " |"
        for p, desc in PERMISSIONS.items()
    ]
    return "\n".join([head, sep, *rows])
