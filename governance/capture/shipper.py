"""The spool shipper: moves finished exchanges from the proxy's local encrypted spool into
PostgreSQL, exactly once.

For each batch of `wire.spool.read_batches`, one transaction inserts the Interaction rows
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

Nothing is dropped silently, and no record stops the shipper (a poison pill would otherwise
crash it on every restart, on the same record):
- text PostgreSQL cannot hold (U+0000; a lone surrogate) is written escaped in the metadata
  columns (`storable_text`); the exact bytes stay in the sealed raw payload, so such a record is
  stored like any other;
- a batch the database still refuses is stored record by record, each in its own transaction;
  a record refused alone becomes a `DeadLetter` row of its tenant (sealed like a raw payload,
  listed on the console's overview, deleted by erasure), as does a record whose step id is
  another flow's;
- a line that does not decrypt, or a record that cannot be attributed to a tenant and agent (or
  names another tenant's trajectory), goes to `<spool>/dead-letter.jsonl.enc` (lines encrypted
  with the spool key, same format as segments; operators only) and is logged with its flow id;
- a record that can be attributed but is malformed is stored as a `quarantined` Interaction
  (never training-eligible).
Shipping then goes on past all of them.

After each pass the shipper records in `SpoolState` the segments it has not finished and the
start of its last complete pass (`drained_through`): erasure waits for, or names, every spool
that still holds data from before the erasure began.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
from cachetools import LRUCache
from django.conf import settings
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    transaction,
)
from django.db.models import F
from django.db.models.functions import Greatest, Least
from django.utils import timezone

from governance.audit import record_event
from governance.capture.rawstore import (
    DELTA_CHAIN_MAX,
    DELTA_REBUILD_MAX,
    data_keys_for,
    decode_body,
    delta_dictionary,
    exchange_head,
    insert_ignore_conflicts,
    key_is_destroyed,
    raw_plaintext,
    request_delta,
    response_bytes,
    seal_dead_letter,
    seal_raw,
    unwrap,
)
from governance.erasure import SUPPRESSED_REASON, suppressed_hashes
from governance.keyring import master_key as configured_master_key
from governance.keyring import subject_hash as keyed_subject_hash
from governance.models import (
    Agent,
    Consent,
    DeadLetter,
    Interaction,
    PendingInteraction,
    SpoolState,
    Trajectory,
)
from governance.tenancy import tenant_context
from wire.openai import ENDPOINTS
from wire.spool import (
    SegmentBatch,
    commit_offset,
    decode_line,
    encode_line,
    finish_segment_if_done,
    json_form,
    read_batches,
    segments,
    spool_key,
)

log = logging.getLogger("steward.shipper")

ACTOR = "system:shipper"
DEAD_LETTER_NAME = "dead-letter.jsonl.enc"
# Ids of fallback rows for a quarantined record whose own ids are unusable.
QUARANTINE_NAMESPACE = uuid.UUID("0b8f3c52-7d4e-4f0e-9c55-0d6f1a2b3c4d")
ENQUEUE_CHUNK = 100
MAX_BACKOFF_S = 5.0
# SpoolState is rewritten at least this often while nothing changes (erasure's liveness view).
SPOOL_STATE_EVERY_S = 2.0
# Dead-letter entries bound for the tenant's DeadLetter table carry this key (not stored).
TO_TABLE = "_tenant_table"

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
    return settings.STEWARD_RAW_RETENTION_DAYS


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


def _segment_time(segment: str) -> datetime | None:
    """When a spool segment was opened: `seg-<unix_ms>-<pid>-<n>` (wire/spool.py)."""
    m = re.match(r"seg-(\d{10,16})-", Path(segment).name) if segment else None
    return _epoch(int(m.group(1)) / 1000) if m else None


def _uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value)) if value else None
    except ValueError:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def storable_text(value: Any, limit: int | None = None) -> str:
    """`value` as text PostgreSQL can store: U+0000 (which a text column cannot hold) written as
    the escape `\\x00`, a lone surrogate (which psycopg cannot encode) as `\\udcXX`, then cut
    to `limit` characters. Only for metadata columns: the exact record is in the sealed raw
    payload."""
    text = value if isinstance(value, str) else str(value)
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text[:limit] if limit is not None else text


def _sqlstate(exc: BaseException) -> str:
    """The SQLSTATE of a database error (psycopg's, under Django's wrapper), or ""."""
    return getattr(exc.__cause__, "sqlstate", None) or getattr(exc, "sqlstate", None) or ""


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


@dataclass
class RawBase:
    """The last raw request body stored for a trajectory: what the next one is a delta of."""

    flow_id: str
    body: bytes
    depth: int  # deltas since the last whole copy
    data_key_id: int
    # Its response body and exchange head: with `body`, what the next delta is compressed
    # against (format 5).
    response: bytes = b""
    head: bytes = b""
    # The bytes opening it rebuilds: its body's length plus its base's figure (what
    # DELTA_REBUILD_MAX bounds).
    rebuild: int = 0

    def dictionary(self) -> bytes:
        return delta_dictionary(self.body, self.response, self.head)

    def size(self) -> int:
        return len(self.body) + len(self.response) + len(self.head)


class RawBases:
    """Per trajectory, the last request body the shipper stored, kept in memory (at most
    MAX_BYTES of bodies, least recently used dropped first): the next call's body is sealed
    as a delta against it (capture/rawstore.py). After a restart or an eviction the next body
    is stored whole — the chain starts again, nothing is read back from the database."""

    MAX_BYTES = 64 * 1024 * 1024

    def __init__(self) -> None:
        self._bases: LRUCache[uuid.UUID, RawBase] = LRUCache(self.MAX_BYTES,
                                                             getsizeof=RawBase.size)

    def delta(self, p: _Prepared, data_key_id: int, pending: dict[uuid.UUID, RawBase]
              ) -> tuple[dict[str, Any] | None, bytes | None]:
        """The delta of this record's request body and the dictionary to compress it against
        ((None, None): store it whole); notes the body as the trajectory's next base in
        `pending`."""
        try:
            body = decode_body(p.record.get("request_body")) or b""
        except (ValueError, TypeError):  # not base64: stored whole, as the proxy spooled it
            pending.pop(p.trajectory_id, None)
            return None, None
        base = pending.get(p.trajectory_id) or self._bases.get(p.trajectory_id)
        delta = None
        if base is not None and base.data_key_id == data_key_id and body \
                and base.depth + 1 < DELTA_CHAIN_MAX \
                and base.rebuild + len(body) <= DELTA_REBUILD_MAX:
            delta = request_delta(base.body, body)
            if delta is not None:
                delta["base"] = base.flow_id
        chained = delta is not None and base is not None
        pending[p.trajectory_id] = RawBase(
            p.flow_id, body, base.depth + 1 if chained else 0, data_key_id,
            response_bytes(p.record), exchange_head(p.record),
            (base.rebuild if chained else 0) + len(body))
        return delta, base.dictionary() if delta is not None and base is not None else None

    def commit(self, pending: dict[uuid.UUID, RawBase], lost: set[str]) -> None:
        for tid, base in pending.items():
            self._bases.pop(tid, None)
            if base.flow_id not in lost and base.size() <= self.MAX_BYTES:
                self._bases[tid] = base  # least recently used ones dropped to make room


class Shipper:
    def __init__(self, spool_dir: Path | str | None = None, master_key: bytes | None = None,
                 enqueue: Enqueue | None = default_enqueue, max_records: int = 500) -> None:
        self.spool_dir = Path(spool_dir or settings.STEWARD_SPOOL_DIR)
        self.master_key = master_key or configured_master_key()
        self.spool_key = spool_key(self.master_key)
        self.enqueue = enqueue
        self.max_records = max_records
        self.dead_letter_path = self.spool_dir / DEAD_LETTER_NAME
        # How erasure names this spool (governance/erasure.py reads SpoolState).
        self.spool_name = f"{socket.gethostname()}:{self.spool_dir.resolve()}"[:512]
        self._last_state: tuple[list[str] | None, float] = (None, 0.0)
        self._bases = RawBases()

    def _seal_whole_if_base_lost(self, rows: list[Interaction], storable: list[_Prepared],
                                 lost: set[str], plain_keys: dict[tuple[int, str], bytes]
                                 ) -> None:
        """A payload stored as a delta of a flow that was not stored after all (dead-lettered
        for a colliding step id): sealed whole instead (rare; one UPDATE each)."""
        if not lost:
            return
        for row, p in zip(rows, storable, strict=True):
            if row.raw_base_flow in lost and row.flow_id not in lost:
                ciphertext = seal_raw(plain_keys[(p.tenant_id, p.subject_hash)], p.flow_id,
                                      raw_plaintext(p.record))
                Interaction.objects.filter(flow_id=p.flow_id).update(
                    raw_ciphertext=ciphertext, raw_base_flow="")

    # -- one pass over the spool ---------------------------------------------------------
    def ship_once(self) -> ShipCounts:
        """Ship every complete record currently in the spool. A database error propagates
        (after logging what was waiting) with the offset of the failed batch untouched."""
        total = ShipCounts()
        # Everything fsynced before this instant is in a complete line that this pass ships
        # (or dead-letters): the pass, once complete, drains the spool up to here.
        started = timezone.now()
        if not self.spool_dir.exists():
            self._record_spool_state(started)
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
        self._record_spool_state(started)
        return total

    def ship_batch(self, batch: SegmentBatch) -> ShipCounts:
        counts = ShipCounts(batches=1, records=len(batch.records), bad_lines=batch.bad_lines)
        dead: list[dict] = []
        if batch.bad_lines:
            dead.extend(self._undecodable_lines(batch))
        if batch.records:
            try:
                stored = self._store(batch.records, batch.segment.name)
            except (OperationalError, InterfaceError):
                raise
            except (DatabaseError, ValueError) as exc:
                # One record the database refuses (or psycopg cannot encode) must not hold
                # back the others, nor crash the shipper on every restart: one by one.
                log.error("shipper: %s bytes %d-%d: the database refused the batch (%s %s); "
                          "storing its %d records one by one", batch.segment.name,
                          batch.start, batch.end, type(exc).__name__, _sqlstate(exc),
                          len(batch.records))
                stored = self._store_one_by_one(batch.records, batch.segment.name)
            new_ids, quarantined, duplicates, batch_dead = stored
            counts.inserted = len(new_ids) + quarantined
            counts.quarantined = quarantined
            counts.duplicates = duplicates
            dead.extend(batch_dead)
        # Dead letters are written after COMMIT and before the offset: a crash in between
        # writes them again (at-least-once: the table ignores a flow it has, the file is
        # deduplicated by flow id by whoever reads it), never loses them.
        if dead:
            self._write_dead_letters(dead, batch.segment.name)
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

    def _store(self, records: list[Any], segment: str
               ) -> tuple[list[int], int, int, list[dict]]:
        """Insert records in one transaction; their step building is queued on commit."""
        with transaction.atomic():
            new_ids, quarantined, duplicates, dead = self._insert(records, segment)
            if new_ids and self.enqueue is not None:
                ids, enqueue = list(new_ids), self.enqueue
                # robust: a broker outage must not undo a committed batch; the beat task
                # build_pending_steps picks the interactions up later.
                transaction.on_commit(lambda: enqueue(ids), robust=True)
        return new_ids, quarantined, duplicates, dead

    def _store_one_by_one(self, records: list[Any], segment: str
                          ) -> tuple[list[int], int, int, list[dict]]:
        new_ids: list[int] = []
        quarantined = duplicates = 0
        dead: list[dict] = []
        for rec in records:
            try:
                ids, n_quarantined, n_duplicates, rec_dead = self._store([rec], segment)
            except (OperationalError, InterfaceError):
                raise
            except (DatabaseError, ValueError) as exc:
                # The class and SQLSTATE only: a database message can quote the value.
                reason = (f"the database refused the record ({type(exc).__name__}"
                          f"{' ' + _sqlstate(exc) if _sqlstate(exc) else ''})")
                # Ids are unique across time partitions by a trigger (migration 0017) that
                # names the unique constraint it stands for: said as the in-partition clash is.
                constraint = getattr(getattr(exc.__cause__, "diag", None), "constraint_name",
                                     None) or ""
                if constraint.endswith("_step_id_key") and isinstance(rec, dict):
                    reason = f"step_id {rec.get('step_id')} already used by another flow"
                elif constraint.endswith("_flow_id_key"):
                    reason = "flow_id already stored with another request time"
                entry = {"reason": reason, "record": rec}
                if self._attributable(rec):
                    entry[TO_TABLE] = True
                dead.append(entry)
                log.error("shipper: dead-lettered flow %s (tenant %s): %s",
                          storable_text(rec.get("flow_id") if isinstance(rec, dict) else "?",
                                        64),
                          rec.get("tenant_id") if isinstance(rec, dict) else "?", reason)
                continue
            new_ids.extend(ids)
            quarantined += n_quarantined
            duplicates += n_duplicates
            dead.extend(rec_dead)
        return sorted(new_ids), quarantined, duplicates, dead

    @staticmethod
    def _attributable(rec: Any) -> bool:
        """The record names an agent that exists in the tenant it names (checked in that
        tenant's scope): its dead letter can be shown to that tenant."""
        if not isinstance(rec, dict) or not isinstance(rec.get("flow_id"), str):
            return False
        tenant_id, agent_id = rec.get("tenant_id"), rec.get("agent_id")
        if not (_is_int(tenant_id) and _is_int(agent_id)):
            return False
        with tenant_context(tenant_id):
            return Agent.objects.filter(pk=agent_id, tenant_id=tenant_id).exists()

    def _record_spool_state(self, drained_through: datetime) -> None:
        """SpoolState for erasure: the segments still unshipped and the start of this (complete)
        pass. Rewritten when it changes, else every SPOOL_STATE_EVERY_S (liveness)."""
        pending = sorted(p.name.rsplit(".", 1)[0] for p in segments(self.spool_dir)) \
            if self.spool_dir.exists() else []
        now = time.monotonic()
        if pending == self._last_state[0] and now - self._last_state[1] < SPOOL_STATE_EVERY_S:
            return
        size = 0
        for stem in pending:
            for suffix in (".open", ".log"):
                try:
                    size += (self.spool_dir / (stem + suffix)).stat().st_size
                except FileNotFoundError:
                    pass
        try:
            SpoolState.objects.update_or_create(
                name=self.spool_name, defaults={
                    "pending_segments": pending, "pending_bytes": size,
                    "drained_through": drained_through, "updated_at": timezone.now()})
        except (OperationalError, InterfaceError):
            raise  # the database is down: the loop backs off and retries
        except DatabaseError:
            # Advisory for erasure (which then names this spool as not reporting): shipping
            # itself must go on.
            log.exception("shipper: could not record the spool state of %s", self.spool_name)
            return
        self._last_state = (pending, now)

    # -- validation ----------------------------------------------------------------------
    def _prepare(self, records: list[Any], agents: dict[int, int], segment: str = ""
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
                          storable_text(flow_id, 64), tenant_id, agent_id, reason)
                continue
            # The flow id is also the raw payload's associated data: escape it before both.
            flow_id = storable_text(flow_id)
            if len(flow_id) > 64:
                dead.append({"reason": "missing or invalid flow_id", "record": rec})
                log.error("shipper: dead-lettered flow %s: invalid flow_id", flow_id[:64])
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
                # The same on every re-read (started_at is in the interaction's unique keys:
                # time partitions, migration 0017): the record's end, else its segment's
                # creation time, which the segment's name holds.
                started_at = (_epoch(rec.get("t_end")) or _segment_time(segment)
                              or timezone.now())
            for key in ("request_body", "response_body"):
                try:
                    value = rec.get(key)
                    if key == "request_body" and not isinstance(value, (str, bytes)):
                        raise ValueError
                    if not isinstance(value, bytes):  # bytes: a binary frame's (wire/spool.py)
                        decode_body(value)
                except (ValueError, TypeError):
                    problems.append(f"{key} is not base64")
            subject = rec.get("subject")
            subject_hash = (keyed_subject_hash(tenant_id, storable_text(subject))
                            if isinstance(subject, str) and subject.strip() else "")
            ok.append(_Prepared(rec, flow_id, tenant_id, agent_id, trajectory_id, step_id,
                                subject_hash, started_at, problems))
        return ok, dead

    # -- the transaction -----------------------------------------------------------------
    def _insert(self, records: list[Any], segment: str
                ) -> tuple[list[int], int, int, list[dict]]:
        """Store a batch in the current transaction: the records of each tenant in that
        tenant's row-level security scope (governance.tenancy.tenant_context: one
        set_config(..., true) per group, several groups in this one transaction), so a record
        can only ever be written as the tenant it names — and only with that tenant's agents
        and trajectories visible."""
        groups: dict[int | None, list[Any]] = defaultdict(list)
        for rec in records:
            tenant_id = rec.get("tenant_id") if isinstance(rec, dict) else None
            groups[tenant_id if _is_int(tenant_id) else None].append(rec)
        new_ids: list[int] = []
        quarantined = duplicates = 0
        dead: list[dict] = []
        seen: set[str] = set()  # flow ids of this batch, across tenants
        for tenant_id, group in groups.items():
            if tenant_id is None:  # no tenant to store them under: dead letters
                dead.extend(self._prepare(group, {})[1])
                continue
            with tenant_context(tenant_id):
                ids, n_quarantined, n_duplicates, tenant_dead = self._insert_tenant(
                    segment, tenant_id, group, seen)
            new_ids.extend(ids)
            quarantined += n_quarantined
            duplicates += n_duplicates
            dead.extend(tenant_dead)
        return sorted(new_ids), quarantined, duplicates, dead

    def _insert_tenant(self, segment: str, tenant_id: int, records: list[Any],
                       seen: set[str]) -> tuple[list[int], int, int, list[dict]]:
        """One tenant's records, inside its scope: agents of other tenants are invisible, so a
        record naming one is dead-lettered ("does not exist in tenant")."""
        agent_ids = {r.get("agent_id") for r in records if _is_int(r.get("agent_id"))}
        agents = dict(Agent.objects.filter(pk__in=agent_ids).values_list("id", "tenant_id"))
        prepared, dead = self._prepare(records, agents, segment)
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
                session_id=storable_text(rec.get("session_id") or "", 256)
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
        # Request bodies as deltas against the trajectory's previous call (RawBases); what
        # this batch adds to the bases is kept only once the transaction commits.
        pending: dict[uuid.UUID, RawBase] = {}
        base_flows: dict[str, str] = {}
        states: dict[str, tuple[str, str]] = {}  # flow -> (state, reason) of a row to insert
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
                delta, dictionary = self._bases.delta(p, key.pk, pending)
                if delta is not None:
                    base_flows[p.flow_id] = delta["base"]
                ciphertext = seal_raw(plain_keys[(p.tenant_id, p.subject_hash)], p.flow_id,
                                      raw_plaintext(rec, delta, dictionary))
            if p.problems:
                state = Interaction.State.QUARANTINED
            err = rec.get("error") if isinstance(rec.get("error"), dict) else {}
            status = rec.get("response_status")
            rows.append(Interaction(
                flow_id=p.flow_id, tenant_id=p.tenant_id, agent_id=p.agent_id,
                trajectory_id=p.trajectory_id, step_id=p.step_id,
                endpoint=storable_text(rec.get("endpoint") or "", 32),
                method=storable_text(rec.get("method") or "", 8),
                path=storable_text(rec.get("path") or "", 512),
                status_code=status if _is_int(status) and 0 <= status < 32768 else None,
                is_stream=bool(rec.get("is_stream")),
                request_is_json=bool(rec.get("request_is_json", True)),
                error_kind=storable_text(err.get("kind") or "", 32),
                error_message=storable_text(err.get("message") or ""),
                subject_hash=p.subject_hash,
                consent=Consent.NO_TRAIN if rec.get("consent") == Consent.NO_TRAIN
                else Consent.TRAIN,
                started_at=p.started_at, first_byte_at=_epoch(rec.get("t_first_byte")),
                ended_at=_epoch(rec.get("t_end")),
                data_key=key, raw_ciphertext=ciphertext,
                raw_base_flow=base_flows.get(p.flow_id, ""),
                raw_expires_at=expires if ciphertext is not None else None,
                proxy_instance=storable_text(rec.get("proxy_instance") or "", 128),
            ))
            states[p.flow_id] = (state, storable_text(reason))

        inserted = [(pk, flow, states[flow][0])
                    for pk, flow in insert_ignore_conflicts(rows, returning=("id", "flow_id"))]
        inserted_flows = {flow for _, flow, _ in inserted}
        # Every call starts unbuilt (or quarantined): its PendingInteraction row (decision 39).
        by_flow_row = {r.flow_id: r for r in rows}
        PendingInteraction.objects.bulk_create([
            PendingInteraction(interaction_id=pk, tenant_id=by_flow_row[flow].tenant_id,
                               trajectory_id=by_flow_row[flow].trajectory_id,
                               started_at=by_flow_row[flow].started_at,
                               state=state, reason=states[flow][1])
            for pk, flow, state in inserted])
        rest = [r.flow_id for r in rows if r.flow_id not in inserted_flows]
        existing = set(Interaction.objects.filter(flow_id__in=rest)
                       .values_list("flow_id", flat=True)) if rest else set()
        for row, p in zip(rows, storable, strict=True):
            if row.flow_id not in inserted_flows and row.flow_id not in existing:
                # Not inserted and not there (in this tenant): the step id collided with
                # another flow's (or the flow id is another tenant's).
                dead.append({"reason": f"step_id {row.step_id} already used by another flow",
                             "record": p.record, TO_TABLE: True})
                log.error("shipper: dead-lettered flow %s (tenant %s): step id %s collides",
                          row.flow_id, row.tenant_id, row.step_id)

        lost = {r.flow_id for r in rows if r.flow_id not in inserted_flows
                and r.flow_id not in existing}
        self._seal_whole_if_base_lost(rows, storable, lost, plain_keys)
        transaction.on_commit(lambda: self._bases.commit(pending, lost))

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
                                  "segment": segment})
            if quarantined:
                log.warning("shipper: tenant %s: quarantined interactions %s", tenant_id,
                            quarantined)
        new_ids = sorted(pk for pk, _, s in inserted if s == Interaction.State.CAPTURED)
        n_quarantined = sum(1 for _, _, s in inserted if s == Interaction.State.QUARANTINED)
        return new_ids, n_quarantined, len(existing) + repeated, dead

    # -- dead letters ----------------------------------------------------------------------
    @staticmethod
    def _undecodable_lines(batch: SegmentBatch) -> list[dict]:
        """The records read_batches could not decode, with their bytes (an operator may still
        recover them with an older key): the batch carries them, nothing is read again."""
        return [{"reason": "undecodable spool line", "segment": batch.segment.name,
                 "offset": offset, "line_b64": base64.b64encode(data).decode()}
                for offset, data in batch.bad]

    def _write_dead_letters(self, entries: list[dict], segment: str) -> None:
        """Entries of an attributable record become DeadLetter rows of its tenant; the rest,
        and any the table refuses, go to the encrypted dead-letter file. Both keep the record
        in its JSON form (bodies base64), whichever spool format it came in."""
        entries = [{**e, "record": json_form(e["record"])} if "record" in e else e
                   for e in entries]
        to_file = [e for e in entries if not e.get(TO_TABLE)]
        by_tenant: dict[int, list[dict]] = defaultdict(list)
        for e in entries:
            if e.get(TO_TABLE):
                by_tenant[e["record"]["tenant_id"]].append(e)
        for tenant_id, group in by_tenant.items():
            try:
                self._insert_dead_letters(tenant_id, group, segment)
            except (OperationalError, InterfaceError):
                raise
            except (DatabaseError, ValueError) as exc:
                log.error("shipper: tenant %s: dead-letter table refused %d entries (%s); "
                          "writing them to %s", tenant_id, len(group), type(exc).__name__,
                          self.dead_letter_path.name)
                to_file.extend(group)
        if to_file:
            self._append_dead_letter_file(to_file)

    def _insert_dead_letters(self, tenant_id: int, entries: list[dict], segment: str) -> None:
        expires = timezone.now() + timedelta(days=retention_days())
        with tenant_context(tenant_id):
            hashes: dict[int, str] = {}
            for i, e in enumerate(entries):
                subject = e["record"].get("subject")
                hashes[i] = (keyed_subject_hash(tenant_id, storable_text(subject))
                             if isinstance(subject, str) and subject.strip() else "")
            suppressed = suppressed_hashes(tenant_id, set(hashes.values()))
            keys = data_keys_for({(tenant_id, h) for h in hashes.values()
                                  if h not in suppressed})
            plain: dict[str, bytes] = {}
            rows = []
            for i, e in enumerate(entries):
                rec, h = e["record"], hashes[i]
                flow_id = storable_text(rec["flow_id"], 64)
                key = keys.get((tenant_id, h))
                ciphertext = None
                if key is not None and not key_is_destroyed(key):
                    if h not in plain:
                        plain[h] = unwrap(key)
                    ciphertext = seal_dead_letter(plain[h], tenant_id, flow_id,
                                                  orjson.dumps(rec))
                else:  # an erased subject: the reason and ids only, never the content
                    key = None
                agent = rec.get("agent_id")
                rows.append(DeadLetter(
                    tenant_id=tenant_id, flow_id=flow_id,
                    agent_ref=agent if _is_int(agent) and abs(agent) < 2**63 else None,
                    trajectory_ref=storable_text(rec.get("trajectory_id") or "", 64),
                    subject_hash=h, reason=storable_text(e["reason"]), segment=segment[:128],
                    data_key=key, record_ciphertext=ciphertext,
                    expires_at=expires if ciphertext is not None else None))
            inserted = insert_ignore_conflicts(rows, returning=("id",))
            if inserted:
                record_event(ACTOR, "capture.dead_lettered", tenant=tenant_id,
                             object_type="dead_letter",
                             object_id=",".join(str(pk) for (pk,) in inserted)[:64],
                             payload={"dead_letters": [pk for (pk,) in inserted],
                                      "segment": segment})

    def _append_dead_letter_file(self, entries: list[dict]) -> None:
        now = time.time()
        data = b"".join(encode_line(self.spool_key, {"at": now, **{
            k: v for k, v in e.items() if k != TO_TABLE}}) for e in entries)
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
    from governance.models import Trajectory

    # The route model through Trajectory.route: the shipper (governance) imports nothing of
    # the evolution app that owns it.
    PolicyRoute = Trajectory._meta.get_field("route").related_model  # noqa: N806
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
