"""Celery tasks of the evolution control plane (issue 7).

`run_gates(candidate_id)` (queue `gpu`): the offline gates shadow_eval -> replay -> safety for
one candidate, then its canary.
1. Route: the candidate id's tenant comes from the SECURITY DEFINER function
   steward_candidate_tenant (trainer migration 0003); all else runs in that tenant's scope, in
   short transactions (never one around a model's generation).
2. Claim with a conditional UPDATE: pending -> running; also this same task's retry, or a
   running candidate at an offline gate whose heartbeat is stale (its worker died). A duplicate
   message claims nothing; a finished candidate is never run again (idempotent). A retry goes
   on from the gate it reached (passed gates are stored and the stage moved on).
3. Each gate: gather inputs in the tenant scope, evaluate the candidate and the current policy
   (evolution.gates policies), decide (pure functions), store the GateResult and move or
   stop the candidate (evolution.services.record_offline_gate).
4. Bounded retries (3) on database connection errors; any other error stops the candidate at
   the gate it was on, with the error as the reason.

`push_candidate_weights(candidate_id)` (queue `gpu`): the weight push of a promotion or a
rollback, recorded as intent by evolution.services (status promoting / rolling_back)
and enqueued when that transaction commits. Claims with a conditional UPDATE (a duplicate
message or a finished push claims nothing), pushes with no transaction open, and records the
outcome in its own audited transaction. Bounded retries: MAX_RETRIES when the engine does not
answer or the database connection drops; an engine that answers with a refusal is final
(push_failed). advance_candidates re-sends a push whose message or worker was lost.

`advance_evolution()` (beat, 30 s): decides every canary route (evolution.canary.
evaluate_canaries), then, in the same tick, advance_candidates follows each route's decision
into the promote gate or a rollback, starts canaries that waited for the agent's previous
route to end, re-sends the message of a candidate left pending (a broker outage loses it), and
rolls back a candidate whose checkpoint erasure tainted (in the pipeline, or the agent's
current promoted weights).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import shared_task
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.db.models import Q
from django.utils import timezone

from evolution import gates as ev
from evolution import services as svc
from evolution.canary import evaluate_canaries
from evolution.models import Candidate, EvolutionPolicy
from governance import jobs
from governance.audit import record_event
from governance.engines import Engine
from governance.models import DatasetVersion, Step, Tenant
from governance.tenancy import tenant_context
from trainer.taskdata import Example, iter_examples, member_trajectory_ids, version_refusal

log = logging.getLogger("steward.evolution")
MAX_RETRIES = 3
STALE = timedelta(minutes=15)
RESEND_AFTER = timedelta(minutes=5)


def candidate_tenant(candidate_id: int) -> int | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT steward_candidate_tenant(%s)", [candidate_id])
        row = cursor.fetchone()
    return row[0] if row else None


def claim(candidate_id: int, tenant_id: int, task_id: str, is_retry: bool) -> bool:
    with tenant_context(tenant_id):
        updated = jobs.claim(Candidate, candidate_id, tenant_id, task_id,
                             waiting=Candidate.Status.PENDING, is_retry=is_retry,
                             stale_after=STALE, running_filter=Q(stage__in=svc.OFFLINE_GATES))
        if updated:
            cand = Candidate.objects.get(pk=candidate_id)
            cand.attempts += 1
            cand.thresholds = svc.thresholds_for(tenant_id).to_dict()
            cand.save(update_fields=["attempts", "thresholds"])
            record_event(svc.SYSTEM_ACTOR, "candidate.gates_started", tenant=tenant_id,
                         object_type="candidate", object_id=candidate_id,
                         payload={"attempt": cand.attempts, "stage": cand.stage,
                                  "task_id": task_id})
    return bool(updated)


# --- the inputs of the offline gates -------------------------------------------------------


@dataclass
class GateInputs:
    th: ev.Thresholds
    candidate: ev.Policy
    current: ev.Policy
    shadow: list[tuple[ev.Prompt, dict[str, Any]]] = field(default_factory=list)
    replay: list[tuple[ev.Prompt, bool]] = field(default_factory=list)
    reward_fn_name: str = "reference_answer"
    eval_version: int | None = None
    held_out_skipped: int = 0
    baseline: dict[str, Any] = field(default_factory=dict)


def _eval_version(cand: Candidate, policy: EvolutionPolicy | None,
                  train_version_id: int | None) -> DatasetVersion | None:
    """The held-out eval split: the candidate's, else the tenant's default, else the newest
    approved version that is not the one the checkpoint was trained on."""
    for v in (cand.eval_version, policy.eval_version if policy else None):
        if v is not None:
            return v
    qs = (DatasetVersion.objects.for_tenant(cand.tenant_id)
          .filter(status=DatasetVersion.Status.APPROVED, invalidated_at__isnull=True)
          .select_related("approval").order_by("-created_at"))
    if train_version_id:
        qs = qs.exclude(pk=train_version_id)
    return next((v for v in qs[:20] if version_refusal(v) is None), None)


def _agent_model(cand: Candidate) -> str:
    return (Step.objects.for_tenant(cand.tenant_id).filter(trajectory__agent_id=cand.agent_id)
            .exclude(request_model="").order_by("-started_at")
            .values_list("request_model", flat=True).first()) or ""


def _engine(url: str, what: str) -> Engine | str:
    """The operator's candidate engine at `url`, or the reason it cannot be used (a row from
    before the allow-list, or an engine the operator has since removed): prompts and a
    credential go only to a listed engine, and each engine gets only its own credential."""
    from governance.engines import candidate_engine
    from governance.services import ServiceError

    try:
        return candidate_engine(url, what)
    except ServiceError as exc:
        return str(exc)


def _upstream_baseline(cand: Candidate, policy: EvolutionPolicy | None
                       ) -> tuple[ev.Policy | None, dict[str, Any]]:
    """The current production policy behind the proxy: the tenant's baseline upstream and
    model, else STEWARD_UPSTREAM_URL and the model the agent last asked for."""
    url = (policy.baseline_upstream_url if policy else "") or settings.STEWARD_UPSTREAM_URL
    model = (policy.baseline_model if policy else "") or _agent_model(cand)
    if not url or not model:
        return None, {"error": "no current policy to compare with: set the baseline upstream "
                               "and model (evolution policy) or STEWARD_UPSTREAM_URL"}
    engine = _engine(url, "the baseline upstream")
    if isinstance(engine, str):
        return None, {"error": engine}
    return (ev.UpstreamPolicy(engine.url, model, api_key=engine.api_key,
                              label=f"current: {model}", max_tokens=256),
            {"kind": "upstream", "url": engine.url, "model": model, "engine": engine.name})


def gather_inputs(candidate_id: int, tenant_id: int) -> GateInputs | str:
    """Everything the offline gates need, read in the tenant's scope; a string is the reason
    the gates cannot run (the candidate is stopped with it)."""
    from trainer.runtime import TINY_BASE
    from trainer.tasks import ensure_tiny_base

    th = ev.Thresholds.from_dict(None)
    with tenant_context(tenant_id):
        cand = (Candidate.objects.select_related("checkpoint", "checkpoint__job",
                                                 "context_update", "eval_version")
                .get(pk=candidate_id))
        th = ev.Thresholds.from_dict(cand.thresholds)
        policy = EvolutionPolicy.objects.for_tenant(tenant_id).select_related(
            "eval_version").first()
        ckpt, job = cand.checkpoint, cand.checkpoint.job if cand.checkpoint_id else None
        if ckpt is not None:
            refusal = svc.checkpoint_refusal(ckpt)
            if refusal:
                return refusal
        # The policies.
        if cand.is_context:
            current, baseline = _upstream_baseline(cand, policy)
            if current is None:
                return baseline["error"]
            update = cand.context_update
            candidate: ev.Policy = ev.UpstreamPolicy(
                baseline["url"], baseline["model"], label=f"candidate: {cand.kind} update "
                f"v{update.version}", context_update=(update.kind, update.content),
                api_key=current.api_key)  # the same engine as the baseline: its credential
        elif cand.upstream_url:
            current, baseline = _upstream_baseline(cand, policy)
            if current is None:
                return baseline["error"]
            engine = _engine(cand.upstream_url, "the candidate's upstream_url")
            if isinstance(engine, str):
                return engine
            candidate = ev.UpstreamPolicy(engine.url, cand.model,
                                          label=f"candidate: {cand.model}",
                                          api_key=engine.api_key)
        else:
            path, version, what = svc._previous_weights(cand)
            if job is not None and job.base_model == TINY_BASE and path == Path(
                    job.base_model_path):
                ensure_tiny_base(path)
            candidate = ev.HFPolicy(svc._model_dir(ckpt), label=f"checkpoint {ckpt.pk}",
                                    max_new_tokens=th.max_new_tokens)
            current = ev.HFPolicy(path, label=f"current: {what}",
                                  max_new_tokens=th.max_new_tokens)
            baseline = {"kind": "checkpoint", "path": str(path), "what": what,
                        "weight_version": version}
        # The data: a held-out approved split with reference rewards, and logged prompts.
        train_version = job.dataset_version_id if job else None
        version = _eval_version(cand, policy, train_version)
        if version is None:
            return ("no approved dataset version to evaluate on (a held-out eval split with "
                    "reference rewards): approve one and set it as the eval version")
        refusal = version_refusal(DatasetVersion.objects.select_related("approval")
                                  .get(pk=version.pk))
        if refusal:
            return f"the eval split may not be used: {refusal}"
        reward_fn = job.reward_fn if job else "reference_answer"
        reference_reward = job.reference_reward if job else "reference"
        params = {k: v for k, v in ((job.reward_params if job else None) or {}).items()
                  if k != "reward_name"}
        if reward_fn == "logged":  # per-prompt pooled references: judge by the verifier
            reward_fn = "reference_answer"
        trained = set(member_trajectory_ids(job.dataset_version)) if job else set()
        examples: list[Example] = list(iter_examples(version, reference_reward=reference_reward))
        held_out = [e for e in examples if e.trajectory_id not in trained]
        replay_pool = list(held_out)
        if job is not None:  # the training version's prompts are approved logged prompts too
            replay_pool += [e for e in iter_examples(job.dataset_version,
                                                     reference_reward=reference_reward)]
    inputs = GateInputs(th=th, candidate=candidate, current=current, reward_fn_name=reward_fn,
                        eval_version=version.pk, baseline=baseline,
                        held_out_skipped=len(examples) - len(held_out))
    inputs.shadow = [(ev.Prompt(e.prompt, e.tools), {**params, **e.reference})
                     for e in held_out if e.reference is not None][:th.eval_limit]
    replay_pool.sort(key=lambda e: (not e.tools, e.trajectory_id))  # tool prompts first
    inputs.replay = [(ev.Prompt(e.prompt, e.tools),
                      bool(e.completion and e.completion.get("tool_calls")))
                     for e in replay_pool][:th.eval_limit]
    with tenant_context(tenant_id):
        Candidate.objects.filter(pk=candidate_id).update(baseline={
            **baseline, "eval_version": version.pk, "reward_fn": reward_fn,
            "held_out_examples": len(inputs.shadow),
            "excluded_training_members": inputs.held_out_skipped})
    return inputs


def evaluate_gate(gate: str, inputs: GateInputs) -> ev.Decision:
    from trainer.rewards import get_reward_fn

    th = inputs.th
    if gate == "shadow_eval":
        fn = get_reward_fn(inputs.reward_fn_name)
        cand = ev.shadow_metrics(inputs.candidate, inputs.shadow, fn)
        cur = ev.shadow_metrics(inputs.current, inputs.shadow, fn)
        d = ev.shadow_decision(cand, cur, th.shadow_margin)
        d.metrics.update(reward_fn=inputs.reward_fn_name, eval_version=inputs.eval_version,
                         candidate_policy=inputs.candidate.label,
                         current_policy=inputs.current.label,
                         excluded_training_members=inputs.held_out_skipped)
        return d
    if gate == "replay":
        d = ev.replay_decision(ev.replay_metrics(inputs.candidate, inputs.replay),
                               ev.replay_metrics(inputs.current, inputs.replay),
                               th.replay_tolerance)
        d.metrics.update(candidate_policy=inputs.candidate.label,
                         current_policy=inputs.current.label)
        return d
    if gate == "safety":
        fn = get_reward_fn(inputs.reward_fn_name)
        hacks = ev.verifier_hacks(fn, inputs.reward_fn_name, [r for _, r in inputs.shadow])
        d = ev.safety_decision(ev.safety_metrics(inputs.candidate),
                               ev.safety_metrics(inputs.current), hacks, th)
        d.metrics.update(safety_set=ev.safety_set()["name"] + "@" + ev.safety_set()["version"],
                         candidate_policy=inputs.candidate.label,
                         current_policy=inputs.current.label)
        return d
    raise ValueError(f"not an offline gate: {gate}")


def execute_gates(candidate_id: int, tenant_id: int) -> str:
    """The offline gates from the candidate's current stage on; returns the final status."""
    inputs: GateInputs | str | None = None
    while True:
        with tenant_context(tenant_id):
            cand = Candidate.objects.get(pk=candidate_id)
        if cand.status != Candidate.Status.RUNNING or cand.stage not in svc.OFFLINE_GATES:
            break
        if inputs is None:
            try:
                inputs = gather_inputs(candidate_id, tenant_id)
            except (OperationalError, InterfaceError):
                raise
            except Exception as e:  # noqa: BLE001 — stop with the reason, never hang running
                log.exception("candidate %s: gathering the gate inputs failed", candidate_id)
                inputs = f"the gate inputs could not be read: {type(e).__name__}: {e}"
        if isinstance(inputs, str):
            decision = ev.Decision(cand.stage, False, inputs)
        else:
            try:
                decision = evaluate_gate(cand.stage, inputs)
            except (OperationalError, InterfaceError):
                raise
            except Exception as e:  # noqa: BLE001 — a gate that cannot run stops the candidate
                log.exception("candidate %s: gate %s failed to run", candidate_id, cand.stage)
                decision = ev.Decision(cand.stage, False,
                                       f"the gate could not run: {type(e).__name__}: {e}")
        if not svc.record_offline_gate(candidate_id, tenant_id, decision):
            break
    with tenant_context(tenant_id):
        cand = Candidate.objects.get(pk=candidate_id)
    if cand.status == Candidate.Status.PASSED:
        svc.start_candidate_canary(candidate_id, tenant_id)
        with tenant_context(tenant_id):
            cand = Candidate.objects.get(pk=candidate_id)
    return cand.status


