"""Dataset selection: which trajectories a dataset's filter admits, the content hash of a frozen
version and its review sample. Pure queries — the mutations (freeze, approve, ...) are in
governance/services.py.

A trajectory is eligible for training data only if ALL hold:
- it has at least one step, and every step is sanitized and `training_eligible`, with consent
  `train` and a classification no more restrictive than the dataset's;
- the trajectory's consent is `train` (never `X-Steward-Consent: no-train`);
- none of its interactions is quarantined (or still waiting to be built);
- it matches the filter: agents, time range (started_at), reward bounds.
Erased trajectories have no steps left, so they never qualify. (The suppression list of the
erasure work plugs in at `eligible_trajectories`.)

Row-level security: the querysets here are lazy and read in the caller's tenant scope (the
services open it: governance.tenancy.tenant_atomic); what is consumed here opens its own.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from typing import Any

from django.db import connection
from django.db.models import Exists, OuterRef, Q, QuerySet, Subquery
from django.db.models.expressions import RawSQL

from governance.capture.atdp import CLASSIFICATION_ORDER
from governance.models import (
    Consent,
    Dataset,
    DatasetVersion,
    DatasetVersionMember,
    Interaction,
    Reward,
    Step,
    Trajectory,
)
from governance.tenancy import tenant_context

SAMPLE_SIZE = 20
HASH_CHUNK = 5000


def allowed_classifications(most_restrictive: str) -> list[str]:
    rank = CLASSIFICATION_ORDER.index(most_restrictive)
    return list(CLASSIFICATION_ORDER[:rank + 1])


def filter_of(dataset: Dataset) -> dict[str, Any]:
    """The dataset's filter as JSON (copied onto each frozen version)."""
    return {
        "agent_ids": sorted(int(a) for a in dataset.agent_ids or []),
        "since": dataset.since.isoformat() if dataset.since else None,
        "until": dataset.until.isoformat() if dataset.until else None,
        "reward_name": dataset.reward_name or None,
        "reward_min": dataset.reward_min,
        "reward_max": dataset.reward_max,
        "classification": dataset.classification,
    }


def latest_reward_value(tenant_id: int, name: str) -> Subquery:
    """The latest final reward `name` of the outer trajectory: by its id or by the upstream
    response id of any of its steps (the same join as the ATDP document)."""
    step_response_ids = Step.objects.filter(
        trajectory_id=OuterRef(OuterRef("pk")), response_id__gt="").values("response_id")
    return Subquery(
        Reward.objects.filter(tenant_id=tenant_id, name=name, final=True)
        .filter(Q(trajectory_id=OuterRef("pk")) | Q(response_id__in=step_response_ids))
        .order_by("-created_at", "-id").values("value")[:1]
    )


# The same rule as latest_reward_value, for all of a tenant's trajectories at once: the latest
# final reward `name` by trajectory id or by the response id of one of its steps. The correlated
# subquery above cannot use an index because of its OR and reads the tenant's rewards once per
# trajectory (seconds at 100,000 trajectories); filters and lists use this instead
# (tests/test_console_trajectories.py checks both agree).
LATEST_REWARDS_SQL = """
SELECT DISTINCT ON (x.tid) x.tid, x.value FROM (
  SELECT r.trajectory_id AS tid, r.value, r.created_at, r.id FROM governance_reward r
   WHERE r.tenant_id = %s AND r.name = %s AND r.final AND r.trajectory_id IS NOT NULL
  UNION ALL
  SELECT s.trajectory_id, r.value, r.created_at, r.id FROM governance_reward r
   JOIN governance_step s ON s.response_id = r.response_id AND s.tenant_id = r.tenant_id
   WHERE r.tenant_id = %s AND r.name = %s AND r.final AND r.response_id > ''
) x ORDER BY x.tid, x.created_at DESC, x.id DESC"""


def latest_rewards_sql(tenant_id: int, name: str) -> tuple[str, list[Any]]:
    return LATEST_REWARDS_SQL, [tenant_id, name, tenant_id, name]


