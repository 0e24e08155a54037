"""Every mutation of the evolution control plane (issue 7): propose a candidate, record its
gate results, start its canary, promote it, roll it back; set a tenant's thresholds; cluster
failures and propose, accept or dismiss governed updates. Each one runs in its tenant's scope
(governance.tenancy), atomically, writing its audit event in the same transaction; who may do
what is checked here too (manage_evolution, rollback_policy), not only in the console.

The five gates (evolution/gates.py has the decisions): shadow_eval -> replay -> safety run
offline in the Celery task evolution.tasks.run_gates (queue `gpu`); canary is a
evolution.canary PolicyRoute whose decision (evaluate_canaries, or a person) the candidate
follows in the same tick of the beat task evolution.tasks.advance_evolution; promote pushes a
weight candidate's checkpoint to the serving engine (SGLang `/update_weights_from_disk`
between pause and continue, trainer.rollout.SGLangRollout) or leaves a context update active.
A failed gate stops the candidate with the gate's readable reason.

Serving engines (env or Django settings): STEWARD_SGLANG_URL — production SGLang, receives a
promoted checkpoint's weights (and the previous ones back on rollback); STEWARD_SGLANG_CANARY_URL
— an SGLang that serves the candidate arm of a weight canary (gets the candidate's weights when
its canary starts); STEWARD_SGLANG_API_KEY for both. None configured: the gate result says that
no serving engine was updated. A candidate served elsewhere, and the baseline, name one of the
operator's candidate engines (STEWARD_ENGINE_ALLOWLIST, governance/engines.py), each called
with its own credential — never a URL a steward typed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from evolution import gates as ev
from evolution.models import (
    Candidate,
    EvolutionPolicy,
    FailureCluster,
    GateResult,
    Proposal,
    UpdateKind,
)
from governance.audit import record_event
from governance.capture.conversation import materialize_observations
from governance.engines import candidate_engine_url
from governance.models import Agent, DatasetVersion, Membership, Tenant
from governance.permissions import member_can
from governance.services import (
    ServiceConflict,
    ServiceError,
    ServiceForbidden,
    acting_user,
    require_reason,
)
from governance.tenancy import tenant_atomic, tenant_context
from trainer.models import Checkpoint
from trainer.taskdata import version_refusal

SYSTEM_ACTOR = "system:evolution"
OFFLINE_GATES = ("shadow_eval", "replay", "safety")
# Which ContextUpdate kind each context candidate kind is carried by.
CONTEXT_KIND = {"memory": "system_prompt", "skill": "system_prompt", "harness": "system_prompt",
                "tool_schema": "tool_schema"}


def setting(name: str, default: str = "") -> str:
    return str(getattr(settings, name, "") or default)  # config/settings.py reads the env


_user = acting_user


def _digest(text: str) -> str:
    """Free text stays out of the audit chain (it is never rewritten); its SHA-256 ties the
    stored row to the event (as governance.services does)."""
    return hashlib.sha256((text or "").encode()).hexdigest()


def _require(actor: Any, tenant_id: int, permission: str, what: str) -> None:
    """A person must hold `permission` in the tenant; "system:..." actors are the control
    plane's own tasks."""
    user = _user(actor)
    if user is None:
        if isinstance(actor, str) and actor.startswith("system:"):
            return
        raise ServiceForbidden(f"{what} needs a person or a system actor")
    membership = Membership.objects.filter(user=user, tenant_id=tenant_id).first()
    if not member_can(membership, permission):
        raise ServiceForbidden(f"your role may not {what} (needs {permission})")


def _reason_payload(actor: Any, reason: str) -> dict[str, str]:
    """A person's free text stays out of the audit chain (its SHA-256 goes in, the text is on
    the row); the control plane's own reasons are machine-written and go in as they are."""
    if _user(actor) is not None:
        return {"reason_sha256": _digest(reason)}
    return {"reason": (reason or "")[:500]}


def _require_reason(reason: str) -> str:
    return require_reason(reason, 2000)


# --- thresholds ---------------------------------------------------------------------------


def thresholds_for(tenant: Tenant | int) -> ev.Thresholds:
    """The tenant's thresholds: its EvolutionPolicy's values over the defaults."""
    tid = tenant if isinstance(tenant, int) else tenant.pk
    with tenant_context(tid):
        policy = EvolutionPolicy.objects.for_tenant(tid).first()
    if policy is None:
        return ev.Thresholds()
    return ev.Thresholds.from_dict({f: getattr(policy, f) or None
                                    if f == "reward_name" else getattr(policy, f)
                                    for f in EvolutionPolicy.THRESHOLD_FIELDS})


@tenant_atomic("tenant")
def set_evolution_policy(actor: Any, tenant: Tenant, **values: Any) -> EvolutionPolicy:
    """Change the tenant's thresholds (None clears one back to its default), the default eval
    version and the baseline upstream. Validated; audited with old and new values."""
    _require(actor, tenant.pk, "manage_evolution", "change the evolution thresholds")
    allowed = set(EvolutionPolicy.THRESHOLD_FIELDS) | {"eval_version", "baseline_upstream_url",
                                                       "baseline_model"}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ServiceError(f"unknown settings: {', '.join(unknown)}")
    policy, _ = EvolutionPolicy.objects.select_for_update().get_or_create(tenant=tenant)
    before = {k: getattr(policy, k if k != "eval_version" else "eval_version_id")
              for k in values}
    for key, value in values.items():
        if key == "eval_version":
            if value is not None:
                version = DatasetVersion.objects.for_tenant(tenant).filter(
                    pk=getattr(value, "pk", value)).first()
                if version is None:
                    raise ServiceError("unknown dataset version")
                value = version
        elif key in ("baseline_upstream_url", "baseline_model", "reward_name"):
            value = str(value or "").strip()
            if key == "baseline_upstream_url" and value:
                value = candidate_engine_url(value, "baseline_upstream_url")
        elif value is not None:
            try:
                value = float(value) if key not in ("min_sessions_per_arm",
                                                    "min_cluster_size") else int(value)
            except (TypeError, ValueError):
                raise ServiceError(f"{key} must be a number") from None
            if value < 0 or (key == "canary_share" and not 0 < value <= 1):
                raise ServiceError(f"{key} is out of range")
        setattr(policy, key, value)
    policy.updated_by = _user(actor)
    policy.save()
    record_event(actor, "evolution_policy.changed", tenant=tenant, object_type="evolution_policy",
                 object_id=policy.pk,
                 payload={"before": before,
                          "after": {k: getattr(policy, k if k != "eval_version"
                                               else "eval_version_id") for k in values}})
    return policy


