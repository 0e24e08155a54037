"""Celery tasks of the capture pipeline (queue "capture"; the worker of `steward up` consumes
capture, sanitize and celery).

`build_steps(interaction_ids)` turns shipped interactions into sanitized ATDP steps, a batch at a
time (the shipper enqueues one task per shipped batch of up to 100 interactions). Per tenant of
the batch, in ONE transaction under that tenant's row-level security scope:

1. claim the interactions (SELECT ... FOR UPDATE SKIP LOCKED, state `captured` only — so two
   workers given the same id, or a redelivered message, never build twice);
2. decrypt each raw payload and parse it (governance.capture.parse_exchange: streams are
   reassembled into the body a non-streamed call returns);
3. load the trajectories' placeholder state (no row lock yet);
4. sanitize every exchange of the batch in ONE `Sanitizer.sanitize_bodies` call
   (governance/sanitizing.py), each with its trajectory's state, in step order; then lock the
   trajectories (SELECT ... FOR UPDATE, in id order) and sanitize again, under the lock, only
   those whose state another worker committed meanwhile (`_sanitize_unlocked`) — so the shipper,
   which updates trajectory rows, never waits for a NER pass;
5. build each step from the sanitized exchange only (governance.capture.fields_from_exchange) and
   write steps, findings, subject-index rows, the interactions' state and the trajectories'
   state, with the audit event.

So no step ever holds unsanitized content. An exchange that cannot be decrypted or parsed is
`quarantined` with its reason; one the sanitizer fails on is quarantined with the exception's
class only (its message could quote the payload). A quarantined interaction has no step, so it is
never training-eligible; stewards see it in the trajectory document. A step is eligible when its
consent is `train` and it has no error. Database errors (a deadlock with the shipper included)
roll the batch back and retry with backoff.

`build_pending_steps()` (Celery beat) re-queues interactions still `captured` a minute after
shipping: the message was lost (broker down when the shipper committed, a worker crash).

Row-level security: every task works inside `tenant_context(tenant)` (governance/tenancy.py).
A batch of interaction ids may span tenants (the shipper ships several per batch), so
build_steps first routes the ids to their tenants (the SECURITY DEFINER function
steward_interaction_tenants: ids and tenant ids only), then builds each tenant's group in its
own scope; beat tasks iterate the tenants.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache, partial
from typing import Any

from celery import shared_task
from celery.signals import worker_init
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from governance.audit import record_event
from governance.capture.conversation import (
    DIGEST_HEX,
    History,
    TrajectoryItems,
    answer_index,
    chain_digests,
    choose_parent,
    history_of,
    known_histories,
    known_items,
    parent_candidates,
)
from governance.capture.findings import packed_rows
from governance.capture.placeholders import keep_states, read_states, write_deltas
from governance.capture.rawstore import (
    RawPayloadUnavailable,
    RecentBodies,
    decode_body,
    delta_bases,
    insert_ignore_conflicts,
    known_flows,
    open_raw,
    rebase_dependents,
)
from governance.capture.session_memo import SESSION_MEMO
from governance.capture.steps import (
    CaptureError,
    Exchange,
    compact_step_json,
    fields_from_exchange,
    parse_exchange,
)
from governance.erasure import SUPPRESSED_REASON, suppressed_hashes
from governance.keyring import content_hasher, subject_hasher
from governance.models import (
    AnswerRef,
    Consent,
    ConversationItem,
    Finding,
    Interaction,
    PendingInteraction,
    Step,
    SubjectIndex,
    Tenant,
    Trajectory,
)
from governance.sanitizer import PlaceholderState, Sanitizer
from governance.sanitizing import (
    NewItem,
    Sanitized,
    finish_fields,
    sanitize_exchanges,
    sanitize_one,
    sanitizer_for_tenant,
)
from governance.tenancy import interaction_tenants, tenant_context

log = logging.getLogger("steward.capture")


class StageClock:
    """Wall time by stage of one builder batch, for its log line: where a batch's time goes
    (claiming, opening raw payloads, the sanitizer's NER pass, building the rows, writing
    them) is what an operator, and tests/bench/long_sessions.py, needs to tell a slow
    sanitizer from small batches or a slow database."""

    STAGES = ("claim", "open", "sanitize", "fields", "store")

    def __init__(self) -> None:
        self.ms: dict[str, float] = dict.fromkeys(self.STAGES, 0.0)
        self.trajectories = 0  # distinct trajectories in the batch
        self.cached = 0  # of them, how many started from RecentBodies (no chain re-read)
        self.built: list[int] = []  # interaction ids, those taken along included
        self.quarantined = 0
        # Strings the sanitizer's detection was asked for, and how many of them the
        # process's AnalysisCache answered (governance/sanitizing.py).
        self.analysed = 0
        self.analysis_hits = 0
        self.shared_hits = 0  # of those, answered by another process's work (SharedDetections)
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.ms[stage] += (now - self._last) * 1000
        self._last = now

    def describe(self) -> str:
        stages = ", ".join(f"{name} {self.ms[name]:.0f}" for name in self.STAGES)
        return (f"in {sum(self.ms.values()):.0f} ms: {stages} ms; {self.cached} of "
                f"{self.trajectories} trajectories' last calls cached; {self.analysis_hits} of "
                f"{self.analysed} strings' detection cached ({self.shared_hits} shared)")


# One body through the whole sanitizer when a worker starts. Loading it is not enough: its
# recognizers import and build what they need on first use (phonenumbers' geodata alone took
# 7 s to import where no bytecode is cached, the country-name tables, Presidio's patterns),
# which cost every prefork child 9-11 s on its first batch — a lag spike after each start.
_WARM_UP_BODY = {"model": "warm-up", "messages": [
    {"role": "system", "content": "You are a support agent."},
    {"role": "user", "content": "I am Jane Doe, born 1 May 1980, of 12 High Street, Leeds, "
                                "United Kingdom; call +44 20 7946 0958 or mail "
                                "jane.doe@example.com, see https://example.com/a."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "lookup", "arguments": '{"customer_name": "Jane Doe", "api_key": '
                                          '"warm-up-not-a-secret"}'}}]},
    {"role": "tool", "tool_call_id": "call_1",
     "content": '{"iban": "GB82 WEST 1234 5698 7654 32", "card": "4111 1111 1111 1111"}'}]}


@worker_init.connect
def _yield_cpu(**_: Any) -> None:
    """Lower the worker's CPU priority (STEWARD_WORKER_NICE) before it loads anything or forks
    its pool, whose processes inherit it. On a host that also runs the proxy, a worker building
    steps competed with the proxy for the cores while agents were sending, so each call waited
    on the worker's NER pass; building is background work that catches up once the cores are
    free (decision 53). Connected before the preload below, so loading spaCy yields too."""
    increment = settings.STEWARD_WORKER_NICE
    if increment <= 0:
        return
    try:
        now = os.nice(increment)
    except OSError as exc:  # a platform or sandbox without it: the worker runs as it was
        log.warning("worker: CPU priority not lowered (STEWARD_WORKER_NICE=%d): %s",
                    increment, exc)
        return
    log.info("worker: CPU priority lowered to nice %d, so the proxy and the console go first "
             "(STEWARD_WORKER_NICE=%d)", now, increment)


@worker_init.connect
def _preload_sanitizer(**_: Any) -> None:
    """Load the sanitizer (spaCy, recognizers: seconds) and run it once when a worker starts,
    before it takes a task — in the parent process, so prefork children share all of it
    instead of each paying it on its first batch (which would add it to the capture lag)."""
    if settings.STEWARD_SANITIZER_PRELOAD:
        from governance.sanitizer import get_sanitizer

        sanitizer = get_sanitizer()
        try:
            sanitizer.sanitize_bodies([("request", _WARM_UP_BODY)])
        except Exception:  # a warm-up only: a batch that fails is quarantined, not the worker
            log.exception("sanitizer: the warm-up run failed")
        freeze_heap()


def freeze_heap() -> None:
    """Move everything alive now (spaCy's model, the gazetteers, Presidio's registry: over
    half a million objects) out of the garbage collector's reach (`gc.freeze`). Every full
    collection in a worker walked all of them again — ~5 % of a step's CPU (decision 36) —
    and, after the fork, touching their headers unshared the parent's memory pages. They live
    as long as the process anyway; garbage made afterwards is collected as before."""
    gc.collect()
    gc.freeze()

ACTOR = "system:capture"
PENDING_AFTER = timedelta(seconds=60)
PENDING_BATCH = 100
PENDING_MAX = 10_000
# Interactions per sanitizer batch (one NER pass, one transaction).
BATCH_MAX = 64
# One builder per trajectory at a time (decision 42): a batch whose trajectory another worker
# is building leaves those calls for a retry this much later, at most DEFER_MAX times; the
# last try waits for the other builder instead.
DEFER_S = 0.5
DEFER_MAX = 20
# A batch that holds this many calls already leaves the further sessions (trajectories with
# more than one waiting call) to a task of their own, which an idle worker builds meanwhile.
SPLIT_AT = 4
# This worker process's last opened call of each trajectory (rawstore.RecentBodies).
RECENT_BODIES = RecentBodies()


def _quarantine(ia: Interaction, reason: str) -> None:
    reason = reason[:2000]
    quarantined = PendingInteraction.State.QUARANTINED
    if not PendingInteraction.objects.filter(interaction_id=ia.pk).update(state=quarantined,
                                                                          reason=reason):
        PendingInteraction.objects.create(
            interaction_id=ia.pk, tenant_id=ia.tenant_id, trajectory_id=ia.trajectory_id,
            started_at=ia.started_at, state=quarantined,
            reason=reason)
    ia._state.fields_cache.pop("pending", None)  # so that ia.state reads the row again
    log.warning("capture: tenant %s: interaction %s (flow %s) quarantined: %s", ia.tenant_id,
                ia.pk, ia.flow_id, reason)


def _header_row(ia: Interaction, step_id: Any) -> SubjectIndex | None:
    """The subject index row of an interaction that named a subject (X-Steward-Subject)."""
    if not ia.subject_hash:
        return None
    return SubjectIndex(tenant_id=ia.tenant_id, trajectory_id=ia.trajectory_id,
                        step_id=step_id, interaction=ia, source=SubjectIndex.Source.HEADER,
                        hashes=SubjectIndex.keys([ia.subject_hash]))


def _open(ia: Interaction, bodies: dict[str, bytes] | None = None,
          bases: dict[str, Interaction] | None = None) -> Exchange | str:
    """The parsed exchange, or the reason to quarantine the interaction. `bodies`: the
    batch's request bodies by flow id (a delta's base is decrypted once, rawstore.open_raw);
    `bases`: the batch's delta bases read beforehand (rawstore.delta_bases)."""
    try:
        raw = open_raw(ia, bodies, bases)
        request_body = decode_body(raw.get("request_body")) or b""
        response_body = decode_body(raw.get("response_body"))
    except RawPayloadUnavailable as exc:
        return f"raw payload unavailable: {exc}"
    except Exception as exc:  # wrong key, tampered ciphertext, bad base64: never a step
        return f"raw payload does not open: {type(exc).__name__}"
    try:
        return parse_exchange(
            endpoint=ia.endpoint, request_body=request_body, response_body=response_body,
            response_status=raw.get("response_status"), is_stream=bool(raw.get("is_stream")),
            error=raw.get("error") if isinstance(raw.get("error"), dict) else None,
            routing=raw.get("routing") if isinstance(raw.get("routing"), dict) else None,
            truncated=raw.get("response_truncated"))
    except CaptureError as exc:
        return f"capture: {exc}"
    except Exception as exc:  # a bug in a parser must not loop forever on one payload
        log.exception("capture: parser failed on interaction %s", ia.pk)
        return f"capture failed: {type(exc).__name__}"


