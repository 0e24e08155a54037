"""GDPR Art. 17 erasure of one data subject in one tenant.

`request_erasure(actor, tenant, subject)` stores the subject only as keyed hashes (never in
clear: not in the row, the broker message, a log line or an audit payload) and enqueues the
Celery task `erase_subject(request_id, tenant_id)` on commit (queue "capture"). A subject already
pending or running answers the existing request (idempotent).

The task claims the request with a conditional UPDATE (pending, or running under its own task id
— a retry — or with a stale heartbeat — a crashed worker) and runs these stages, saving `stage`
and `progress` in the same transaction as each unit of work, so a crash resumes where it left
off and nothing is counted twice:

1. suppress: the lookup hashes go on the suppression list (SuppressedSubject) and the subject's
   data keys are destroyed (crypto-shredding: every raw payload sealed under them — in the
   database, in spool files, in backups — can never be opened again). From here on a capture
   about the subject is kept as metadata only: the shipper stores no raw payload for a
   suppressed header subject, and the step builder builds no step (and drops the raw payload)
   for an exchange whose identifiers hash to a suppressed hash — both quarantine the
   interaction with the reason "suppressed subject".
2. spool: spool lines cannot be searched by subject (they are encrypted records, and only the
   sanitizer finds identifiers in free text), so the guarantee is drain-based: the task waits
   (bounded, STEWARD_ERASURE_SPOOL_WAIT_S) until every spool has shipped what it held when the
   stage began. The spools are the ones the shippers report (SpoolState, one row per shipper:
   `<host>:<dir>`) plus STEWARD_SPOOL_DIR. A spool on this host is checked on disk (each segment
   shipped up to its size at the start); another host's is drained when its shipper finished a
   pass that started after the stage began (`drained_through`). A spool still pending at the
   deadline is named in the certificate and the request does not end `clean`. Whatever ships
   lands under stage 1's suppression and is caught by stages 3 to 5.
3. scan: payloads that were never indexed — interactions still `captured` or `quarantined` with
   a readable raw payload, steps with `steward.sanitizer.unscanned` (a non-JSON body, say), and
   the tenant's dead letters — are decrypted and searched: every run of up to SCAN_MAX_WORDS
   words is hashed like a subject header, and the sanitizer's identifiers are hashed like the
   subject index's. A match adds a subject-index row (source `scan`), so stage 4
   deletes its trajectory; a matching dead letter is deleted here. A payload that does not
   decrypt (not shredded: damaged, or another key) is counted and keeps the request from
   ending `clean`. The scan is incremental (by id), and stage 6 scans what arrived since.
4. delete, in bounded batches (BATCH_TRAJECTORIES per transaction): the trajectories found by
   Trajectory.subject_hash, Interaction.subject_hash (the X-Steward-Subject header) and the
   subject index (identifiers the sanitizer found: email, phone, name, ...). Per batch:
   checkpoints trained on them are marked `tainted`; unapproved (draft, pending) dataset versions
   lose them (content hash, size and sample recomputed); approved versions holding them are
   invalidated; then rewards (by trajectory id and by the steps' response ids, through
   `purge_allowed()`), findings, subject-index rows, steps, interactions with their raw payloads,
   dataset memberships and the trajectories themselves are deleted; so are the subject's dead
   letters (by the header hash).
5. exports: files under VAR_DIR whose size and SHA-256 match an audited export
   (`dataset_version.exported`) of an affected dataset version are deleted.
6. verify: scan what arrived since stage 3, then the post-condition — no trajectory,
   interaction, subject-index row or dead letter with any of the hashes, no live data key. Rows
   that raced in meanwhile send the job back to stage 4 (at most VERIFY_ROUNDS times). Clean
   means that, every spool drained and every never-indexed payload scanned; otherwise the
   request fails and the certificate says why (`post_condition.because`).

The certificate: counts per kind, affected dataset versions and checkpoints, the spools checked
(drained, or pending by name), the scan of never-indexed payloads, timestamps, the
post-condition result, the sanitizer version — and only the keyed hash of the subject.
Every stage writes an audit event (ids and counts only).

Scope: everything runs in the requesting tenant's row-level security scope; another tenant's
rows are neither visible nor touched, and the hashes are per tenant anyway.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
from celery import shared_task
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from governance import jobs
from governance.audit import record_event
from governance.datasets import version_content_hash
from governance.keyring import subject_hash
from governance.models import (
    AuditEvent,
    DatasetVersion,
    DatasetVersionMember,
    DeadLetter,
    ErasureRequest,
    Interaction,
    SpoolState,
    SubjectIndex,
    SuppressedSubject,
    Tenant,
    subject_keys_operator,
)
from governance.tenancy import tenant_atomic, tenant_context

log = logging.getLogger("steward.erasure")

ACTOR = "system:erasure"
SUPPRESSED_REASON = "suppressed subject"
MAX_SUBJECT_CHARS = 512
BATCH_TRAJECTORIES = 200
VERIFY_ROUNDS = 3
HEARTBEAT_STALE_S = 120
SPOOL_POLL_S = 0.25
STAGES = ("suppress", "spool", "scan", "delete", "exports", "verify", "done")
COUNT_KINDS = ("trajectories", "steps", "interactions", "raw_payloads", "findings",
               "subject_index", "rewards", "dataset_memberships", "data_keys_destroyed",
               "suppressed_hashes", "exports_removed", "dead_letters")
# A record appended this long before the spool stage began is on disk (the proxy's writer
# fsyncs every 20 ms), so a shipper pass started after it ships it.
SPOOL_GRACE_S = 1.0
# The scan of never-indexed payloads: rows per batch, the longest run of words hashed (a
# subject as given: "Jane Roe", "jane.roe@example.com", "+1 415 555 0100" ...).
SCAN_BATCH = 50
SCAN_MAX_WORDS = 6
_EDGE_PUNCT = ".,;:!?()[]{}<>\"'`*"
# Identifier types of the subject index (governance.recognizers.IDENTIFIER_TYPES) under whose
# normalisation a looked-up subject is hashed; the header hash (keyring.subject_hash of the
# subject as given) is always included.
_PHONE_LIKE = re.compile(r"^[\d\s().+\-/x]+$|^[\d\s().+\-/]+(?:ext\.?|extension)\s*\d+$", re.I)


class ErasureError(ValueError):
    """Bad erasure input (the REST layer answers 400 with the message)."""


# --- participants ---------------------------------------------------------------------------
# What other apps own and an erasure must reach, registered by those apps in their
# AppConfig.ready() (the trainer: "checkpoints_tainted"), so that governance imports none of
# them. Each is called in every delete batch, inside the batch's transaction and before the
# trajectories go, as participant(actor, tenant_id, trajectory_ids, reason), and returns the ids
# of what it changed; they are recorded under its key in the request's progress, the batch's
# audit event and the certificate.
ErasureParticipant = Callable[[Any, int, list[str], str], list[int]]
PARTICIPANTS: dict[str, ErasureParticipant] = {}


def register_erasure_participant(key: str, participant: ErasureParticipant) -> None:
    """Register `participant` under `key` (idempotent for the same callable: ready() may run
    more than once in tests)."""
    existing = PARTICIPANTS.get(key)
    if existing is not None and existing is not participant:
        raise ValueError(f"erasure participant {key!r} is registered already ({existing!r})")
    PARTICIPANTS[key] = participant


# --- hashes -----------------------------------------------------------------------------------


def lookup_hashes(tenant_id: int, subject: str) -> list[str]:
    """Every keyed hash the subject may be stored under in this tenant: as an X-Steward-Subject
    header and as each identifier type the sanitizer indexes (normalised the same way,
    governance.sanitizer.normalize_identifier). Sorted, distinct."""
    from governance.recognizers import IDENTIFIER_TYPES
    from governance.sanitizer import normalize_identifier

    hashes = {subject_hash(tenant_id, subject)}
    for etype in sorted(IDENTIFIER_TYPES):
        if etype == "PHONE_NUMBER" and not _PHONE_LIKE.match(subject.strip()):
            continue  # a name's digits are not a phone number
        normalized = normalize_identifier(etype, subject)
        if len(normalized) >= 3:
            hashes.add(subject_hash(tenant_id, normalized))
    return sorted(hashes)


def suppressed_hashes(tenant_id: int, hashes: Iterable[str]) -> set[str]:
    """The subset of `hashes` on the tenant's suppression list (one indexed query). Called by
    the shipper and the step builder inside the tenant's scope."""
    wanted = {h for h in hashes if h}
    if not wanted:
        return set()
    return set(SuppressedSubject.objects.for_tenant(tenant_id)
               .filter(subject_hash__in=wanted).values_list("subject_hash", flat=True))


