"""Trajectory search and the conversation view of one trajectory."""

from __future__ import annotations

from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from governance.models import Agent, Interaction, Step, Trajectory
from governance.views.common import console_view, proxy_base_url


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