def _sanitize(sanitizer: Sanitizer, batch: list[tuple[Interaction, Exchange]],
              states: dict[Any, PlaceholderState], histories: dict[int, History],
              known: dict[Any, TrajectoryItems]
              ) -> tuple[list[tuple[Interaction, Sanitized]], list[tuple[Interaction, str]]]:
    """One sanitize_bodies call for the batch; if it raises, each exchange alone (from the
    states as they were), so only the one the sanitizer fails on is quarantined. `known`: the
    trajectories' conversation items (governance/capture/conversation.py) — items in it are
    reused, the others sanitized and added."""
    # The failed call may have numbered values it never wrote: start again from here.
    snapshot = {tid: st.to_json() for tid, st in states.items()}
    try:
        results = sanitize_exchanges(sanitizer, [
            (ex, states[ia.trajectory_id], histories[ia.pk], known[ia.trajectory_id])
            for ia, ex in batch])
        return [(ia, r) for (ia, _), r in zip(batch, results, strict=True)], []
    except Exception as exc:
        log.error("sanitizer: batch of %d failed (%s); retrying one by one", len(batch),
                  type(exc).__name__)
    for tid, data in snapshot.items():
        states[tid] = PlaceholderState.from_json(data)
    ok: list[tuple[Interaction, Sanitized]] = []
    failed: list[tuple[Interaction, str]] = []
    for ia, ex in batch:
        state = states[ia.trajectory_id]
        before = state.to_json()
        try:
            ok.append((ia, sanitize_one(sanitizer, ex, state, histories[ia.pk],
                                        known[ia.trajectory_id])))
        except Exception as exc:
            states[ia.trajectory_id] = PlaceholderState.from_json(before)
            # The class only: an exception message could quote the payload.
            failed.append((ia, f"sanitizer failed: {type(exc).__name__}"))
    return ok, failed