def requeue(candidate_id: int, tenant_id: int) -> None:
    try:
        with tenant_context(tenant_id):
            Candidate.objects.filter(pk=candidate_id, status=Candidate.Status.RUNNING,
                                     stage__in=svc.OFFLINE_GATES).update(
                status=Candidate.Status.PENDING)
    except (OperationalError, InterfaceError):
        pass


@shared_task(bind=True, name="evolution.tasks.run_gates", acks_late=True,
             max_retries=MAX_RETRIES)
def run_gates(self: Any, candidate_id: int) -> str:
    tenant_id = candidate_tenant(candidate_id)
    if tenant_id is None:
        return "missing"
    task_id = self.request.id or f"local-{candidate_id}"
    if not claim(candidate_id, tenant_id, task_id, is_retry=bool(self.request.retries)):
        return "skipped"
    try:
        return execute_gates(candidate_id, tenant_id)
    except (OperationalError, InterfaceError) as exc:
        requeue(candidate_id, tenant_id)
        raise self.retry(exc=exc, countdown=5 * (self.request.retries + 1)) from exc


@shared_task(bind=True, name="evolution.tasks.push_candidate_weights", acks_late=True,
             max_retries=MAX_RETRIES)
def push_candidate_weights(self: Any, candidate_id: int) -> str:
    """Push the recorded plan's weights (module docstring); returns the candidate's new
    status, "skipped" (nothing to claim) or "missing"."""
    tenant_id = candidate_tenant(candidate_id)
    if tenant_id is None:
        return "missing"
    task_id = self.request.id or f"local-push-{candidate_id}"
    try:
        plan = svc.claim_push(candidate_id, tenant_id, task_id)
        if plan is None:
            return "skipped"
        error = plan["refusal"] and f"refused: {plan['refusal']}"
        if not error:
            try:
                svc.push_weights(plan["engine"], Path(plan["path"]), plan["weight_version"])
            except svc.EngineUnavailable as exc:
                if self.request.retries < MAX_RETRIES:
                    raise self.retry(exc=exc, countdown=10 * (self.request.retries + 1)) \
                        from exc
                error = f"{exc} (after {MAX_RETRIES + 1} attempts)"
            except svc.ServiceError as exc:
                error = str(exc)
        return svc.record_push_outcome(candidate_id, tenant_id, task_id, error or None)
    except (OperationalError, InterfaceError) as exc:
        raise self.retry(exc=exc, countdown=5 * (self.request.retries + 1)) from exc


