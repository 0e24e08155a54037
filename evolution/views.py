"""Console pages of the evolution control plane (issue 7): `/evolution/` — candidates with their
gate pipeline, open proposals with their evidence, the forms that start candidates and find
failures; `/evolution/candidates/<id>/` — one candidate's gate results, the canary comparison
chart (rewards per arm, evolution.canary.compare_arms) and the promote / rollback buttons.

Views parse, authorize, call a service (evolution/services.py), redirect with a message;
a ServiceError becomes an error message, never a 500. Reading needs read_training; promoting,
proposing and accepting need manage_evolution; rolling back needs rollback_policy — checked
here for the buttons and again in the services."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from evolution import gates as ev
from evolution import services as svc
from evolution.models import Candidate, EvolutionPolicy, GateResult, Proposal
from governance.models import Agent, DatasetVersion, Role
from governance.permissions import ROLE_PERMISSIONS
from governance.services import ServiceError
from governance.views.common import can, console_view
from trainer.models import Checkpoint

GATE_ORDER = list(ev.GATES)
# A candidate whose gates are still being decided: its page polls (candidate.html#live).
LIVE_STATUSES = ("pending", "running", "passed")  # passed: offline gates done, canary on


def roles_with(permission: str) -> str:
    return ", ".join(str(Role(r).label) for r, perms in ROLE_PERMISSIONS.items()
                     if permission in perms)


def _summary(gate: str, metrics: dict[str, Any]) -> str:
    """One line of the key figures of a gate result, for the pipeline table."""
    cand, cur = metrics.get("candidate") or {}, metrics.get("current") or {}
    if gate == "shadow_eval" and "mean" in cand:
        return f"reward {cand['mean']:.3f} vs {cur.get('mean', 0):.3f} (n={cand.get('n')})"
    if gate == "replay" and cand:
        return (f"tools {ev.pct(cand.get('tool_valid_rate'))} vs "
                f"{ev.pct(cur.get('tool_valid_rate'))}, format "
                f"{ev.pct(cand.get('format_ok_rate'))} vs {ev.pct(cur.get('format_ok_rate'))}")
    if gate == "safety" and "harmful_refusal_rate" in cand:
        return (f"refusal {ev.pct(cand['harmful_refusal_rate'])} vs "
                f"{ev.pct(cur.get('harmful_refusal_rate'))}")
    if gate == "canary":
        return str(metrics.get("route_status") or "")
    if gate == "promote":
        prod = (metrics.get("serving") or {}).get("production") or {}
        return "weights pushed" if prod.get("pushed") else ""
    return ""


def pipeline(cand: Candidate, results: dict[str, GateResult]) -> list[dict[str, Any]]:
    """The five gates of a candidate: passed / failed / running / pending, with the reason."""
    out = []
    for gate in GATE_ORDER:
        r = results.get(gate)
        if r is not None:
            state = "passed" if r.passed else "failed"
        elif cand.stage == gate and cand.status in ("running", "passed", "pending"):
            state = "running" if cand.status != "pending" else "pending"
        elif cand.status in ("failed", "rolled_back"):
            state = "skipped"  # never reached: the candidate stopped before this gate
        else:
            state = "pending"
        out.append({"gate": gate, "label": ev.GATE_LABELS[gate], "state": state,
                    "reason": r.reason if r else "", "summary": _summary(gate, r.metrics)
                    if r else "", "result": r})
    return out


def _results_by_candidate(cands: list[Candidate]) -> dict[int, dict[str, GateResult]]:
    out: dict[int, dict[str, GateResult]] = {c.pk: {} for c in cands}
    for r in (GateResult.objects.filter(candidate_id__in=list(out))
              .order_by("created_at", "pk")):
        out[r.candidate_id][r.gate] = r
    return out


@console_view(permission="read_training")
def evolution(request: HttpRequest) -> HttpResponse:
    tenant = request.tenant
    cands = list(Candidate.objects.for_tenant(tenant)
                 .select_related("agent", "checkpoint", "context_update", "route")
                 .order_by("-created_at", "-pk")[:50])
    results = _results_by_candidate(cands)
    rows = [{"c": c, "pipeline": pipeline(c, results[c.pk])} for c in cands]
    proposals = list(Proposal.objects.for_tenant(tenant).filter(status=Proposal.Status.OPEN)
                     .select_related("cluster", "cluster__agent").order_by("-created_at")[:50])
    versions = list(DatasetVersion.objects.for_tenant(tenant)
                    .filter(status=DatasetVersion.Status.APPROVED, invalidated_at__isnull=True)
                    .select_related("dataset").order_by("-created_at")[:50])
    context = {
        "rows": rows, "proposals": proposals,
        "can_manage": can(request, "manage_evolution"),
        "manage_roles": roles_with("manage_evolution"),
        "checkpoints": list(Checkpoint.objects.for_tenant(tenant)
                            .filter(status=Checkpoint.Status.OK)
                            .select_related("job").order_by("-created_at")[:50]),
        "agents": list(Agent.objects.for_tenant(tenant).order_by("name")),
        "versions": versions,
        # The form offers "the tenant's default" only when one is set and still usable;
        # otherwise a split must be chosen from versions that exist (none: nothing to propose).
        "default_eval": _default_eval(tenant, versions),
        "thresholds": svc.thresholds_for(tenant).to_dict(),
        "engines": _engine_names(),
    }
    return render(request, "console/evolution.html", context)


def _engine_names() -> list[str]:
    """The operator's candidate engines a checkpoint may be served at (a choice, never a
    free URL: governance/engines.py). A broken configuration offers none; proposing says why."""
    from governance.engines import engines

    try:
        return sorted(engines().candidates)
    except ServiceError:
        return []


def _default_eval(tenant: Any, versions: list[DatasetVersion]) -> DatasetVersion | None:
    """The tenant's configured eval split, if it is one of the usable (approved, valid)
    versions listed."""
    default_id = (EvolutionPolicy.objects.for_tenant(tenant)
                  .values_list("eval_version_id", flat=True).first())
    return next((v for v in versions if v.pk == default_id), None)


def _eval_split_exists(tenant: Any, checkpoint_id: int) -> bool:
    """Whether a candidate of this checkpoint proposed without an eval split would get one (the
    rule of evolution/tasks._eval_version: the tenant's default, else the newest
    approved, valid version it was not trained on). A checkpoint that is not usable answers
    True: the service refuses it with its own reason."""
    ckpt = (Checkpoint.objects.for_tenant(tenant).filter(pk=checkpoint_id,
                                                         status=Checkpoint.Status.OK)
            .select_related("job").first())
    if ckpt is None or EvolutionPolicy.objects.for_tenant(tenant).filter(
            eval_version__isnull=False).exists():
        return True
    usable = DatasetVersion.objects.for_tenant(tenant).filter(
        status=DatasetVersion.Status.APPROVED, invalidated_at__isnull=True)
    if ckpt.job_id:
        usable = usable.exclude(pk=ckpt.job.dataset_version_id)
    return usable.exists()


def _get_candidate(request: HttpRequest, candidate_id: int) -> Candidate:
    cand = (Candidate.objects.for_tenant(request.tenant)
            .select_related("agent", "checkpoint", "checkpoint__job", "context_update", "route",
                            "created_by", "eval_version")
            .filter(pk=candidate_id).first())
    if cand is None:
        raise Http404("no such candidate")
    return cand


def canary_chart(comparison: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chart.js data (static/steward/charts.js): mean reward per arm, with mean - std and
    mean + std as the whiskers (three bar series), n in the labels."""
    if not comparison:
        return None

    def val(x: Any) -> float | None:
        return round(float(x), 4) if x is not None else None

    arms = [("control", comparison.get("mean_control"), comparison.get("std_control"),
             comparison.get("n_control")),
            ("candidate", comparison.get("mean_candidate"), comparison.get("std_candidate"),
             comparison.get("n_candidate"))]
    labels = [f"{name} (n={n or 0})" for name, _, _, n in arms]
    mean = [val(m) for _, m, _, _ in arms]
    low = [val(m - (s or 0)) if m is not None else None for _, m, s, _ in arms]
    high = [val(m + (s or 0)) if m is not None else None for _, m, s, _ in arms]
    return {"type": "bar", "labels": labels, "y_label": "reward",
            "datasets": [{"label": "mean − std", "data": low, "color": "#9bb5e0"},
                         {"label": "mean", "data": mean, "color": "#1f5fbf"},
                         {"label": "mean + std", "data": high, "color": "#5b6575"}]}