# --- candidates ---------------------------------------------------------------------------


def checkpoint_refusal(ckpt: Checkpoint) -> str | None:
    """Why this checkpoint may not enter the pipeline (None: it may): tainted, or trained on a
    version that is no longer approved (erasure, retention), or its weights are gone."""
    if ckpt.status == Checkpoint.Status.TAINTED:
        return (f"checkpoint {ckpt.pk} is tainted ({ckpt.tainted_reason or 'data it was trained '
                'on was erased'}); a tainted checkpoint can never be promoted")
    version = (DatasetVersion.objects.select_related("approval")
               .get(pk=ckpt.job.dataset_version_id))
    refusal = version_refusal(version)
    if refusal:
        return f"checkpoint {ckpt.pk} was trained on data that lost its approval: {refusal}"
    if not (Path(ckpt.path) / "model" / "config.json").is_file():
        return f"checkpoint {ckpt.pk}: its weights are gone ({ckpt.path})"
    return None


# The Celery tasks that take work out of a transaction, by name. evolution.tasks imports this
# module (the gates call the services), so this one does not import it back: EvolutionConfig.
# ready() fills the table with the tasks' `delay`.
ENQUEUE: dict[str, Callable[[int], Any]] = {}


def _enqueue_gates(candidate_id: int) -> None:
    ENQUEUE["run_gates"](candidate_id)


@tenant_atomic("tenant")
def propose_candidate(actor: Any, tenant: Tenant, *, agent: Agent | int,
                      checkpoint: Checkpoint | int | None = None,
                      context_update: Any = None, kind: str | None = None,
                      upstream_url: str = "", model: str = "",
                      eval_version: DatasetVersion | int | None = None) -> Candidate:
    """A candidate for `agent`: new weights (a checkpoint, and/or a model served at
    upstream_url — the name or URL of an engine the operator listed, never a free URL) or a
    draft context update (kind memory | skill | harness for a system-prompt snippet,
    tool_schema for tool definitions). Refused (ServiceForbidden / ServiceConflict, with the
    reason) for a tainted checkpoint or one whose dataset version was invalidated.
    Its gates run in the Celery task enqueued when this transaction commits."""
    from evolution.models import ContextUpdate

    _require(actor, tenant.pk, "manage_evolution", "propose a candidate")
    agent_obj = Agent.objects.for_tenant(tenant).filter(pk=getattr(agent, "pk", agent)).first()
    if agent_obj is None:
        raise ServiceError("unknown agent")
    ckpt = update = version = None
    if checkpoint is not None:
        ckpt = (Checkpoint.objects.for_tenant(tenant).select_for_update(of=("self",))
                .select_related("job").filter(pk=getattr(checkpoint, "pk", checkpoint)).first())
        if ckpt is None:
            raise ServiceError("unknown checkpoint")
        refusal = checkpoint_refusal(ckpt)
        if refusal:
            exc = ServiceForbidden if ckpt.status == Checkpoint.Status.TAINTED \
                else ServiceConflict
            raise exc(f"refused: {refusal}")
    if context_update is not None:
        update = (ContextUpdate.objects.for_tenant(tenant).select_for_update()
                  .filter(pk=getattr(context_update, "pk", context_update)).first())
        if update is None:
            raise ServiceError("unknown context update")
        if update.agent_id != agent_obj.pk:
            raise ServiceError("the context update belongs to another agent")
        if update.status != ContextUpdate.Status.DRAFT:
            raise ServiceConflict(f"context update {update.pk} is {update.status}; only a draft "
                                  "can become a candidate")
    if update is not None and (ckpt is not None or upstream_url or model):
        raise ServiceError("a candidate is either new weights or a context update, not both")
    if update is not None:
        kind = kind or ("tool_schema" if update.kind == "tool_schema" else "memory")
        if CONTEXT_KIND.get(kind) != update.kind:
            raise ServiceError(f"a {kind} candidate needs a {CONTEXT_KIND.get(kind, '?')} "
                               f"context update, not {update.kind}")
    else:
        kind = kind or "weights"
        if kind != "weights":
            raise ServiceError(f"a {kind} candidate needs a context update")
        if ckpt is None and not (upstream_url and model):
            raise ServiceError("a weight candidate needs a checkpoint, or an upstream URL and "
                               "model that serve it")
    if upstream_url:
        upstream_url = candidate_engine_url(upstream_url, "upstream_url")
    if eval_version is not None:
        version = DatasetVersion.objects.for_tenant(tenant).filter(
            pk=getattr(eval_version, "pk", eval_version)).select_related("approval").first()
        if version is None:
            raise ServiceError("unknown dataset version")
        refusal = version_refusal(version)
        if refusal:
            raise ServiceConflict(f"the eval split must be approved: {refusal}")
    live = Candidate.objects.for_tenant(tenant).filter(status__in=Candidate.LIVE)
    if ckpt is not None and live.filter(checkpoint=ckpt).exists():
        raise ServiceConflict(f"checkpoint {ckpt.pk} is already a candidate in the pipeline")
    if update is not None and live.filter(context_update=update).exists():
        raise ServiceConflict(f"context update {update.pk} is already a candidate")
    cand = Candidate.objects.create(
        tenant=tenant, agent=agent_obj, kind=kind, checkpoint=ckpt, context_update=update,
        upstream_url=upstream_url, model=(model or "").strip()[:256], eval_version=version,
        created_by=_user(actor), heartbeat_at=timezone.now())
    record_event(actor, "candidate.proposed", tenant=tenant, object_type="candidate",
                 object_id=cand.pk,
                 payload={"agent": agent_obj.pk, "kind": kind,
                          "checkpoint": ckpt.pk if ckpt else None,
                          "manifest_sha256": ckpt.manifest_sha256 if ckpt else None,
                          "context_update": update.pk if update else None,
                          "content_hash": update.content_hash if update else None,
                          "upstream_url": upstream_url or None, "model": model or None,
                          "eval_version": version.pk if version else None})
    transaction.on_commit(lambda: _enqueue_gates(cand.pk), robust=True)
    return cand


