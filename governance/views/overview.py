"""The overview page (live charts and counts, refreshed by htmx every 5 s) and the tenant
switcher.

What it shows, all for the last 24 hours in hourly buckets (one GROUP BY query each, never a
query per hour):
- calls captured per agent (Interaction.started_at), stacked per agent;
- capture lag: how long after a call its sanitized step was built — Step.created_at minus
  Step.started_at (a step's started_at is its call's start, copied from the interaction), p50
  and p95 per hour of the call;
- counts that ask for action: the sanitizer backlog (interactions captured, step not built yet),
  quarantined interactions, dataset versions waiting for approval and erasures not finished —
  each linking to the page that resolves it, where the person's role may open that page.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.db.models import Aggregate, Count, DurationField, F, Max, Min
from django.db.models.functions import Trunc
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme, urlencode
from django.views.decorators.http import require_POST

from governance.middleware import SESSION_KEY
from governance.models import (
    Agent,
    DatasetVersion,
    DeadLetter,
    ErasureRequest,
    Interaction,
    Step,
    Tenant,
    Trajectory,
)
from governance.views.common import can, console_view, proxy_base_url

HOURS = 24
# More agents than this and the chart folds the smallest into "other agents" (legible colours).
MAX_AGENT_SERIES = 8
# Dead letters listed on the page (the count is of all of them).
DEAD_LETTERS_SHOWN = 10


@require_POST
@login_required
def switch_tenant(request: HttpRequest) -> HttpResponse:
    wanted = request.POST.get("tenant")
    if not any(str(m.tenant_id) == wanted for m in request.memberships):
        raise Http404("no such tenant")
    request.session[SESSION_KEY] = int(wanted)
    # `next` comes from the form, so from whoever built the form: only a path on this host is
    # followed (`//evil.example` and `https://evil.example/` are not), else the overview.
    target = request.POST.get("next") or ""
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                           require_https=request.is_secure()):
        return redirect("overview")
    return redirect(target)


class Percentile(Aggregate):
    """PostgreSQL's percentile_cont(fraction) WITHIN GROUP (ORDER BY expr)."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    allow_distinct = False

    def __init__(self, expression: Any, fraction: float, **extra: Any) -> None:
        super().__init__(expression, fraction=float(fraction), **extra)


# --- the counts other pages own (their helpers when installed, the same rule here otherwise) --

def _pending_approvals(tenant: Tenant) -> int:
    try:
        from governance.views.approvals import pending_approvals_count
    except ImportError:
        return DatasetVersion.objects.for_tenant(tenant).filter(
            status=DatasetVersion.Status.PENDING_APPROVAL).count()
    return pending_approvals_count(tenant)


def _pending_erasures(tenant: Tenant) -> int:
    try:
        from governance.views.erasure import pending_erasures_count
    except ImportError:
        return ErasureRequest.objects.for_tenant(tenant).filter(
            status__in=[ErasureRequest.Status.PENDING, ErasureRequest.Status.RUNNING]).count()
    return pending_erasures_count(tenant)


def _href(name: str, query: dict[str, str] | None = None) -> str | None:
    try:
        url = reverse(name)
    except NoReverseMatch:  # a section not installed (yet)
        return None
    return f"{url}?{urlencode(query)}" if query else url


# --- the charts -------------------------------------------------------------------------------

def hour_buckets(now: datetime, hours: int = HOURS) -> list[datetime]:
    """The starts of the last `hours` hours, the current (partial) hour last."""
    top = timezone.localtime(now).replace(minute=0, second=0, microsecond=0)
    return [top - timedelta(hours=hours - 1 - i) for i in range(hours)]


def _label(hour: datetime) -> str:
    return timezone.localtime(hour).strftime("%H:00")


