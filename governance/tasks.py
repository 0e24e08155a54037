"""Celery tasks of the capture pipeline (queue "capture").

`build_steps(interaction_ids)` turns shipped interactions into ATDP steps: per interaction, one
transaction claims the row (SELECT ... FOR UPDATE SKIP LOCKED, state `captured` only — so two
workers given the same id, or a redelivered message, never build twice), decrypts the raw
payload, builds the step with governance/capture.py and writes the Step together with the state
change. An exchange that cannot be parsed is marked `quarantined` with its reason (it never
becomes a step, so it is never training-eligible). Database errors retry with backoff.

`build_pending_steps()` (Celery beat) re-queues interactions still `captured` a minute after
shipping: the message was lost (broker down when the shipper committed, a worker crash).

Row-level security: every task works inside `tenant_context(tenant)` (governance/tenancy.py).
A batch of interaction ids may span tenants (the shipper ships several per batch), so
build_steps first routes the ids to their tenants (the SECURITY DEFINER function
steward_interaction_tenants: ids and tenant ids only), then builds each tenant's group in its
own scope; beat tasks iterate the tenants.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction
from django.utils import timezone

from governance.audit import record_event
from governance.capture import CaptureError, build_step_fields
from governance.models import Interaction, Step, Tenant
from governance.rawstore import RawPayloadUnavailable, decode_body, open_raw
from governance.tenancy import interaction_tenants, tenant_context

log = logging.getLogger("steward.capture")

ACTOR = "system:capture"
PENDING_AFTER = timedelta(seconds=60)
PENDING_BATCH = 100
PENDING_MAX = 10_000


def _quarantine(ia: Interaction, reason: str) -> None:
    ia.state = Interaction.State.QUARANTINED
    ia.state_reason = reason[:2000]
    ia.save(update_fields=["state", "state_reason"])
    log.warning("capture: tenant %s: interaction %s (flow %s) quarantined: %s", ia.tenant_id,
                ia.pk, ia.flow_id, reason)


def build_one(interaction_id: int, harness_version: str = "",
              tenant_id: int | None = None) -> tuple[str, int | None]:
    """Build the step of one interaction. Returns ("built" | "quarantined" | "skipped", tenant
    id); skipped: not in state captured, or claimed by another worker right now (or unknown).
    `tenant_id`: the interaction's tenant when the caller knows it (else it is looked up)."""
    if tenant_id is None:
        tenant_id = interaction_tenants([interaction_id]).get(interaction_id)
        if tenant_id is None:
            return "skipped", None
    with tenant_context(tenant_id):
        ia = (Interaction.objects.select_for_update(skip_locked=True, of=("self",))
              .select_related("data_key")
              .filter(pk=interaction_id, state=Interaction.State.CAPTURED).first())
        if ia is None:
            return "skipped", None
        try:
            raw = open_raw(ia)
            request_body = decode_body(raw.get("request_body")) or b""
            response_body = decode_body(raw.get("response_body"))
        except RawPayloadUnavailable as exc:
            _quarantine(ia, f"raw payload unavailable: {exc}")
            return "quarantined", ia.tenant_id
        except Exception as exc:  # wrong key, tampered ciphertext, bad base64: never a step
            _quarantine(ia, f"raw payload does not open: {type(exc).__name__}: {exc}")
            return "quarantined", ia.tenant_id
        try:
            fields = build_step_fields(
                endpoint=ia.endpoint, request_body=request_body, response_body=response_body,
                response_status=raw.get("response_status"), is_stream=bool(raw.get("is_stream")),
                error=raw.get("error") if isinstance(raw.get("error"), dict) else None,
                t_request=ia.started_at.timestamp(),
                t_first_byte=ia.first_byte_at.timestamp() if ia.first_byte_at else None,
                t_end=ia.ended_at.timestamp() if ia.ended_at else None,
                harness_version=harness_version,
            )
        except CaptureError as exc:
            _quarantine(ia, f"capture: {exc}")
            return "quarantined", ia.tenant_id
        except Exception as exc:  # a bug in a parser must not loop forever on one payload
            log.exception("capture: parser failed on interaction %s", ia.pk)
            _quarantine(ia, f"capture failed: {type(exc).__name__}: {exc}")
            return "quarantined", ia.tenant_id
        if not Step.objects.filter(pk=ia.step_id).exists():
            Step.objects.create(
                id=ia.step_id, tenant_id=ia.tenant_id, trajectory_id=ia.trajectory_id,
                interaction=ia, endpoint=ia.endpoint, started_at=ia.started_at,
                ended_at=ia.ended_at, status_code=ia.status_code,
                consent=ia.consent, classification="internal", retention_until=None,
                # Sanitization is a separate stage: until it ran, a step is not eligible.
                sanitizer_version="", training_eligible=False,
                **fields,
            )
        ia.state = Interaction.State.PROCESSED
        ia.state_reason = ""
        ia.save(update_fields=["state", "state_reason"])
        return "built", ia.tenant_id