def get_candidate(tenant: Tenant | int, candidate_id: int) -> Candidate:
    """The tenant's candidate; Candidate.DoesNotExist for another tenant's."""
    with tenant_context(tenant):
        return (Candidate.objects.for_tenant(tenant).select_related("agent", "checkpoint",
                                                                     "context_update", "route")
                .get(pk=candidate_id))


def latest_results(candidate: Candidate) -> dict[str, GateResult]:
    """The latest stored result of each gate (inside the tenant's scope)."""
    out: dict[str, GateResult] = {}
    for r in GateResult.objects.filter(candidate_id=candidate.pk).order_by("created_at", "pk"):
        out[r.gate] = r
    return out


def _record_gate(actor: Any, cand: Candidate, decision: ev.Decision, *,
                 hash_reason: bool = False) -> GateResult:
    """Store a gate's verdict and move the candidate (inside its tenant's transaction).
    hash_reason: a system actor records a person's text (only its SHA-256 goes in)."""
    result = GateResult.objects.create(
        tenant_id=cand.tenant_id, candidate=cand, gate=decision.gate, passed=decision.passed,
        metrics=json.loads(json.dumps(decision.metrics, default=str)),
        thresholds=decision.thresholds, reason=decision.reason[:4000])
    record_event(actor, "candidate.gate", tenant=cand.tenant_id, object_type="candidate",
                 object_id=cand.pk,
                 payload={"gate": decision.gate, "passed": decision.passed,
                          "result": result.pk,
                          **({"reason_sha256": _digest(decision.reason)} if hash_reason
                             else _reason_payload(actor, decision.reason))})
    return result


def _stop(actor: Any, cand: Candidate, status: str, reason: str,
          hash_reason: bool = False) -> None:
    cand.status = status
    cand.reason = reason[:4000]
    cand.finished_at = timezone.now()
    cand.save(update_fields=["status", "reason", "finished_at", "updated_at"])
    if cand.context_update_id and cand.context_update.status == "draft":
        from evolution.canary import reject_context_update

        reject_context_update(actor, cand.context_update, f"candidate {cand.pk}: {reason}")
    record_event(actor, f"candidate.{status}", tenant=cand.tenant_id, object_type="candidate",
                 object_id=cand.pk,
                 payload={"stage": cand.stage,
                          **({"reason_sha256": _digest(reason)} if hash_reason
                             else _reason_payload(actor, reason))})


def record_offline_gate(candidate_id: int, tenant_id: int, decision: ev.Decision) -> bool:
    """Called by the task after each offline gate: store the result; a failure stops the
    candidate. Returns whether the pipeline goes on. Only a running candidate at this stage
    changes (a person may have rolled it back meanwhile)."""
    with tenant_context(tenant_id):
        cand = (Candidate.objects.select_for_update(of=("self",)).select_related("context_update")
                .get(pk=candidate_id))
        if cand.status != Candidate.Status.RUNNING or cand.stage != decision.gate:
            return False
        _record_gate(SYSTEM_ACTOR, cand, decision)
        if not decision.passed:
            _stop(SYSTEM_ACTOR, cand, Candidate.Status.FAILED,
                  f"stopped at {ev.GATE_LABELS[decision.gate]}: {decision.reason}")
            return False
        nxt = OFFLINE_GATES.index(decision.gate) + 1
        cand.stage = OFFLINE_GATES[nxt] if nxt < len(OFFLINE_GATES) else "canary"
        if cand.stage == "canary":
            cand.status = Candidate.Status.PASSED
            cand.reason = "offline gates passed; the canary starts"
        cand.heartbeat_at = timezone.now()
        cand.save(update_fields=["stage", "status", "reason", "heartbeat_at", "updated_at"])
        return True


# --- serving engines ----------------------------------------------------------------------


def _sglang(url: str) -> Any:
    from trainer.rollout import SGLangRollout

    return SGLangRollout(url, api_key=setting("STEWARD_SGLANG_API_KEY") or None, timeout=600)


def _model_dir(ckpt: Checkpoint) -> Path:
    return Path(ckpt.path) / "model"


class EngineUnavailable(ServiceConflict):
    """The serving engine did not answer (as opposed to answering with a refusal): the push
    task retries it a bounded number of times."""


def push_weights(url: str, path: Path, weight_version: str) -> dict[str, Any]:
    """Load weights into an SGLang server (pause -> /update_weights_from_disk -> continue).
    RolloutError -> ServiceError (shown to the person, stored as the gate's reason);
    EngineUnavailable when the engine could not be reached at all.

    Never inside a transaction: the push can take minutes (600 s timeout), and a transaction
    held across it would hold its row locks — and, once an audit event is written, the global
    audit lock that every audited write of every tenant waits for — and could still roll back
    after the engine already serves the weights. Callers record intent, commit, push, then
    record the outcome (push_candidate_weights)."""
    from django.db import connection

    from trainer.rollout import EngineUnreachable, RolloutError

    if connection.in_atomic_block:
        raise RuntimeError("weights are never pushed inside a database transaction")
    try:
        _sglang(url).update_weights_from_disk(path, weight_version)
    except (EngineUnreachable, TimeoutError) as e:
        raise EngineUnavailable(f"the serving engine did not answer: {e}") from None
    except RolloutError as e:
        raise ServiceConflict(f"the serving engine refused the weights: {e}") from None
    return {"engine": url, "path": str(path), "weight_version": weight_version, "pushed": True}


def _weight_version(ckpt: Checkpoint) -> str:
    return f"ckpt-{ckpt.pk}-step-{ckpt.step}"


def _previous_weights(cand: Candidate) -> tuple[Path | None, str, str]:
    """What production served before `cand`: the latest other promoted weight candidate's
    checkpoint of the agent, else the base model its job started from."""
    prev = (Candidate.objects.filter(tenant_id=cand.tenant_id, agent_id=cand.agent_id,
                                     kind="weights", status=Candidate.Status.PROMOTED,
                                     checkpoint__isnull=False)
            .exclude(pk=cand.pk).select_related("checkpoint").order_by("-finished_at", "-pk")
            .first())
    if prev is not None and prev.checkpoint.status == Checkpoint.Status.OK:
        return _model_dir(prev.checkpoint), _weight_version(prev.checkpoint), \
            f"candidate {prev.pk} (checkpoint {prev.checkpoint_id})"
    if cand.checkpoint_id:
        job = cand.checkpoint.job
        return Path(job.base_model_path), f"base-{job.base_model}", f"base model {job.base_model}"
    return None, "", "nothing"