def _sanitize_unlocked(tenant: Tenant, parsed: list[tuple[Interaction, Exchange]]
                       ) -> tuple[dict[Any, Trajectory], dict[Any, PlaceholderState],
                                  dict[Any, dict[str, Any]], dict[Any, TrajectoryItems],
                                  list[tuple[Interaction, Sanitized]],
                                  list[tuple[Interaction, str]]]:
    """Sanitize the batch from its trajectories' placeholder states and stored conversation
    items WITHOUT their row locks, then lock the trajectories (in id order) for the write. The
    shipper updates trajectory rows (step counts) with every batch it ships: a lock held across
    the NER pass (seconds) stalled it — and with it every tenant's capture — behind the
    sanitizer. A trajectory whose state another worker committed meanwhile (two batches of one
    trajectory in flight at once, rare) is sanitized again, now under its lock, from the
    committed state and items, so placeholder numbering never forks (the state's version is
    Trajectory.sanitizer_state_seq, capture/placeholders.py). Returns (locked trajectories,
    their states after the batch, the states as read (to_json), their items, sanitized,
    failed)."""
    if not parsed:
        return {}, {}, {}, {}, [], []
    sanitizer = sanitizer_for_tenant(tenant)
    version = sanitizer.policy.version
    # Remembered by this process: a session's messages are digested once, not per call.
    digest = SESSION_MEMO.digest(tenant.pk, content_hasher(tenant.pk))
    histories = {ia.pk: history_of(ia.endpoint, ex.request, digest) for ia, ex in parsed}
    ids = {ia.trajectory_id for ia, _ in parsed}

    def items_of(tids: set[Any]) -> dict[Any, TrajectoryItems]:
        return known_items(tids, {d for ia, _ in parsed if ia.trajectory_id in tids
                                  for d in histories[ia.pk].item_digests()}, version,
                           SESSION_MEMO)

    read = read_states(ids, SESSION_MEMO, tenant.pk)
    seen = {tid: seq for tid, (seq, _) in read.items()}
    states = {tid: state for tid, (_, state) in read.items()}
    before = {tid: state.to_json() for tid, state in states.items()}
    known = items_of(ids)
    sanitized, failed = _sanitize(sanitizer, parsed, states, histories, known)
    trajectories = {t.pk: t for t in Trajectory.objects.select_for_update(of=("self",))
                    .filter(pk__in=ids).order_by("pk")}
    stale = {tid for tid, t in trajectories.items() if t.sanitizer_state_seq != seen.get(tid)}
    if stale:
        log.info("sanitizer: tenant %s: %d trajectories changed during the batch; sanitizing "
                 "their exchanges again from the committed state", tenant.pk, len(stale))
        for tid, (_, state) in read_states(stale).items():
            states[tid] = state
            before[tid] = state.to_json()
        known.update(items_of(stale))
        again, again_failed = _sanitize(
            sanitizer, [(ia, ex) for ia, ex in parsed if ia.trajectory_id in stale], states,
            histories, known)
        sanitized = [(ia, r) for ia, r in sanitized if ia.trajectory_id not in stale] + again
        failed = [(ia, r) for ia, r in failed if ia.trajectory_id not in stale] + again_failed
        order = {ia.pk: i for i, (ia, _) in enumerate(parsed)}
        sanitized.sort(key=lambda pair: order[pair[0].pk])
    return trajectories, states, before, known, sanitized, failed


@dataclass
class _StepWrite:
    """The rows one built interaction adds: its step (None when it exists already), findings
    and subject-index rows — and, for a step of the conversation store, the digests of its
    whole history (`history`), of what it appends and of its tool schemas / instructions, which
    `_link_items` turns into item ids once the batch's new items are stored."""

    interaction: Interaction
    step: Step | None = None
    findings: list[Finding] = field(default_factory=list)
    index_rows: list[SubjectIndex] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    appended: list[str] = field(default_factory=list)
    refs: dict[str, str] = field(default_factory=dict)
    full_history: list[int] = field(default_factory=list)
    # Items of this batch pointing at this step's answer (decision 62), with the message:
    # given it back (_unpoint) when this step is not stored after all.
    pointed: list[tuple[int, Any]] = field(default_factory=list)


def _write(writes: list[_StepWrite]) -> None:
    Step.objects.bulk_create([w.step for w in writes if w.step is not None])
    Finding.objects.bulk_create([f for w in writes for f in w.findings], batch_size=1000)
    SubjectIndex.objects.bulk_create([r for w in writes for r in w.index_rows],
                                     batch_size=1000, ignore_conflicts=True)
    # Built: no longer pending (decision 39: a delete here, not an update of the interaction).
    PendingInteraction.objects.filter(
        interaction_id__in=[w.interaction.pk for w in writes]).delete()


def _store_steps(writes: list[_StepWrite]
                 ) -> tuple[list[_StepWrite], list[tuple[Interaction, str]]]:
    """Write the batch's steps in one savepoint; when PostgreSQL refuses it (a value it cannot
    store, e.g. `\\u0000` in JSON content, which jsonb rejects), write them one by one, each in
    its own savepoint, so only the interactions the database refuses are quarantined and their
    neighbours are built. Without this the whole batch rolled back, the beat sweep re-queued
    it every minute, and coalescing dragged the poison interaction into every later batch of
    the tenant, so none of them was ever built. A step whose parent step was refused keeps its
    whole history itself, and the rows of the items a refused step first carried go to the next
    step carrying them (_hand_over_item_rows, decision 46). A lost connection is not the
    payload's fault: it propagates and the task retries."""
    if not writes:
        return [], []
    try:
        with transaction.atomic():
            _write(writes)
        return writes, []
    except (OperationalError, InterfaceError):
        raise
    except (DatabaseError, ValueError) as exc:
        log.error("capture: the database refused a batch of %d steps (%s); storing them one "
                  "by one", len(writes), type(exc).__name__)
    stored: list[_StepWrite] = []
    refused: list[tuple[Interaction, str]] = []
    refused_steps: set[Any] = set()
    orphans: set[int] = set()
    for position, write in enumerate(writes):
        step = write.step
        if step is not None and step.parent_step in refused_steps:
            step.parent_step, step.kept, step.appended = None, 0, list(write.full_history)
        try:
            with transaction.atomic():
                _write([write])
            stored.append(write)
        except (OperationalError, InterfaceError):
            raise
        except (DatabaseError, ValueError) as exc:
            if step is not None:
                refused_steps.add(step.pk)
            _unpoint(write)
            orphans |= _hand_over_item_rows(write, writes[position + 1:])
            # The class and SQLSTATE only: a database message can quote the value.
            code = getattr(getattr(exc, "__cause__", None), "sqlstate", None) or ""
            refused.append((write.interaction, "step not stored: the database refused it ("
                            f"{type(exc).__name__}{' ' + code if code else ''})"))
    _delete_orphan_items(writes[0].interaction.tenant_id, orphans)
    return stored, refused