# --- the request ------------------------------------------------------------------------------


def _enqueue(request_id: int, tenant_id: int) -> None:
    erase_subject.delay(request_id, tenant_id)


@tenant_atomic("tenant")
def request_erasure(actor: Any, tenant: Tenant, subject: str) -> tuple[ErasureRequest, bool]:
    """File an erasure of `subject`. Returns (request, created); a request for the same subject
    still pending or running is returned instead of a new one."""
    subject = (subject or "").strip()
    if not subject:
        raise ErasureError("subject must not be empty")
    if len(subject) > MAX_SUBJECT_CHARS:
        raise ErasureError(f"subject must be at most {MAX_SUBJECT_CHARS} characters")
    tenant_id = tenant if isinstance(tenant, int) else tenant.pk
    h = subject_hash(tenant_id, subject)
    # Serialise requests for one subject so two concurrent POSTs create one request.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [int(h[:15], 16)])
    existing = (ErasureRequest.objects.for_tenant(tenant_id)
                .filter(subject_hash=h, status__in=[ErasureRequest.Status.PENDING,
                                                    ErasureRequest.Status.RUNNING])
                .order_by("pk").first())
    if existing is not None:
        return existing, False
    lookups = lookup_hashes(tenant_id, subject)
    req = ErasureRequest.objects.create(
        tenant_id=tenant_id, subject_hash=h, lookup_hashes=lookups,
        requested_by=actor if hasattr(actor, "pk") else None,
        progress={"counts": dict.fromkeys(COUNT_KINDS, 0)})
    record_event(actor, "erasure.requested", tenant=tenant_id, object_type="erasure_request",
                 object_id=req.pk, payload={"lookup_hashes": len(lookups)})
    # robust: a broker outage must not undo the request; resume_erasures re-queues it.
    transaction.on_commit(lambda: _enqueue(req.pk, tenant_id), robust=True)
    return req, True


# --- the task ---------------------------------------------------------------------------------