def latest_rewards(tenant_id: int, name: str, trajectory_ids: list[Any]) -> dict[Any, float]:
    """{trajectory id: latest final reward `name`} for the given trajectories."""
    if not trajectory_ids:
        return {}
    sql, params = latest_rewards_sql(tenant_id, name)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT l.tid, l.value FROM ({sql}) l WHERE l.tid = ANY(%s)",
                       [*params, list(trajectory_ids)])
        return dict(cursor.fetchall())


def reward_within(tenant_id: int, name: str, low: float | None, high: float | None) -> Q:
    """Q: the trajectory's latest final reward `name` exists and lies within [low, high]."""
    sql, params = latest_rewards_sql(tenant_id, name)
    bounds = ["TRUE"]
    if low is not None:
        bounds.append("l.value >= %s")
        params.append(low)
    if high is not None:
        bounds.append("l.value <= %s")
        params.append(high)
    return Q(pk__in=RawSQL(f"SELECT l.tid FROM ({sql}) l WHERE {' AND '.join(bounds)}", params))


def eligible_trajectories(dataset: Dataset) -> QuerySet:
    """The trajectories a freeze of `dataset` would take now (unordered)."""
    tenant_id = dataset.tenant_id
    allowed = allowed_classifications(dataset.classification)
    steps = Step.objects.filter(trajectory_id=OuterRef("pk"))
    bad_step = steps.filter(
        ~Q(training_eligible=True) | Q(sanitizer_version="") | ~Q(consent=Consent.TRAIN)
        | ~Q(classification__in=allowed))
    not_built = Interaction.objects.filter(trajectory_id=OuterRef("pk"),
                                           pending__isnull=False)
    qs = (Trajectory.objects.for_tenant(tenant_id)
          .filter(consent=Consent.TRAIN)
          .filter(Exists(steps))
          .exclude(Exists(bad_step))
          .exclude(Exists(not_built)))
    if dataset.agent_ids:
        qs = qs.filter(agent_id__in=[int(a) for a in dataset.agent_ids])
    if dataset.since:
        qs = qs.filter(started_at__gte=dataset.since)
    if dataset.until:
        qs = qs.filter(started_at__lt=dataset.until)
    if dataset.reward_name and (dataset.reward_min is not None
                                or dataset.reward_max is not None):
        qs = qs.filter(reward_within(tenant_id, dataset.reward_name, dataset.reward_min,
                                     dataset.reward_max))
    return qs


# A pinned reward as hashed: (id, trajectory id or "", response id, name, value, final,
# SHA-256 of its comment). The comment is the reference answer of a "reference" reward.
RewardRow = tuple[int, str, str, str, float, bool, str]


def _reward_line(row: RewardRow) -> bytes:
    # JSON: names and response ids are free text and may hold the separator of the other lines.
    return b"r:" + json.dumps(list(row), separators=(",", ":")).encode() + b"\n"


def _ordered_hash(trajectory_ids: Iterable[str], steps: Iterable[tuple[str, str, str]],
                  rewards: Iterable[RewardRow] = ()) -> str:
    h = hashlib.sha256(b"steward-dataset-v1\n")
    for tid in trajectory_ids:
        h.update(f"t:{tid}\n".encode())
    for tid, sid, sanitizer in steps:
        h.update(f"s:{tid}:{sid}:{sanitizer}\n".encode())
    for row in rewards:
        h.update(_reward_line(row))
    return h.hexdigest()


def reward_row(reward_id: int, trajectory_id: Any, response_id: str, name: str, value: float,
               final: bool, comment: str) -> RewardRow:
    return (int(reward_id), str(trajectory_id) if trajectory_id else "", response_id or "",
            name, float(value), bool(final), hashlib.sha256((comment or "").encode()).hexdigest())


def content_hash(trajectory_ids: Iterable[Any], steps: Iterable[tuple[Any, Any, str]],
                 rewards: Iterable[RewardRow] = ()) -> str:
    """SHA-256 over the sorted trajectory ids, then every (trajectory id, step id, sanitizer
    version) sorted by trajectory id and step id (ids as canonical lowercase strings), then
    every pinned reward (reward_row, sorted by reward id, one JSON line each). Anyone holding
    the member list, the steps and the rewards recomputes it (the trainer does, before it
    trains). A version without rewards hashes as it did before rewards were pinned."""
    return _ordered_hash(sorted(str(t) for t in trajectory_ids),
                         sorted((str(t), str(s), v) for t, s, v in steps),
                         sorted(rewards))


