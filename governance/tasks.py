"""Celery tasks of the capture pipeline (queue "capture").

`build_steps(interaction_ids)` turns shipped interactions into ATDP steps: per interaction, one
transaction claims the row (SELECT ... FOR UPDATE SKIP LOCKED, state `captured` only — so two
workers given the same id, or a redelivered message, never build twice), decrypts the raw
payload, builds the step with governance/capture.py and writes the Step together with the state
change. An exchange that cannot be parsed is marked `quarantined` with its reason (it never
becomes a step, so it is never training-eligible). Database errors retry with backoff.

`build_pending_steps()` (Celery beat) re-queues interactions still `captured` a minute after
shipping: the message was lost (broker down when the shipper committed, a worker crash).
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
from governance.models import Interaction, Step
from governance.rawstore import RawPayloadUnavailable, decode_body, open_raw

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


def build_one(interaction_id: int, harness_version: str = "") -> tuple[str, int | None]:
    """Build the step of one interaction. Returns ("built" | "quarantined" | "skipped", tenant
    id); skipped: not in state captured, or claimed by another worker right now."""
    with transaction.atomic():
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
def build_steps(interaction_ids: list[int]) -> dict[str, int]:
    harness = getattr(settings, "STEWARD_HARNESS_VERSION", "")
    results: dict[str, list[int]] = {"built": [], "quarantined": [], "skipped": []}
    # One transaction for the batch (each interaction in its own savepoint), so the audit
    # event — the raw payloads were read by the system and steps written — commits with them.
    with transaction.atomic():
        by_tenant: dict[int, dict[str, list[int]]] = {}
        for pk in interaction_ids:
            outcome, tenant_id = build_one(int(pk), harness)
            results[outcome].append(int(pk))
            if tenant_id is not None:
                by_tenant.setdefault(tenant_id, {"built": [], "quarantined": []})[
                    outcome].append(int(pk))
        for tenant_id, done in by_tenant.items():
            ids = done["built"] + done["quarantined"]
            record_event(ACTOR, "capture.steps_built", tenant=tenant_id,
                         object_type="interaction", object_id=f"{min(ids)}-{max(ids)}",
                         payload=done)
    log.info("capture: built %d steps, quarantined %d, skipped %d", len(results["built"]),
             len(results["quarantined"]), len(results["skipped"]))
    return {k: len(v) for k, v in results.items()}


@shared_task(name="governance.tasks.build_pending_steps")
def build_pending_steps() -> int:
    """Re-queue interactions left `captured` for over a minute (their message was lost)."""
    cutoff = timezone.now() - PENDING_AFTER
    ids = list(Interaction.objects.filter(state=Interaction.State.CAPTURED,
                                          shipped_at__lt=cutoff)
               .order_by("pk").values_list("pk", flat=True)[:PENDING_MAX])
    for i in range(0, len(ids), PENDING_BATCH):
        build_steps.delay(ids[i:i + PENDING_BATCH])
    if ids:
        log.warning("capture: re-queued %d interactions still captured after %s", len(ids),
                    PENDING_AFTER)
    return len(ids)


@shared_task(name="governance.tasks.purge_expired")
def purge_expired(tenant_id: int | None = None) -> dict[str, dict[str, int]]:
    """Retention (Celery beat): purge expired data of every tenant, or of one, in bounded
    batches within a time budget; each batch audited. See governance/retention.py."""
    from governance.retention import purge_expired as purge

    results = purge(tenant_id)
    # Celery serialises results as JSON: string keys.
    return {str(k): v for k, v in results.items()}
