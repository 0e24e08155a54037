"""Rewards that name no capture (issue 13.8). A reward is late-bound: it may arrive before the
trajectory or response it names (governance.services.record_reward accepts it unchecked and it
is joined when the capture is served). One that names an id nothing matches — a typo, the
wrong tenant's id, a capture that never came — would otherwise be invisible: this page lists
them to the people who post rewards (record_rewards), newest first, with how long each has
waited. Nothing is changed here; a reward that matches later drops off the list by itself."""

from __future__ import annotations

from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from governance.models import Reward, Step, Trajectory
from governance.views.common import console_view

SHOWN = 100


def unmatched_rewards(tenant) -> QuerySet:
    """The tenant's rewards whose trajectory id names no trajectory, or whose response id no
    step of the tenant carries (yet)."""
    trajectory = Trajectory.objects.for_tenant(tenant).filter(pk=OuterRef("trajectory_id"))
    response = Step.objects.for_tenant(tenant).filter(response_id=OuterRef("response_id"))
    return (Reward.objects.for_tenant(tenant)
            .filter((Q(trajectory_id__isnull=False) & ~Exists(trajectory))
                    | (Q(trajectory_id__isnull=True) & ~Q(response_id="") & ~Exists(response))))


@console_view(permission="record_rewards")
def unmatched_reward_list(request: HttpRequest) -> HttpResponse:
    qs = unmatched_rewards(request.tenant)
    rows = list(qs.select_related("created_by").order_by("-created_at", "-pk")[:SHOWN + 1])
    return render(request, "console/unmatched_rewards.html", {
        "rows": rows[:SHOWN], "more": len(rows) > SHOWN, "shown": SHOWN})