def _claim(request_id: int, tenant_id: int, task_id: str,
           is_retry: bool) -> ErasureRequest | None:
    now = timezone.now()
    with tenant_context(tenant_id):
        n = jobs.claim(ErasureRequest, request_id, tenant_id, task_id,
                       waiting=ErasureRequest.Status.PENDING, is_retry=is_retry,
                       stale_after=timedelta(seconds=HEARTBEAT_STALE_S),
                       attempts=F("attempts") + 1, started_at=Coalesce("started_at", now))
        if not n:
            return None
        req = ErasureRequest.objects.get(pk=request_id)
        if req.attempts == 1:
            record_event(ACTOR, "erasure.started", tenant=tenant_id,
                         object_type="erasure_request", object_id=req.pk, payload={})
        else:
            record_event(ACTOR, "erasure.resumed", tenant=tenant_id,
                         object_type="erasure_request", object_id=req.pk,
                         payload={"stage": req.stage, "attempt": req.attempts})
        return req


def _save(req: ErasureRequest, stage: str | None = None) -> None:
    """Progress, in the caller's transaction (the batch it describes)."""
    if stage is not None:
        req.stage = stage
    req.heartbeat_at = timezone.now()
    ErasureRequest.objects.filter(pk=req.pk).update(
        stage=req.stage, progress=req.progress, heartbeat_at=req.heartbeat_at)


def _add(req: ErasureRequest, counts: dict[str, int]) -> None:
    total = req.progress.setdefault("counts", dict.fromkeys(COUNT_KINDS, 0))
    for k, v in counts.items():
        total[k] = total.get(k, 0) + int(v)


def _add_ids(req: ErasureRequest, key: str, ids: Iterable[int]) -> None:
    req.progress[key] = sorted(set(req.progress.get(key, [])) | {int(i) for i in ids})


def erased_trajectory_hash(tenant_id: int, trajectory_id: Any) -> str:
    """What an erasure keeps of each trajectory it deletes (in its `progress`, never in the
    certificate), so the console can answer a later look-up of the id with "erased by request
    #N" instead of a bare 404. A truncated SHA-256 of tenant and id: a trajectory id is a
    random UUID, so the hash says nothing without the id and keeps no list of ids."""
    return hashlib.sha256(f"{tenant_id}:{trajectory_id}".lower().encode()).hexdigest()[:32]


def erased_by(tenant_id: int, trajectory_id: Any) -> int | None:
    """The erasure request that deleted this trajectory, if one did."""
    digest = erased_trajectory_hash(tenant_id, trajectory_id)
    return (ErasureRequest.objects.for_tenant(tenant_id)
            .filter(progress__erased_trajectories__contains=[digest])
            .order_by("pk").values_list("pk", flat=True).first())


def _table(name: str) -> str:
    from django.apps import apps

    return connection.ops.quote_name(apps.get_model("governance", name)._meta.db_table)


# stage 1 -------------------------------------------------------------------------------------


def _suppress(req: ErasureRequest) -> None:
    hashes = list(req.lookup_hashes)
    with tenant_context(req.tenant_id):
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {_table('SuppressedSubject')} "  # noqa: S608
                "(tenant_id, subject_hash, erasure_request_id, created_at) "
                "SELECT %s, h, %s, now() FROM unnest(%s::text[]) AS h "
                "ON CONFLICT (tenant_id, subject_hash) DO NOTHING",
                [req.tenant_id, req.pk, hashes])
            suppressed = cursor.rowcount
            # Crypto-shredding: the wrapped key is gone for good; the row stays as a tombstone
            # so the shipper never creates a fresh key for the subject.
            cursor.execute(
                f"UPDATE {_table('DataKey')} SET wrapped_key = NULL, "  # noqa: S608
                "destroyed_at = coalesce(destroyed_at, now()) "
                "WHERE tenant_id = %s AND subject_hash = ANY(%s::text[]) AND subject_hash <> '' "
                "AND wrapped_key IS NOT NULL", [req.tenant_id, hashes])
            destroyed = cursor.rowcount
        _add(req, {"suppressed_hashes": suppressed, "data_keys_destroyed": destroyed})
        _save(req, "spool")
        record_event(ACTOR, "erasure.suppressed", tenant=req.tenant_id,
                     object_type="erasure_request", object_id=req.pk,
                     payload={"suppressed_hashes": suppressed, "data_keys_destroyed": destroyed})


# stage 2 -------------------------------------------------------------------------------------


def _local_sizes(spool_dir: Path) -> dict[str, int]:
    """Each segment of a spool directory on this host -> its size now (what must ship)."""
    from wire.spool import segments

    out: dict[str, int] = {}
    for path in segments(spool_dir) if spool_dir.is_dir() else []:
        try:
            out[path.name] = path.stat().st_size
        except FileNotFoundError:
            continue
    return out


def _local_pending(spool_dir: Path, sizes: dict[str, int]) -> int:
    """Segments of the snapshot not yet shipped up to their size then (a segment renamed from
    .open to .log keeps its offset file's stem; a deleted one is fully shipped)."""
    from wire.spool import read_offset

    pending = 0
    for name, size in sizes.items():
        stem = name.rsplit(".", 1)[0]
        current = [p for p in (spool_dir / f"{stem}.open", spool_dir / f"{stem}.log")
                   if p.exists()]
        if current and read_offset(current[0]) < size:
            pending += 1
    return pending


def _spools_to_check() -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """(spools on this host by name -> directory, other hosts' SpoolState rows)."""
    host = socket.gethostname()
    local: dict[str, Path] = {}
    configured = Path(settings.STEWARD_SPOOL_DIR)
    local[f"{host}:{configured.resolve()}"] = configured
    remote = []
    for row in SpoolState.objects.order_by("name").values(
            "name", "pending_segments", "drained_through", "updated_at"):
        row_host, _, directory = row["name"].partition(":")
        if row_host == host:
            local.setdefault(row["name"], Path(directory))
        else:
            remote.append(row)
    return local, remote