# --- the canary ---------------------------------------------------------------------------


def start_candidate_canary(candidate_id: int, tenant_id: int) -> str:
    """Offline gates passed: open the canary route (evolution.canary.start_canary) with the
    tenant's share and thresholds. A weight candidate's checkpoint is first loaded into the
    canary engine (STEWARD_SGLANG_CANARY_URL). Returns "started", "waiting" (the agent has a
    live route; advance_candidates tries again) or "failed"."""
    from evolution.canary import start_canary

    th = thresholds_for(tenant_id)
    canary_url = setting("STEWARD_SGLANG_CANARY_URL")
    # The push to the canary engine happens before the locked transaction below, never
    # inside it (push_weights); the candidate is re-checked under the lock afterwards.
    pushed: dict[str, Any] | ServiceError | None = None
    with tenant_context(tenant_id):
        cand = Candidate.objects.select_related("checkpoint").get(pk=candidate_id)
        needs_push = (cand.status == Candidate.Status.PASSED and cand.stage == "canary"
                      and cand.kind == "weights" and cand.checkpoint_id
                      and not cand.upstream_url)
    if needs_push and canary_url:
        try:
            pushed = push_weights(canary_url, _model_dir(cand.checkpoint),
                                  _weight_version(cand.checkpoint))
        except ServiceError as e:
            pushed = e
    with tenant_context(tenant_id):
        cand = (Candidate.objects.select_for_update(of=("self",)).select_related(
            "checkpoint", "context_update", "agent", "tenant").get(pk=candidate_id))
        if cand.status != Candidate.Status.PASSED or cand.stage != "canary":
            return "skipped"
        upstream, model, serving = cand.upstream_url, cand.model, dict(cand.serving or {})
        if cand.kind == "weights" and cand.checkpoint_id and not upstream:
            if pushed is None and canary_url:  # became pushable after the first read
                return "skipped"  # advance_candidates tries again
            if not canary_url:
                _record_gate(SYSTEM_ACTOR, cand, ev.Decision(
                    "canary", False, "no engine serves the candidate's weights for a canary: "
                    "set STEWARD_SGLANG_CANARY_URL, or propose the checkpoint with the upstream "
                    "URL and model that serve it"))
                _stop(SYSTEM_ACTOR, cand, Candidate.Status.FAILED,
                      "stopped at Canary: no engine serves the candidate's weights")
                return "failed"
            if isinstance(pushed, ServiceError):
                _record_gate(SYSTEM_ACTOR, cand, ev.Decision("canary", False, str(pushed)))
                _stop(SYSTEM_ACTOR, cand, Candidate.Status.FAILED,
                      f"stopped at Canary: {pushed}")
                return "failed"
            serving["canary"] = pushed
            upstream = canary_url
        try:
            with transaction.atomic():
                route = start_canary(
                    SYSTEM_ACTOR, cand.tenant, cand.agent, candidate_ref=f"candidate:{cand.pk}",
                    share=th.canary_share, upstream_url=upstream, model=model,
                    context_update=cand.context_update,
                    min_sessions_per_arm=th.min_sessions_per_arm,
                    max_error_rate_increase=th.max_error_rate_increase)
        except ServiceConflict as e:
            if cand.reason != f"waiting for the canary: {e}":
                cand.reason = f"waiting for the canary: {e}"
                cand.save(update_fields=["reason", "updated_at"])
            return "waiting"
        except ServiceError as e:
            _record_gate(SYSTEM_ACTOR, cand, ev.Decision("canary", False, str(e)))
            _stop(SYSTEM_ACTOR, cand, Candidate.Status.FAILED, f"stopped at Canary: {e}")
            return "failed"
        cand.route = route
        cand.status = Candidate.Status.RUNNING
        cand.serving = serving
        cand.reason = f"canary: {th.canary_share:.0%} of new sessions on the candidate"
        cand.save(update_fields=["route", "status", "serving", "reason", "updated_at"])
        record_event(SYSTEM_ACTOR, "candidate.canary_started", tenant=tenant_id,
                     object_type="candidate", object_id=cand.pk,
                     payload={"route": route.pk, "share": th.canary_share,
                              "upstream_url": upstream or None, "model": model or None})
        return "started"


def comparison_for(cand: Candidate) -> dict[str, Any] | None:
    if not cand.route_id:
        return None
    from evolution.canary import compare_arms

    try:
        return compare_arms(cand.route).as_dict()
    except Exception:  # noqa: BLE001 — a chart must never break a decision or a page
        return None


def follow_route(candidate_id: int, tenant_id: int) -> str:
    """advance_candidates, for one candidate in canary: the route promoted -> canary passed,
    then the promote gate; rolled back / stopped -> the candidate is rolled back with the
    route's reason; still canary -> nothing."""
    with tenant_context(tenant_id):
        cand = (Candidate.objects.select_related("route", "context_update", "checkpoint")
                .get(pk=candidate_id))
        if cand.status != Candidate.Status.RUNNING or cand.stage != "canary" or not cand.route:
            return "skipped"
        route = cand.route
        decision = ev.canary_decision(route.status, route.decision_reason,
                                      comparison_for(cand))
    if decision is None:
        return "wait"
    if decision.passed:
        cand = promote_candidate(SYSTEM_ACTOR, cand,
                                 f"the canary was promoted: {decision.reason}",
                                 _canary=decision)
        return "promoting" if cand.status == Candidate.Status.PROMOTING else "promoted"
    _rollback(SYSTEM_ACTOR, cand, decision.reason, _canary=decision)
    return "rolled_back"