def _hand_over_item_rows(dead: _StepWrite, later: list[_StepWrite]) -> set[int]:
    """The findings and subject-index rows of the items first stored for a step that is not
    stored after all (the database refused it, or one of its other items) go to the next step
    of the batch that carries each item: an item is stored before its steps, so without this
    a later step would reference it while nothing indexed whom it names — an erasure would not
    find the trajectory by that subject — and its findings would be counted nowhere. Returns
    the items no later step carries: nothing references them, and they are deleted
    (_delete_orphan_items); a later call carrying the same message stores it again, with its
    rows."""
    owned = {f.item_id for f in dead.findings if f.item_id is not None} | {
        row.item_id for row in dead.index_rows if row.source == SubjectIndex.Source.ITEM}
    if not owned:
        return set()
    heirs: dict[int, _StepWrite] = {}
    for write in later:
        if write.step is None:
            continue
        carried = {*write.full_history, *write.step.item_refs.values()}
        for item_id in (owned & carried) - heirs.keys():
            heirs[item_id] = write
    for finding in dead.findings:
        heir = heirs.get(finding.item_id) if finding.item_id is not None else None
        if heir is not None:
            finding.step_id = heir.step.pk
            heir.findings.append(finding)
    for row in dead.index_rows:
        if row.source == SubjectIndex.Source.ITEM and row.item_id in heirs:
            heirs[row.item_id].index_rows.append(row)
    dead.findings, dead.index_rows = [], []
    return owned - heirs.keys()


def _point_at_answers(rows: dict[tuple[Any, str], ConversationItem],
                      owners: dict[tuple[Any, str], _StepWrite],
                      writes_by_step: dict[Any, _StepWrite]
                      ) -> dict[tuple[Any, str], tuple[Any, Any]]:
    """Decision 62: a new chat message that is exactly one of the messages of its first
    carrier's parent step's answer — the agent sending back the answer it was given, in 1,968
    of the 2,018 calls with a parent of tau-bench's recorded sessions — is stored as an
    AnswerRef to that message (19 bytes) instead of a second copy (~250 bytes packed), and
    without findings (the answer's step holds them: counted once). Its subject-index row
    stays: erasure finds the trajectory by the item as before. Sets the rows' content; returns
    item key -> (answering step id, the message) for the rows that point. `writes_by_step`:
    the batch's new steps' writes by step id (their answers are read from them)."""
    parents = {key: owners[key].step.parent_step for key, row in rows.items()
               if row.kind == ConversationItem.Kind.MESSAGE
               and owners[key].step.endpoint == "chat.completions"
               and owners[key].step.parent_step is not None}
    if not parents:
        return {}
    answers = {pk: w.step.action for pk, w in writes_by_step.items()}
    earlier = set(parents.values()) - answers.keys()
    if earlier:
        answers.update(Step.objects.filter(pk__in=earlier).values_list("pk", "action"))
    pointing: dict[tuple[Any, str], tuple[Any, Any]] = {}
    for key, parent in parents.items():
        row = rows[key]
        k = answer_index(row.content, answers.get(parent))
        if k is not None:
            pointing[key] = (parent, row.content)
            row.content = AnswerRef(parent, k)
    return pointing


def _unpoint(write: _StepWrite) -> None:
    """The items pointing at this step's answer get the message itself: the step is not
    stored (refused by the database, or dropped with an item of its own)."""
    for item_id, message in write.pointed:
        ConversationItem.objects.filter(pk=item_id).update(content=message)
    write.pointed = []


def _delete_orphan_items(tenant_id: int, item_ids: set[int]) -> None:
    """Items of this batch that no step references (see _hand_over_item_rows): kept, they
    would hold sanitized content for no step, and erasure and retention reach items through
    the steps and subject-index rows that no longer exist for them."""
    if item_ids:
        ConversationItem.objects.filter(pk__in=item_ids).delete()
        log.info("capture: tenant %s: %d conversation items deleted, the steps first carrying "
                 "them were not stored (items %s)", tenant_id, len(item_ids),
                 _id_ranges(sorted(item_ids)))


def _remember_batch(tenant_id: int, trajectories: dict[Any, Trajectory],
                    states: dict[Any, PlaceholderState], last_steps: dict[Any, Step],
                    version: str) -> None:
    """After a batch's commit: what its next batch starts from (capture/session_memo.py)."""
    keep_states(SESSION_MEMO, tenant_id, trajectories, states)
    for tid, step in last_steps.items():
        SESSION_MEMO.keep_parent((tenant_id, tid), step.history_digest, step.history_length,
                                 version)


def _parent_lookup(tenant_id: int, sanitized: list[tuple[Interaction, Sanitized]],
                   chains: dict[int, list[str]], version: str
                   ) -> dict[Any, dict[str, tuple[Any, int]]]:
    """known_histories for the batch's histories: for a session this process built last, the
    prefixes from its last step on (conversation.parent_candidates: the longest stored prefix
    is among them while that step exists), else — or when that step is gone — every prefix:
    a 200-call session's next call used to look up 400 chain digests."""
    tids = {ia.trajectory_id for ia, _ in sanitized}
    hints = {tid: SESSION_MEMO.parent_hint((tenant_id, tid), version) for tid in tids}
    wanted = {ia.pk: parent_candidates(chains[ia.pk], hints[ia.trajectory_id])
              for ia, _ in sanitized if ia.pk in chains}
    histories = known_histories(tids, {c for cs in wanted.values() for c in cs}, version)
    again = {ia.pk for ia, _ in sanitized if ia.pk in chains
             and len(wanted[ia.pk]) < len(chains[ia.pk])
             and not any(c in histories[ia.trajectory_id] for c in wanted[ia.pk])}
    if again:
        more = known_histories({ia.trajectory_id for ia, _ in sanitized if ia.pk in again},
                               {c for pk in again for c in chains[pk]}, version)
        for tid, found in more.items():
            histories[tid].update(found)
    return histories


def _plan_history(write: _StepWrite, result: Sanitized, fields: dict,
                  histories: dict[str, tuple[Any, int]],
                  chains: list[str] | None = None) -> dict[str, Any]:
    """The conversation-store columns of one new step (its history as item references, see
    governance/capture/conversation.py), and the history, tools and instructions taken out of
    `fields["observation"]`. `histories`: the trajectory's steps by history digest, this
    batch's included; gains this step. `chains`: the history's chain digests, when known."""
    hist = result.history
    if hist is None or result.exchange.request is None:
        return {}
    obs = fields["observation"]
    columns: dict[str, Any] = {}
    if hist.key and hist.digests and hist.key in obs:
        chains = chains or chain_digests(hist.digests)
        parent, kept = choose_parent(chains, histories)
        columns.update(parent_step=parent, kept=kept, history_digest=chains[-1],
                       history_length=len(chains))
        write.history = hist.digests
        write.appended = hist.digests[kept:]
        histories[chains[-1]] = (write.interaction.step_id, len(chains))
        obs.pop(hist.key)
    for name, digest in (("tools", hist.tools_digest),
                         ("instructions", hist.instructions_digest)):
        if digest is not None and name in obs:
            write.refs[name] = digest
            obs.pop(name)
    return columns


