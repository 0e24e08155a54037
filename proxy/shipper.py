"""The spool shipper: moves finished exchanges from the proxy's local encrypted spool into
PostgreSQL, exactly once.

For each batch of `proxy.spool.read_batches`, one transaction inserts the Interaction rows
(INSERT ... ON CONFLICT DO NOTHING: `flow_id` is unique, so re-reading a segment after a crash
inserts nothing twice), upserts their Trajectory rows, creates the missing data keys and seals
each raw exchange under its subject's (or tenant's) data key. Only after COMMIT does the shipper
advance the segment's offset, then delete a closed segment that is fully shipped. So: the
database down -> nothing advances, the spool grows, the shipper retries with a bounded backoff;
a crash between COMMIT and the offset write -> the batch is read again and inserts nothing new.

Row-level security: a batch may hold several tenants' records; each tenant's group is stored in
its own tenant scope (governance.tenancy.tenant_context) inside the batch's one transaction.

Newly inserted interactions are handed to Celery (`governance.tasks.build_steps`) on commit; a
lost message is picked up by the beat task `build_pending_steps`.

Nothing is dropped silently: a line that does not decrypt, or a record that cannot be attributed
to a tenant and agent, goes to `<spool>/dead-letter.jsonl.enc` (lines encrypted with the spool
key, same format as segments) and is logged with its flow id; a record that can be attributed
but is malformed is stored as a `quarantined` Interaction (never training-eligible).
"""

from __future__ import annotations

import base64
import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections, transaction
from django.db.models import F
from django.db.models.functions import Greatest, Least
from django.utils import timezone

from governance.audit import record_event
from governance.capture import ENDPOINTS
from governance.crypto import master_key as configured_master_key
from governance.crypto import subject_hash as keyed_subject_hash
from governance.erasure import SUPPRESSED_REASON, suppressed_hashes
from governance.models import Agent, Consent, Interaction, Trajectory
from governance.rawstore import (
    data_keys_for,
    decode_body,
    insert_ignore_conflicts,
    key_is_destroyed,
    raw_plaintext,
    seal_raw,
    unwrap,
)
from governance.tenancy import tenant_context
from proxy.spool import (
    SegmentBatch,
    commit_offset,
    decode_line,
    encode_line,
    finish_segment_if_done,
    read_batches,
    spool_key,
)

log = logging.getLogger("steward.shipper")

ACTOR = "system:shipper"
DEAD_LETTER_NAME = "dead-letter.jsonl.enc"
# Ids of fallback rows for a quarantined record whose own ids are unusable.
QUARANTINE_NAMESPACE = uuid.UUID("0b8f3c52-7d4e-4f0e-9c55-0d6f1a2b3c4d")
ENQUEUE_CHUNK = 100
MAX_BACKOFF_S = 5.0

Enqueue = Callable[[list[int]], None]


@dataclass
class ShipCounts:
    batches: int = 0
    records: int = 0
    inserted: int = 0
    duplicates: int = 0
    quarantined: int = 0
    dead_lettered: int = 0
    bad_lines: int = 0
    segments_finished: int = 0

    def add(self, other: ShipCounts) -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def retention_days() -> int:
    value = os.environ.get("STEWARD_RAW_RETENTION_DAYS")
    if value is None:
        value = getattr(settings, "STEWARD_RAW_RETENTION_DAYS", 7)
    return int(value)


def default_enqueue(ids: list[int]) -> None:
    from governance.tasks import build_steps

    for i in range(0, len(ids), ENQUEUE_CHUNK):
        build_steps.delay(ids[i:i + ENQUEUE_CHUNK])


def _epoch(value: Any) -> datetime | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        try:
            return datetime.fromtimestamp(value, tz=UTC)
        except (OverflowError, OSError, ValueError):
            return None
    return None


def _uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value)) if value else None
    except ValueError:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class _Prepared:
    record: dict
    flow_id: str
    tenant_id: int
    agent_id: int
    trajectory_id: uuid.UUID
    step_id: uuid.UUID
    subject_hash: str
    started_at: datetime
    problems: list[str]


