"""Console tenant selection: a logged-in person acts in one tenant at a time (their session's
choice among their memberships). Sets request.tenant / request.membership for console views;
REST requests get theirs from the API token instead (governance/auth.py)."""

from __future__ import annotations

from governance.models import Membership

SESSION_KEY = "steward_tenant_id"


class TenantMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request.tenant = None
        request.membership = None
        request.memberships = []
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            memberships = list(
                Membership.objects.filter(user=user).select_related("tenant")
                .order_by("tenant__slug")
            )
            request.memberships = memberships
            chosen = request.session.get(SESSION_KEY)
            current = next((m for m in memberships if m.tenant_id == chosen), None)
            current = current or (memberships[0] if memberships else None)
            if current is not None:
                request.tenant = current.tenant
                request.membership = current
        return self.get_response(request)