def member_steps(version: DatasetVersion) -> Iterable[tuple[str, str, str]]:
    """(trajectory id, step id, sanitizer version) of the members' steps, in hash order,
    streamed (a version may hold 1e5 trajectories and 1e6 steps).

    A version pins its members' steps as of its creation (`created_at`): a session that goes
    on after the freeze adds steps that are not part of the version. A step committed in the
    instant of the freeze may show up in a later recomputation; the hash then differs and the
    version is refused for training — failing safe, never training on unhashed content."""
    member_ids = DatasetVersionMember.objects.filter(version=version).values("trajectory_id")
    rows = (Step.objects.filter(trajectory_id__in=member_ids,
                                created_at__lte=version.created_at)
            .order_by("trajectory_id", "id")
            .values_list("trajectory_id", "id", "sanitizer_version")
            .iterator(chunk_size=HASH_CHUNK))
    return ((str(t), str(s), v) for t, s, v in rows)


def pinned_rewards(version: DatasetVersion) -> QuerySet:
    """The rewards a version pins (unordered): every reward row naming a member — by trajectory
    id, or by the response id of one of its pinned steps — recorded by the version's creation.

    Labels are part of what is approved: a reference answer or a judge's score posted after the
    freeze is not in the version (its hash covers these rows, ids and values), training reads
    only these (trainer.taskdata.iter_examples), and using a later one takes a new version and
    a new approval. Rewards are append-only, so the pinned rows never change; a reward
    committed in the instant of the freeze may show up in a later recomputation, and the
    version is then refused (failing safe), as for steps (member_steps)."""
    members = DatasetVersionMember.objects.filter(version=version).values("trajectory_id")
    response_ids = (Step.objects.filter(trajectory_id__in=members,
                                        created_at__lte=version.created_at, response_id__gt="")
                    .values("response_id"))
    return (Reward.objects.filter(tenant_id=version.tenant_id,
                                  created_at__lte=version.created_at)
            .filter(Q(trajectory_id__in=members) | Q(response_id__in=response_ids)))


def member_rewards(version: DatasetVersion) -> Iterable[RewardRow]:
    """The pinned rewards as hashed, in hash order (by id), streamed."""
    rows = (pinned_rewards(version).order_by("id")
            .values_list("id", "trajectory_id", "response_id", "name", "value", "final",
                         "comment")
            .iterator(chunk_size=HASH_CHUNK))
    return (reward_row(*row) for row in rows)


def member_ids(version: DatasetVersion) -> Iterable[str]:
    """The members' trajectory ids in hash order, streamed."""
    ids = (DatasetVersionMember.objects.filter(version=version).order_by("trajectory_id")
           .values_list("trajectory_id", flat=True).iterator(chunk_size=HASH_CHUNK))
    return (str(t) for t in ids)


def version_content_hash(version: DatasetVersion) -> tuple[str, int]:
    """(content hash, step count) of a version's members as they are now. Streams: PostgreSQL
    orders uuids byte-wise, which is the order of their canonical lowercase strings, so the
    database's order is the hash's order and nothing is sorted in memory."""
    count = 0

    def counted(rows: Iterable[tuple[str, str, str]]) -> Iterable[tuple[str, str, str]]:
        nonlocal count
        for row in rows:
            count += 1
            yield row

    # The streams are consumed here, inside the version's tenant scope (row-level security).
    with tenant_context(version.tenant_id):
        digest = _ordered_hash(member_ids(version), counted(member_steps(version)),
                               member_rewards(version))
    return digest, count


def review_sample(trajectory_ids: list[str], seed: str, k: int = SAMPLE_SIZE) -> list[str]:
    """A deterministic sample (seeded by the content hash) for the reviewer."""
    ids = sorted(trajectory_ids)
    if len(ids) <= k:
        return ids
    return sorted(random.Random(seed).sample(ids, k))