def _spool(req: ErasureRequest) -> None:
    wait_s = float(getattr(settings, "STEWARD_ERASURE_SPOOL_WAIT_S", 60))
    state = dict(req.progress.get("spool") or {})
    if "since" not in state:  # first attempt (a resumed one keeps its snapshot)
        local, _ = _spools_to_check()
        state = {"since": timezone.now().isoformat(),
                 "local": {name: {"dir": str(d), "sizes": _local_sizes(d)}
                           for name, d in local.items()}}
    since = datetime.fromisoformat(state["since"]) + timedelta(seconds=SPOOL_GRACE_S)
    deadline = time.monotonic() + wait_s
    while True:
        report: list[dict[str, Any]] = []
        for name, snap in sorted(state["local"].items()):
            pending = _local_pending(Path(snap["dir"]), snap["sizes"])
            report.append({"name": name, "checked": "on disk", "drained": not pending,
                           "segments_at_start": len(snap["sizes"]),
                           "segments_pending": pending})
        _, remote = _spools_to_check()
        for row in remote:
            drained = row["drained_through"] is not None and row["drained_through"] >= since
            report.append({"name": row["name"], "checked": "shipper report", "drained": drained,
                           "segments_pending": 0 if drained else len(row["pending_segments"]),
                           "last_report": row["updated_at"].isoformat()})
        waiting = [r for r in report if not r["drained"]]
        if not waiting or time.monotonic() > deadline:
            break
        jobs.heartbeat(ErasureRequest, req.pk, req.tenant_id)  # the wait is not a crash
        time.sleep(SPOOL_POLL_S)
    state.update(spools=report, drained=not waiting,
                 pending=[r["name"] for r in waiting])
    req.progress["spool"] = state
    with tenant_context(req.tenant_id):
        _save(req, "scan")
        record_event(ACTOR, "erasure.spool_checked", tenant=req.tenant_id,
                     object_type="erasure_request", object_id=req.pk,
                     payload={"drained": state["drained"], "spools": len(report),
                              "pending": len(waiting)})


# stage 3 -------------------------------------------------------------------------------------


def _strings(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)


def _body_texts(data: bytes) -> list[str]:
    """The text of a body as bytes, and, when it is JSON (or a stream of JSON events), every
    string in it unescaped (a name written with \\u escapes is found too)."""
    from wire.sse import iter_sse

    out = [data.decode("utf-8", errors="replace")]
    try:
        _strings(orjson.loads(data), out)
    except orjson.JSONDecodeError:
        for _, payload in iter_sse(data):
            try:
                _strings(orjson.loads(payload), out)
            except orjson.JSONDecodeError:
                continue
    return out


def raw_texts(raw: dict[str, Any]) -> list[str]:
    """Every text of a raw exchange (or a spool record): path, header values, bodies, error."""
    from governance.capture.rawstore import decode_body

    texts: list[str] = []
    for key in ("path", "session_id", "subject"):
        if isinstance(raw.get(key), str):
            texts.append(raw[key])
    for key in ("request_headers", "response_headers"):
        for pair in raw.get(key) or []:
            if isinstance(pair, list | tuple) and len(pair) == 2:
                texts.extend(str(v) for v in pair)
    for key in ("request_body", "response_body"):
        try:
            data = decode_body(raw.get(key))
        except (ValueError, TypeError):
            data = str(raw.get(key) or "").encode()
        if data:
            texts.extend(_body_texts(data))
    _strings(raw.get("error"), texts)
    return texts


def find_subject(texts: list[str], wanted: set[str], hasher: Any, sanitizer: Any
                 ) -> tuple[str | None, bool]:
    """(the lookup hash the texts contain, or None; whether the sanitizer ran). First every
    run of 1..SCAN_MAX_WORDS words (also without edge punctuation), hashed as a subject header
    is; then the identifiers the sanitizer finds, hashed as the subject index's are."""
    for text in texts:
        words = text.split()
        for i in range(len(words)):
            for n in range(1, min(SCAN_MAX_WORDS, len(words) - i) + 1):
                candidate = " ".join(words[i:i + n])
                if (h := hasher(candidate)) in wanted:
                    return h, False
                stripped = candidate.strip(_EDGE_PUNCT)
                if stripped and stripped != candidate and (h := hasher(stripped)) in wanted:
                    return h, False
    if sanitizer is None:
        return None, False
    try:
        results = sanitizer.sanitize_bodies([("request", t) for t in texts if t.strip()])
    except Exception:  # the reason it was never indexed, maybe: the word scan stands
        log.warning("erasure: the sanitizer failed on a never-indexed payload", exc_info=True)
        return None, False
    for result in results:
        for _etype, value in result.identifiers:
            if (h := hasher(value)) in wanted:
                return h, True
    return None, True


def _never_indexed(tenant_id: int, after: int) -> list[Interaction]:
    from governance.capture.steps import UNSCANNED_KEY

    return list(
        Interaction.objects.for_tenant(tenant_id).select_related("data_key")
        .filter(pk__gt=after, raw_ciphertext__isnull=False, data_key__isnull=False,
                data_key__destroyed_at__isnull=True)
        .filter(Q(pending__isnull=False)  # captured or quarantined: not built
                | Q(step__metadata__has_key=UNSCANNED_KEY))
        .order_by("pk")[:SCAN_BATCH])