def _link_items(tenant_id: int, writes: list[_StepWrite], known: dict[Any, TrajectoryItems],
                new_items: dict[tuple[Any, str], NewItem], version: str,
                hash_subject: Callable[[str], str]) -> list[tuple[Interaction, str]]:
    """Store the conversation items the batch's steps reference that are not stored yet (one
    INSERT; an item another worker stored meanwhile is read back, not duplicated), each with
    its findings and subject-index rows on the first step carrying it; then fill each step's
    `appended` and `item_refs` with item ids. Returns the interactions whose steps cannot be
    stored (an item of theirs refused by the database), removed from `writes`."""
    rows: dict[tuple[Any, str], ConversationItem] = {}
    owners: dict[tuple[Any, str], _StepWrite] = {}
    for w in writes:
        if w.step is None:
            continue
        tid = w.interaction.trajectory_id
        ids = known[tid].ids
        for digest in [*w.history, *w.refs.values()]:
            if digest in ids:
                continue
            key = (tid, digest)
            if key in rows:
                continue
            item = new_items.get(key)
            rows[key] = ConversationItem(
                tenant_id=tenant_id, trajectory_id=tid,
                kind=item.kind if item else ConversationItem.Kind.MESSAGE, digest=digest,
                sanitizer_version=version, content=known[tid].content[digest],
                first_step=w.step.pk)
            owners[key] = w
    writes_by_step = {w.step.pk: w for w in writes if w.step is not None}
    pointing = _point_at_answers(rows, owners, writes_by_step)
    inserted, refused = _insert_items(rows)
    for pk, tid, digest in inserted:
        known[tid].ids[digest] = pk
    missing = {k for k in rows if k[1] not in known[k[0]].ids and k not in refused}
    if missing:  # stored by another worker between our read and our insert
        again = known_items({t for t, _ in missing}, {d for _, d in missing}, version,
                            SESSION_MEMO)
        for tid, items in again.items():
            known[tid].ids.update(items.ids)
    ours = {(tid, digest) for _, tid, digest in inserted}
    for key, (parent, message) in pointing.items():
        if key in ours and parent in writes_by_step:  # an earlier batch's step is stored
            writes_by_step[parent].pointed.append((known[key[0]].ids[key[1]], message))
    for key, w in owners.items():
        item = new_items.get(key)
        if item is None or key not in ours:
            continue
        item_id = known[key[0]].ids[key[1]]
        ia = w.interaction
        if key not in pointing:
            w.findings.extend(packed_rows(ia.tenant_id, ia.step_id, item.findings, version,
                                          item_id))
        w.index_rows.extend(_index_rows(ia, item.identifiers, hash_subject, item_id))
    for w in writes:
        _drop_covered_keys(w)
    # A step holding an item the database refused (a value jsonb cannot store, e.g. \u0000)
    # is not stored either; a step extending one of those keeps its whole history itself.
    out: list[tuple[Interaction, str]] = []
    dropped: set[Any] = set()
    for w in writes:
        if w.step is None:
            continue
        tid = w.interaction.trajectory_id
        bad = [refused[(tid, d)] for d in [*w.history, *w.refs.values()]
               if (tid, d) in refused] if refused else []
        if bad:
            out.append((w.interaction, bad[0]))
            dropped.add(w.step.pk)
            continue
        ids = known[tid].ids
        w.step.appended = [ids[d] for d in w.appended]
        w.step.item_refs = {name: ids[d] for name, d in w.refs.items()}
        w.full_history = [ids[d] for d in w.history]
        if w.step.parent_step in dropped:
            w.step.parent_step, w.step.kept = None, 0
            w.step.appended = list(w.full_history)
    if dropped:
        def stays(w: _StepWrite) -> bool:
            return w.step is None or w.step.pk not in dropped

        orphans: set[int] = set()
        for position, w in enumerate(writes):
            if not stays(w):
                _unpoint(w)
                orphans |= _hand_over_item_rows(w, [k for k in writes[position + 1:] if stays(k)])
        _delete_orphan_items(tenant_id, orphans)
        writes[:] = [w for w in writes if stays(w)]
    return out


def _drop_covered_keys(write: _StepWrite) -> None:
    """Keep in the step's own subject-index row only the keys that no item row of the same
    write holds (decision 45). An agent's reply mostly names who the tool result it just read
    named: the key is then indexed twice, by the item and by the step. The item row is enough:
    the step references the item, so the item (and its row) lives at least as long as the
    step (conversation.delete_unreferenced_items), and every reader of the index wants
    trajectories, never steps. Only rows of the same write count: they are stored, or
    refused, together with the step (_store_steps)."""
    covered = {key for row in write.index_rows if row.source == SubjectIndex.Source.ITEM
               for key in row.hashes}
    if not covered:
        return
    kept: list[SubjectIndex] = []
    for row in write.index_rows:
        if row.source == SubjectIndex.Source.STEP:
            row.hashes = [key for key in row.hashes if key not in covered]
            if not row.hashes:
                continue
        kept.append(row)
    write.index_rows[:] = kept


def _insert_items(rows: dict[tuple[Any, str], ConversationItem]
                  ) -> tuple[list[tuple], dict[tuple[Any, str], str]]:
    """Insert the batch's new items in one statement (in a savepoint); when PostgreSQL refuses
    it, one by one, so only the items it refuses (and the steps holding them) are lost.
    Returns (inserted (id, trajectory, digest) rows, refused key -> reason)."""
    objs = list(rows.values())
    try:
        with transaction.atomic():
            return insert_ignore_conflicts(objs, ("id", "trajectory_id", "digest")), {}
    except (OperationalError, InterfaceError):
        raise
    except (DatabaseError, ValueError) as exc:
        log.error("capture: the database refused %d conversation items (%s); storing them "
                  "one by one", len(objs), type(exc).__name__)
    inserted: list[tuple] = []
    refused: dict[tuple[Any, str], str] = {}
    for key, obj in rows.items():
        try:
            with transaction.atomic():
                inserted += insert_ignore_conflicts([obj], ("id", "trajectory_id", "digest"))
        except (OperationalError, InterfaceError):
            raise
        except (DatabaseError, ValueError) as exc:
            # The class and SQLSTATE only: a database message can quote the value.
            code = getattr(getattr(exc, "__cause__", None), "sqlstate", None) or ""
            refused[key] = ("step not stored: the database refused it ("
                            f"{type(exc).__name__}{' ' + code if code else ''})")
    return inserted, refused


def _batch_subject_hashes(tenant_id: int) -> Callable[[str], str]:
    """keyring.subject_hash for one tenant, each value hashed once per batch. A session's
    calls each carry the identifiers of every message they resend (`Sanitized.carried`, for
    the erasure check), so a batch of one session's calls hashed the same values again and
    again: 52,254 hashes (one HKDF derivation each) for 210 calls of a 100 KB window
    (`python -m tests.bench.step_cpu --calls 0 --sessions 2 --session-calls 105 --window-kb
    100 --profile`). Kept for one batch only: no hash outlives the master key it was made
    with."""
    return cache(subject_hasher(tenant_id))


def _index_rows(ia: Interaction, identifiers: list[tuple[str, str]],
                hash_subject: Callable[[str], str],
                item_id: int | None = None) -> list[SubjectIndex]:
    """The subject-index row (none or one) of the identifiers found in a step — or in a
    conversation item: bound to the item then, not to the step (see SubjectIndex).
    `hash_subject`: keyring.subject_hash for the interaction's tenant (_batch_subject_hashes)."""
    hashes = sorted({hash_subject(value) for _, value in identifiers})
    if not hashes:
        return []
    packed = {"hashes": SubjectIndex.keys(hashes)}
    if item_id is not None:
        return [SubjectIndex(tenant_id=ia.tenant_id, trajectory_id=ia.trajectory_id,
                             item_id=item_id, source=SubjectIndex.Source.ITEM, **packed)]
    return [SubjectIndex(tenant_id=ia.tenant_id, trajectory_id=ia.trajectory_id,
                         step_id=ia.step_id, interaction=ia, source=SubjectIndex.Source.STEP,
                         **packed)]


