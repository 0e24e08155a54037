"""The hash-chained audit log. `record_event` must be called inside the transaction of the
mutation it records (services do this), so the event and the change commit or fail together."""

from __future__ import annotations

import hashlib
import json
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


def verify_chain() -> tuple[bool, int | None, str]:
    """Walk the chain in seq order. Returns (ok, first bad seq, reason).

    The chain links the events of every tenant, so it is read in the system context (the one
    documented cross-tenant read, docs/decisions.md); only the verdict leaves this function."""
    with system_context(VERIFY_REASON):
        return _verify()


def audit_event_count() -> int:
    """The length of the whole chain (every tenant), as reported next to a verification."""
    with system_context(VERIFY_REASON):
        return AuditEvent.objects.count()


def _verify() -> tuple[bool, int | None, str]:
    prev = GENESIS_HASH
    expected_seq = 1
    for ev in AuditEvent.objects.order_by("seq").iterator(chunk_size=2000):
        if ev.seq != expected_seq:
            return False, expected_seq, f"sequence gap: expected {expected_seq}, found {ev.seq}"
        if ev.prev_hash != prev:
            return False, ev.seq, "prev_hash does not match the previous event's hash"
        canonical = canonical_event(ev.seq, ev.tenant_id, ev.actor, ev.action, ev.object_type,
                                    ev.object_id, ev.payload, ev.created_at)
        if chain_hash(prev, canonical) != ev.hash:
            return False, ev.seq, "hash does not match the event's content"
        prev = ev.hash
        expected_seq += 1
    return True, None, "ok"
