"""Retention: which data of a tenant has expired, and the bounded purge that removes it
(run by Celery beat through governance.tasks.purge_expired).

Per tenant and classification (a step's `classification`; "*" covers the rest), with these
defaults when a tenant has no policy:
- raw payloads: STEWARD_RAW_RETENTION_DAYS (7) days after capture — the ciphertext is destroyed
  (`raw_ciphertext` NULL), the interaction's metadata stays with its step;
- steps: 365 days after the call; the step goes together with its interaction row; a
  trajectory left with neither is deleted with the rewards naming it (append-only rows,
  deleted under services.purge_allowed());
- findings: 365 days (enforced once PII findings are stored: no such table yet);
- dead letters: the sealed record like a raw payload, the row like an interaction that never
  became a step;
- audit: 3650 days — reported, never purged. Deleting audit rows would cut the hash chain, and
  its payloads hold pseudonymous ids only, so keeping them keeps no personal data.

A raw payload is destroyed by the first of: its `raw_expires_at` (set at shipping) or the
current policy's `raw_days` (a policy shortened later applies to what is already stored).
Versions of datasets holding a trajectory whose steps are purged are invalidated first.

Each batch (at most `batch_size` rows of each kind) is its own transaction, scoped to its tenant
(row-level security: governance.tenancy.tenant_context), with one audit event carrying the
counts; batches repeat until nothing is left or the time budget is spent. Running it again finds
nothing (idempotent); a crash loses at most one uncommitted batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Exists, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from governance.audit import record_event
from governance.capture.atdp import CLASSIFICATION_ORDER
from governance.capture.conversation import delete_unreferenced_items, reroot_children
from governance.capture.rawstore import rebase_dependents
from governance.models import (
    DeadLetter,
    Interaction,
    RetentionPolicy,
    Reward,
    Step,
    Tenant,
    Trajectory,
)
from governance.tenancy import tenant_context

log = logging.getLogger("steward.retention")

ACTOR = "system:retention"
DEFAULT_STEPS_DAYS = 365
DEFAULT_FINDINGS_DAYS = 365
DEFAULT_AUDIT_DAYS = 3650
BATCH_SIZE = 1000
TIME_BUDGET_S = 240.0


@dataclass(frozen=True)
class Effective:
    classification: str
    steps_days: int
    raw_days: int
    findings_days: int
    audit_days: int
    source: str  # "policy:<id>" or "default"


def default_policy(classification: str = RetentionPolicy.ANY) -> Effective:
    return Effective(classification, DEFAULT_STEPS_DAYS,
                     int(getattr(settings, "STEWARD_RAW_RETENTION_DAYS", 7)),
                     DEFAULT_FINDINGS_DAYS, DEFAULT_AUDIT_DAYS, "default")


def effective_policies(tenant: Tenant | int) -> dict[str, Effective]:
    """The policy in force for every known classification and for "*" (the rest)."""
    tenant_id = tenant if isinstance(tenant, int) else tenant.pk
    with tenant_context(tenant_id):
        rows = {p.classification: p for p in RetentionPolicy.objects.for_tenant(tenant_id)}

    def eff(label: str, p: RetentionPolicy | None) -> Effective:
        if p is None:
            return default_policy(label)
        return Effective(label, p.steps_days, p.raw_days, p.findings_days, p.audit_days,
                         f"policy:{p.pk}")

    fallback = rows.get(RetentionPolicy.ANY)
    out = {RetentionPolicy.ANY: eff(RetentionPolicy.ANY, fallback)}
    for label in CLASSIFICATION_ORDER:
        out[label] = eff(label, rows.get(label, fallback))
    return out


@dataclass(frozen=True)
class StepDeadlines:
    step_id: str
    steps: datetime          # the step (and its interaction) is purged after this
    raw: datetime | None     # the raw payload is destroyed after this; None: already gone
    findings: datetime
    source: str              # "policy:<id>" or "default"


def step_deadlines(tenant_id: int, trajectory_id: Any) -> dict[str, StepDeadlines]:
    """The deadlines the purge applies to each step of one trajectory, by the same rules as
    _purge_batch: the policy of the step's classification ("*" or the defaults otherwise);
    a raw payload goes at the first of its `raw_expires_at` and the policy's raw_days."""
    policies = effective_policies(tenant_id)
    rows = (Step.objects.for_tenant(tenant_id).filter(trajectory_id=trajectory_id)
            .values("pk", "started_at", "classification", "interaction__raw_expires_at")
            .annotate(has_raw=Q(interaction__raw_ciphertext__isnull=False)))
    out: dict[str, StepDeadlines] = {}
    for row in rows:
        policy = policies.get(row["classification"], policies[RetentionPolicy.ANY])
        started = row["started_at"]
        raw = None
        if row["has_raw"]:
            raw = started + timedelta(days=policy.raw_days)
            if row["interaction__raw_expires_at"] is not None:
                raw = min(raw, row["interaction__raw_expires_at"])
        out[str(row["pk"])] = StepDeadlines(
            str(row["pk"]), started + timedelta(days=policy.steps_days), raw,
            started + timedelta(days=policy.findings_days), policy.source)
    return out


