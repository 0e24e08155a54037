"""The tenant's audit log: filters, keyset pagination by `seq` (newest first; no COUNT over a
large log), and the hash chain's verification.

Verification (one chain over every tenant, governance.audit) runs only when a `verify_audit`
holder presses a button: "Verify chain" walks the events since the last verified checkpoint
(verify_new_events: cheap, whatever the log's size), "Full walk" every event from the first
(verify_full_chain, what `manage.py verify_audit` runs). The verdict is kept in the session and
shown with the time it was taken and this tenant's event count (never other tenants')."""

from __future__ import annotations

import json
from datetime import date, datetime, time, timedelta
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth import get_user_model
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from governance.audit import verify_full_chain, verify_new_events
from governance.models import AuditEvent, Membership
from governance.views.common import can, console_view

PAGE_SIZE = 50
FILTERS = ("action", "actor", "object_type", "object_id", "since", "until", "people")
VERIFY_SESSION_KEY = "steward_audit_verify"
# What the action box suggests (families; "x." matches every action starting with it).
ACTION_FAMILIES = (
    "agent.", "api_token.", "capture.", "checkpoint.", "dataset.", "dataset_version.",
    "erasure.", "membership.", "proxy_key.", "raw.", "retention.", "retention_policy.",
    "reward.", "sanitizer_policy.", "tenant.", "training_job.", "user.",
)


def _parse_date(value: str, label: str, errors: list[str]) -> date | None:
    if not value:
        return None
    try:
        return date.fromisoformat(value)
    except ValueError:
        errors.append(f"{label} must be a date like 2026-01-31 (ignored)")
        return None


def _filtered(request: HttpRequest) -> tuple[Any, dict[str, str], list[str]]:
    """The tenant's events narrowed by the query string; (queryset, filters, errors)."""
    f = {name: request.GET.get(name, "").strip() for name in FILTERS}
    errors: list[str] = []
    qs = AuditEvent.objects.for_tenant(request.tenant)
    if f["action"]:
        # A value ending in "." is a prefix (a family of actions, like the REST filter); a
        # family named without its dot ("erasure") is that family too, or the exact action.
        action = f["action"]
        qs = (qs.filter(action__startswith=action) if action.endswith(".")
              else qs.filter(Q(action=action) | Q(action__startswith=action + ".")))
    if f["actor"]:
        actor = _actor_value(request, f["actor"])
        if actor is None:
            errors.append(f"Actor: no member of {request.tenant.name} is called "
                          f"“{f['actor']}” (a username, user:<id> or system:<name>)")
            qs = qs.none()
        else:
            qs = qs.filter(actor=actor)
    if f["people"]:
        # What people did, without the system events (shipper, sanitizer, beat) around it.
        qs = qs.filter(actor__startswith="user:")
    for field in ("object_type", "object_id"):
        if f[field]:
            qs = qs.filter(**{field: f[field]})
    tz = timezone.get_current_timezone()
    since = _parse_date(f["since"], "From", errors)
    until = _parse_date(f["until"], "To", errors)
    if since:
        qs = qs.filter(created_at__gte=datetime.combine(since, time.min, tz))
    if until:  # inclusive: the whole "to" day
        qs = qs.filter(created_at__lt=datetime.combine(until + timedelta(days=1), time.min, tz))
    return qs, f, errors


def _actor_value(request: HttpRequest, value: str) -> str | None:
    """The `actor` column's value for what was typed: "user:3" and "system:erasure" as they
    are, a username as its member's "user:<id>" (None: no member of this tenant has it)."""
    if ":" in value:
        return value
    pk = (Membership.objects.for_tenant(request.tenant).filter(user__username=value)
          .values_list("user_id", flat=True).first())
    return f"user:{pk}" if pk is not None else None


def _actor_names(events: list[AuditEvent]) -> dict[str, str]:
    """"user:<id>" -> username for the events on the page (one query)."""
    ids = {int(e.actor[5:]) for e in events if e.actor.startswith("user:")
           and e.actor[5:].isdigit()}
    if not ids:
        return {}
    users = get_user_model().objects.filter(pk__in=ids).values_list("pk", "username")
    return {f"user:{pk}": name for pk, name in users}


def _verify_state(request: HttpRequest) -> dict[str, Any] | None:
    state = request.session.get(VERIFY_SESSION_KEY)
    if not state:
        return None
    return {**state, "at": datetime.fromisoformat(state["at"])}


@console_view(permission="read_audit")
def audit_log(request: HttpRequest) -> HttpResponse:
    qs, filters, errors = _filtered(request)
    for error in errors:
        messages.error(request, error)
    before = request.GET.get("before", "")
    if before.isdigit():
        qs = qs.filter(seq__lt=int(before))
    # Keyset page: one row more than shown tells whether an older page exists.
    events = list(qs.order_by("-seq")[:PAGE_SIZE + 1])
    has_older = len(events) > PAGE_SIZE
    events = events[:PAGE_SIZE]
    names = _actor_names(events)
    rows = [{"e": e, "actor_name": names.get(e.actor, ""),
             "payload": json.dumps(e.payload, sort_keys=True, ensure_ascii=False)}
            for e in events]
    query = urlencode({k: v for k, v in filters.items() if v})
    members = (Membership.objects.for_tenant(request.tenant).select_related("user")
               .order_by("user__username"))
    context = {
        "rows": rows,
        "filters": filters,
        "filtered": any(filters.values()),
        "query": query,
        "before": before if before.isdigit() else "",
        "older_before": events[-1].seq if has_older and events else None,
        "members": members,
        "action_families": ACTION_FAMILIES,
        "can_verify": can(request, "verify_audit"),
        "verify": _verify_state(request),
    }
    return render(request, "console/audit.html", context)


@console_view(permission="verify_audit")
@require_POST
def audit_verify(request: HttpRequest) -> HttpResponse:
    """Verify the new events (or, with `full`, the whole chain) now; the verdict is kept in
    the session. It is global (one chain over every tenant) but says nothing about other
    tenants: the count shown is this tenant's events."""
    full = request.POST.get("full") == "1"
    result = verify_full_chain() if full else verify_new_events()
    ok, bad_seq, reason = result.ok, result.first_bad_seq, result.reason
    state = {"ok": ok, "first_bad_seq": bad_seq, "reason": reason,
             "events": AuditEvent.objects.for_tenant(request.tenant).count(),
             "checked": result.checked, "from_seq": result.from_seq, "full": result.full,
             "at": timezone.now().isoformat()}
    request.session[VERIFY_SESSION_KEY] = state
    if request.htmx:
        return render(request, "console/audit.html#verify",
                      {"verify": _verify_state(request), "can_verify": True})
    if ok:
        messages.success(request, f"Audit chain verified: {result.checked} new event"
                         f"{'s' if result.checked != 1 else ''} checked, intact.")
    else:
        messages.error(request, f"Audit chain broken at seq {bad_seq}: {reason}.")
    return redirect("audit")
