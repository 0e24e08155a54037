"""ATDP v1: the trajectory document served by the API (and exported as JSONL).

The schema lives in governance/schemas/atdp-v1.schema.json (JSON Schema draft 2020-12) and is
served at /api/v1/atdp/schema/. `trajectory_document(traj)` builds one document with three
queries: the steps (with their sanitizer findings counted by entity type), the rewards, and the
calls of the trajectory that are not a step (quarantined, or not built yet).

Governance fields are true values: each step was sanitized before it was stored
(`sanitizer_version`), `training_eligible` (consent train, no error), and `findings` counts by
entity type — never a value.

Two things are computed when the document is served, never stored, so history is never mutated:
- a step's `action_result`: the tool results for its tool calls, taken from the first later
  step whose request carries them (chat `role: tool` messages by `tool_call_id`; Responses
  `function_call_output` items by `call_id`);
- `rewards`: rows naming the trajectory id, or the upstream response id of any of its steps (a
  reward may arrive before its capture; it is joined here, never copied onto the step).
"""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from pathlib import Path

from django.db.models import JSONField, Q, QuerySet
from django.db.models.expressions import RawSQL

from governance.capture.conversation import (
    HISTORY_KEYS,
    compact_form,
    materialize_observations,
)
from governance.capture.steps import step_json
from governance.models import Consent, Interaction, Reward, Step, Trajectory

ATDP_VERSION = "1.0"
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "atdp-v1.schema.json"


@lru_cache(maxsize=1)
def atdp_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


# Data classifications from least to most restrictive; an unknown label counts as the most.
CLASSIFICATION_ORDER = ("public", "internal", "confidential", "restricted")


def most_restrictive(labels: set[str]) -> str:
    """A trajectory is as restricted as its most restricted step ("internal" when empty)."""
    if not labels:
        return "internal"
    rank = {name: i for i, name in enumerate(CLASSIFICATION_ORDER)}
    return max(sorted(labels), key=lambda c: rank.get(c, len(CLASSIFICATION_ORDER)))


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def _tool_call_ids(action: dict) -> list[str]:
    ids: list[str] = []
    for message in action.get("messages") or []:
        if not isinstance(message, dict):
            continue
        for call in message.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                ids.append(call["id"])
    return ids


def _tool_results(observation: dict) -> dict[str, dict]:
    """Tool results carried by a request, keyed by tool call id."""
    out: dict[str, dict] = {}
    messages = observation.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict) and m.get("role") == "tool" and isinstance(
                    m.get("tool_call_id"), str):
                result = {"tool_call_id": m["tool_call_id"], "content": m.get("content")}
                if m.get("name"):
                    result["name"] = m["name"]
                out.setdefault(m["tool_call_id"], result)
    items = observation.get("input")
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("type") == "function_call_output" and \
                    isinstance(item.get("call_id"), str):
                out.setdefault(item["call_id"], {"tool_call_id": item["call_id"],
                                                 "content": item.get("output")})
    return out


def action_results(steps: list[Step]) -> list[dict | None]:
    """For each step, its tool calls' results from the first later step that carries them."""
    found: list[dict | None] = [None] * len(steps)
    pending: dict[str, int] = {}  # tool call id -> index of the step that made the call
    for i, step in enumerate(steps):
        results = _tool_results(step.observation or {}) if pending else {}
        for call_id, result in results.items():
            j = pending.pop(call_id, None)
            if j is None:
                continue
            doc = found[j] or {"tool_results": [], "source_step_id": str(step.id),
                               "source_step_index": i}
            doc["tool_results"].append(result)
            found[j] = doc
        for call_id in _tool_call_ids(step.action or {}):
            pending[call_id] = i
    return found


def step_governance(step: Step, findings: dict[str, int] | None = None) -> dict:
    return {
        "consent": step.consent,
        "classification": step.classification,
        "retention_until": _iso(step.retention_until),
        "sanitizer_version": step.sanitizer_version,
        "training_eligible": step.training_eligible,
        # What the sanitizer found and replaced, by entity type: counts only, never values.
        "findings": dict(sorted((findings or {}).items())),
    }