# Queue "capture" comes from CELERY_TASK_ROUTES (the task-level `queue` option is deprecated).
@shared_task(name="governance.tasks.build_steps",
             autoretry_for=(OperationalError, InterfaceError), max_retries=5,
             retry_backoff=True, retry_backoff_max=60, retry_jitter=True)
def build_steps(interaction_ids: list[int], tenant_id: int | None = None) -> dict[str, int]:
    """Build the steps of these interactions. `tenant_id` (optional): they all belong to this
    tenant — ids of any other tenant are then invisible and skipped."""
    harness = getattr(settings, "STEWARD_HARNESS_VERSION", "")
    results: dict[str, list[int]] = {"built": [], "quarantined": [], "skipped": []}
    pks = [int(pk) for pk in interaction_ids]
    routes = ({pk: tenant_id for pk in pks} if tenant_id is not None
              else interaction_tenants(pks))
    groups: dict[int, list[int]] = {}
    for pk in pks:
        if pk in routes:
            groups.setdefault(routes[pk], []).append(pk)
        else:
            results["skipped"].append(pk)  # no such interaction (erased, purged)
    # One transaction for the batch (each interaction in its own savepoint; each tenant's
    # group in its own row-level security scope), so the audit event — the raw payloads were
    # read by the system and steps written — commits with them.
    with transaction.atomic():
        for group_tenant, group in groups.items():
            with tenant_context(group_tenant):
                done: dict[str, list[int]] = {"built": [], "quarantined": []}
                for pk in group:
                    outcome, owner = build_one(pk, harness, group_tenant)
                    results[outcome].append(pk)
                    if owner is not None:
                        done[outcome].append(pk)
                ids = done["built"] + done["quarantined"]
                if ids:
                    record_event(ACTOR, "capture.steps_built", tenant=group_tenant,
                                 object_type="interaction", object_id=f"{min(ids)}-{max(ids)}",
                                 payload=done)
    log.info("capture: built %d steps, quarantined %d, skipped %d", len(results["built"]),
             len(results["quarantined"]), len(results["skipped"]))
    return {k: len(v) for k, v in results.items()}


@shared_task(name="governance.tasks.build_pending_steps")
def build_pending_steps() -> int:
    """Re-queue interactions left `captured` for over a minute (their message was lost)."""
    cutoff = timezone.now() - PENDING_AFTER
    total = 0
    for tenant_id in Tenant.objects.order_by("pk").values_list("pk", flat=True):
        if total >= PENDING_MAX:
            break
        with tenant_context(tenant_id):
            ids = list(Interaction.objects.filter(state=Interaction.State.CAPTURED,
                                                  shipped_at__lt=cutoff)
                       .order_by("pk").values_list("pk", flat=True)[:PENDING_MAX - total])
        for i in range(0, len(ids), PENDING_BATCH):
            build_steps.delay(ids[i:i + PENDING_BATCH], tenant_id=tenant_id)
        total += len(ids)
    if total:
        log.warning("capture: re-queued %d interactions still captured after %s", total,
                    PENDING_AFTER)
    return total


@shared_task(name="governance.tasks.purge_expired")
def purge_expired(tenant_id: int | None = None) -> dict[str, dict[str, int]]:
    """Retention (Celery beat): purge expired data of every tenant, or of one, in bounded
    batches within a time budget; each batch audited. See governance/retention.py."""
    from governance.retention import purge_expired as purge

    results = purge(tenant_id)
    # Celery serialises results as JSON: string keys.
    return {str(k): v for k, v in results.items()}