def _scan(req: ErasureRequest) -> int:
    """Scan never-indexed payloads newer than the last scanned (see the module docstring).
    Returns how many matched. Decryption and the search run outside any transaction."""
    from governance.capture.rawstore import RawPayloadUnavailable, open_dead_letter, open_raw
    from governance.keyring import subject_hasher
    from governance.sanitizing import sanitizer_for_tenant

    tenant_id = req.tenant_id
    wanted = set(req.lookup_hashes)
    hasher = subject_hasher(tenant_id)
    with tenant_context(tenant_id):
        tenant = Tenant.objects.get(pk=tenant_id)
    # The sanitizer (spaCy and the model: seconds in a process that has not loaded them) is
    # built on the first payload that needs it, outside any transaction; most erasures find
    # nothing never-indexed and never need it.
    sanitizers: list[Any] = []

    def sanitizer() -> Any:
        if not sanitizers:
            sanitizers.append(sanitizer_for_tenant(tenant))
        return sanitizers[0]

    scan = req.progress.setdefault("scan", {
        "after_interaction": 0, "after_dead_letter": 0, "scanned": 0, "matched": 0,
        "unreadable": 0, "word_scan_only": 0})
    matched_total = 0
    for kind in ("interaction", "dead_letter"):
        while True:
            after = scan[f"after_{kind}"]
            with tenant_context(tenant_id):
                if kind == "interaction":
                    rows: list[Any] = _never_indexed(tenant_id, after)
                else:
                    rows = list(DeadLetter.objects.for_tenant(tenant_id).select_related(
                        "data_key").filter(pk__gt=after, record_ciphertext__isnull=False)
                        .order_by("pk")[:SCAN_BATCH])
            if not rows:
                break
            hits: list[tuple[Any, str]] = []
            for row in rows:
                try:
                    raw = open_raw(row) if kind == "interaction" else open_dead_letter(row)
                except RawPayloadUnavailable:
                    continue  # shredded: nobody can read it any more
                except Exception:
                    scan["unreadable"] += 1
                    log.error("erasure: request %s: %s %s does not decrypt", req.pk, kind,
                              row.pk)
                    continue
                scan["scanned"] += 1
                found, sanitized = find_subject(raw_texts(raw), wanted, hasher, sanitizer())
                if found is None and not sanitized:
                    scan["word_scan_only"] += 1
                if found is not None:
                    hits.append((row, found))
            with tenant_context(tenant_id):
                if kind == "interaction":
                    SubjectIndex.objects.bulk_create([SubjectIndex(
                        tenant_id=tenant_id, trajectory_id=ia.trajectory_id, interaction=ia,
                        source=SubjectIndex.Source.SCAN, hashes=SubjectIndex.keys([h]))
                        for ia, h in hits])
                else:
                    deleted = DeadLetter.objects.for_tenant(tenant_id).filter(
                        pk__in=[d.pk for d, _ in hits]).delete()[0]
                    _add(req, {"dead_letters": deleted})
                scan[f"after_{kind}"] = rows[-1].pk
                scan["matched"] += len(hits)
                req.progress["scan"] = scan
                _save(req)
            matched_total += len(hits)
    return matched_total


def _scan_stage(req: ErasureRequest) -> None:
    matched = _scan(req)
    with tenant_context(req.tenant_id):
        _save(req, "delete")
        record_event(ACTOR, "erasure.scanned", tenant=req.tenant_id,
                     object_type="erasure_request", object_id=req.pk,
                     payload={**{k: v for k, v in req.progress.get("scan", {}).items()
                                 if not k.startswith("after_")}, "matched_now": matched})


# stage 4 -------------------------------------------------------------------------------------


def _find_trajectories(cursor: Any, tenant_id: int, hashes: list[str], limit: int) -> list[str]:
    cursor.execute(
        f"SELECT t::text FROM ("  # noqa: S608
        f"SELECT id AS t FROM {_table('Trajectory')} WHERE tenant_id = %s "
        "AND subject_hash = ANY(%s::text[]) AND subject_hash <> '' "
        f"UNION SELECT trajectory_id FROM {_table('Interaction')} WHERE tenant_id = %s "
        "AND subject_hash = ANY(%s::text[]) AND subject_hash <> '' "
        f"UNION SELECT trajectory_id FROM {_table('SubjectIndex')} WHERE tenant_id = %s "
        f"AND hashes {subject_keys_operator()} %s::bigint[]) AS s LIMIT %s",
        [tenant_id, hashes, tenant_id, hashes, tenant_id, SubjectIndex.keys(hashes), limit])
    return [row[0] for row in cursor.fetchall()]


def _drop_from_unapproved(req: ErasureRequest, trajectory_ids: list[str]) -> list[int]:
    """Remove the trajectories from draft and pending versions and recompute what describes
    their content; a version left empty is invalidated. Returns the versions changed."""
    holding = (DatasetVersionMember.objects.for_tenant(req.tenant_id)
               .filter(trajectory_id__in=trajectory_ids).values("version_id"))
    unapproved = list(DatasetVersion.objects.for_tenant(req.tenant_id)
                      .filter(pk__in=holding, status__in=[DatasetVersion.Status.DRAFT,
                                                          DatasetVersion.Status.PENDING_APPROVAL])
                      .select_for_update().order_by("pk"))
    if not unapproved:
        return []
    removed = (DatasetVersionMember.objects.for_tenant(req.tenant_id)
               .filter(version__in=unapproved, trajectory_id__in=trajectory_ids).delete()[0])
    _add(req, {"dataset_memberships": removed})
    gone = set(trajectory_ids)
    for version in unapproved:
        version.size = version.members.count()
        version.sample_ids = [t for t in version.sample_ids if t not in gone]
        fields = ["size", "sample_ids"]
        if version.size == 0:
            version.status = DatasetVersion.Status.INVALIDATED
            version.invalidated_at = timezone.now()
            version.invalidated_reason = f"erasure request {req.pk}: no members left"
            fields += ["status", "invalidated_at", "invalidated_reason"]
        version.save(update_fields=fields)
        record_event(ACTOR, "dataset_version.members_erased", tenant=req.tenant_id,
                     object_type="dataset_version", object_id=version.pk,
                     payload={"erasure_request": req.pk, "size": version.size})
    return [v.pk for v in unapproved]