def advance_candidates() -> dict[str, int]:
    """The candidate half of advance_evolution: per tenant, follow canary decisions, start
    waiting canaries, re-send lost messages. One candidate's error never blocks the others."""
    counts: dict[str, int] = {}
    for tenant_id in Tenant.objects.values_list("pk", flat=True):
        try:
            tainted = svc.roll_back_tainted(tenant_id)
        except (OperationalError, InterfaceError):
            raise
        except Exception:  # noqa: BLE001
            log.exception("tenant %s: rolling back tainted candidates failed", tenant_id)
            tainted = []
        if tainted:
            counts["tainted_rolled_back"] = counts.get("tainted_rolled_back", 0) + len(tainted)
        resent = svc.resend_stale_pushes(tenant_id)
        if resent:
            counts["resent_push"] = counts.get("resent_push", 0) + resent
        with tenant_context(tenant_id):
            rows = list(Candidate.objects.for_tenant(tenant_id)
                        .filter(status__in=Candidate.LIVE)
                        .values_list("pk", "status", "stage", "heartbeat_at"))
        for pk, status, stage, heartbeat in rows:
            try:
                if status in Candidate.PUSHING:
                    outcome = "pushing"  # its task records the outcome (stale: resent above)
                elif status == Candidate.Status.RUNNING and stage == "canary":
                    outcome = svc.follow_route(pk, tenant_id)
                elif status == Candidate.Status.PASSED:
                    outcome = svc.start_candidate_canary(pk, tenant_id)
                elif status == Candidate.Status.PENDING and (
                        heartbeat is None or heartbeat < timezone.now() - RESEND_AFTER):
                    with tenant_context(tenant_id):
                        Candidate.objects.filter(pk=pk).update(heartbeat_at=timezone.now())
                    run_gates.delay(pk)
                    outcome = "resent"
                else:
                    outcome = "wait"
            except (OperationalError, InterfaceError):
                raise
            except Exception:  # noqa: BLE001
                log.exception("candidate %s: advancing failed", pk)
                outcome = "error"
            counts[outcome] = counts.get(outcome, 0) + 1
    return counts


@shared_task(name="evolution.tasks.advance_evolution",
             autoretry_for=(OperationalError, InterfaceError), max_retries=3,
             retry_backoff=True, retry_backoff_max=30, retry_jitter=True)
def advance_evolution() -> dict[str, dict[str, int]]:
    """Celery beat (every 30 s), the one tick of the control plane: decide the canary routes
    first (evolution.canary.evaluate_canaries), then move the candidates after them
    (advance_candidates), so a route promoted or rolled back in this tick has its candidate
    promoted or rolled back in the same tick (two tasks on two 30 s timers took up to 60 s).
    Both halves are idempotent: a retry after a dropped connection redoes only what is left."""
    return {"routes": evaluate_canaries(), "candidates": advance_candidates()}


__all__ = ["advance_candidates", "advance_evolution", "push_candidate_weights", "run_gates"]