class Shipper:
    def __init__(self, spool_dir: Path | str | None = None, master_key: bytes | None = None,
                 enqueue: Enqueue | None = default_enqueue, max_records: int = 500) -> None:
        self.spool_dir = Path(spool_dir or settings.STEWARD_SPOOL_DIR)
        self.master_key = master_key or configured_master_key()
        self.spool_key = spool_key(self.master_key)
        self.enqueue = enqueue
        self.max_records = max_records
        self.dead_letter_path = self.spool_dir / DEAD_LETTER_NAME

    # -- one pass over the spool ---------------------------------------------------------
    def ship_once(self) -> ShipCounts:
        """Ship every complete record currently in the spool. A database error propagates
        (after logging what was waiting) with the offset of the failed batch untouched."""
        total = ShipCounts()
        if not self.spool_dir.exists():
            return total
        for batch in read_batches(self.spool_dir, self.master_key, self.max_records):
            try:
                counts = self.ship_batch(batch)
            except (OperationalError, InterfaceError) as exc:
                tenants = sorted({r.get("tenant_id") for r in batch.records
                                  if isinstance(r, dict)}, key=str)
                log.warning(
                    "shipper: database unavailable; %d records of %s (bytes %d-%d, tenants %s) "
                    "stay in the spool, %d shipped this round: %s",
                    len(batch.records), batch.segment.name, batch.start, batch.end, tenants,
                    total.inserted, str(exc).strip().splitlines()[0] if str(exc) else exc)
                raise
            total.add(counts)
        return total

    def ship_batch(self, batch: SegmentBatch) -> ShipCounts:
        counts = ShipCounts(batches=1, records=len(batch.records), bad_lines=batch.bad_lines)
        dead: list[dict] = []
        if batch.bad_lines:
            dead.extend(self._undecodable_lines(batch))
        new_ids: list[int] = []
        if batch.records:
            with transaction.atomic():
                new_ids, quarantined, duplicates, batch_dead = self._insert(batch)
                counts.inserted = len(new_ids) + quarantined
                counts.quarantined = quarantined
                counts.duplicates = duplicates
                dead.extend(batch_dead)
                if new_ids and self.enqueue is not None:
                    ids, enqueue = list(new_ids), self.enqueue
                    # robust: a broker outage must not undo a committed batch; the beat task
                    # build_pending_steps picks the interactions up later.
                    transaction.on_commit(lambda: enqueue(ids), robust=True)
        # Dead letters are written after COMMIT and before the offset: a crash in between
        # writes them again (at-least-once, deduplicate by flow id), never loses them.
        if dead:
            self._write_dead_letters(dead)
            counts.dead_lettered = len(dead)
        commit_offset(batch.segment, batch.end)
        if finish_segment_if_done(batch.segment):
            counts.segments_finished = 1
        if counts.inserted or counts.duplicates or dead:
            log.info("shipper: %s bytes %d-%d: %d records, %d new, %d duplicate, %d quarantined, "
                     "%d dead-lettered, %d bad lines", batch.segment.name, batch.start,
                     batch.end, counts.records, counts.inserted, counts.duplicates,
                     counts.quarantined, counts.dead_lettered, counts.bad_lines)
        return counts

    # -- validation ----------------------------------------------------------------------
    def _prepare(self, records: list[Any], agents: dict[int, int]
                 ) -> tuple[list[_Prepared], list[dict]]:
        """Split records into storable ones (possibly with problems -> quarantined) and
        dead letters (cannot be attributed to a tenant and agent, so nowhere to store them)."""
        ok: list[_Prepared] = []
        dead: list[dict] = []
        for rec in records:
            if not isinstance(rec, dict):
                dead.append({"reason": "record is not a JSON object", "record": rec})
                log.error("shipper: dead-lettered a record that is not an object")
                continue
            flow_id = rec.get("flow_id")
            tenant_id, agent_id = rec.get("tenant_id"), rec.get("agent_id")
            reason = None
            if not isinstance(flow_id, str) or not flow_id or len(flow_id) > 64:
                reason = "missing or invalid flow_id"
            elif not _is_int(tenant_id):
                reason = "missing or invalid tenant_id"
            elif not _is_int(agent_id):
                reason = "missing or invalid agent_id"
            elif agents.get(agent_id) != tenant_id:
                reason = f"agent {agent_id} does not exist in tenant {tenant_id}"
            if reason:
                dead.append({"reason": reason, "record": rec})
                log.error("shipper: dead-lettered flow %s (tenant %s, agent %s): %s",
                          flow_id, tenant_id, agent_id, reason)
                continue
            problems: list[str] = []
            if rec.get("v") != 1:
                problems.append(f"unknown record version {rec.get('v')!r}")
            if rec.get("endpoint") not in ENDPOINTS:
                problems.append(f"unknown endpoint {rec.get('endpoint')!r}")
            trajectory_id = _uuid(rec.get("trajectory_id"))
            if trajectory_id is None:
                problems.append("invalid trajectory_id")
                trajectory_id = uuid.uuid5(QUARANTINE_NAMESPACE, f"trajectory:{flow_id}")
            step_id = _uuid(rec.get("step_id"))
            if step_id is None:
                problems.append("invalid step_id")
                step_id = uuid.uuid5(QUARANTINE_NAMESPACE, f"step:{flow_id}")
            started_at = _epoch(rec.get("t_request"))
            if started_at is None:
                problems.append("invalid t_request")
                started_at = timezone.now()
            for key in ("request_body", "response_body"):
                try:
                    if key == "request_body" and not isinstance(rec.get(key), str):
                        raise ValueError
                    decode_body(rec.get(key))
                except (ValueError, TypeError):
                    problems.append(f"{key} is not base64")
            subject = rec.get("subject")
            subject_hash = (keyed_subject_hash(tenant_id, subject)
                            if isinstance(subject, str) and subject.strip() else "")
            ok.append(_Prepared(rec, flow_id, tenant_id, agent_id, trajectory_id, step_id,
                                subject_hash, started_at, problems))
        return ok, dead

    # -- the transaction -----------------------------------------------------------------
    def _insert(self, batch: SegmentBatch) -> tuple[list[int], int, int, list[dict]]:
        """Store a batch in the current transaction: the records of each tenant in that
        tenant's row-level security scope (governance.tenancy.tenant_context: one
        set_config(..., true) per group, several groups in this one transaction), so a record
        can only ever be written as the tenant it names — and only with that tenant's agents
        and trajectories visible."""
        groups: dict[int | None, list[Any]] = defaultdict(list)
        for rec in batch.records:
            tenant_id = rec.get("tenant_id") if isinstance(rec, dict) else None
            groups[tenant_id if _is_int(tenant_id) else None].append(rec)
        new_ids: list[int] = []
        quarantined = duplicates = 0
        dead: list[dict] = []
        seen: set[str] = set()  # flow ids of this batch, across tenants
        for tenant_id, records in groups.items():
            if tenant_id is None:  # no tenant to store them under: dead letters
                dead.extend(self._prepare(records, {})[1])
                continue
            with tenant_context(tenant_id):
                ids, n_quarantined, n_duplicates, tenant_dead = self._insert_tenant(
                    batch, tenant_id, records, seen)
            new_ids.extend(ids)
            quarantined += n_quarantined
            duplicates += n_duplicates
            dead.extend(tenant_dead)
        return sorted(new_ids), quarantined, duplicates, dead

    def _insert_tenant(self, batch: SegmentBatch, tenant_id: int, records: list[Any],
                       seen: set[str]) -> tuple[list[int], int, int, list[dict]]:
        """One tenant's records, inside its scope: agents of other tenants are invisible, so a
        record naming one is dead-lettered ("does not exist in tenant")."""
        agent_ids = {r.get("agent_id") for r in records if _is_int(r.get("agent_id"))}
        agents = dict(Agent.objects.filter(pk__in=agent_ids).values_list("id", "tenant_id"))
        prepared, dead = self._prepare(records, agents)
        # The same flow twice in one batch (a proxy retrying its append): keep the first.
        unique = []
        for p in prepared:
            if p.flow_id not in seen:
                seen.add(p.flow_id)
                unique.append(p)
        repeated = len(prepared) - len(unique)
        prepared = unique
        if not prepared:
            return [], 0, repeated, dead

        # Trajectories: create missing ones; counters are bumped below for new rows only.
        by_traj: dict[uuid.UUID, list[_Prepared]] = defaultdict(list)
        for p in prepared:
            by_traj[p.trajectory_id].append(p)
        new_trajs = []
        routes = _known_routes(prepared)
        for tid, items in by_traj.items():
            first = min(items, key=lambda p: p.started_at)
            rec = first.record
            route_id, route_arm = _route_of(rec, first.agent_id, routes)
            new_trajs.append(Trajectory(
                id=tid, tenant_id=first.tenant_id, agent_id=first.agent_id,
                session_id=(rec.get("session_id") or "")[:256]
                if isinstance(rec.get("session_id"), str) else "",
                source=rec.get("trajectory_source")
                if rec.get("trajectory_source") in Trajectory.Source.values
                else Trajectory.Source.NEW,
                subject_hash=first.subject_hash,
                consent=Consent.NO_TRAIN if any(p.record.get("consent") == Consent.NO_TRAIN
                                                for p in items) else Consent.TRAIN,
                started_at=first.started_at,
                last_step_at=max(p.started_at for p in items),
                step_count=0,
                route_id=route_id, route_arm=route_arm,
            ))
        Trajectory.objects.bulk_create(new_trajs, ignore_conflicts=True)
        owners = dict(Trajectory.objects.filter(pk__in=list(by_traj))
                      .values_list("id", "tenant_id"))
        storable = []
        for p in prepared:
            if owners.get(p.trajectory_id) != p.tenant_id:
                dead.append({"reason": f"trajectory {p.trajectory_id} belongs to another tenant",
                             "record": p.record})
                log.error("shipper: dead-lettered flow %s (tenant %s): trajectory %s belongs "
                          "to another tenant", p.flow_id, p.tenant_id, p.trajectory_id)
            else:
                storable.append(p)

        # Erased subjects (governance/erasure.py): metadata only — no raw payload, no step,
        # and no fresh data key for them.
        suppressed = suppressed_hashes(tenant_id, {p.subject_hash for p in storable})
        keys = data_keys_for({(p.tenant_id, p.subject_hash) for p in storable
                              if p.subject_hash not in suppressed})
        plain_keys: dict[tuple[int, str], bytes] = {}
        expires = timezone.now() + timedelta(days=retention_days())
        rows: list[Interaction] = []
        for p in storable:
            rec = p.record
            key = keys.get((p.tenant_id, p.subject_hash))
            state = Interaction.State.CAPTURED
            reason = "; ".join(p.problems)
            ciphertext = None
            if p.subject_hash in suppressed:
                state = Interaction.State.QUARANTINED
                reason = "; ".join(filter(None, [reason, SUPPRESSED_REASON]))
                key = None
            elif key_is_destroyed(key):
                # The subject was erased: never store a readable copy of new data about them.
                state = Interaction.State.QUARANTINED
                reason = "; ".join(filter(None, [reason, "data key destroyed (subject erased)"]))
                key = None
            else:
                if (p.tenant_id, p.subject_hash) not in plain_keys:
                    plain_keys[(p.tenant_id, p.subject_hash)] = unwrap(key)
                ciphertext = seal_raw(plain_keys[(p.tenant_id, p.subject_hash)], p.flow_id,
                                      raw_plaintext(rec))
            if p.problems:
                state = Interaction.State.QUARANTINED
            err = rec.get("error") if isinstance(rec.get("error"), dict) else {}
            status = rec.get("response_status")
            rows.append(Interaction(
                flow_id=p.flow_id, tenant_id=p.tenant_id, agent_id=p.agent_id,
                trajectory_id=p.trajectory_id, step_id=p.step_id,
                endpoint=str(rec.get("endpoint") or "")[:32],
                method=str(rec.get("method") or "")[:8], path=str(rec.get("path") or "")[:512],
                status_code=status if _is_int(status) and 0 <= status < 32768 else None,
                is_stream=bool(rec.get("is_stream")),
                request_is_json=bool(rec.get("request_is_json", True)),
                error_kind=str(err.get("kind") or "")[:32],
                error_message=str(err.get("message") or ""),
                subject_hash=p.subject_hash,
                consent=Consent.NO_TRAIN if rec.get("consent") == Consent.NO_TRAIN
                else Consent.TRAIN,
                started_at=p.started_at, first_byte_at=_epoch(rec.get("t_first_byte")),
                ended_at=_epoch(rec.get("t_end")),
                data_key=key, raw_ciphertext=ciphertext,
                raw_expires_at=expires if ciphertext is not None else None,
                state=state, state_reason=reason,
                proxy_instance=str(rec.get("proxy_instance") or "")[:128],
            ))

        inserted = insert_ignore_conflicts(rows, returning=("id", "flow_id", "state"))
        inserted_flows = {flow for _, flow, _ in inserted}
        rest = [r.flow_id for r in rows if r.flow_id not in inserted_flows]
        existing = set(Interaction.objects.filter(flow_id__in=rest)
                       .values_list("flow_id", flat=True)) if rest else set()
        for row, p in zip(rows, storable, strict=True):
            if row.flow_id not in inserted_flows and row.flow_id not in existing:
                # Not inserted and not there (in this tenant): the step id collided with
                # another flow's (or the flow id is another tenant's).
                dead.append({"reason": f"step_id {row.step_id} already used by another flow",
                             "record": p.record})
                log.error("shipper: dead-lettered flow %s (tenant %s): step id %s collides",
                          row.flow_id, row.tenant_id, row.step_id)

        # Counters for the rows really inserted in this transaction only.
        by_flow = {p.flow_id: p for p in storable}
        bumps: dict[uuid.UUID, list[_Prepared]] = defaultdict(list)
        for _, flow, _ in inserted:
            bumps[by_flow[flow].trajectory_id].append(by_flow[flow])
        for tid, items in bumps.items():
            update: dict[str, Any] = {
                "step_count": F("step_count") + len(items),
                "last_step_at": Greatest(F("last_step_at"), max(p.started_at for p in items)),
                "started_at": Least(F("started_at"), min(p.started_at for p in items)),
            }
            if any(p.record.get("consent") == Consent.NO_TRAIN for p in items):
                update["consent"] = Consent.NO_TRAIN
            subject = next((p.subject_hash for p in items if p.subject_hash), "")
            Trajectory.objects.filter(pk=tid).update(**update)
            if subject:
                Trajectory.objects.filter(pk=tid, subject_hash="").update(subject_hash=subject)

        if inserted:
            ids = [pk for pk, _, _ in inserted]
            quarantined = [pk for pk, _, s in inserted if s == Interaction.State.QUARANTINED]
            record_event(ACTOR, "capture.shipped", tenant=tenant_id, object_type="interaction",
                         object_id=f"{min(ids)}-{max(ids)}",
                         payload={"inserted": len(ids), "quarantined": quarantined,
                                  "segment": batch.segment.name})
            if quarantined:
                log.warning("shipper: tenant %s: quarantined interactions %s", tenant_id,
                            quarantined)
        new_ids = sorted(pk for pk, _, s in inserted if s == Interaction.State.CAPTURED)
        n_quarantined = sum(1 for _, _, s in inserted if s == Interaction.State.QUARANTINED)
        return new_ids, n_quarantined, len(existing) + repeated, dead

    # -- dead letters ----------------------------------------------------------------------
    def _undecodable_lines(self, batch: SegmentBatch) -> list[dict]:
        """read_batches only counts the lines it could not decode; find them again so their
        bytes are kept (an operator may still recover them with an older key)."""
        out = []
        try:
            with open(batch.segment, "rb") as f:
                f.seek(batch.start)
                data = f.read(batch.end - batch.start)
        except FileNotFoundError:
            return out
        pos = 0
        for line in data.splitlines(keepends=True):
            try:
                decode_line(self.spool_key, line)
            except Exception:
                out.append({"reason": "undecodable spool line", "segment": batch.segment.name,
                            "offset": batch.start + pos,
                            "line_b64": base64.b64encode(line).decode()})
            pos += len(line)
        return out

    def _write_dead_letters(self, entries: list[dict]) -> None:
        now = time.time()
        data = b"".join(encode_line(self.spool_key, {"at": now, **e}) for e in entries)
        with open(self.dead_letter_path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def read_dead_letters(self) -> list[dict]:
        if not self.dead_letter_path.exists():
            return []
        return [decode_line(self.spool_key, line)
                for line in self.dead_letter_path.read_bytes().splitlines(keepends=True)]

    # -- the loop --------------------------------------------------------------------------
    def run(self, interval: float = 0.5, once: bool = False,
            should_stop: Callable[[], bool] = lambda: False) -> ShipCounts:
        total = ShipCounts()
        backoff = 0.0
        while not should_stop():
            # A connection broken by a database restart is dropped here, so the next round
            # reconnects instead of failing forever on a dead socket.
            close_old_connections()
            try:
                counts = self.ship_once()
            except (OperationalError, InterfaceError):
                _close_connection()
                backoff = min(MAX_BACKOFF_S, max(0.25, backoff * 2))
                log.warning("shipper: retrying in %.2f s", backoff)
                time.sleep(backoff)
                continue
            if backoff:
                log.info("shipper: database reachable again")
            backoff = 0.0
            total.add(counts)
            if once:
                break
            if not counts.records and not counts.bad_lines:
                time.sleep(interval)
        return total


def _route_field(rec: Any) -> tuple[Any, Any]:
    routing = rec.get("routing") if isinstance(rec, dict) else None
    route = routing.get("route") if isinstance(routing, dict) else None
    if not isinstance(route, dict):
        return None, None
    return route.get("id"), route.get("arm")


def _known_routes(prepared: list[_Prepared]) -> dict[int, int]:
    """route id -> agent id of the canary routes the records name, as far as they exist in
    the current tenant scope (a stale or forged id must not break the batch's foreign key)."""
    from governance.models import PolicyRoute

    ids = {rid for p in prepared for rid in [_route_field(p.record)[0]] if _is_int(rid)}
    if not ids:
        return {}
    return dict(PolicyRoute.objects.filter(pk__in=ids).values_list("id", "agent_id"))


def _route_of(rec: Any, agent_id: int, routes: dict[int, int]) -> tuple[int | None, str]:
    """Trajectory.route / route_arm from the record the trajectory starts with (the proxy
    keeps a session on one arm, proxy/routing.py)."""
    rid, arm = _route_field(rec)
    if _is_int(rid) and routes.get(rid) == agent_id and arm in ("control", "candidate"):
        return rid, arm
    return None, ""


def _close_connection() -> None:
    from django.db import connection

    try:
        connection.close()
    except Exception:  # the socket is already dead; Django resets its state anyway
        pass


def ship_once(spool_dir: Path | str | None = None, master_key: bytes | None = None,
              enqueue: Enqueue | None = default_enqueue) -> dict[str, int]:
    """Ship what is in the spool now; returns the counts (see ShipCounts)."""
    return Shipper(spool_dir, master_key, enqueue).ship_once().as_dict()