def building_lock(trajectory_id: Any) -> str:
    """The name of the advisory lock that says "a worker is building this trajectory's
    steps"; its key is `hashtextextended(name, 0)`, as migration 0017's lock is."""
    return f"steward.build:{trajectory_id}"


class BatchPlan:
    """Which waiting calls one builder batch takes (decision 42). One builder per trajectory:
    a trajectory's calls are built by the worker holding its building lock (an advisory lock
    for the transaction), so no two batches sanitize one session's new messages twice. And
    the sessions of one task are spread over the workers: once the batch holds SPLIT_AT
    calls, a further trajectory with several waiting calls is left to another task.
    Trajectories are taken oldest call first; `wait`: wait for a lock another worker holds
    instead of leaving its calls (the last of a call's retries).

    `waiting`: how many calls each trajectory has waiting in all (not only among the calls
    asked about). A trajectory counts towards SPLIT_AT with every call coalescing will take
    along, so a backlog of two sessions is split between two workers, not built by one: when
    the workers had fallen behind, a batch asked for two calls of each session, took both
    sessions (4 calls, below SPLIT_AT) and then coalesced 60 more of both, while the other
    worker found both locked and idled (a 60-call session run measured 1.81x instead of
    ~1.0x)."""

    def __init__(self, wait: bool = False, split: bool = True,
                 waiting: dict[Any, int] | None = None) -> None:
        self.wait = wait
        self.split = split
        self.waiting = waiting or {}
        self.held: set[Any] = set()
        self.busy: set[Any] = set()
        self.calls = 0

    def _lock(self, trajectory_id: Any) -> bool:
        function = "pg_advisory_xact_lock" if self.wait else "pg_try_advisory_xact_lock"
        with connection.cursor() as cur:
            cur.execute(f"SELECT {function}(hashtextextended(%s, 0))",
                        [building_lock(trajectory_id)])
            # pg_advisory_xact_lock returns nothing: it waited until it had the lock.
            return self.wait or bool(cur.fetchone()[0])

    def choose(self, calls: dict[int, Any]) -> tuple[list[int], list[int], list[int]]:
        """`calls`: interaction id -> trajectory id. (take, busy: another worker builds
        their trajectories, split: left to another task). One lock query per trajectory, in
        turn: a trajectory found busy must not count towards SPLIT_AT (taking the locks in
        one query, deciding as if all were free, left batches empty and slowed the 60-call
        sessions from ~1.0x to 1.5-1.9x; a lock costs ~1.7 ms of a one-off call's claim)."""
        by_trajectory: dict[Any, list[int]] = {}
        for pk, tid in sorted(calls.items()):
            by_trajectory.setdefault(tid, []).append(pk)
        take: list[int] = []
        busy: list[int] = []
        split: list[int] = []
        for tid, ids in by_trajectory.items():
            if tid in self.busy:
                busy += ids
                continue
            if tid not in self.held:
                waiting = max(len(ids), self.waiting.get(tid, 0))
                if self.split and waiting > 1 and self.calls >= SPLIT_AT:
                    split += ids
                    continue
                if not self._lock(tid):
                    self.busy.add(tid)
                    busy += ids
                    continue
                self.held.add(tid)
                self.calls += waiting - len(ids)  # its calls that coalescing takes along
            take += ids
            self.calls += len(ids)
        return take, busy, split