# --- promote and rollback -----------------------------------------------------------------
#
# A weight push can take minutes; it is never done inside a transaction (push_weights). A
# promote or rollback that must push weights records its intent — status promoting or
# rolling_back, the push plan in `serving` (engine, path, weight version), an audit event —
# and commits; the gpu-queue task evolution.tasks.push_candidate_weights (enqueued
# at commit) claims the candidate with a conditional UPDATE, pushes with no transaction
# open, and records the outcome in its own audited transaction (record_push_outcome):
# promoting -> promoted | push_failed, rolling_back -> rolled_back | promoted (the previous
# weights could not be restored, so production still serves this candidate's). Until the
# outcome is recorded the database never claims what the engine does not serve.

PUSH_STALE = timedelta(minutes=15)  # > the 600 s push timeout: the claimant is gone


def _enqueue_push(candidate_id: int) -> None:
    ENQUEUE["push_candidate_weights"](candidate_id)


def _finish_promotion(actor: Any, cand: Candidate, reason: str,
                      serving: dict[str, Any], hash_reason: bool = False) -> None:
    """The database side of a promotion, once production serves the candidate (or nothing
    had to be pushed): the route promoted, then stopped when it is no longer needed; the
    promote gate passed; the candidate promoted; audited. No network call. hash_reason: the
    push task records the person's reason as "system:evolution"."""
    from evolution.canary import promote_route, stop_route
    from evolution.models import PolicyRoute

    route = (PolicyRoute.objects.select_for_update().filter(pk=cand.route_id).first()
             if cand.route_id else None)
    if route is not None and route.status == "canary":
        route = promote_route(actor, route, reason)
    if cand.kind == "weights" and cand.checkpoint_id:
        if route is not None and route.status == "promoted" and (
                serving["production"]["pushed"] or not cand.upstream_url):
            # Production now serves these weights: back to the normal upstream, and the
            # agent is free for its next canary.
            stop_route(actor, route, f"candidate {cand.pk} promoted; production serves its "
                       "weights")
    elif cand.is_context and route is not None and route.status == "promoted":
        # The update is active for all traffic; the route has done its job.
        stop_route(actor, route, f"candidate {cand.pk} promoted; its context update is "
                   "active")
    note = serving.get("production", {}).get("note") if "production" in serving else None
    _record_gate(actor, cand, ev.Decision(
        "promote", True, reason + (f" ({note})" if note else ""), {"serving": serving}),
        hash_reason=hash_reason)
    cand.status = Candidate.Status.PROMOTED
    cand.serving = serving
    cand.reason = reason
    cand.finished_at = timezone.now()
    cand.save(update_fields=["stage", "status", "serving", "reason", "finished_at",
                             "updated_at"])
    record_event(actor, "candidate.promoted", tenant=cand.tenant_id, object_type="candidate",
                 object_id=cand.pk,
                 payload={"route": cand.route_id, "serving": serving,
                          "reason_sha256": _digest(reason)})


@tenant_atomic("candidate.tenant_id")
def promote_candidate(actor: Any, candidate: Candidate, reason: str,
                      _canary: ev.Decision | None = None) -> Candidate:
    """The promote gate. Only a candidate that passed shadow eval, replay and safety and whose
    canary started (a person may end the canary early: recorded as the canary gate's result,
    with who and why). Weights with a production engine (STEWARD_SGLANG_URL): the intent is
    recorded (status promoting) and the push runs after commit in push_candidate_weights,
    which promotes the candidate (and stops its route) or marks it push_failed. Without an
    engine, an upstream-served model keeps its promoted route (all new sessions); a context
    update becomes the agent's active one — both at once, as nothing is pushed."""
    reason = _require_reason(reason)
    _require(actor, candidate.tenant_id, "manage_evolution", "promote a candidate")
    cand = (Candidate.objects.select_for_update(of=("self",))
            .select_related("route", "checkpoint", "checkpoint__job", "context_update")
            .get(pk=candidate.pk))
    passed = {g for g, r in latest_results(cand).items() if r.passed}
    if not set(OFFLINE_GATES) <= passed:
        missing = [ev.GATE_LABELS[g] for g in OFFLINE_GATES if g not in passed]
        raise ServiceConflict(f"candidate {cand.pk} has not passed {', '.join(missing)}; "
                              "only a candidate through the offline gates can be promoted")
    if cand.status not in (Candidate.Status.RUNNING, Candidate.Status.PASSED,
                           Candidate.Status.PUSH_FAILED) and not (
            cand.status == Candidate.Status.FAILED and cand.stage == "promote"):
        raise ServiceConflict(f"candidate {cand.pk} is {cand.get_status_display().lower()}; "
                              "it cannot be promoted")
    if cand.route_id is None:
        raise ServiceConflict(f"candidate {cand.pk} has no canary yet ({cand.reason or 'its '
                              'canary has not started'}); it reaches production through one")
    if cand.checkpoint_id:
        refusal = checkpoint_refusal(cand.checkpoint)
        if refusal:  # tainted by an erasure while it was in the pipeline
            raise ServiceForbidden(f"refused: {refusal}")
    route = cand.route
    if _canary is None:
        _canary = ev.Decision("canary", True, f"ended early by {getattr(actor, 'username', actor)}"
                              f": {reason}", {"route_status": route.status if route else None})
    if cand.stage == "canary":
        _record_gate(actor, cand, _canary)
    cand.stage = "promote"
    serving = dict(cand.serving or {})
    engine = setting("STEWARD_SGLANG_URL")
    if cand.kind == "weights" and cand.checkpoint_id and engine:
        serving["production"] = {"engine": engine, "path": str(_model_dir(cand.checkpoint)),
                                 "weight_version": _weight_version(cand.checkpoint),
                                 "pushed": False}
        cand.status = Candidate.Status.PROMOTING
        cand.serving = serving
        cand.reason = reason
        cand.task_id = ""
        cand.heartbeat_at = timezone.now()
        cand.save(update_fields=["stage", "status", "serving", "reason", "task_id",
                                 "heartbeat_at", "updated_at"])
        record_event(actor, "candidate.promoting", tenant=cand.tenant_id,
                     object_type="candidate", object_id=cand.pk,
                     payload={"route": cand.route_id, "push": serving["production"],
                              "reason_sha256": _digest(reason)})
        transaction.on_commit(lambda: _enqueue_push(cand.pk), robust=True)
        return cand
    if cand.kind == "weights" and cand.checkpoint_id:
        serving["production"] = {"engine": None, "pushed": False,
                                 "note": "no serving engine configured (STEWARD_SGLANG_URL): "
                                         "no weights pushed"}
    try:
        with transaction.atomic():
            _finish_promotion(actor, cand, reason, serving)
    except ServiceError as e:
        _record_gate(actor, cand, ev.Decision("promote", False, str(e), {"serving": serving}))
        cand.status = Candidate.Status.FAILED
        cand.reason = f"promote failed: {e}"
        cand.save(update_fields=["stage", "status", "reason", "updated_at"])
        record_event(actor, "candidate.failed", tenant=cand.tenant_id, object_type="candidate",
                     object_id=cand.pk, payload={"stage": "promote", "error": str(e)[:500]})
    return cand