def _expired(policies: dict[str, Effective], now: datetime, days_field: str,
             time_field: str, classification_field: str) -> Q:
    """Rows whose classification's retention has passed: one OR-ed term per known
    classification, and the "*" policy for any other label."""
    q = Q()
    for label in CLASSIFICATION_ORDER:
        cutoff = now - timedelta(days=getattr(policies[label], days_field))
        q |= Q(**{classification_field: label, f"{time_field}__lt": cutoff})
    cutoff = now - timedelta(days=getattr(policies[RetentionPolicy.ANY], days_field))
    q |= Q(**{f"{time_field}__lt": cutoff}) & ~Q(
        **{f"{classification_field}__in": list(CLASSIFICATION_ORDER)})
    return q


def _purge_batch(tenant_id: int, policies: dict[str, Effective], now: datetime,
                 batch_size: int) -> dict[str, int]:
    """One transaction: at most `batch_size` raw payloads, steps (with their interactions),
    orphan interactions and empty trajectories. Returns the counts (all zero: done)."""
    from governance.services import invalidate_versions_containing, purge_allowed

    counts = {"raw_payloads": 0, "steps": 0, "interactions": 0, "trajectories": 0,
              "rewards": 0, "invalidated_versions": 0, "dead_letters": 0,
              "conversation_items": 0}
    default = policies[RetentionPolicy.ANY]
    internal = policies["internal"]
    # One transaction per batch, under the tenant's row-level security scope.
    with tenant_context(tenant_id):
        # Raw payloads: expired at shipping time, or by the policy of the step's classification
        # (an interaction without a step yet counts as "internal", the step builder's label).
        raw_q = Q(raw_expires_at__lte=now) | (
            Q(step__isnull=True, started_at__lt=now - timedelta(days=internal.raw_days))
            | _expired(policies, now, "raw_days", "started_at", "step__classification"))
        raw_ids = list(Interaction.objects.for_tenant(tenant_id)
                       .filter(raw_ciphertext__isnull=False).filter(raw_q)
                       .order_by("started_at").values_list("pk", flat=True)[:batch_size])
        if raw_ids:
            # A later payload stored as a delta of one of these is sealed whole first.
            rebase_dependents(list(Interaction.objects.filter(pk__in=raw_ids)
                                   .values_list("flow_id", flat=True)))
            counts["raw_payloads"] = Interaction.objects.filter(pk__in=raw_ids).update(
                raw_ciphertext=None, raw_base_flow="")

        step_rows = list(Step.objects.for_tenant(tenant_id)
                         .filter(_expired(policies, now, "steps_days", "started_at",
                                          "classification"))
                         .order_by("started_at")
                         .values_list("pk", "trajectory_id", "interaction_id")[:batch_size])
        if step_rows:
            traj_ids = {t for _, t, _ in step_rows}
            counts["invalidated_versions"] = len(invalidate_versions_containing(
                ACTOR, tenant_id, traj_ids, "retention: member steps expired"))
            doomed = [s for s, _, _ in step_rows]
            # The conversation store (issue 16): a remaining step that extends a purged one
            # takes its whole history itself first; items no step references go after.
            reroot_children(doomed)
            # Rows of the model itself: delete()'s total counts the cascaded findings too.
            counts["steps"] = Step.objects.filter(pk__in=doomed).delete()[1].get(
                Step._meta.label, 0)
            counts["conversation_items"] = delete_unreferenced_items(traj_ids)
            gone = Interaction.objects.filter(
                pk__in=[i for _, _, i in step_rows if i is not None])
            rebase_dependents(list(gone.values_list("flow_id", flat=True)))
            counts["interactions"] = gone.delete()[1].get(Interaction._meta.label, 0)
            # Keep the summaries true for trajectories that lost only some steps.
            remaining = (Step.objects.filter(trajectory_id=OuterRef("pk")).order_by()
                         .values("trajectory_id").annotate(n=Count("pk")).values("n"))
            Trajectory.objects.filter(pk__in=traj_ids).update(
                step_count=Coalesce(Subquery(remaining), 0))

        # Interactions that never became a step (quarantined, or waiting), past the steps
        # retention that applies to unlabelled data.
        orphan_ids = list(Interaction.objects.for_tenant(tenant_id)
                          .filter(step__isnull=True,
                                  started_at__lt=now - timedelta(days=internal.steps_days))
                          .order_by("started_at").values_list("pk", flat=True)[:batch_size])
        if orphan_ids:
            gone = Interaction.objects.filter(pk__in=orphan_ids)
            rebase_dependents(list(gone.values_list("flow_id", flat=True)))
            counts["interactions"] += gone.delete()[1].get(Interaction._meta.label, 0)

        # Dead letters (records the shipper could not store, capture/shipper.py): their sealed
        # record goes when a raw payload would, the row with the unlabelled interactions.
        dead_raw = list(DeadLetter.objects.for_tenant(tenant_id)
                        .filter(record_ciphertext__isnull=False)
                        .filter(Q(expires_at__lte=now) | Q(
                            created_at__lt=now - timedelta(days=internal.raw_days)))
                        .order_by("created_at").values_list("pk", flat=True)[:batch_size])
        if dead_raw:
            counts["raw_payloads"] += DeadLetter.objects.filter(pk__in=dead_raw).update(
                record_ciphertext=None)
        dead_rows = list(DeadLetter.objects.for_tenant(tenant_id)
                         .filter(created_at__lt=now - timedelta(days=internal.steps_days))
                         .order_by("created_at").values_list("pk", flat=True)[:batch_size])
        if dead_rows:
            counts["dead_letters"] = DeadLetter.objects.filter(pk__in=dead_rows).delete()[0]

        # Trajectories with nothing left, and the rewards naming them.
        empty = list(Trajectory.objects.for_tenant(tenant_id)
                     .filter(last_step_at__lt=now - timedelta(days=min(
                         default.steps_days, *(p.steps_days for p in policies.values()))))
                     .exclude(Exists(Step.objects.filter(trajectory_id=OuterRef("pk"))))
                     .exclude(Exists(Interaction.objects.filter(trajectory_id=OuterRef("pk"))))
                     .order_by("last_step_at").values_list("pk", flat=True)[:batch_size])
        if empty:
            with purge_allowed():
                counts["rewards"] = Reward.objects.for_tenant(tenant_id).filter(
                    trajectory_id__in=empty).delete()[0]
            counts["invalidated_versions"] += len(invalidate_versions_containing(
                ACTOR, tenant_id, empty, "retention: trajectory purged"))
            counts["trajectories"] = Trajectory.objects.filter(pk__in=empty).delete()[1].get(
                Trajectory._meta.label, 0)
        if any(counts.values()):
            record_event(ACTOR, "retention.purged", tenant=tenant_id, object_type="tenant",
                         object_id=tenant_id,
                         payload={**counts, "policies": {
                             label: {"steps_days": p.steps_days, "raw_days": p.raw_days,
                                     "source": p.source}
                             for label, p in sorted(policies.items())}})
    return counts


