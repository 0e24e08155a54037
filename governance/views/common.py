"""What every console view shares: the login + tenant + permission decorator, the navigation
table (what a person sees is what their role allows — governance.permissions decides), and
small helpers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse

from governance.permissions import member_can


def console_view(view=None, *, permission: str | None = None):
    """Login required, a tenant to act in, and (when named) a permission of the person's role
    in that tenant. A person without any membership gets a page that says so; a member whose
    role lacks the permission gets 403 with the reason (the navigation never links there)."""

    def decorate(func):
        @login_required
        @wraps(func)
        def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if request.tenant is None:
                return render(request, "console/no_tenant.html", status=403)
            if permission is not None and not member_can(request.membership, permission):
                raise PermissionDenied(missing_permission(request, permission))
            return func(request, *args, **kwargs)

        wrapper.console_permission = permission  # the nav test reads it
        return wrapper

    return decorate(view) if view is not None else decorate


def missing_permission(request: HttpRequest, permission: str) -> str:
    """The reason a 403 page shows (templates/403.html): the person's role, the tenant and the
    permission that role lacks."""
    role = request.membership.get_role_display() if request.membership else "no role"
    return (f"Your role in {request.tenant.name}, {role}, may not do this: it needs the "
            f"{permission} permission.")


def can(request: HttpRequest, permission: str) -> bool:
    return member_can(getattr(request, "membership", None), permission)


def proxy_base_url(request: HttpRequest) -> str:
    host = request.get_host().split(":")[0]
    return f"http://{host}:{settings.STEWARD_PROXY_PORT}/v1"


@dataclass(frozen=True)
class NavItem:
    label: str
    url_name: str
    permission: str | None          # None: every member
    also_current: tuple[str, ...] = ()   # detail pages that highlight this entry


# The console's sections in the order of the day's work. A section whose page does not exist
# (yet) raises in tests/test_console_nav.py, not here.
NAV: tuple[NavItem, ...] = (
    NavItem("Overview", "overview", None),
    NavItem("Trajectories", "trajectories", "read_trajectories", ("trajectory",)),
    NavItem("Datasets", "datasets", "read_datasets", ("dataset", "dataset-version")),
    NavItem("Approvals", "approvals", "read_datasets", ("approval",)),
    NavItem("Erasure", "erasure", "erase", ("erasure-request",)),
    NavItem("Training", "training", "read_training", ("training-job",)),
    NavItem("Checkpoints", "checkpoints", "read_training", ("checkpoint",)),
    NavItem("Evolution", "evolution", "read_training", ("candidate",)),
    NavItem("Audit", "audit", "read_audit", ()),
    NavItem("Keys", "keys", "manage_keys", ()),
    NavItem("Settings", "settings", "read_retention", ()),
)


def nav_for(request: HttpRequest) -> list[dict[str, Any]]:
    membership = getattr(request, "membership", None)
    if membership is None:
        return []
    match = getattr(request, "resolver_match", None)
    current = match.url_name if match else None
    items = []
    for item in NAV:
        if item.permission and not member_can(membership, item.permission):
            continue
        try:
            href = reverse(item.url_name)
        except NoReverseMatch:
            continue  # a section not installed; tests/test_console_nav.py requires all
        items.append({"label": item.label, "href": href,
                      "current": current == item.url_name or current in item.also_current})
    return items


def console_nav(request: HttpRequest) -> dict[str, Any]:
    """Template context processor: `console_nav` for base.html."""
    if not getattr(request, "user", None) or not request.user.is_authenticated:
        return {"console_nav": []}
    return {"console_nav": nav_for(request)}