@tenant_atomic("candidate.tenant_id")
def rollback_candidate(actor: Any, candidate: Candidate, reason: str) -> Candidate:
    """Manual, at any time: a candidate in the pipeline is stopped (its canary route rolled
    back); a promoted one is undone — its route rolled back, its context update rolled back,
    its weights replaced on production SGLang by the previously promoted checkpoint's (or the
    base model's; status rolling_back until push_candidate_weights has restored them)."""
    reason = _require_reason(reason)
    _require(actor, candidate.tenant_id, "rollback_policy", "roll back a policy")
    return _rollback(actor, candidate, reason)


@tenant_atomic("candidate.tenant_id")
def _rollback(actor: Any, candidate: Candidate, reason: str,
              _canary: ev.Decision | None = None) -> Candidate:
    from evolution.canary import rollback_context_update, rollback_route

    cand = (Candidate.objects.select_for_update(of=("self",))
            .select_related("route", "checkpoint", "checkpoint__job", "context_update")
            .get(pk=candidate.pk))
    if cand.status in (Candidate.Status.FAILED, Candidate.Status.ROLLED_BACK):
        raise ServiceConflict(f"candidate {cand.pk} is already {cand.status.replace('_', ' ')}")
    if cand.status in Candidate.PUSHING:
        raise ServiceConflict(f"candidate {cand.pk} is {cand.get_status_display().lower()}; "
                              "wait for the push's outcome, then decide")
    was_promoted = cand.status == Candidate.Status.PROMOTED
    serving = dict(cand.serving or {})
    route = cand.route
    if route is not None and route.status in ("canary", "promoted"):
        rollback_route(actor, route, reason)
    if cand.context_update_id:
        update = cand.context_update
        update.refresh_from_db()
        if update.status in ("active", "canary"):
            rollback_context_update(actor, update, reason)
    if was_promoted and cand.kind == "weights" and cand.checkpoint_id:
        path, version, what = _previous_weights(cand)
        engine = setting("STEWARD_SGLANG_URL")
        if engine and path is not None:
            serving["rollback"] = {"engine": engine, "path": str(path),
                                   "weight_version": version, "restored": what,
                                   "pushed": False}
            cand.status = Candidate.Status.ROLLING_BACK
            cand.serving = serving
            cand.reason = f"rolling back: {reason}"[:4000]
            cand.task_id = ""
            cand.heartbeat_at = timezone.now()
            cand.save(update_fields=["status", "serving", "reason", "task_id", "heartbeat_at",
                                     "updated_at"])
            record_event(actor, "candidate.rolling_back", tenant=cand.tenant_id,
                         object_type="candidate", object_id=cand.pk,
                         payload={"push": serving["rollback"],
                                  **_reason_payload(actor, reason)})
            transaction.on_commit(lambda: _enqueue_push(cand.pk), robust=True)
            return cand
        serving["rollback"] = {"engine": engine or None, "pushed": False, "restored": what,
                               "note": "no serving engine configured (STEWARD_SGLANG_URL): "
                                       "no weights pushed" if not engine else
                                       "no previous weights known"}
    if _canary is not None and cand.stage == "canary":
        _record_gate(actor, cand, _canary)
    cand.serving = serving
    cand.save(update_fields=["serving", "updated_at"])
    if cand.context_update_id:
        cand.context_update.refresh_from_db()
    _stop(actor, cand, Candidate.Status.ROLLED_BACK,
          (f"rolled back: {reason}" if _canary is None else f"stopped at Canary: {reason}"))
    return cand


def claim_push(candidate_id: int, tenant_id: int, task_id: str) -> dict[str, Any] | None:
    """push_candidate_weights' claim: a conditional UPDATE on a promoting / rolling_back
    candidate nobody holds (no task yet, this same task — a retry or a redelivery — or a
    claimant silent for PUSH_STALE). Returns the push plan ({"which": "production" |
    "rollback", "engine", "path", "weight_version", "refusal"}) or None: nothing to do (a
    duplicate message, or the outcome is already recorded)."""
    now = timezone.now()
    with tenant_context(tenant_id):
        claimed = (Candidate.objects.filter(pk=candidate_id, status__in=Candidate.PUSHING)
                   .filter(Q(task_id="") | Q(task_id=task_id)
                           | Q(heartbeat_at__lt=now - PUSH_STALE))
                   .update(task_id=task_id, heartbeat_at=now))
        if not claimed:
            return None
        cand = Candidate.objects.select_related("checkpoint", "checkpoint__job").get(
            pk=candidate_id)
        which = "production" if cand.status == Candidate.Status.PROMOTING else "rollback"
        plan = dict((cand.serving or {}).get(which) or {})
        # Promoting weights an erasure tainted meanwhile: refused without pushing. A rollback
        # is never refused (it takes a tainted checkpoint off production).
        refusal = checkpoint_refusal(cand.checkpoint) \
            if which == "production" and cand.checkpoint_id else None
        record_event(SYSTEM_ACTOR, "candidate.push_started", tenant=tenant_id,
                     object_type="candidate", object_id=candidate_id,
                     payload={"which": which, "engine": plan.get("engine"),
                              "weight_version": plan.get("weight_version"),
                              "task_id": task_id})
    return {**plan, "which": which, "refusal": refusal}


