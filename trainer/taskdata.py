"""From a frozen dataset version to training examples: prompts, logged completions and the
late-bound ground truth. Shared by the training task and the exports; imports no torch.

One example per member trajectory, from its LAST chat step (an agent sends the whole
conversation with every call, so the last call holds the most context):

    prompt      the step's observation messages (sanitized: steps hold nothing else) — the
                conversation up to the assistant turn the policy is trained to produce
    completion  the assistant message the agent got back (the step's action), for SFT and for
                the `logged` reward
    tools       the tool schemas the agent offered (observation.tools), if any

Steps and rewards count as of the version's freeze (governance.datasets.member_steps and
pinned_rewards: created_at <= the version's created_at, both covered by its content hash), so a
session that went on after the freeze adds nothing, and neither does a label posted after it.
Chat completions steps give their `messages`; Responses API steps their `instructions` (as a
system message) and `input` (a string, or message items). Other steps (legacy completions,
non-JSON bodies) give no example.

Ground truth (the reference-answer convention). A trajectory's reference is its latest FINAL
reward named `reference_reward` (default "reference"), bound to the trajectory id or to the
response id of one of its steps — only final rows count (late-bound: a provisional one may
still change). Its `comment` carries the reference:
    - a JSON object: the reference dict as is, e.g. {"answer": "42", "tolerance": 0.01},
      {"pattern": "^ok$"}, {"schema": {...}, "name": "get_weather"};
    - any other JSON value or plain text: {"answer": <it>};
    - empty: the reward's value is the answer, {"answer": value} (an integral value as int).
The reward's value is otherwise not used for a reference. For the `logged` reward function the
logged reward is the latest final reward named reward_params["reward_name"] (default "reward")
and the examples that share a prompt are pooled into one task (trainer.rewards.logged).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from django.db.models import Q

from governance.capture.conversation import materialize_observations
from governance.datasets import pinned_rewards
from governance.models import DatasetVersion, DatasetVersionMember, Reward, Step
from wire.openai import message_text

CHUNK = 500


@dataclass
class Example:
    trajectory_id: str
    step_id: str
    prompt: list[dict[str, Any]]
    completion: dict[str, Any] | None
    tools: list[dict[str, Any]] | None
    reference: dict[str, Any] | None = None
    logged_reward: float | None = None
    sanitizer_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def version_refusal(version: DatasetVersion) -> str | None:
    """Why this version may not be trained on or exported now; None when it may: approved
    (with an approval row that says so) and never invalidated."""
    if version.invalidated_at is not None or version.status == DatasetVersion.Status.INVALIDATED:
        return (f"dataset version {version.pk} was invalidated"
                + (f": {version.invalidated_reason}" if version.invalidated_reason else ""))
    if version.status != DatasetVersion.Status.APPROVED:
        return (f"dataset version {version.pk} is {version.status}; only an approved version "
                "can be trained on or exported")
    approval = getattr(version, "approval", None)
    if approval is None or approval.decision != "approve":
        return f"dataset version {version.pk} has no approval"
    return None


def normalize_message(m: dict[str, Any]) -> dict[str, Any]:
    """One chat message with a uniform shape (the parquet struct of trainer/exports.py):
    role, content (text), and tool_calls / tool_call_id / name where present."""
    out: dict[str, Any] = {"role": str(m.get("role") or "user"),
                           "content": message_text(m.get("content"))}
    calls = []
    for call in m.get("tool_calls") or []:
        if not isinstance(call, dict):
            continue
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        args = fn.get("arguments")
        calls.append({"id": str(call.get("id") or ""), "type": str(call.get("type") or "function"),
                      "function": {"name": str(fn.get("name") or ""),
                                   "arguments": args if isinstance(args, str)
                                   else json.dumps(args if args is not None else {})}})
    if calls:
        out["tool_calls"] = calls
    if isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def prompt_messages(step: Step) -> list[dict[str, Any]] | None:
    obs = step.observation or {}
    if step.endpoint == "chat.completions" and isinstance(obs.get("messages"), list):
        msgs = [normalize_message(m) for m in obs["messages"] if isinstance(m, dict)]
        return msgs or None
    if step.endpoint == "responses":
        msgs = []
        if isinstance(obs.get("instructions"), str) and obs["instructions"]:
            msgs.append({"role": "system", "content": obs["instructions"]})
        items = obs.get("input")
        if isinstance(items, str):
            msgs.append({"role": "user", "content": items})
        elif isinstance(items, list):
            for item in items:
                if isinstance(item, dict) and item.get("role") and "content" in item:
                    msgs.append(normalize_message(item))
        return msgs or None
    return None


def completion_message(step: Step) -> dict[str, Any] | None:
    action = step.action or {}
    messages = action.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        msg = normalize_message({"role": "assistant", **messages[0]})
        msg["role"] = "assistant"
        return msg
    text = action.get("output_text") or action.get("text")
    if isinstance(text, str):
        return {"role": "assistant", "content": text}
    return None


def parse_reference(reward: Reward) -> dict[str, Any]:
    text = (reward.comment or "").strip()
    if not text:
        value = reward.value
        return {"answer": int(value) if float(value).is_integer() else value}
    try:
        obj = json.loads(text)
    except ValueError:
        return {"answer": text}
    return obj if isinstance(obj, dict) else {"answer": obj}


def _latest_final(rewards: list[Reward], name: str, tid: str,
                  response_ids: set[str]) -> Reward | None:
    found = [r for r in rewards if r.name == name and r.final
             and (str(r.trajectory_id) == tid if r.trajectory_id else
                  r.response_id in response_ids)]
    return max(found, key=lambda r: (r.created_at, r.pk)) if found else None


def iter_examples(version: DatasetVersion, *, reference_reward: str = "reference",
                  logged_reward: str | None = None,
                  skipped: Counter[str] | None = None) -> Iterator[Example]:
    """The version's examples in trajectory id order (run inside the version's tenant scope).
    `skipped` counts the members that give none, by reason."""
    skipped = skipped if skipped is not None else Counter()
    ids = list(DatasetVersionMember.objects.filter(version=version).order_by("trajectory_id")
               .values_list("trajectory_id", flat=True))
    names = [reference_reward] + ([logged_reward] if logged_reward else [])
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        steps: dict[str, list[Step]] = {}
        for step in (Step.objects.filter(trajectory_id__in=chunk,
                                         created_at__lte=version.created_at)
                     .order_by("trajectory_id", "started_at", "id")):
            steps.setdefault(str(step.trajectory_id), []).append(step)
        # Full observations (the conversation store keeps histories as item references).
        materialize_observations([s for ss in steps.values() for s in ss])
        response_ids = [s.response_id for ss in steps.values() for s in ss if s.response_id]
        # Only the rewards the version pins (its hash covers them): a label posted after the
        # freeze needs a new version and a new approval.
        rewards = list(pinned_rewards(version).filter(name__in=names, final=True)
                       .filter(Q(trajectory_id__in=chunk) | Q(response_id__in=response_ids)))
        for tid_obj in chunk:
            tid = str(tid_obj)
            tsteps = steps.get(tid, [])
            usable = [s for s in tsteps if prompt_messages(s)]
            if not usable:
                skipped["no chat step"] += 1
                continue
            last = usable[-1]
            rids = {s.response_id for s in tsteps if s.response_id}
            ref_row = _latest_final(rewards, reference_reward, tid, rids)
            logged_row = (_latest_final(rewards, logged_reward, tid, rids)
                          if logged_reward else None)
            obs_tools = (last.observation or {}).get("tools")
            yield Example(
                trajectory_id=tid, step_id=str(last.id), prompt=prompt_messages(last) or [],
                completion=completion_message(last),
                tools=obs_tools if isinstance(obs_tools, list) and obs_tools else None,
                reference=parse_reference(ref_row) if ref_row is not None else None,
                logged_reward=logged_row.value if logged_row is not None else None,
                sanitizer_version=last.sanitizer_version)


def sanitizer_versions(version: DatasetVersion) -> list[str]:
    """The distinct sanitizer versions of the version's (pinned) member steps."""
    members = DatasetVersionMember.objects.filter(version=version).values("trajectory_id")
    return sorted(set(Step.objects.filter(trajectory_id__in=members,
                                          created_at__lte=version.created_at)
                      .values_list("sanitizer_version", flat=True).distinct()))


def member_trajectory_ids(version: DatasetVersion) -> list[str]:
    return [str(t) for t in DatasetVersionMember.objects.filter(version=version)
            .order_by("trajectory_id").values_list("trajectory_id", flat=True)]


def prompt_key(prompt: list[dict[str, Any]]) -> str:
    return json.dumps(prompt, sort_keys=True, separators=(",", ":"))


def ground_truth_text(reference: dict[str, Any]) -> str:
    """The reference as verl's reward_model.ground_truth: the answer itself when that is all
    there is, else the reference dict as JSON."""
    if set(reference) == {"answer"}:
        answer = reference["answer"]
        return answer if isinstance(answer, str) else json.dumps(answer)
    return json.dumps(reference, sort_keys=True)
