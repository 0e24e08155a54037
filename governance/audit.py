"""The hash-chained audit log. `record_event` must be called inside the transaction of the
mutation it records (services do this), so the event and the change commit or fail together."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from governance.models import AuditEvent, Tenant
from governance.tenancy import audit_head, system_context

GENESIS_HASH = "0" * 64
# One advisory lock serialises sequence allocation: the chain is gapless and totally ordered.
AUDIT_LOCK_ID = 0x5354_4155  # "STAU"


def actor_label(actor: Any) -> str:
    """`user:<id>` for a Django user, the string itself for system actors ("system:shipper")."""
    if actor is None:
        return "system"
    if isinstance(actor, str):
        return actor
    return f"user:{actor.pk}"


def canonical_event(seq: int, tenant_id: int | None, actor: str, action: str, object_type: str,
                    object_id: str, payload: dict, created_at: datetime) -> bytes:
    return json.dumps(
        {
            "seq": seq,
            "tenant": tenant_id,
            "actor": actor,
            "action": action,
            "object_type": object_type,
            "object_id": object_id,
            "payload": payload,
            "created_at": created_at.isoformat(),
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        default=str,
    ).encode()


def chain_hash(prev_hash: str, canonical: bytes) -> str:
    return hashlib.sha256(prev_hash.encode() + canonical).hexdigest()


def record_event(actor: Any, action: str, *, tenant: Tenant | int | None = None,
                 object_type: str = "", object_id: Any = "", payload: dict | None = None
                 ) -> AuditEvent:
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("record_event must run inside the mutation's transaction")
    tenant_id = tenant if (tenant is None or isinstance(tenant, int)) else tenant.pk
    payload = json.loads(json.dumps(payload or {}, default=str))
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [AUDIT_LOCK_ID])
    # The chain spans every tenant, but row-level security shows this transaction only its
    # own tenant's events: the head comes from a SECURITY DEFINER function (migration 0004).
    last = audit_head()
    seq = (last[0] + 1) if last else 1
    prev = last[1] if last else GENESIS_HASH
    created_at = timezone.now()
    actor_s = actor_label(actor)
    canonical = canonical_event(seq, tenant_id, actor_s, action, object_type, str(object_id),
                                payload, created_at)
    return AuditEvent.objects.create(
        seq=seq, tenant_id=tenant_id, actor=actor_s, action=action, object_type=object_type,
        object_id=str(object_id), payload=payload, created_at=created_at, prev_hash=prev,
        hash=chain_hash(prev, canonical),
    )


VERIFY_REASON = "audit chain verification: one hash chain over every tenant's events"


@dataclass(frozen=True)
class Verification:
    """One verification's verdict: `checked` events walked, from `from_seq` on."""

    ok: bool
    first_bad_seq: int | None
    reason: str
    checked: int
    from_seq: int
    full: bool


def verify_chain() -> tuple[bool, int | None, str]:
    """Walk the WHOLE chain in seq order (`manage.py verify_audit`). Returns (ok, first bad
    seq, reason), and records the outcome as a checkpoint (AuditCheckpoint).

    The chain links the events of every tenant, so it is read in the system context (the one
    documented cross-tenant read, docs/decisions.md); only the verdict leaves this function."""
    result = verify_full_chain()
    return result.ok, result.first_bad_seq, result.reason


def verify_full_chain() -> Verification:
    return _verify_and_record(full=True)


def verify_new_events() -> Verification:
    """Verify only the events after the latest checkpoint (what a console or REST click runs):
    the checkpoint's own event must still carry the hash it had, and each later event must
    follow, link to and hash as `verify_chain` checks. A chain found broken stays broken for
    these clicks until a full walk finds it intact again. Cost: the events since the last
    click, not the whole log. (An edit of an event BEFORE the checkpoint is found by the full
    walk: `manage.py verify_audit`, or `?full=true` on REST.)"""
    return _verify_and_record(full=False)


def audit_event_count() -> int:
    """The length of the whole chain (every tenant), as `manage.py verify_audit` reports it."""
    with system_context(VERIFY_REASON):
        return AuditEvent.objects.count()


def _verify_and_record(*, full: bool) -> Verification:
    from governance.models import AuditCheckpoint

    with system_context(VERIFY_REASON):
        last = None if full else AuditCheckpoint.objects.order_by("-created_at", "-id").first()
        if last is not None and not last.ok:
            # Broken stays broken: a click never clears what a walk found.
            return Verification(False, last.first_bad_seq, last.reason, 0, last.seq + 1, False)
        start, prev = (last.seq, last.hash) if last is not None else (0, GENESIS_HASH)
        if start:
            anchor = AuditEvent.objects.filter(seq=start).values_list("hash", flat=True).first()
            if anchor != prev:
                result = Verification(False, start, "the last verified event changed or is "
                                      "gone since it was verified", 0, start, False)
                _record(result, start - 1, "")
                return result
        result, last_seq, last_hash = _walk(start + 1, prev, full=full or not start)
        _record(result, last_seq, last_hash)
        return result


def _record(result: Verification, last_seq: int, last_hash: str) -> None:
    from governance.models import AuditCheckpoint

    if result.ok and result.checked == 0 and not result.full:
        return  # nothing new: the latest checkpoint still says it
    AuditCheckpoint.objects.create(seq=last_seq, hash=last_hash, ok=result.ok,
                                   first_bad_seq=result.first_bad_seq,
                                   reason=result.reason[:200], full=result.full)


def _walk(start_seq: int, prev: str, *, full: bool) -> tuple[Verification, int, str]:
    """(verdict, last intact seq, its hash) of the events from `start_seq` on, `prev` being
    the hash of the event before it."""
    expected_seq = start_seq
    checked = 0
    for ev in (AuditEvent.objects.filter(seq__gte=start_seq).order_by("seq")
               .iterator(chunk_size=2000)):
        problem = None
        if ev.seq != expected_seq:
            problem = expected_seq, f"sequence gap: expected {expected_seq}, found {ev.seq}"
        elif ev.prev_hash != prev:
            problem = ev.seq, "prev_hash does not match the previous event's hash"
        elif chain_hash(prev, canonical_event(ev.seq, ev.tenant_id, ev.actor, ev.action,
                                              ev.object_type, ev.object_id, ev.payload,
                                              ev.created_at)) != ev.hash:
            problem = ev.seq, "hash does not match the event's content"
        checked += 1
        if problem:
            return (Verification(False, problem[0], problem[1], checked, start_seq, full),
                    expected_seq - 1, prev)
        prev = ev.hash
        expected_seq += 1
    return Verification(True, None, "ok", checked, start_seq, full), expected_seq - 1, prev