def calls_chart(tenant: Tenant, buckets: list[datetime]) -> dict[str, Any]:
    """Calls captured per agent per hour: one GROUP BY (hour, agent) query."""
    rows = (Interaction.objects.for_tenant(tenant).filter(started_at__gte=buckets[0])
            .annotate(hour=Trunc("started_at", "hour"))
            .values("hour", "agent__name").annotate(n=Count("id")).order_by())
    index = {b: i for i, b in enumerate(buckets)}
    series: dict[str, list[int]] = {}
    for row in rows:
        i = index.get(timezone.localtime(row["hour"]))
        if i is None:
            continue
        series.setdefault(row["agent__name"], [0] * len(buckets))[i] += row["n"]
    ranked = sorted(series.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    if len(ranked) > MAX_AGENT_SERIES:
        head, tail = ranked[:MAX_AGENT_SERIES - 1], ranked[MAX_AGENT_SERIES - 1:]
        other = [sum(values[i] for _, values in tail) for i in range(len(buckets))]
        ranked = [*head, (f"{len(tail)} other agents", other)]
    return {
        "type": "bar", "stacked": True,
        "labels": [_label(b) for b in buckets],
        "datasets": [{"label": name, "data": data} for name, data in ranked],
        "y_label": "calls", "x_label": f"hour ({timezone.get_current_timezone_name()})",
    }


def lag_chart(tenant: Tenant, buckets: list[datetime]) -> dict[str, Any]:
    """Capture lag per hour of the call: p50 and p95 of (step built - call started), seconds.
    One GROUP BY query over the steps of calls in the window."""
    lag = F("created_at") - F("started_at")
    rows = (Step.objects.for_tenant(tenant).filter(started_at__gte=buckets[0])
            .annotate(hour=Trunc("started_at", "hour"))
            .values("hour")
            .annotate(p50=Percentile(lag, 0.5, output_field=DurationField()),
                      p95=Percentile(lag, 0.95, output_field=DurationField()),
                      n=Count("id"))
            .order_by())
    index = {b: i for i, b in enumerate(buckets)}
    p50: list[float | None] = [None] * len(buckets)
    p95: list[float | None] = [None] * len(buckets)
    built = 0
    for row in rows:
        i = index.get(timezone.localtime(row["hour"]))
        if i is None:
            continue
        built += row["n"]
        p50[i] = _seconds(row["p50"])
        p95[i] = _seconds(row["p95"])
    return {
        "type": "line",
        "labels": [_label(b) for b in buckets],
        "datasets": [{"label": "p50", "data": p50, "spanGaps": True},
                     {"label": "p95", "data": p95, "spanGaps": True}],
        "y_label": "seconds from call to step", "x_label": "hour of the call",
        "built": built,
    }


def _seconds(value: timedelta | None) -> float | None:
    return None if value is None else round(max(value.total_seconds(), 0.0), 3)


# --- the page ---------------------------------------------------------------------------------

def overview_context(request: HttpRequest) -> dict[str, Any]:
    tenant = request.tenant
    now = timezone.now()
    interactions = Interaction.objects.for_tenant(tenant)
    backlog = interactions.filter(pending__state=Interaction.State.CAPTURED).aggregate(
        n=Count("id"), oldest=Min("started_at"))
    dead_letters = DeadLetter.objects.for_tenant(tenant)
    dead_letter_count = dead_letters.count()
    captured_anything = (backlog["n"] > 0
                         or Trajectory.objects.for_tenant(tenant).exists()
                         or interactions.exists() or dead_letter_count > 0)
    context: dict[str, Any] = {
        "captured_anything": captured_anything,
        "base_url": proxy_base_url(request),
        "refreshed_at": now,
    }
    if not captured_anything:
        context["agent_count"] = Agent.objects.for_tenant(tenant).count()
        return context

    buckets = hour_buckets(now)
    calls = calls_chart(tenant, buckets)
    lag = lag_chart(tenant, buckets)
    built = lag.pop("built")
    oldest = backlog["oldest"]
    actions = [
        {"label": "captured, step not built yet", "count": backlog["n"], "level": "warn",
         "href": _href("trajectories", {"status": "pending"}) if can(request,
                                                                     "read_trajectories")
         else None,
         "hint": (f"oldest waiting {_age(now - oldest)}" if oldest else "")},
        {"label": "quarantined", "count": interactions.filter(
            pending__state=Interaction.State.QUARANTINED).count(), "level": "bad",
         "href": _href("trajectories", {"status": "quarantined"}) if can(request,
                                                                         "read_trajectories")
         else None,
         "hint": "never training data; see the reason on the trajectory"},
        {"label": "records the shipper could not store", "count": dead_letter_count,
         "level": "bad", "href": "#dead-letters" if can(request, "read_trajectories") else None,
         "hint": "kept encrypted as dead letters; erasure removes a subject's"},
        {"label": "dataset versions awaiting approval", "count": _pending_approvals(tenant),
         "level": "warn", "href": _href("approvals") if can(request, "read_datasets") else None,
         "hint": "a compliance officer decides"},
        {"label": "erasure requests not finished", "count": _pending_erasures(tenant),
         "level": "warn", "href": _href("erasure") if can(request, "erase") else None,
         "hint": "pending or running"},
    ]
    calls_24h = sum(sum(d["data"]) for d in calls["datasets"])
    # Only asked when the chart is empty (a scan without a (tenant, started_at) index).
    last_call = None if calls_24h else interactions.aggregate(last=Max("started_at"))["last"]
    context.update({
        "calls_chart": calls,
        "lag_chart": lag,
        "calls_24h": calls_24h,
        "steps_24h": built,
        "agents_24h": len(calls["datasets"]),
        "trajectory_count": Trajectory.objects.for_tenant(tenant).count(),
        "agent_count": Agent.objects.for_tenant(tenant).count(),
        "last_call": last_call,
        "actions": actions,
        "dead_letter_count": dead_letter_count,
        # The newest few: ids, reason, segment and time only (the record stays sealed).
        "dead_letters": list(dead_letters.order_by("-created_at", "-pk")
                             .only("pk", "flow_id", "reason", "segment", "created_at",
                                   "record_ciphertext")[:DEAD_LETTERS_SHOWN])
        if dead_letter_count and can(request, "read_trajectories") else [],
        "recent": Trajectory.objects.for_tenant(tenant).select_related("agent")
        .order_by("-started_at")[:10] if can(request, "read_trajectories") else [],
    })
    return context


def _age(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds < 120:
        return f"{max(seconds, 0)} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h"


@console_view
def overview(request: HttpRequest) -> HttpResponse:
    context = overview_context(request)
    # htmx polls the stats region only; a full page otherwise (also on history restore).
    partial = request.htmx and not request.htmx.history_restore_request
    template = "console/_overview_stats.html" if partial else "console/overview.html"
    response = render(request, template, context)
    response["Vary"] = "HX-Request"
    return response