@console_view(permission="read_training")
def candidate(request: HttpRequest, candidate_id: int) -> HttpResponse:
    cand = _get_candidate(request, candidate_id)
    results = list(GateResult.objects.filter(candidate=cand).order_by("created_at", "pk"))
    latest = {r.gate: r for r in results}
    if request.htmx and request.htmx.target == "candidate-live":
        return _candidate_poll(request, cand, latest)
    comparison = svc.comparison_for(cand)
    passed_offline = all(g in latest and latest[g].passed for g in svc.OFFLINE_GATES)
    can_promote_state = passed_offline and cand.route_id is not None and (
        cand.status in ("running", "passed")
        or (cand.status == "failed" and cand.stage == "promote"))
    can_rollback_state = cand.status not in ("failed", "rolled_back")
    context = {
        "c": cand, "pipeline": pipeline(cand, latest), "results": results,
        "comparison": comparison, "chart": canary_chart(comparison),
        "can_manage": can(request, "manage_evolution"),
        "can_rollback": can(request, "rollback_policy"),
        "promote_state_ok": can_promote_state, "rollback_state_ok": can_rollback_state,
        "manage_roles": roles_with("manage_evolution"),
        "rollback_roles": roles_with("rollback_policy"),
        "proposals": list(cand.proposals.select_related("cluster")),
        "live": cand.status in LIVE_STATUSES,
    }
    return render(request, "console/candidate.html", context)