# A step's findings by entity type, as one JSON object: annotated onto the steps query, so
# the document still costs one query for its steps. Its packed rows' counts, summed.
FINDING_COUNTS_SQL = (
    "SELECT coalesce(jsonb_object_agg(x.entity_type, x.n), '{}'::jsonb) FROM ("
    "SELECT c.key AS entity_type, sum(c.value::int) AS n FROM governance_finding f, "
    "jsonb_each_text(f.counts) c WHERE f.step_id = governance_step.id GROUP BY c.key) x")


def with_finding_counts(steps: QuerySet) -> QuerySet:
    """Steps annotated with `finding_counts` ({entity type: count})."""
    return steps.annotate(finding_counts=RawSQL(FINDING_COUNTS_SQL, [],
                                                output_field=JSONField()))


# A trajectory's `status`: "processing" while a shipped call is waiting for its step (the
# worker has not built it yet — e.g. in the first minute after start-up, or during a backlog),
# else "quarantined" when a call could not become a step, else "complete".
PROCESSING, QUARANTINED, COMPLETE = "processing", "quarantined", "complete"


def capture_status(pending: bool, quarantined: bool) -> str:
    return PROCESSING if pending else QUARANTINED if quarantined else COMPLETE


def with_capture_status(qs: QuerySet, tenant) -> QuerySet:
    """Trajectories annotated with `pending_calls` / `quarantined_calls` (two EXISTS on the
    trajectory's interactions joined to their PendingInteraction rows), for capture_status on
    list pages."""
    from django.db.models import Exists, OuterRef

    calls = Interaction.objects.for_tenant(tenant).filter(trajectory_id=OuterRef("pk"))
    return qs.annotate(
        pending_calls=Exists(calls.filter(pending__state=Interaction.State.CAPTURED)),
        quarantined_calls=Exists(calls.filter(pending__state=Interaction.State.QUARANTINED)))


def quarantined_interactions(traj: Trajectory) -> list[dict]:
    """The trajectory's calls that never became a step: quarantined (unparseable, or the
    sanitizer failed — never training-eligible) or not built yet."""
    rows = (Interaction.objects.filter(trajectory_id=traj.pk)
            .filter(pending__isnull=False)
            .order_by("started_at", "pk")
            .values_list("step_id", "pending__state", "pending__reason", "started_at"))
    return [{"step_id": str(step_id), "state": state, "reason": reason,
             "started_at": _iso(started_at)} for step_id, state, reason, started_at in rows]


def step_document(step: Step, index: int, action_result: dict | None,
                  findings: dict[str, int] | None = None) -> dict:
    usage, versions, metadata = step_json(step)
    return {
        "index": index,
        "id": str(step.id),
        "started_at": _iso(step.started_at),
        "ended_at": _iso(step.ended_at),
        "endpoint": step.endpoint,
        "status_code": step.status_code,
        "response_id": step.response_id or None,
        "observation": step.observation or {},
        "hidden_state": step.hidden_state or {},
        "action": step.action or {},
        "action_result": action_result,
        "tokens": step.tokens or {},
        "usage": usage,
        "timings": step.timings or {},
        "versions": versions,
        "metadata": metadata,
        "error": step.error,
        "governance": step_governance(step, findings),
    }


def rewards_query(traj: Trajectory, response_ids: list[str]):
    q = Q(trajectory_id=traj.id)
    if response_ids:
        q |= Q(response_id__in=response_ids)
    return Reward.objects.for_tenant(traj.tenant_id).filter(q).order_by("created_at", "id")


def reward_document(reward: Reward, step_by_response: dict[str, tuple[int, str]]) -> dict:
    matched = step_by_response.get(reward.response_id) if reward.response_id else None
    return {
        "id": reward.pk,
        "name": reward.name,
        "value": reward.value,
        "final": reward.final,
        "source": reward.source,
        "comment": reward.comment,
        "trajectory_id": str(reward.trajectory_id) if reward.trajectory_id else None,
        "response_id": reward.response_id or None,
        "step_index": matched[0] if matched else None,
        "step_id": matched[1] if matched else None,
        "created_at": _iso(reward.created_at),
    }


