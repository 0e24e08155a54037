"""Existing steps into the conversation store (issue 16), and back.

Forward: per trajectory, its steps in call order; each step's history (`messages` of chat, a
list `input` of the Responses API), tool schemas and Responses instructions become
ConversationItem rows (one per distinct value and sanitizer version), and the step references
them (parent step, kept, appended, item_refs) exactly as the step builder now writes them. The
raw messages are not there any more to hash, so these items' digests are plain SHA-256 of the
stored (sanitized) content, prefixed `s:` — they never match a digest of a raw message, so a
call arriving after the upgrade stores its history as new items (once) rather than reusing
these.

Backward: each step's full observation is materialized into `observation` again and the
columns cleared; the items go with the schema migration before this one.

Both run in batches of trajectories, under the system scope (row-level security is forced on
these tables, for the owner too).
"""

import hashlib

from django.db import migrations
from django.db.models import Q

from governance.capture.conversation import (
    HISTORY_KEYS,
    Layout,
    canonical,
    chain_digests,
    choose_parent,
    materialize,
    ordered_observation,
)

BATCH = 200


def _system(schema_editor) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT set_config('steward.system', 'on', true)")


def _digest(kind: str, value) -> str:
    prefix = {"message": "s:m:", "tools": "s:t:", "instructions": "s:i:"}[kind]
    return prefix + hashlib.sha256(kind.encode() + b"\0" + canonical(value)).hexdigest()


def _trajectory_batches(Step, **filters):
    ids = list(Step.objects.filter(**filters).order_by("trajectory_id")
               .values_list("trajectory_id", flat=True).distinct())
    for i in range(0, len(ids), BATCH):
        yield ids[i:i + BATCH]


def forward(apps, schema_editor) -> None:
    Step = apps.get_model("governance", "Step")
    Item = apps.get_model("governance", "ConversationItem")
    _system(schema_editor)
    for batch in _trajectory_batches(Step, history_digest="", item_refs={}):
        steps = list(Step.objects.filter(trajectory_id__in=batch, history_digest="",
                                         item_refs={}).order_by("trajectory_id", "started_at",
                                                                "id"))
        ids: dict[tuple, int] = {}
        histories: dict = {}
        changed = []
        for step in steps:
            obs = dict(step.observation_rest or {})
            version = step.sanitizer_version or ""
            tid = step.trajectory_id
            parts: list[tuple[str, str, object]] = []
            key = HISTORY_KEYS.get(step.endpoint)
            history = obs.get(key) if key else None
            if isinstance(history, list) and history:
                parts += [("message", _digest("message", m), m) for m in history]
            if isinstance(obs.get("tools"), list) and obs["tools"]:
                parts.append(("tools", _digest("tools", obs["tools"]), obs["tools"]))
            if step.endpoint == "responses" and isinstance(obs.get("instructions"), str) \
                    and obs["instructions"]:
                parts.append(("instructions", _digest("instructions", obs["instructions"]),
                              obs["instructions"]))
            if not parts:
                continue
            for kind, digest, value in parts:
                if (tid, digest, version) not in ids:
                    item, _ = Item.objects.get_or_create(
                        trajectory_id=tid, digest=digest, sanitizer_version=version,
                        defaults={"tenant_id": step.tenant_id, "kind": kind, "content": value,
                                  "first_step": step.id})
                    ids[(tid, digest, version)] = item.pk
            digests = [d for kind, d, _ in parts if kind == "message"]
            if digests:
                chains = chain_digests(digests)
                known = histories.setdefault(tid, {})
                parent, kept = choose_parent(chains, known)
                step.parent_step, step.kept = parent, kept
                step.appended = [ids[(tid, d, version)] for d in digests[kept:]]
                step.history_digest, step.history_length = chains[-1], len(chains)
                known[chains[-1]] = (step.id, len(chains))
                obs.pop(key)
            step.item_refs = {kind: ids[(tid, d, version)] for kind, d, _ in parts
                              if kind != "message"}
            for name in step.item_refs:
                obs.pop(name)
            step.observation_rest = obs
            changed.append(step)
        Step.objects.bulk_update(changed, ["observation_rest", "parent_step", "kept", "appended",
                                           "history_digest", "history_length", "item_refs"],
                                 batch_size=500)


def backward(apps, schema_editor) -> None:
    Step = apps.get_model("governance", "Step")
    Item = apps.get_model("governance", "ConversationItem")
    _system(schema_editor)
    compact = (~Q(history_digest="")
               | ~Q(item_refs={}))
    ids = list(Step.objects.filter(compact).order_by("trajectory_id")
               .values_list("trajectory_id", flat=True).distinct())
    for i in range(0, len(ids), BATCH):
        steps = list(Step.objects.filter(trajectory_id__in=ids[i:i + BATCH]))
        layouts = {s.id: Layout(s.parent_step, s.kept, tuple(s.appended or ()))
                   for s in steps if s.history_digest}
        full = materialize(layouts)
        wanted = {j for h in full.values() for j in h} | {
            j for s in steps for j in (s.item_refs or {}).values()}
        contents = dict(Item.objects.filter(pk__in=wanted).values_list("pk", "content"))
        changed = []
        for s in steps:
            if not s.history_digest and not s.item_refs:
                continue
            obs = dict(s.observation_rest or {})
            key = HISTORY_KEYS.get(s.endpoint)
            if s.history_digest and key:
                obs[key] = [contents[j] for j in full[s.id]]
            for name, j in (s.item_refs or {}).items():
                obs[name] = contents[j]
            s.observation_rest = ordered_observation(obs)
            s.parent_step, s.kept, s.appended = None, 0, []
            s.history_digest, s.history_length, s.item_refs = "", 0, {}
            changed.append(s)
        Step.objects.bulk_update(changed, ["observation_rest", "parent_step", "kept", "appended",
                                           "history_digest", "history_length", "item_refs"],
                                 batch_size=500)


class Migration(migrations.Migration):

    dependencies = [
        ("governance", "0014_conversation_store"),
    ]

    operations = [
        migrations.RunPython(forward, backward),
    ]