def build_group(tenant_id: int, pks: list[int], harness_version: str = "",
                coalesce: bool = True, clock: StageClock | None = None,
                wait: bool = False, split: bool = False) -> dict[str, list[int]]:
    """Build the steps of these interactions of one tenant (see the module docstring). Runs
    in the tenant's scope, in the caller's transaction or its own.

    `coalesce`: when the batch is smaller than BATCH_MAX, also take the tenant's oldest other
    interactions still waiting (`captured`, not locked by another worker) — adaptive batching:
    when the workers fall behind, the shipper's many small batches become few large ones (one
    NER pass, one transaction each), and the tasks of the interactions taken along find them
    built and skip them. Returned under "coalesced" (not in "built"/"quarantined").
    `clock`: timed by stage into it (the caller logs it once the batch has committed).

    One builder per trajectory: the calls of a trajectory that another worker is building
    now are left waiting, returned under "deferred" for the caller to ask again after that
    worker's commit (`wait`: wait for it here instead); with `split` (a worker's task), the
    sessions beyond the batch's first SPLIT_AT calls go to a task of their own (BatchPlan).
    Two batches of one session built at once cost the NER pass twice: the later one finds
    the earlier one's new messages not stored yet and sanitizes them itself, then sanitizes
    its own again when it finds the trajectory's state moved on (_sanitize_unlocked) —
    measured at 60 calls, 2.7x the NER time of the same content sent as one-off calls
    (decision 42)."""
    clock = clock or StageClock()
    done: dict[str, list[int]] = {"built": [], "quarantined": [], "skipped": [],
                                  "coalesced": [], "deferred": []}
    with tenant_context(tenant_id):
        # Claimed by locking their PendingInteraction rows: a worker that built a call
        # deleted its row, so another worker's claim skips it whether it is still locked
        # (skip_locked) or already gone (PostgreSQL re-checks a row deleted meanwhile).
        # Which calls, and so which trajectories, are decided on an unlocked read first: a
        # row locked here stays locked until this batch commits, so what is left to another
        # worker must not be.
        pending = (PendingInteraction.objects.for_tenant(tenant_id)
                   .filter(state=PendingInteraction.State.CAPTURED))
        waiting = pending.select_for_update(skip_locked=True).values_list("interaction_id",
                                                                          flat=True)
        asked = dict(pending.filter(interaction_id__in=pks).values_list("interaction_id",
                                                                        "trajectory_id"))
        waiting_calls: dict[Any, int] = {}
        if split and asked:
            # What coalescing would look at: the tenant's oldest waiting calls (a task asked
            # for one session's call still coalesces an older session's otherwise).
            waiting_calls = Counter(pending.order_by("interaction_id").values_list(
                "trajectory_id", flat=True)[:BATCH_MAX])
        plan = BatchPlan(wait=wait, split=split, waiting=waiting_calls)
        take, busy, split_off = plan.choose(asked)
        done["deferred"] = busy
        if split_off:
            # Committed already (the shipper's), so asked for now, not at this commit: an
            # idle worker builds them while this one builds the rest.
            build_steps.apply_async((split_off,), {"tenant_id": tenant_id})
            log.info("capture: tenant %s: interactions %s left to another task (sessions "
                     "beyond this batch's first %d calls)", tenant_id, _id_ranges(split_off),
                     SPLIT_AT)
        claimed_ids = set(waiting.filter(interaction_id__in=take)[:len(take)])
        done["skipped"] = [pk for pk in pks if pk not in claimed_ids
                           and pk not in busy and pk not in split_off]
        if claimed_ids and coalesce and len(claimed_ids) < BATCH_MAX:
            # Only what this batch can hold is looked at, so it takes no lock it will not
            # use; what it leaves (busy, split) has tasks of its own.
            more, _, _ = plan.choose(dict(
                pending.exclude(interaction_id__in=pks).order_by("interaction_id")
                .values_list("interaction_id", "trajectory_id")[:BATCH_MAX - len(claimed_ids)]))
            claimed_ids |= set(waiting.filter(interaction_id__in=more))
        if not claimed_ids:
            return done
        claimed = list(Interaction.objects.for_tenant(tenant_id).select_related("data_key")
                       .filter(pk__in=claimed_ids))
        orphans = claimed_ids - {ia.pk for ia in claimed}
        if orphans:
            # A pending row whose interaction is gone (deleted by a path that missed it):
            # nothing to build, and the sweeper would re-queue it every minute.
            PendingInteraction.objects.filter(interaction_id__in=orphans).delete()
            log.warning("capture: tenant %s: dropped pending rows of missing interactions %s",
                        tenant_id, sorted(orphans))
            done["skipped"] += sorted(orphans & set(pks))
        if not claimed:
            return done
        claimed.sort(key=lambda ia: (ia.started_at, ia.pk))
        requested = set(pks)
        clock.lap("claim")
        tenant = Tenant.objects.get(pk=tenant_id)
        index_rows: list[SubjectIndex] = []

        def quarantine(ia: Interaction, reason: str, index: bool = True) -> None:
            _quarantine(ia, reason)
            done["quarantined"].append(ia.pk)
            # Erasure finds a quarantined interaction by its subject too (not one whose payload
            # no longer opens: its key is gone — the subject was erased already).
            row = _header_row(ia, None) if index else None
            if row is not None:
                index_rows.append(row)

        parsed: list[tuple[Interaction, Exchange]] = []
        # Chains end at the last call this process opened of each trajectory (RecentBodies).
        bodies = RECENT_BODIES.seed({(ia.tenant_id, ia.trajectory_id) for ia in claimed})
        bases = delta_bases(claimed, known_flows(bodies))
        clock.trajectories = len({ia.trajectory_id for ia in claimed})
        clock.cached = len(known_flows(bodies))
        for ia in claimed:  # in call order: the last opened of a trajectory is kept
            outcome = _open(ia, bodies, bases)
            if isinstance(outcome, str):
                quarantine(ia, outcome, index=not outcome.startswith("raw payload"))
                RECENT_BODIES.forget((ia.tenant_id, ia.trajectory_id))
            else:
                parsed.append((ia, outcome))
                RECENT_BODIES.remember((ia.tenant_id, ia.trajectory_id), ia.flow_id, bodies)
        clock.lap("open")

        analyzer = sanitizer_for_tenant(tenant).analyzer
        shared = getattr(analyzer, "shared", None)
        asked = (getattr(analyzer, "hits", 0), getattr(analyzer, "misses", 0),
                 shared.hits if shared is not None else 0)
        trajectories, states, before, known, sanitized, failed = _sanitize_unlocked(tenant,
                                                                                     parsed)
        clock.lap("sanitize")
        clock.analysis_hits = getattr(analyzer, "hits", 0) - asked[0]
        clock.analysed = clock.analysis_hits + getattr(analyzer, "misses", 0) - asked[1]
        clock.shared_hits = (shared.hits if shared is not None else 0) - asked[2]
        for ia, reason in failed:
            quarantine(ia, reason)
        version = sanitizer_for_tenant(tenant).policy.version

        existing = set(Step.objects.filter(pk__in=[ia.step_id for ia, _ in sanitized])
                       .values_list("pk", flat=True))
        # Erased subjects (governance/erasure.py): an exchange naming one (header, an
        # identifier found in it or in a conversation item it carries) is kept as metadata
        # only — no step, no raw payload.
        hash_subject = _batch_subject_hashes(tenant_id)
        ident_hashes = {ia.pk: {ia.subject_hash} | {hash_subject(v)
                                                    for _, v in r.identifiers + r.carried}
                        for ia, r in sanitized}
        suppressed = suppressed_hashes(tenant_id, set().union(*ident_hashes.values()))
        # The items first sanitized in this batch, by trajectory and digest (an item whose
        # first carrier is not stored belongs to the next step that is).
        new_items = {(ia.trajectory_id, item.digest): item
                     for ia, r in reversed(sanitized) for item in r.new_items}
        chains = {ia.pk: SESSION_MEMO.chains((tenant_id, ia.trajectory_id),
                                             r.history.digests, DIGEST_HEX)
                  for ia, r in sanitized if r.history and r.history.key}
        histories = _parent_lookup(tenant_id, sanitized, chains, version)
        # What each built interaction writes; stored together, or one by one when the
        # database refuses the batch (see _store_steps).
        writes: list[_StepWrite] = []
        for ia, result in sanitized:
            if ident_hashes[ia.pk] & suppressed:
                quarantine(ia, SUPPRESSED_REASON, index=False)
                rebase_dependents([ia.flow_id])
                Interaction.objects.filter(pk=ia.pk).update(
                    raw_ciphertext=None, data_key=None, raw_expires_at=None)
                continue
            try:
                fields = fields_from_exchange(
                    result.exchange, t_request=ia.started_at.timestamp(),
                    t_first_byte=ia.first_byte_at.timestamp() if ia.first_byte_at else None,
                    t_end=ia.ended_at.timestamp() if ia.ended_at else None,
                    harness_version=harness_version)
                fields = finish_fields(fields, result, version)
            except Exception as exc:
                log.exception("capture: step fields failed on interaction %s", ia.pk)
                quarantine(ia, f"capture failed: {type(exc).__name__}")
                continue
            write = _StepWrite(ia)
            writes.append(write)
            if ia.step_id in existing:
                continue  # built before under this id (kept as it is: steps are immutable)
            whole = dict(fields["observation"])  # _plan_history takes the history out
            columns = _plan_history(write, result, fields, histories[ia.trajectory_id],
                                    chains.get(ia.pk))
            write.step = Step(
                id=ia.step_id, tenant_id=ia.tenant_id, trajectory_id=ia.trajectory_id,
                interaction=ia, endpoint=ia.endpoint, started_at=ia.started_at,
                ended_at=ia.ended_at, status_code=ia.status_code,
                consent=ia.consent, classification="internal", retention_until=None,
                sanitizer_version=version,
                training_eligible=ia.consent == Consent.TRAIN and fields["error"] is None,
                **fields, **columns,
            )
            compact_step_json(write.step, whole)
            write.findings.extend(packed_rows(ia.tenant_id, ia.step_id, result.findings, version))
            write.index_rows.extend(_index_rows(ia, result.identifiers, hash_subject))
            row = _header_row(ia, ia.step_id)
            if row is not None:
                write.index_rows.append(row)
        for ia, reason in _link_items(tenant_id, writes, known, new_items, version,
                                      hash_subject):
            quarantine(ia, reason)
        clock.lap("fields")

        stored, refused = _store_steps(writes)
        for ia, reason in refused:
            quarantine(ia, reason)
        built = [w.interaction.pk for w in stored]
        findings = [f for w in stored for f in w.findings]
        SubjectIndex.objects.bulk_create(index_rows, batch_size=1000, ignore_conflicts=True)
        # What the batch numbered: one delta row per trajectory, not the whole state again.
        write_deltas(trajectories, states, before)
        # Remembered once this commits (never a rolled-back batch's numbering): the states,
        # and the last step of each session, which the next batch's parent lookup starts from.
        last_steps = {w.interaction.trajectory_id: w.step for w in stored
                      if w.step is not None and w.step.history_digest}
        transaction.on_commit(partial(_remember_batch, tenant_id, trajectories, states,
                                      last_steps, version))
        done["built"] = built
        ids = done["built"] + done["quarantined"]
        done["coalesced"] = [pk for pk in ids if pk not in requested]
        if ids:
            record_event(ACTOR, "capture.steps_built", tenant=tenant_id,
                         object_type="interaction", object_id=f"{min(ids)}-{max(ids)}",
                         payload={"built": done["built"], "quarantined": done["quarantined"],
                                  "sanitizer_version": version,
                                  "findings": dict(sorted(sum(
                                      (Counter(f.counts) for f in findings),
                                      Counter()).items()))})
        clock.lap("store")
    clock.built, clock.quarantined = list(done["built"]), len(done["quarantined"])
    if done["coalesced"]:
        taken = set(done["coalesced"])
        done["built"] = [pk for pk in done["built"] if pk not in taken]
        done["quarantined"] = [pk for pk in done["quarantined"] if pk not in taken]
    return done


