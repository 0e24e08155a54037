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

Steps, interactions and findings are partitioned by month (governance/partitions.py, decision
33). A month whose every step and interaction is past its deadline — under its own tenant's
policy for its classification — is dropped whole (drop_expired_partitions) after what outside
that month depends on its rows is dealt with as the row-by-row purge would; what remains is
purged row by row, which PostgreSQL prunes to the partitions older than each cutoff (in
practice the one month that straddles the deadline).

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
from django.db import OperationalError, connection, transaction
from django.db.models import Count, Exists, Max, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from governance.audit import record_event
from governance.capture.atdp import CLASSIFICATION_ORDER
from governance.capture.conversation import (
    delete_unreferenced_items,
    keep_answers_of,
    reroot_children,
)
from governance.capture.rawstore import rebase_dependents
from governance.models import (
    DeadLetter,
    Finding,
    Interaction,
    PendingInteraction,
    RetentionPolicy,
    Reward,
    Step,
    SubjectIndex,
    Tenant,
    Trajectory,
)
from governance.partitions import Month, drop_partition, monthly_partitions
from governance.tenancy import tenant_context

log = logging.getLogger("steward.retention")

ACTOR = "system:retention"
DEFAULT_STEPS_DAYS = 365
DEFAULT_FINDINGS_DAYS = 365
DEFAULT_AUDIT_DAYS = 3650
BATCH_SIZE = 1000
TIME_BUDGET_S = 240.0
# How long a partition drop waits for the parent tables' lock: while it waits, every insert
# into them queues behind it, so it gives up soon and the next run tries again.
DROP_LOCK_TIMEOUT_MS = 3000


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
            # Items repeating a purged step's answer get the message itself (decision 62).
            keep_answers_of(traj_ids, Step.objects.filter(pk__in=doomed))
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
    if tenant_id is None:
        # Whole months first (they span tenants): what they take, no batch deletes.
        drop_expired_partitions(now=now, deadline=deadline)
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


# --- whole months -------------------------------------------------------------------------


def _in(month: Month, field: str = "started_at") -> Q:
    return Q(**{f"{field}__gte": month.start, f"{field}__lt": month.end})


def _month_expired(tenant_id: int, month: Month, policies: dict[str, Effective],
                   now: datetime) -> bool | None:
    """Whether every step and interaction of this tenant in `month` is past its deadline by
    the rules of _purge_batch (None: the tenant has no row there). A step whose interaction
    lies in another month (or the reverse) keeps the month: the row-by-row purge handles it."""
    steps = Step.objects.for_tenant(tenant_id).filter(_in(month))
    interactions = Interaction.objects.for_tenant(tenant_id).filter(_in(month))
    groups = list(steps.order_by().values("classification").annotate(last=Max("started_at")))
    orphans = interactions.filter(step__isnull=True).aggregate(last=Max("started_at"))["last"]
    if not groups and orphans is None and not interactions.exists():
        return None
    for group in groups:
        policy = policies.get(group["classification"], policies[RetentionPolicy.ANY])
        if group["last"] >= now - timedelta(days=policy.steps_days):
            return False
    if orphans is not None and orphans >= now - timedelta(days=policies["internal"].steps_days):
        return False
    if steps.filter(interaction__isnull=False).exclude(_in(month, "interaction__started_at")) \
            .exists() or interactions.filter(step__isnull=False) \
            .exclude(_in(month, "step__started_at")).exists():
        return False
    return True


def _release_month(tenant_id: int, month: Month) -> tuple[dict[str, int], set]:
    """Before this tenant's rows of `month` go with their partitions: what the row-by-row
    purge does for what depends on them, for the rows outside the month that do. Returns the
    counts and the trajectories touched."""
    from governance.services import invalidate_versions_containing

    steps = Step.objects.filter(_in(month))
    interactions = Interaction.objects.filter(_in(month))
    traj_ids = set(steps.values_list("trajectory_id", flat=True).distinct()) | set(
        interactions.values_list("trajectory_id", flat=True).distinct())
    counts = {
        "steps": steps.count(), "interactions": interactions.count(),
        "raw_payloads": interactions.filter(raw_ciphertext__isnull=False).count(),
        "findings": Finding.objects.filter(_in(month, "created_at"),
                                           step_id__in=steps.values("pk"))
        .aggregate(n=Coalesce(Sum("total"), 0))["n"],
        "invalidated_versions": len(invalidate_versions_containing(
            ACTOR, tenant_id, traj_ids, "retention: member steps expired")),
    }
    # Later steps extending one of these take their whole history first (conversation
    # store); later payloads stored as deltas of these are sealed whole.
    parents = list(Step.objects.filter(parent_step__in=steps.values("pk")).exclude(_in(month))
                   .values_list("parent_step", flat=True).distinct())
    reroot_children(parents)
    keep_answers_of(traj_ids, steps)
    bases = list(Interaction.objects.filter(trajectory_id__in=interactions.values("trajectory_id"),
                                            raw_base_flow__in=interactions.values("flow_id"),
                                            raw_ciphertext__isnull=False)
                 .exclude(_in(month)).values_list("raw_base_flow", flat=True).distinct())
    rebase_dependents(bases)
    # Findings of these steps built after the month ended live in a later partition.
    later = Finding.objects.filter(created_at__gte=month.end, step_id__in=steps.values("pk"))
    counts["findings"] += later.aggregate(n=Coalesce(Sum("total"), 0))["n"]
    later.delete()
    # Not partitioned: the subject index rows of these steps and interactions, and the
    # pending rows of its calls never built (quarantined or waiting; same month key).
    counts["subject_index"] = SubjectIndex.objects.filter(
        Q(step_id__in=steps.values("pk")) | Q(interaction_id__in=interactions.values("pk"))
    ).delete()[0]
    PendingInteraction.objects.filter(_in(month)).delete()
    return counts, traj_ids