def _candidate_poll(request: HttpRequest, cand: Candidate,
                    latest: dict[str, GateResult]) -> HttpResponse:
    """The page polls its status and pipeline while gates run (only what that fragment needs:
    no canary statistics every 2 s). When the stage or the status moves on, the rest of the page
    (canary chart, buttons) changes too: htmx reloads it whole."""
    if (request.GET.get("stage"), request.GET.get("status")) != (cand.stage, cand.status):
        response = HttpResponse(status=204)
        response["HX-Refresh"] = "true"
        return response
    return render(request, "console/candidate.html#live",
                  {"c": cand, "pipeline": pipeline(cand, latest),
                   "live": cand.status in LIVE_STATUSES})


def _reason(request: HttpRequest) -> str:
    return (request.POST.get("reason") or "").strip()


@console_view(permission="manage_evolution")
@require_POST
def candidate_promote(request: HttpRequest, candidate_id: int) -> HttpResponse:
    cand = _get_candidate(request, candidate_id)
    try:
        cand = svc.promote_candidate(request.user, cand, _reason(request))
    except ServiceError as exc:
        messages.error(request, f"Not promoted: {exc}")
    else:
        if cand.status == Candidate.Status.PROMOTED:
            messages.success(request, f"Candidate {cand.pk} promoted.")
        elif cand.status == Candidate.Status.PROMOTING:
            messages.info(request, f"Candidate {cand.pk}: promotion recorded; its weights are "
                          "being pushed to production (this page shows the outcome).")
        else:
            messages.error(request, f"Promotion failed: {cand.reason}")
    return redirect("candidate", cand.pk)


