"""Approvals: the compliance queue (versions waiting first, then decided ones) and the review
page of one version — its size, classification and agent mix, the sanitizer's findings, a
sample to read, what approving would allow — with approve / reject and a required reason.

Four eyes is the service's rule (governance.services._decide): whoever froze a version or asked
for its approval never decides on it. The page shows that before anyone tries (the buttons are
disabled, with the reason), and a POST that tries anyway gets the service's refusal as a
message, never a 500."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import Case, Count, F, IntegerField, QuerySet, Sum, Value, When
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from governance.capture.conversation import materialize_observations
from governance.datasets import pinned_rewards, review_sample
from governance.models import (
    DatasetVersion,
    DatasetVersionMember,
    Finding,
    Membership,
    Role,
    Step,
    Trajectory,
)
from governance.permissions import role_has
from governance.services import (
    ServiceConflict,
    ServiceError,
    ServiceForbidden,
    approve_version,
    four_eyes_refusal,
    reject_version,
)
from governance.tenancy import tenant_context
from governance.views.common import can, console_view
from governance.views.datasets import (
    agent_names,
    counted,
    describe_filter,
    get_version,
    status_hint,
    version_history,
)
from wire.openai import message_text

PAGE_SIZE = 25
EXCERPT_CHARS = 240
PENDING = DatasetVersion.Status.PENDING_APPROVAL


def pending_approvals_count(tenant: Any) -> int:
    """How many of the tenant's dataset versions wait for a compliance officer's decision."""
    with tenant_context(tenant):
        return DatasetVersion.objects.for_tenant(tenant).filter(status=PENDING).count()


def _queue(tenant: Any):
    """Every version that was ever submitted: waiting ones first (oldest request first, as a
    queue), then decided or invalidated ones (latest first)."""
    return (DatasetVersion.objects.for_tenant(tenant).filter(requested_at__isnull=False)
            .select_related("dataset", "created_by", "requested_by", "approval",
                            "approval__decided_by")
            .annotate(waiting=Case(When(status=PENDING, then=Value(0)), default=Value(1),
                                   output_field=IntegerField()))
            .order_by("waiting",
                      Case(When(status=PENDING, then=F("requested_at"))).asc(nulls_last=True),
                      Coalesce("approval__decided_at", "invalidated_at", "requested_at").desc(),
                      "-pk"))


def deciders(tenant: Any, version: DatasetVersion) -> list[str]:
    """Usernames of the members who may decide on this version (a role with `approve`,
    neither its freezer nor its requester)."""
    roles = [r for r in Role.values if role_has(r, "approve")]
    excluded = [u for u in (version.created_by_id, version.requested_by_id) if u]
    return list(Membership.objects.for_tenant(tenant).filter(role__in=roles)
                .exclude(user_id__in=excluded).order_by("user__username")
                .values_list("user__username", flat=True))


four_eyes_reason = four_eyes_refusal  # the service's rule, shown before anyone clicks


def _first_text(messages_: Any, role: str) -> str:
    if isinstance(messages_, str):
        return messages_
    if not isinstance(messages_, list):
        return ""
    for m in reversed(messages_):
        if isinstance(m, dict) and m.get("role") == role:
            text = message_text(m.get("content"))
            if text:
                return text
    return ""


def step_excerpt(step: Step) -> dict[str, str]:
    """The user's last message and the assistant's reply of one (sanitized) step."""
    obs = step.observation if isinstance(step.observation, dict) else {}
    prompt = (_first_text(obs.get("messages"), "user") or _first_text(obs.get("input"), "user")
              or (obs.get("prompt") if isinstance(obs.get("prompt"), str) else ""))
    action = step.action if isinstance(step.action, dict) else {}
    reply = ""
    for m in action.get("messages") or []:
        if not isinstance(m, dict):
            continue
        reply = message_text(m.get("content"))
        if not reply and m.get("tool_calls"):
            names = [c.get("function", {}).get("name", "?") for c in m["tool_calls"]
                     if isinstance(c, dict)]
            reply = "calls " + ", ".join(names)
        if reply:
            break
    if not reply and isinstance(action.get("text"), str):
        reply = action["text"]
    return {"prompt": prompt, "reply": reply}


def findings_by_type(findings: QuerySet) -> list[dict[str, Any]]:
    """[{entity_type, n, trajectories}] over these (packed) Finding rows, most found first:
    their counts summed (capture/findings.py). The rows are the queryset's own SQL, so the
    version's filters are written once."""
    sql, params = findings.values_list("counts", "step__trajectory_id").query.sql_with_params()
    with connection.cursor() as cur:
        cur.execute(
            "SELECT c.key, sum(c.value::int), count(DISTINCT f.trajectory_id) "  # noqa: S608
            f"FROM ({sql}) AS f(counts, trajectory_id) "
            "CROSS JOIN LATERAL jsonb_each_text(f.counts) c GROUP BY c.key ORDER BY 2 DESC, 1",
            params)
        return [{"entity_type": k, "n": int(n), "trajectories": t}
                for k, n, t in cur.fetchall()]