def _findings_month_free(month: Month) -> bool:
    """Whether every finding created in `month` belongs to a step of that month (findings
    of an older month's step still kept must stay)."""
    return not Finding.objects.filter(_in(month, "created_at")).exclude(
        step_id__in=Step.objects.filter(_in(month)).values("pk")).exists()


def _drop_month(month: Month, now: datetime, tenants: list[int],
                policies: dict[int, dict[str, Effective]]) -> dict[str, Any] | None:
    """One transaction: check the month, release it per tenant, drop its partitions, audit
    per tenant. None when some row in it is not expired yet."""
    with transaction.atomic():
        present = []
        for tid in tenants:
            with tenant_context(tid):
                expired = _month_expired(tid, month, policies[tid], now)
            if expired is False:
                return None
            if expired:
                present.append(tid)
        with connection.cursor() as cur:
            cur.execute("SET LOCAL lock_timeout = %s", [f"{DROP_LOCK_TIMEOUT_MS}ms"])
        released: dict[int, tuple[dict[str, int], set]] = {}
        for tid in present:
            with tenant_context(tid):
                released[tid] = _release_month(tid, month)
        # Every tenant, not only those with steps this month: another's kept step of an older
        # month may have findings built in this one.
        free = True
        for tid in tenants:
            with tenant_context(tid):
                free = free and _findings_month_free(month)
        if not free:
            # Findings of older, still kept steps share the month: only these steps' go.
            for tid in present:
                with tenant_context(tid):
                    Finding.objects.filter(_in(month, "created_at"), step_id__in=Step.objects
                                           .filter(_in(month)).values("pk")).delete()
        dropped = []
        for table in ("governance_finding", "governance_step", "governance_interaction"):
            if table == "governance_finding" and not free:
                continue
            if drop_partition(table, month):
                dropped.append(month.partition(table))
            else:
                # No partition for that month (rows in the DEFAULT one): row by row.
                for tid in present:
                    with tenant_context(tid):
                        model = {"governance_finding": Finding, "governance_step": Step,
                                 "governance_interaction": Interaction}[table]
                        field = "created_at" if model is Finding else "started_at"
                        model.objects.filter(_in(month, field)).delete()
        for tid in present:
            counts, traj_ids = released[tid]
            with tenant_context(tid):
                counts["conversation_items"] = delete_unreferenced_items(traj_ids)
                remaining = (Step.objects.filter(trajectory_id=OuterRef("pk")).order_by()
                             .values("trajectory_id").annotate(n=Count("pk")).values("n"))
                Trajectory.objects.filter(pk__in=traj_ids).update(
                    step_count=Coalesce(Subquery(remaining), 0))
                record_event(ACTOR, "retention.partition_dropped", tenant=tid,
                             object_type="tenant", object_id=tid,
                             payload={**counts, "month": f"{month.start:%Y-%m}",
                                      "partitions": dropped, "policies": {
                                          label: {"steps_days": p.steps_days,
                                                  "raw_days": p.raw_days, "source": p.source}
                                          for label, p in sorted(policies[tid].items())}})
        return {"month": f"{month.start:%Y-%m}", "partitions": dropped, "tenants": present}


def drop_expired_partitions(*, now: datetime | None = None,
                            deadline: float | None = None) -> list[dict[str, Any]]:
    """Drop each month (oldest first) of steps, interactions and findings whose every row is
    past its deadline, each in its own transaction; a month still holding a live row is left
    to the row-by-row purge. Returns what was dropped. Idempotent: a dropped month is gone, a
    failed one (a lock not granted in time) is tried again by the next run."""
    now = now or timezone.now()
    wall = timezone.now()
    tenants = list(Tenant.objects.order_by("pk").values_list("pk", flat=True))
    policies = {tid: effective_policies(tid) for tid in tenants}
    shortest = min((p.steps_days for pol in policies.values() for p in pol.values()),
                   default=DEFAULT_STEPS_DAYS)
    results = []
    for month in monthly_partitions("governance_step"):
        # Not over yet (the drop function refuses it), or too young for any policy.
        if month.end > wall or month.start >= now - timedelta(days=shortest):
            break
        if deadline is not None and time.monotonic() > deadline:
            break
        try:
            outcome = _drop_month(month, now, tenants, policies)
        except OperationalError as exc:  # lock_timeout: the next run tries again
            log.warning("retention: month %s not dropped: %s", month.suffix(), exc)
            continue
        if outcome is not None:
            log.info("retention: dropped %s", outcome)
            results.append(outcome)
    return results