def record_push_outcome(candidate_id: int, tenant_id: int, task_id: str,
                        error: str | None) -> str:
    """push_candidate_weights, after the push (error None: the engine took the weights), in
    its own audited transaction; only the task holding the claim records. Returns the
    candidate's new status, or "skipped"."""
    with tenant_context(tenant_id):
        cand = (Candidate.objects.select_for_update(of=("self",))
                .select_related("route", "checkpoint", "context_update").get(pk=candidate_id))
        if cand.status not in Candidate.PUSHING or cand.task_id != task_id:
            return "skipped"
        serving = dict(cand.serving or {})
        which = "production" if cand.status == Candidate.Status.PROMOTING else "rollback"
        outcome = {**serving.get(which, {}), "pushed": error is None}
        if error is not None:
            outcome["error"] = error[:500]
        serving[which] = outcome
        if which == "production" and error is None:
            _finish_promotion(SYSTEM_ACTOR, cand, cand.reason or "promoted", serving,
                              hash_reason=True)
        elif which == "production":
            # The engine does not serve the candidate; the route stays as it was (its canary
            # share goes on); a person may retry the promotion or roll the candidate back.
            _record_gate(SYSTEM_ACTOR, cand, ev.Decision("promote", False, error,
                                                         {"serving": serving}))
            _record_push_failure(cand, Candidate.Status.PUSH_FAILED, "candidate.push_failed",
                                 f"promote failed: {error}; production still serves the "
                                 "previous weights", which, serving)
        elif error is None:
            cand.serving = serving
            cand.save(update_fields=["serving", "updated_at"])
            # cand.reason holds the text of the intent ("rolling back: <why>"), which may
            # be a person's: only its SHA-256 goes into the chain.
            why = cand.reason.removeprefix("rolling back: ")
            _stop(SYSTEM_ACTOR, cand, Candidate.Status.ROLLED_BACK,
                  f"rolled back: {why} ({outcome.get('restored', 'previous weights')} "
                  "restored on production)", hash_reason=True)
        else:
            # Production still serves this candidate's weights: the database says so.
            _record_push_failure(cand, Candidate.Status.PROMOTED, "candidate.rollback_failed",
                                 f"rollback failed: {error}; production still serves this "
                                 "candidate's weights", which, serving)
        return cand.status


def _record_push_failure(cand: Candidate, status: str, action: str, reason: str, which: str,
                         serving: dict) -> None:
    """A push the engine refused: the status says what production really serves; audited in
    the caller's transaction."""
    cand.status = status
    cand.serving = serving
    cand.reason = reason[:4000]
    cand.save(update_fields=["status", "serving", "reason", "updated_at"])
    record_event(SYSTEM_ACTOR, action, tenant=cand.tenant_id, object_type="candidate",
                 object_id=cand.pk, payload={"which": which, "serving": serving})


def resend_stale_pushes(tenant_id: int) -> int:
    """advance_candidates: a promoting / rolling_back candidate whose push message was lost
    (broker outage) or whose worker died: released (task_id cleared) and sent again."""
    now = timezone.now()
    with tenant_context(tenant_id):
        stale = list(Candidate.objects.for_tenant(tenant_id)
                     .filter(status__in=Candidate.PUSHING, heartbeat_at__lt=now - PUSH_STALE)
                     .values_list("pk", flat=True))
        for pk in stale:
            if Candidate.objects.filter(pk=pk, status__in=Candidate.PUSHING,
                                        heartbeat_at__lt=now - PUSH_STALE).update(
                    task_id="", heartbeat_at=now):
                transaction.on_commit(lambda pk=pk: _enqueue_push(pk), robust=True)
    return len(stale)


def roll_back_tainted(tenant_id: int) -> list[int]:
    """Erasure tainted a checkpoint that is in the pipeline or serving: the candidate is rolled
    back as "system:evolution" — a live one stops, the agent's current promoted one is replaced
    by the previous untainted weights (or the base model). Older promoted candidates are
    already superseded and stay as they are. Returns the candidates rolled back."""
    with tenant_context(tenant_id):
        rows = list(Candidate.objects.for_tenant(tenant_id)
                    .filter(checkpoint__status=Checkpoint.Status.TAINTED)
                    .filter(Q(status__in=Candidate.LIVE)
                            | Q(status__in=[Candidate.Status.PROMOTED,
                                            Candidate.Status.PUSH_FAILED]))
                    .select_related("checkpoint"))
        current = {}
        for c in (Candidate.objects.for_tenant(tenant_id)
                  .filter(kind="weights", status=Candidate.Status.PROMOTED,
                          checkpoint__isnull=False).order_by("agent_id", "finished_at", "pk")):
            current[c.agent_id] = c.pk  # the latest promoted per agent wins
    done = []
    for cand in rows:
        if cand.status == Candidate.Status.PROMOTED and current.get(cand.agent_id) != cand.pk:
            continue
        try:
            _rollback(SYSTEM_ACTOR, cand, f"checkpoint {cand.checkpoint_id} was tainted: "
                      f"{cand.checkpoint.tainted_reason or 'data it was trained on was erased'}")
        except ServiceConflict:
            continue
        done.append(cand.pk)
    return done


# --- failure clusters and proposals -------------------------------------------------------


def _failure_items(tenant_id: int, th: ev.Thresholds, since: Any) -> list[ev.FailureItem]:
    """Low-reward trajectories (latest final `reward_name` reward below the threshold) with the
    signature of their steps (inside the tenant's scope)."""
    from governance.datasets import latest_reward_value
    from governance.models import Step, Trajectory

    rows = list(Trajectory.objects.for_tenant(tenant_id).filter(last_step_at__gte=since)
                .annotate(_reward=latest_reward_value(tenant_id, th.reward_name))
                .filter(_reward__lt=th.low_reward_threshold)
                .select_related("agent").order_by("-last_step_at")[:2000])
    steps: dict[str, list[dict[str, Any]]] = {}
    found = materialize_observations(list(
        Step.objects.filter(trajectory_id__in=[t.pk for t in rows])
        .order_by("trajectory_id", "started_at")
        .only("trajectory_id", "endpoint", "status_code", "error", "observation_rest", "action",
              "parent_step", "kept", "appended", "item_refs", "history_digest")))
    for s in found:
        steps.setdefault(str(s.trajectory_id), []).append(
            {"trajectory_id": s.trajectory_id, "status_code": s.status_code, "error": s.error,
             "observation": s.observation, "action": s.action})
    items = []
    for t in rows:
        sig, tool = ev.trajectory_signature(steps.get(str(t.pk), []))
        items.append(ev.FailureItem(str(t.pk), t.agent.name, sig, tool, float(t._reward)))
    return items