def _recompute_hashes(version_ids: list[int]) -> None:
    """After the batch's steps are gone: the content hash of each changed unapproved version
    as it now is (an approval later covers exactly this content)."""
    for version in DatasetVersion.objects.filter(pk__in=version_ids).exclude(
            status=DatasetVersion.Status.INVALIDATED):
        version.content_hash, version.step_count = version_content_hash(version)
        version.size = version.members.count()
        version.save(update_fields=["content_hash", "step_count", "size", "sample_ids"])


def _delete_dead_letters(req: ErasureRequest) -> None:
    """The subject's dead letters by the header hash (the scan took those found by content)."""
    with tenant_context(req.tenant_id):
        deleted = DeadLetter.objects.for_tenant(req.tenant_id).filter(
            subject_hash__in=[h for h in req.lookup_hashes if h]).delete()[0]
        if deleted:
            _add(req, {"dead_letters": deleted})
            _save(req)
            record_event(ACTOR, "erasure.dead_letters_deleted", tenant=req.tenant_id,
                         object_type="erasure_request", object_id=req.pk,
                         payload={"dead_letters": deleted})


def _delete_batch(req: ErasureRequest) -> bool:
    """One transaction: at most BATCH_TRAJECTORIES trajectories of the subject and everything
    hanging off them. Returns False when nothing was left to delete."""
    from governance.services import invalidate_versions_containing, purge_allowed

    tenant_id = req.tenant_id
    hashes = list(req.lookup_hashes)
    with tenant_context(tenant_id), connection.cursor() as cursor:
        ids = _find_trajectories(cursor, tenant_id, hashes, BATCH_TRAJECTORIES)
        if not ids:
            return False
        reason = f"erasure request {req.pk}"
        req.progress["erased_trajectories"] = sorted(
            set(req.progress.get("erased_trajectories", []))
            | {erased_trajectory_hash(tenant_id, t) for t in ids})
        # The participants first (the trainer's checkpoints): the version memberships that
        # link the trajectories to what they reach go below.
        reached = {key: participant(ACTOR, tenant_id, ids, reason)
                   for key, participant in PARTICIPANTS.items()}
        changed = _drop_from_unapproved(req, ids)
        # What still holds them now is approved (or already rejected/invalidated).
        invalidated = invalidate_versions_containing(
            ACTOR, tenant_id, ids, f"{reason}: a member trajectory was erased")
        p = [ids]
        cursor.execute(
            f"SELECT coalesce(array_agg(DISTINCT response_id), '{{}}') "  # noqa: S608
            f"FROM {_table('Step')} WHERE trajectory_id = ANY(%s::uuid[]) AND response_id <> ''",
            p)
        response_ids = cursor.fetchone()[0]
        counts: dict[str, int] = {}
        with purge_allowed():
            cursor.execute(
                f"DELETE FROM {_table('Reward')} WHERE tenant_id = %s AND ("  # noqa: S608
                "trajectory_id = ANY(%s::uuid[]) OR response_id = ANY(%s::text[]))",
                [tenant_id, ids, response_ids])
            counts["rewards"] = cursor.rowcount
        # Findings are packed per place (decision 37): the count is of findings, not rows.
        cursor.execute(
            f"WITH gone AS (DELETE FROM {_table('Finding')} f USING {_table('Step')} s "  # noqa: S608
            "WHERE f.step_id = s.id AND s.trajectory_id = ANY(%s::uuid[]) RETURNING f.total) "
            "SELECT coalesce(sum(total), 0) FROM gone", p)
        counts["findings"] = int(cursor.fetchone()[0])
        statements = [
            ("subject_index", f"DELETE FROM {_table('SubjectIndex')} "
                              "WHERE trajectory_id = ANY(%s::uuid[])"),
            ("steps", f"DELETE FROM {_table('Step')} WHERE trajectory_id = ANY(%s::uuid[])"),
            ("conversation_items", f"DELETE FROM {_table('ConversationItem')} "
                                   "WHERE trajectory_id = ANY(%s::uuid[])"),
        ]
        for kind, sql in statements:
            cursor.execute(sql, p)
            counts[kind] = cursor.rowcount
        cursor.execute(
            f"DELETE FROM {_table('Interaction')} WHERE trajectory_id = ANY(%s::uuid[]) "  # noqa: S608
            "RETURNING raw_ciphertext IS NOT NULL", p)
        rows = cursor.fetchall()
        counts["interactions"] = len(rows)
        counts["raw_payloads"] = sum(1 for (has_raw,) in rows if has_raw)
        cursor.execute(
            f"DELETE FROM {_table('DatasetVersionMember')} "  # noqa: S608
            "WHERE trajectory_id = ANY(%s::uuid[])", p)
        counts["dataset_memberships"] = cursor.rowcount
        cursor.execute(
            f"DELETE FROM {_table('PlaceholderDelta')} "  # noqa: S608
            "WHERE trajectory_id = ANY(%s::uuid[])", p)
        cursor.execute(
            f"DELETE FROM {_table('PendingInteraction')} "  # noqa: S608
            "WHERE trajectory_id = ANY(%s::uuid[])", p)
        cursor.execute(
            f"DELETE FROM {_table('Trajectory')} WHERE id = ANY(%s::uuid[])", p)  # noqa: S608
        counts["trajectories"] = cursor.rowcount
        _recompute_hashes(changed)
        _add(req, counts)
        _add_ids(req, "dataset_versions_changed", changed)
        _add_ids(req, "dataset_versions_invalidated", invalidated)
        for key, reached_ids in reached.items():
            _add_ids(req, key, reached_ids)
        req.progress["batches"] = req.progress.get("batches", 0) + 1
        _save(req)
        record_event(ACTOR, "erasure.batch_deleted", tenant=tenant_id,
                     object_type="erasure_request", object_id=req.pk,
                     payload={**counts, "dataset_versions_changed": changed,
                              "dataset_versions_invalidated": invalidated, **reached})
    return True