def review_facts(version: DatasetVersion) -> dict[str, Any]:
    """What a reviewer reads before deciding, all limited to the version's members and to the
    steps the freeze pinned (created at or before it)."""
    tenant_id = version.tenant_id
    members = DatasetVersionMember.objects.for_tenant(tenant_id).filter(version=version)
    member_ids = members.values("trajectory_id")
    steps = Step.objects.for_tenant(tenant_id).filter(trajectory_id__in=member_ids,
                                                      created_at__lte=version.created_at)
    classification_mix = list(steps.values("classification").annotate(n=Count("id"))
                              .order_by("-n", "classification"))
    agent_mix = list(Trajectory.objects.for_tenant(tenant_id).filter(pk__in=member_ids)
                     .values("agent__name").annotate(n=Count("pk")).order_by("-n", "agent__name"))
    findings = Finding.objects.for_tenant(tenant_id).filter(
        step__trajectory_id__in=member_ids, step__created_at__lte=version.created_at)
    per_type = findings_by_type(findings)
    with_findings = findings.values("step__trajectory_id").distinct().count()

    sample_ids = list(version.sample_ids or [])
    if not sample_ids:  # a version frozen before samples were stored
        sample_ids = review_sample([str(t) for t in members.values_list("trajectory_id",
                                                                        flat=True)],
                                   version.content_hash)
    trajectories = {str(t.pk): t for t in Trajectory.objects.for_tenant(tenant_id)
                    .filter(pk__in=sample_ids).select_related("agent")}
    first_steps = {str(s.trajectory_id): s for s in materialize_observations(list(
                   steps.filter(trajectory_id__in=sample_ids)
                   .order_by("trajectory_id", "started_at", "id").distinct("trajectory_id")))}
    finding_counts = dict(findings.filter(step__trajectory_id__in=sample_ids)
                          .values_list("step__trajectory_id").annotate(n=Sum("total")))
    sample = []
    for tid in sample_ids:
        traj = trajectories.get(str(tid))
        step = first_steps.get(str(tid))
        sample.append({
            "id": tid, "trajectory": traj,
            "excerpt": step_excerpt(step) if step is not None else None,
            "findings": finding_counts.get(traj.pk, 0) if traj is not None else 0,
        })
    return {
        "classification_mix": classification_mix,
        "agent_mix": agent_mix,
        "findings": per_type,
        "findings_total": sum(f["n"] for f in per_type),
        "trajectories_with_findings": with_findings,
        "sample": sample,
    }


def allows_text(version: DatasetVersion) -> str:
    what = ("this trajectory" if version.size == 1
            else f"these {counted(version.size, 'trajectory', 'trajectories')}")
    return (f"Approving lets stewards launch GRPO jobs and exports (verl parquet, ATDP JSONL) "
            f"on {what} ({counted(version.step_count, 'step', 'steps')}), exactly as frozen "
            "(content hash "
            f"{version.content_hash[:12]}…); every checkpoint trained on it names this approval "
            "in its lineage. Erasure of a subject later invalidates it, and a checkpoint "
            "trained on an erased trajectory is marked tainted.")


# --- pages ----------------------------------------------------------------------------------


@console_view(permission="read_datasets")
def approval_list(request: HttpRequest) -> HttpResponse:
    page = Paginator(_queue(request.tenant), PAGE_SIZE).get_page(request.GET.get("page"))
    approver_roles = [Role(r).label for r in Role.values if role_has(r, "approve")]
    context = {
        "page": page,
        "pending": pending_approvals_count(request.tenant),
        "can_approve": can(request, "approve"),
        "approver_roles": approver_roles,
    }
    return render(request, "console/approvals.html", context)


def _review(request: HttpRequest, version: DatasetVersion, *, reason: str = "",
            error: str = "", status: int = 200) -> HttpResponse:
    can_approve = can(request, "approve")
    self_reason = four_eyes_reason(request.user, version)
    context = {
        "version": version,
        "dataset": version.dataset,
        "filter": describe_filter(version.filter or {}, agent_names(request.tenant)),
        "status_hint": status_hint(version),
        "history": version_history(version),
        "facts": review_facts(version),
        # The labels the version pins (covered by its hash; later rewards are not in it).
        "pinned_rewards": pinned_rewards(version).count(),
        "allows": allows_text(version),
        "is_pending": version.status == PENDING,
        "can_approve": can_approve,
        "self_reason": self_reason,
        "may_decide": can_approve and version.status == PENDING and not self_reason,
        "deciders": deciders(request.tenant, version),
        "reason": reason,
        "error": error,
    }
    return render(request, "console/approval.html", context, status=status)


@console_view(permission="read_datasets")
def approval_detail(request: HttpRequest, version_id: int) -> HttpResponse:
    return _review(request, get_version(request, version_id))


@console_view(permission="approve")
@require_POST
def approval_decide(request: HttpRequest, version_id: int) -> HttpResponse:
    version = get_version(request, version_id)
    decision = request.POST.get("decision", "")
    reason = request.POST.get("reason", "")
    service = {"approve": approve_version, "reject": reject_version}.get(decision)
    if service is None:
        return _review(request, version, reason=reason, status=400,
                       error="Choose Approve or Reject.")
    try:
        service(request.user, version, reason)
    except ServiceForbidden as exc:
        error, status = f"Refused: {exc}.", 403
    except ServiceConflict as exc:
        error, status = f"Not decided: {exc}.", 409
    except ServiceError as exc:
        error, status = f"Not decided: {exc}.", 400
    else:
        word = "approved" if decision == "approve" else "rejected"
        messages.success(request, f"Version {version.number} of “{version.dataset.name}” "
                                  f"{word}. The decision and its reason are recorded.")
        return redirect("approval", version.pk)
    return _review(request, get_version(request, version_id), reason=reason, error=error,
                   status=status)