def _id_ranges(ids: list[int]) -> str:
    """`[3, 4, 5, 9]` as "3-5, 9": a batch's interaction ids, short enough for a log line."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive ids
    for pk in sorted(set(ids)):
        if runs and pk == runs[-1][1] + 1:
            runs[-1][1] = pk
        else:
            runs.append([pk, pk])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


# Queue "capture" comes from CELERY_TASK_ROUTES (the task-level `queue` option is deprecated).
@shared_task(name="governance.tasks.build_steps",
             autoretry_for=(OperationalError, InterfaceError), max_retries=5,
             retry_backoff=True, retry_backoff_max=60, retry_jitter=True)
def build_steps(interaction_ids: list[int], tenant_id: int | None = None,
                deferrals: int = 0) -> dict[str, int]:
    """Build the steps of these interactions. `tenant_id` (optional): they all belong to this
    tenant — ids of any other tenant are then invisible and skipped. Calls of a trajectory
    that another worker is building are asked for again DEFER_S later, by a task of their
    own (`deferrals`: how many times before; at DEFER_MAX the task waits instead)."""
    harness = getattr(settings, "STEWARD_HARNESS_VERSION", "")
    results: dict[str, list[int]] = {"built": [], "quarantined": [], "skipped": []}
    coalesced = 0
    pks = [int(pk) for pk in interaction_ids]
    routes = ({pk: tenant_id for pk in pks} if tenant_id is not None
              else interaction_tenants(pks))
    groups: dict[int, list[int]] = {}
    for pk in pks:
        if pk in routes:
            groups.setdefault(routes[pk], []).append(pk)
        else:
            results["skipped"].append(pk)  # no such interaction (erased, purged)
    # One transaction for the batch; each tenant's group in its own row-level security scope
    # (build_group), so the audit events commit with the steps.
    timed: list[tuple[int, StageClock]] = []
    deferred: dict[int, list[int]] = {}
    # Sessions are spread over workers only by a worker's task (a direct call, or an eager
    # one, would leave them to a task nobody runs now).
    in_worker = (not build_steps.request.called_directly
                 and not settings.CELERY_TASK_ALWAYS_EAGER)
    with transaction.atomic():
        for group_tenant, group in groups.items():
            clock = StageClock()
            done = build_group(group_tenant, group, harness, clock=clock,
                               wait=deferrals >= DEFER_MAX, split=in_worker)
            timed.append((group_tenant, clock))
            coalesced += len(done.pop("coalesced"))
            if done["deferred"]:
                deferred[group_tenant] = done["deferred"]  # asked for again, below
            del done["deferred"]
            for outcome, ids in done.items():
                results[outcome].extend(ids)
        in_groups = time.perf_counter()
    committed = time.perf_counter()
    for group_tenant, clock in timed:
        if clock.built or clock.quarantined:
            log.info("capture: tenant %s: built %d steps (interactions %s), quarantined %d %s",
                     group_tenant, len(clock.built), _id_ranges(clock.built),
                     clock.quarantined, clock.describe())
    log.info("capture: built %d steps, quarantined %d, skipped %d (and %d waiting ones taken "
             "along); commit %.0f ms", len(results["built"]), len(results["quarantined"]),
             len(results["skipped"]), coalesced, (committed - in_groups) * 1000)
    for group_tenant, ids in deferred.items():
        # A busy session's calls can wait through many retries, two a second: the first
        # deferral and the last before waiting are worth an operator's line, the rest debug.
        level = logging.INFO if deferrals in (0, DEFER_MAX - 1) else logging.DEBUG
        log.log(level, "capture: tenant %s: interactions %s deferred (%d of %d): another "
                "worker is building their trajectories", group_tenant, _id_ranges(ids),
                deferrals + 1, DEFER_MAX)
        # On commit: inside a caller's transaction the building locks are held until its end.
        transaction.on_commit(lambda ids=ids, t=group_tenant: build_steps.apply_async(
            (ids,), {"tenant_id": t, "deferrals": deferrals + 1}, countdown=DEFER_S))
    # The ids asked for; interactions taken along are counted by their own (skipped) task.
    out = {k: len(v) for k, v in results.items()}
    if deferred:
        out["deferred"] = sum(len(ids) for ids in deferred.values())
    return out


@shared_task(name="governance.tasks.build_pending_steps")
def build_pending_steps() -> int:
    """Re-queue interactions left `captured` for over a minute (their message was lost)."""
    cutoff = timezone.now() - PENDING_AFTER
    total = 0
    for tenant_id in Tenant.objects.order_by("pk").values_list("pk", flat=True):
        if total >= PENDING_MAX:
            break
        with tenant_context(tenant_id):
            ids = list(PendingInteraction.objects.filter(
                state=PendingInteraction.State.CAPTURED, interaction__shipped_at__lt=cutoff)
                .order_by("interaction_id")
                .values_list("interaction_id", flat=True)[:PENDING_MAX - total])
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


@shared_task(name="governance.tasks.ensure_partitions",
             autoretry_for=(OperationalError, InterfaceError), max_retries=3,
             retry_backoff=True, retry_backoff_max=300, retry_jitter=True)
def ensure_partitions() -> list[dict]:
    """Time partitions (Celery beat): the monthly partitions of interactions, steps and
    findings for this month and the next ones, created when missing, rows that landed in the
    DEFAULT partition moved into theirs. Idempotent. See governance/partitions.py."""
    from governance.partitions import ensure_partitions as ensure

    created = ensure()
    if created:
        log.info("partitions: created %s", created)
    return created