def purge_tenant(tenant_id: int, *, now: datetime | None = None, batch_size: int = BATCH_SIZE,
                 deadline: float | None = None) -> dict[str, int]:
    """Purge one tenant's expired data in bounded batches until done or past `deadline`
    (time.monotonic()). Returns the totals, with `batches` and `complete`."""
    now = now or timezone.now()
    policies = effective_policies(tenant_id)
    totals: dict[str, int] = {"batches": 0}
    complete = True
    while True:
        counts = _purge_batch(tenant_id, policies, now, batch_size)
        if not any(counts.values()):
            break
        totals["batches"] += 1
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
        if deadline is not None and time.monotonic() > deadline:
            complete = False
            break
    totals["complete"] = int(complete)
    return totals


def purge_expired(tenant_id: int | None = None, *, now: datetime | None = None,
                  batch_size: int = BATCH_SIZE,
                  time_budget_s: float = TIME_BUDGET_S) -> dict[int, dict[str, int]]:
    """Purge every tenant (or one). What the time budget leaves undone, the next run does."""
    deadline = time.monotonic() + time_budget_s
    tenant_ids = [tenant_id] if tenant_id is not None else list(
        Tenant.objects.order_by("pk").values_list("pk", flat=True))
    results: dict[int, dict[str, int]] = {}
    for tid in tenant_ids:
        if results and time.monotonic() > deadline:
            break  # the first tenant always gets at least one batch
        results[tid] = purge_tenant(tid, now=now, batch_size=batch_size, deadline=deadline)
        if any(v for k, v in results[tid].items() if k not in ("complete",)):
            log.info("retention: tenant %s purged %s", tid, results[tid])
    return results