def trajectory_rewards(traj: Trajectory, steps: list[Step] | None = None) -> list[dict]:
    if steps is None:
        steps = list(Step.objects.filter(trajectory=traj).only("id", "response_id", "started_at")
                     .order_by("started_at", "id"))
    by_response = {s.response_id: (i, str(s.id)) for i, s in enumerate(steps) if s.response_id}
    return [reward_document(r, by_response) for r in rewards_query(traj, list(by_response))]


def trajectory_document(traj: Trajectory, compact: bool = False) -> dict:
    """The ATDP v1 document of one trajectory in five queries: steps (with their finding
    counts), their history items (and the ancestors of steps whose parents lie outside it),
    rewards, calls not built (select_related("tenant", "agent") on `traj` saves two more).

    `compact`: each step with a stored history (chat `messages`, a Responses `input` list)
    carries `history` = {"parent_step", "kept", "appended"} instead of that list in its
    observation — the full history is the parent step's first `kept` messages plus `appended`
    (the schema's optional compact form). Tools and instructions stay in full."""
    # The calls not built yet are read before the steps: a batch that commits between the two
    # reads then shows as "processing" with its step, never as "complete" without it.
    unbuilt = quarantined_interactions(traj)
    steps = list(with_finding_counts(Step.objects.filter(trajectory=traj))
                 .order_by("started_at", "id"))
    # Compact form: each step's history as its parent step, the messages kept and those it
    # appends (conversation.compact_form) — read before the observations are materialized.
    histories = compact_form(steps) if compact else {}
    materialize_observations(steps)
    results = action_results(steps)
    step_docs = [step_document(s, i, results[i], s.finding_counts)
                 for i, s in enumerate(steps)]
    if compact:
        for doc, s in zip(step_docs, steps, strict=True):
            if s.pk in histories:
                key = HISTORY_KEYS[s.endpoint]
                doc["observation"] = {k: v for k, v in doc["observation"].items() if k != key}
                doc["history"] = histories[s.pk]
    totals: Counter[str] = Counter()
    for s in steps:
        totals.update(s.finding_counts or {})
    rewards = trajectory_rewards(traj, steps)
    retention = [s.retention_until for s in steps if s.retention_until is not None]
    sanitizer = {s.sanitizer_version for s in steps}
    classification = {s.classification for s in steps}
    return {
        "atdp_version": ATDP_VERSION,
        "id": str(traj.id),
        "tenant": traj.tenant.slug,
        "agent": {"id": traj.agent_id, "name": traj.agent.name},
        "session_id": traj.session_id or None,
        "source": traj.source,
        "started_at": _iso(traj.started_at),
        "last_step_at": _iso(traj.last_step_at),
        "step_count": len(steps),
        "status": capture_status(
            any(u["state"] == Interaction.State.CAPTURED for u in unbuilt),
            any(u["state"] == Interaction.State.QUARANTINED for u in unbuilt)),
        "steps": step_docs,
        "rewards": rewards,
        "governance": {
            "consent": traj.consent,
            "subject_hash_present": bool(traj.subject_hash),
            "classification": most_restrictive(classification),
            "retention": {"until": _iso(min(retention)) if retention else None},
            # "" when any step is unsanitized: the trajectory as a whole is not sanitized yet.
            "sanitizer_version": sanitizer.pop() if len(sanitizer) == 1 else "",
            # Like dataset selection (governance/datasets.py): every call built into an
            # eligible step, none quarantined or waiting.
            "training_eligible": bool(steps) and traj.consent == Consent.TRAIN
            and all(s.training_eligible for s in steps) and not unbuilt,
            "findings": dict(sorted(totals.items())),
            "quarantined": unbuilt,
            "approval": None,
        },
    }