@tenant_atomic("tenant")
def propose_updates(actor: Any, tenant: Tenant, *, days: int = 30) -> list[Proposal]:
    """Cluster the tenant's recent failures (cluster_failures) and open one proposal per
    cluster that has none open (the rule table, evolution.gates.propose_kind). Idempotent:
    a cluster's open proposal is refreshed, not duplicated. Returns the open proposals."""
    _require(actor, tenant.pk, "manage_evolution", "propose updates")
    th = thresholds_for(tenant)
    clusters = ev.group_failures(_failure_items(tenant.pk, th,
                                                timezone.now() - timedelta(days=days)))
    agents = {a.name: a for a in Agent.objects.for_tenant(tenant)}
    out = []
    for c in clusters:
        key = hashlib.sha256(f"{c['agent']}|{c['tool']}|{c['signature']}".encode()).hexdigest()
        cluster, _ = FailureCluster.objects.update_or_create(
            tenant=tenant, key=key,
            defaults={"agent": agents.get(c["agent"]), "agents": c["agents"], "tool": c["tool"],
                      "signature": c["signature"], "size": c["size"],
                      "mean_reward": c["mean_reward"], "sample": c["sample"]})
        kind, rationale = ev.propose_kind(c["signature"], c["size"], len(c["agents"]),
                                          th.min_cluster_size)
        evidence = {"cluster": c, "rule": {"signature": c["signature"],
                                           "agents": len(c["agents"]), "size": c["size"],
                                           "min_cluster_size": th.min_cluster_size},
                    "reward_name": th.reward_name,
                    "low_reward_threshold": th.low_reward_threshold}
        proposal = Proposal.objects.filter(cluster=cluster, status="open").first()
        if proposal is None:
            proposal = Proposal.objects.create(tenant=tenant, cluster=cluster, kind=kind,
                                               rationale=rationale, evidence=evidence)
            record_event(actor, "proposal.opened", tenant=tenant, object_type="proposal",
                         object_id=proposal.pk,
                         payload={"cluster": cluster.pk, "kind": kind, "size": c["size"],
                                  "signature": c["signature"], "tool": c["tool"],
                                  "agent": c["agent"]})
        elif (proposal.kind, proposal.evidence) != (kind, evidence):
            proposal.kind, proposal.rationale, proposal.evidence = kind, rationale, evidence
            proposal.save(update_fields=["kind", "rationale", "evidence"])
        out.append(proposal)
    return out


def cluster_failures(tenant: Tenant | int, *, days: int = 30) -> list[dict[str, Any]]:
    """The clusters, without storing anything (read only)."""
    tid = tenant if isinstance(tenant, int) else tenant.pk
    th = thresholds_for(tid)
    with tenant_context(tid):
        return ev.group_failures(_failure_items(tid, th, timezone.now() - timedelta(days=days)))


@tenant_atomic("proposal.tenant_id")
def accept_proposal(actor: Any, proposal: Proposal, *, content: Any = None,
                    checkpoint: Checkpoint | int | None = None,
                    agent: Agent | int | None = None) -> Candidate:
    """Accept: a context proposal creates a draft ContextUpdate (the snippet or tool schemas
    the steward wrote, `content`) through evolution.canary and a Candidate for it; a weight
    proposal needs the checkpoint (trained on an approved version) to propose. A no-op can
    only be dismissed."""
    from evolution.canary import create_context_update

    _require(actor, proposal.tenant_id, "manage_evolution", "accept a proposal")
    prop = (Proposal.objects.select_for_update(of=("self",)).select_related("cluster")
            .get(pk=proposal.pk))
    if prop.status != Proposal.Status.OPEN:
        raise ServiceConflict(f"proposal {prop.pk} is {prop.status}")
    if prop.kind == UpdateKind.NO_OP:
        raise ServiceConflict("a no-op proposal can only be dismissed")
    tenant = Tenant.objects.get(pk=prop.tenant_id)
    target = agent if agent is not None else prop.cluster.agent_id
    if target is None:
        raise ServiceError("this cluster spans several agents: choose the agent")
    if prop.kind == UpdateKind.WEIGHTS:
        if checkpoint is None:
            raise ServiceError("a weight update needs a checkpoint: train on an approved "
                               "version, then accept with that checkpoint")
        cand = propose_candidate(actor, tenant, agent=target, checkpoint=checkpoint)
    else:
        if isinstance(content, str):
            content = ({"snippet": content} if prop.kind != "tool_schema"
                       else _json_or_error(content))
        update = create_context_update(actor, tenant, target, kind=CONTEXT_KIND[prop.kind],
                                       content=content,
                                       reason=f"proposal {prop.pk}: {prop.rationale}")
        cand = propose_candidate(actor, tenant, agent=target, context_update=update,
                                 kind=prop.kind)
    prop.status = Proposal.Status.ACCEPTED
    prop.candidate = cand
    prop.decided_by = _user(actor)
    prop.decided_at = timezone.now()
    prop.save(update_fields=["status", "candidate", "decided_by", "decided_at"])
    record_event(actor, "proposal.accepted", tenant=prop.tenant_id, object_type="proposal",
                 object_id=prop.pk, payload={"candidate": cand.pk, "kind": prop.kind})
    return cand


def _json_or_error(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ServiceError(f"the tool schemas must be JSON: {e}") from None


@tenant_atomic("proposal.tenant_id")
def dismiss_proposal(actor: Any, proposal: Proposal, reason: str) -> Proposal:
    reason = _require_reason(reason)
    _require(actor, proposal.tenant_id, "manage_evolution", "dismiss a proposal")
    claimed = (Proposal.objects.filter(pk=proposal.pk, status=Proposal.Status.OPEN)
               .update(status=Proposal.Status.DISMISSED, decided_by=_user(actor),
                       decided_at=timezone.now(), decision_reason=reason))
    if not claimed:
        raise ServiceConflict(f"proposal {proposal.pk} is not open")
    record_event(actor, "proposal.dismissed", tenant=proposal.tenant_id, object_type="proposal",
                 object_id=proposal.pk, payload={"reason_sha256": _digest(reason)})
    proposal.refresh_from_db()
    return proposal
