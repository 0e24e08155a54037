"""Console views (server-rendered, htmx). Each view parses, authorizes through `console_view`,
reads through the tenant-scoped manager and renders."""

from __future__ import annotations

from datetime import timedelta
from functools import wraps

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Count, Max
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from governance.middleware import SESSION_KEY
from governance.models import Agent, Interaction, Step, Trajectory


def console_view(view):
    """Login required, and a tenant to act in; a person without any membership gets a page
    that says so instead of an error."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if request.tenant is None:
            return render(request, "console/no_tenant.html", status=403)
        return view(request, *args, **kwargs)

    return wrapper


def proxy_base_url(request: HttpRequest) -> str:
    host = request.get_host().split(":")[0]
    return f"http://{host}:{settings.STEWARD_PROXY_PORT}/v1"


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


@console_view
def trajectory_list(request: HttpRequest) -> HttpResponse:
    qs = (Trajectory.objects.for_tenant(request.tenant).select_related("agent")
          .order_by("-started_at"))
    agent = request.GET.get("agent", "").strip()
    session = request.GET.get("session", "").strip()
    if agent:
        qs = qs.filter(agent__name=agent)
    if session:
        qs = qs.filter(session_id=session)
    page = Paginator(qs, 50).get_page(request.GET.get("page"))
    context = {
        "page": page,
        "agent": agent,
        "session": session,
        "agents": Agent.objects.for_tenant(request.tenant).order_by("name"),
        "base_url": proxy_base_url(request),
    }
    return render(request, "console/trajectories.html", context)


@console_view
def trajectory_detail(request: HttpRequest, trajectory_id) -> HttpResponse:
    trajectory = (Trajectory.objects.for_tenant(request.tenant).select_related("agent")
                  .filter(pk=trajectory_id).first())
    if trajectory is None:
        raise Http404("no such trajectory")
    steps = Step.objects.for_tenant(request.tenant).filter(trajectory=trajectory) \
        .order_by("started_at", "id")
    pending = Interaction.objects.for_tenant(request.tenant).filter(
        trajectory=trajectory, state=Interaction.State.CAPTURED).count()
    return render(request, "console/trajectory.html",
                  {"trajectory": trajectory, "steps": steps, "pending": pending})