@console_view(permission="rollback_policy")
@require_POST
def candidate_rollback(request: HttpRequest, candidate_id: int) -> HttpResponse:
    cand = _get_candidate(request, candidate_id)
    try:
        cand = svc.rollback_candidate(request.user, cand, _reason(request))
    except ServiceError as exc:
        messages.error(request, f"Not rolled back: {exc}")
    else:
        if cand.status == Candidate.Status.ROLLING_BACK:
            messages.info(request, f"Candidate {cand.pk}: rollback recorded; the previous "
                          "weights are being pushed to production (this page shows the "
                          "outcome).")
        else:
            messages.success(request, f"Candidate {cand.pk} rolled back.")
    return redirect("candidate", cand.pk)


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@console_view(permission="manage_evolution")
@require_POST
def evolution_propose(request: HttpRequest) -> HttpResponse:
    """Propose a checkpoint (from this page or from a checkpoint's page) as a candidate."""
    ckpt_id, agent_id = _int(request.POST.get("checkpoint")), _int(request.POST.get("agent"))
    version_id = _int(request.POST.get("eval_version"))
    if ckpt_id is None or agent_id is None:
        messages.error(request, "Choose a checkpoint and the agent it is for.")
        return redirect("evolution")
    if version_id is None and not _eval_split_exists(request.tenant, ckpt_id):
        messages.error(request, "Not proposed: there is no held-out eval split for its shadow "
                       "eval — no default eval version is set and no approved dataset version "
                       "other than the one it was trained on exists. Approve one, then choose "
                       "it.")
        back = request.POST.get("back")
        return redirect("checkpoint", ckpt_id) if back == "checkpoint" else redirect("evolution")
    try:
        cand = svc.propose_candidate(request.user, request.tenant, agent=agent_id,
                                     checkpoint=ckpt_id, eval_version=version_id,
                                     upstream_url=(request.POST.get("upstream_url") or ""),
                                     model=(request.POST.get("model") or ""))
    except ServiceError as exc:
        messages.error(request, f"Not proposed: {exc}")
        back = request.POST.get("back")
        return redirect("checkpoint", ckpt_id) if back == "checkpoint" else redirect("evolution")
    messages.success(request, f"Candidate {cand.pk} proposed; its gates are running.")
    return redirect("candidate", cand.pk)


@console_view(permission="manage_evolution")
@require_POST
def evolution_find_failures(request: HttpRequest) -> HttpResponse:
    try:
        found = svc.propose_updates(request.user, request.tenant)
    except ServiceError as exc:
        messages.error(request, f"Not done: {exc}")
    else:
        messages.success(request, f"{len(found)} failure cluster{'s' if len(found) != 1 else ''}"
                         " with an open proposal.")
    return redirect("evolution")


def _get_proposal(request: HttpRequest, proposal_id: int) -> Proposal:
    prop = Proposal.objects.for_tenant(request.tenant).filter(pk=proposal_id).first()
    if prop is None:
        raise Http404("no such proposal")
    return prop


@console_view(permission="manage_evolution")
@require_POST
def proposal_accept(request: HttpRequest, proposal_id: int) -> HttpResponse:
    prop = _get_proposal(request, proposal_id)
    try:
        cand = svc.accept_proposal(request.user, prop,
                                   content=(request.POST.get("content") or "").strip() or None,
                                   checkpoint=_int(request.POST.get("checkpoint")),
                                   agent=_int(request.POST.get("agent")))
    except ServiceError as exc:
        messages.error(request, f"Not accepted: {exc}")
        return redirect("evolution")
    messages.success(request, f"Proposal {prop.pk} accepted: candidate {cand.pk}.")
    return redirect("candidate", cand.pk)


@console_view(permission="manage_evolution")
@require_POST
def proposal_dismiss(request: HttpRequest, proposal_id: int) -> HttpResponse:
    prop = _get_proposal(request, proposal_id)
    try:
        svc.dismiss_proposal(request.user, prop, _reason(request))
    except ServiceError as exc:
        messages.error(request, f"Not dismissed: {exc}")
    else:
        messages.success(request, f"Proposal {prop.pk} dismissed.")
    return redirect("evolution")