# stage 5 -------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _exports(req: ErasureRequest) -> None:
    """Delete export files of the affected versions found under VAR_DIR (by the size and
    SHA-256 their audited export event recorded; the database and spool are skipped)."""
    versions = sorted(set(req.progress.get("dataset_versions_invalidated", []))
                      | set(req.progress.get("dataset_versions_changed", [])))
    removed: list[str] = []
    if versions:
        with tenant_context(req.tenant_id):
            wanted: dict[int, set[str]] = {}
            for payload in (AuditEvent.objects.for_tenant(req.tenant_id)
                            .filter(action="dataset_version.exported",
                                    object_id__in=[str(v) for v in versions])
                            .values_list("payload", flat=True)):
                if payload.get("sha256") and isinstance(payload.get("bytes"), int):
                    wanted.setdefault(payload["bytes"], set()).add(payload["sha256"])
        root = Path(settings.VAR_DIR)
        skip = {Path(settings.STEWARD_SPOOL_DIR).resolve()}
        for dirpath, dirnames, filenames in os.walk(root) if wanted else ():
            here = Path(dirpath)
            if "PG_VERSION" in filenames or here.resolve() in skip:
                dirnames[:] = []
                continue
            for name in filenames:
                path = here / name
                try:
                    size = path.stat().st_size
                    if size in wanted and _sha256(path) in wanted[size]:
                        path.unlink()
                        removed.append(str(path.relative_to(root)))
                except OSError:
                    continue
    with tenant_context(req.tenant_id):
        _add(req, {"exports_removed": len(removed)})
        _save(req, "verify")
        record_event(ACTOR, "erasure.exports_removed", tenant=req.tenant_id,
                     object_type="erasure_request", object_id=req.pk,
                     payload={"removed": removed, "dataset_versions": versions})


# stage 6 -------------------------------------------------------------------------------------


def post_condition(tenant_id: int, hashes: list[str]) -> dict[str, int]:
    """What is left of the subject (all zero: erased). Runs in the tenant's scope."""
    with tenant_context(tenant_id), connection.cursor() as cursor:
        cursor.execute(
            f"SELECT (SELECT count(*) FROM {_table('Trajectory')} "  # noqa: S608
            "WHERE tenant_id = %s AND subject_hash = ANY(%s::text[]) AND subject_hash <> ''), "
            f"(SELECT count(*) FROM {_table('Interaction')} "
            "WHERE tenant_id = %s AND subject_hash = ANY(%s::text[]) AND subject_hash <> ''), "
            f"(SELECT count(*) FROM {_table('SubjectIndex')} "
            f"WHERE tenant_id = %s AND hashes {subject_keys_operator()} %s::bigint[]), "
            f"(SELECT count(*) FROM {_table('DataKey')} WHERE tenant_id = %s "
            "AND subject_hash = ANY(%s::text[]) AND subject_hash <> '' "
            "AND wrapped_key IS NOT NULL), "
            f"(SELECT count(*) FROM {_table('DeadLetter')} "
            "WHERE tenant_id = %s AND subject_hash = ANY(%s::text[]) AND subject_hash <> '')",
            [tenant_id, hashes] * 2 + [tenant_id, SubjectIndex.keys(hashes)]
            + [tenant_id, hashes] * 2)
        t, i, s, k, d = cursor.fetchone()
    return {"trajectories": t, "interactions": i, "subject_index": s, "live_data_keys": k,
            "dead_letters": d}


