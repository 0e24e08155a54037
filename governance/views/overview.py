"""The overview page (live stats, refreshed by htmx) and the tenant switcher."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.decorators import login_required
from django.db.models import Count, Max
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from governance.middleware import SESSION_KEY
from governance.models import Agent, Interaction, Step, Trajectory
from governance.views.common import console_view, proxy_base_url


@require_POST
@login_required
def switch_tenant(request: HttpRequest) -> HttpResponse:
    wanted = request.POST.get("tenant")
    if not any(str(m.tenant_id) == wanted for m in request.memberships):
        raise Http404("no such tenant")
    request.session[SESSION_KEY] = int(wanted)
    return redirect(request.POST.get("next") or "overview")


@console_view
def overview(request: HttpRequest) -> HttpResponse:
    tenant = request.tenant
    since = timezone.now() - timedelta(hours=24)
    per_agent = (
        Interaction.objects.for_tenant(tenant).filter(started_at__gte=since)
        .values("agent__name").annotate(calls=Count("id"), last=Max("started_at"))
        .order_by("-calls")
    )
    interactions = Interaction.objects.for_tenant(tenant)
    context = {
        "per_agent": list(per_agent),
        "trajectory_count": Trajectory.objects.for_tenant(tenant).count(),
        "step_count": Step.objects.for_tenant(tenant).count(),
        "backlog": interactions.filter(state=Interaction.State.CAPTURED).count(),
        "quarantined": interactions.filter(state=Interaction.State.QUARANTINED).count(),
        "agent_count": Agent.objects.for_tenant(tenant).count(),
        "recent": Trajectory.objects.for_tenant(tenant).select_related("agent")
        .order_by("-last_step_at")[:10],
        "base_url": proxy_base_url(request),
    }
    template = "console/_overview_stats.html" if request.htmx else "console/overview.html"
    return render(request, template, context)
