"""Console tenant selection, and the per-request tenant transaction.

A logged-in person acts in one tenant at a time (their session's choice among their
memberships): sets request.tenant / request.membership / request.memberships for console views.
REST requests get theirs from the API token instead (governance/auth.py).

Every request that reaches a view runs in ONE transaction whose row-level security tenant is
request.tenant (governance.tenancy.request_scope): the console's choice here, switched to the
API token's tenant by ApiTokenAuthentication; no tenant -> the database shows no tenant rows.
Because it wraps every view, no view can forget it. A 5xx response rolls the transaction back.
(A StreamingHttpResponse that reads the database while streaming would run after the
transaction: there is none today; such a view must open its own tenant_context.)
"""

from __future__ import annotations

from django.db import transaction

from governance.models import Membership, Tenant
from governance.tenancy import request_scope, user_memberships

SESSION_KEY = "steward_tenant_id"

_MEMBERSHIP_FIELDS = ["id", "user_id", "tenant_id", "role", "created_at"]
_TENANT_FIELDS = ["id", "slug", "name", "created_at"]


def memberships_of(user) -> list[Membership]:
    """The user's memberships in every tenant, ordered by tenant slug, with their tenants.
    Read through the SECURITY DEFINER function steward_user_memberships: no tenant is chosen
    yet, so row-level security would show none of them."""
    out = []
    for row in user_memberships(user.pk):
        m = Membership.from_db("default", _MEMBERSHIP_FIELDS,
                               [row[f] for f in _MEMBERSHIP_FIELDS])
        m.user = user
        m.tenant = Tenant.from_db("default", _TENANT_FIELDS,
                                  [row["tenant_id"], row["tenant_slug"], row["tenant_name"],
                                   row["tenant_created_at"]])
        out.append(m)
    return out


class TenantMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request.tenant = None
        request.membership = None
        request.memberships = []
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            memberships = memberships_of(user)
            request.memberships = memberships
            chosen = request.session.get(SESSION_KEY)
            current = next((m for m in memberships if m.tenant_id == chosen), None)
            current = current or (memberships[0] if memberships else None)
            if current is not None:
                request.tenant = current.tenant
                request.membership = current
        with request_scope(request.tenant):
            response = self.get_response(request)
            if response.status_code >= 500:
                transaction.set_rollback(True)
        return response