def _verify(req: ErasureRequest) -> bool:
    """True when clean (the certificate is written); False: back to stage 3."""
    from governance.sanitizer import SANITIZER_VERSION

    _scan(req)  # what arrived since the scan stage (its matches show up below)
    left = post_condition(req.tenant_id, list(req.lookup_hashes))
    rounds = req.progress.get("verify_rounds", 0) + 1
    req.progress["verify_rounds"] = rounds
    rows_left = any(left.values())
    with tenant_context(req.tenant_id):
        if rows_left and rounds < VERIFY_ROUNDS:
            _save(req, "delete")
            record_event(ACTOR, "erasure.recheck", tenant=req.tenant_id,
                         object_type="erasure_request", object_id=req.pk, payload=left)
            return False
        spool = req.progress.get("spool") or {}
        scan = req.progress.get("scan") or {}
        # `clean` is a promise about every copy: not made while a spool may still ship data
        # from before the erasure, nor while a never-indexed payload could not be read.
        because = []
        if rows_left:
            because.append("data of the subject is still present")
        if not spool.get("drained", False):
            because.append("spool not drained: " + ", ".join(spool.get("pending") or ["?"]))
        if scan.get("unreadable"):
            because.append(f"{scan['unreadable']} never-indexed payload(s) could not be "
                           "decrypted to be scanned")
        clean = not because
        post = {"clean": clean, "remaining": left}
        if because:
            post["because"] = because
        now = timezone.now()
        req.refresh_from_db(fields=["created_at", "started_at"])
        certificate = {
            "erasure_request": req.pk,
            "tenant": req.tenant_id,
            "subject_hash": req.subject_hash,
            "lookup_hashes": len(req.lookup_hashes),
            "counts": dict(req.progress.get("counts", {})),
            "dataset_versions_invalidated": req.progress.get("dataset_versions_invalidated", []),
            "dataset_versions_changed": req.progress.get("dataset_versions_changed", []),
            **{key: req.progress.get(key, []) for key in PARTICIPANTS},
            "spool": {"drained": bool(spool.get("drained")), "since": spool.get("since"),
                      "spools": spool.get("spools", []), "pending": spool.get("pending", [])},
            "unindexed_scan": {k: v for k, v in scan.items() if not k.startswith("after_")},
            "post_condition": post,
            "requested_at": req.created_at.isoformat(),
            "started_at": req.started_at.isoformat() if req.started_at else None,
            "finished_at": now.isoformat(),
            "sanitizer_version": SANITIZER_VERSION,
            "suppressed": True,
        }
        status = ErasureRequest.Status.COMPLETED if clean else ErasureRequest.Status.FAILED
        ErasureRequest.objects.filter(pk=req.pk).update(
            status=status, stage="done", progress=req.progress, certificate=certificate,
            finished_at=now, heartbeat_at=now,
            error="" if clean else ("not clean: " + "; ".join(because))[:2000])
        record_event(ACTOR, "erasure.completed" if clean else "erasure.failed",
                     tenant=req.tenant_id, object_type="erasure_request", object_id=req.pk,
                     payload={"counts": certificate["counts"], "post_condition": left,
                              "certificate_sha256": hashlib.sha256(repr(sorted(
                                  certificate.items())).encode()).hexdigest()})
    return True


def run_erasure(req: ErasureRequest) -> None:
    """The stages from where the request left off (see the module docstring)."""
    stage = req.stage or "suppress"
    while stage != "done":
        if stage == "suppress":
            _suppress(req)
        elif stage == "spool":
            _spool(req)
        elif stage == "scan":
            _scan_stage(req)
        elif stage == "delete":
            _delete_dead_letters(req)
            while _delete_batch(req):
                pass
            with tenant_context(req.tenant_id):
                _save(req, "exports")
        elif stage == "exports":
            _exports(req)
        elif stage == "verify":
            if _verify(req):
                req.stage = "done"
        else:
            raise RuntimeError(f"unknown erasure stage {stage!r}")
        stage = req.stage


@shared_task(name="governance.erasure.erase_subject", bind=True,
             autoretry_for=(OperationalError, InterfaceError), max_retries=5,
             retry_backoff=True, retry_backoff_max=60, retry_jitter=True, acks_late=True)
def erase_subject(self: Any, request_id: int, tenant_id: int) -> dict[str, Any]:
    """Run (or resume) an erasure request. Returns {status, stage}."""
    task_id = getattr(self.request, "id", None) or ""
    req = _claim(int(request_id), int(tenant_id), task_id, bool(self.request.retries))
    if req is None:
        with tenant_context(int(tenant_id)):
            current = (ErasureRequest.objects.for_tenant(tenant_id).filter(pk=request_id)
                       .values("status", "stage").first())
        return current or {"status": "unknown", "stage": ""}
    try:
        run_erasure(req)
    except (OperationalError, InterfaceError):
        raise  # retried under the same task id: the claim lets it resume
    except Exception as exc:
        log.exception("erasure: request %s failed in stage %s", req.pk, req.stage)
        with tenant_context(req.tenant_id):
            ErasureRequest.objects.filter(pk=req.pk).update(
                status=ErasureRequest.Status.FAILED, finished_at=timezone.now(),
                error=f"{type(exc).__name__} in stage {req.stage}"[:2000])
            record_event(ACTOR, "erasure.failed", tenant=req.tenant_id,
                         object_type="erasure_request", object_id=req.pk,
                         payload={"stage": req.stage, "error": type(exc).__name__})
        return {"status": "failed", "stage": req.stage}
    return {"status": "completed", "stage": "done"}


@shared_task(name="governance.erasure.resume_erasures")
def resume_erasures() -> int:
    """Celery beat: re-queue requests whose message was lost (pending for a minute) or whose
    worker died (running with a stale heartbeat)."""
    now = timezone.now()
    total = 0
    for tenant_id in Tenant.objects.order_by("pk").values_list("pk", flat=True):
        with tenant_context(tenant_id):
            ids = list(ErasureRequest.objects.for_tenant(tenant_id).filter(
                Q(status=ErasureRequest.Status.PENDING,
                  created_at__lt=now - timedelta(minutes=1))
                | Q(status=ErasureRequest.Status.RUNNING,
                    heartbeat_at__lt=now - timedelta(seconds=HEARTBEAT_STALE_S)))
                .values_list("pk", flat=True))
        for pk in ids:
            _enqueue(pk, tenant_id)
        total += len(ids)
    return total
