"""A trajectory's placeholder state (governance.sanitizer.PlaceholderState: `<PERSON_1>` is the
same person in every step) as a base plus append-only deltas (decision 34).

The state grows with every identifier a session mentions; rewritten whole with each step-builder
batch, a 60-call session left ~9 KB of dead row versions per call in the trajectory table (a
200-call one, quadratically more). Now each batch appends one PlaceholderDelta row with only
what it numbered, and bumps Trajectory.sanitizer_state_seq — the version the step builder
compares under the row lock to find a state another worker changed meanwhile.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.db.models import Q

from governance.models import PlaceholderDelta, Trajectory
from governance.sanitizer import PlaceholderState

if TYPE_CHECKING:
    from governance.capture.session_memo import SessionMemo


def read_states(trajectory_ids: Iterable[Any], memo: SessionMemo | None = None,
                tenant_id: int | None = None) -> dict[Any, tuple[int, PlaceholderState]]:
    """(seq, state) of each trajectory (ids as UUIDs, the keys of the result): its base column
    with its deltas applied in order. Two queries for any number of trajectories; a trajectory
    that does not exist reads as (0, an empty state).

    With `memo` (the step builder's, capture/session_memo.py): a state this process committed
    is taken from it (the caller owns it now, and gives it back with keep_states once its
    batch commits) and only the deltas committed after it are read — not every delta of the
    session again with every batch."""
    ids = list(trajectory_ids)
    rows = Trajectory.objects.filter(pk__in=ids).values_list(
        "pk", "sanitizer_state", "sanitizer_state_seq", "created_at")
    out = {tid: (0, PlaceholderState()) for tid in ids}
    seqs: dict[Any, int] = {}
    since: dict[Any, int] = {}
    for tid, base, seq, created in rows:
        kept = memo.take_state((tenant_id, tid, created)) if memo is not None else None
        if kept is not None and kept[0] <= seq:
            out[tid], since[tid] = (seq, kept[1]), kept[0]
        else:
            out[tid], since[tid] = (seq, PlaceholderState.from_json(base)), 0
        seqs[tid] = seq
    behind = [tid for tid, seq in seqs.items() if seq > since[tid]]
    if behind:
        after = Q()
        for tid in behind:
            after |= Q(trajectory_id=tid, seq__gt=since[tid])
        for tid, seq, data in (PlaceholderDelta.objects.filter(after)
                               .order_by("trajectory_id", "seq")
                               .values_list("trajectory_id", "seq", "data")):
            if seq <= seqs[tid]:  # a delta committed after the trajectory row was read waits
                apply_delta(out[tid][1], PlaceholderDelta.unpack(data))
    return out


def keep_states(memo: SessionMemo, tenant_id: int, trajectories: dict[Any, Trajectory],
                states: dict[Any, PlaceholderState]) -> None:
    """After the batch's commit: give the memo each (locked, written) trajectory's state at
    its new seq."""
    for tid, traj in trajectories.items():
        if tid in states:
            memo.keep_state((tenant_id, tid, traj.created_at), traj.sanitizer_state_seq,
                            states[tid])


def apply_delta(state: PlaceholderState, delta: dict[str, Any]) -> None:
    state.labels.update(delta.get("labels") or {})
    state.aliases.update(delta.get("aliases") or {})
    state.counters.update(delta.get("counters") or {})


def delta_between(before: dict[str, Any], after: PlaceholderState) -> dict[str, Any]:
    """What `after` numbered beyond `before` (a to_json() snapshot): new labels and aliases
    (a label or alias, once given, never changes), and the counters if they moved. {}: none."""
    old_labels = before.get("labels") or {}
    old_aliases = before.get("aliases") or {}
    labels = {k: v for k, v in after.labels.items() if k not in old_labels}
    aliases = {k: v for k, v in after.aliases.items() if k not in old_aliases}
    delta: dict[str, Any] = {}
    if labels:
        delta["labels"] = labels
    if aliases:
        delta["aliases"] = aliases
    if after.counters != (before.get("counters") or {}):
        delta["counters"] = dict(after.counters)
    return delta


def write_deltas(trajectories: dict[Any, Trajectory], states: dict[Any, PlaceholderState],
                 before: dict[Any, dict[str, Any]]) -> int:
    """Append what each (locked) trajectory's state gained since `before` as its next delta,
    and bump its seq. Returns how many trajectories changed."""
    rows: list[PlaceholderDelta] = []
    changed: list[Trajectory] = []
    for tid, traj in trajectories.items():
        delta = delta_between(before.get(tid) or {}, states[tid])
        if not delta:
            continue
        traj.sanitizer_state_seq += 1
        rows.append(PlaceholderDelta(tenant_id=traj.tenant_id, trajectory_id=tid,
                                     seq=traj.sanitizer_state_seq,
                                     data=PlaceholderDelta.pack(
                                         {"v": PlaceholderState.VERSION, **delta})))
        changed.append(traj)
    PlaceholderDelta.objects.bulk_create(rows, batch_size=500)
    Trajectory.objects.bulk_update(changed, ["sanitizer_state_seq"], batch_size=500)
    return len(changed)


def placeholder_state(trajectory_id: Any) -> PlaceholderState:
    """One trajectory's whole state (tests, tools); the id as a UUID or its text."""
    tid = uuid.UUID(str(trajectory_id))
    return read_states([tid])[tid][1]
