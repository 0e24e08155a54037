"""The conversation store (issue 16): within a trajectory each distinct message, tool schema
set and Responses `instructions` is stored once (governance.models.ConversationItem), and a
step records the step it extends and the items it appends — not its whole history again.

An agent resends its whole conversation with every call. Stored as it came, a session's cost
grew with the square of its length (60 calls: 10x the time, 15x the database of the same new
content sent as one-off calls). Now:

- **Addresses.** Each history element (a chat message, a Responses input item), the `tools`
  list and `instructions` get a digest: a keyed hash (keyring.content_hasher, per tenant) of
  its kind and its exact canonical JSON (sorted keys, no whitespace), prefixed `m:`, `t:`,
  `i:`. One changed byte is another message; the same message twice in one history is one item
  referenced twice. A digest keeps the HMAC's first 128 bits (DIGEST_HEX, decision 40): it only
  has to tell apart the items of one trajectory, where a collision is never even likely
  (~1e-27 at a million items), and each digest is stored twice, in the row and its unique
  index; the history digests likewise.
- **Parents.** A step's `history_digest` chains its history's digests (`chain_digests`); a
  new call looks up the chain digests of all its prefixes among the trajectory's steps and
  extends the step with the longest one (`kept` of its messages, then `appended`). A branch —
  an edited message, a retry, a truncated history — extends the step it shares the longest
  prefix with; the items it appends that exist already are referenced, not copied.
- **Sanitize once.** Only items not yet stored under the current sanitizer version (which
  names the policy: governance.sanitizer.policy_version) are sanitized
  (governance/sanitizing.py); the rest are reused as they were stored, so `<PERSON_1>` stays
  the same person across the session and the NER pass runs on new text only. After a policy
  change an item is sanitized again the first time a step needs it, and that step's
  sanitizer version says which policy it was.
- **On read**, `observations(steps)` materializes each step's full observation (one recursive
  query for the parent chains, one for the items); the ATDP document, the console, the
  exports and the trainer read that. ATDP's compact form (`parent_step` + `appended`) is
  `compact_form`.

Pure functions first (tests use them alone), then the database helpers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from governance.capture.session_memo import SessionMemo


# The request key of each endpoint's resent history (completions' `prompt` is one string:
# stored in the observation as it is).
HISTORY_KEYS = {"chat.completions": "messages", "responses": "input"}
KIND_PREFIX = {"message": "m:", "tools": "t:", "instructions": "i:"}
# Hex digits kept of an item's keyed hash and of a history's chain digest (128 bits).
DIGEST_HEX = 32
# Keys of the observation whose values live in items; the order observations are rebuilt in.
OBSERVATION_ORDER = ("messages", "prompt", "input", "instructions", "previous_response_id",
                     "tools", "tool_choice", "params")


def canonical(value: Any) -> bytes:
    """The exact JSON value as bytes, independent of key order and whitespace."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


@dataclass
class History:
    """The parts of one request that the conversation store holds as items: the history
    elements (in order) under `key`, the tool schemas, the instructions — each with its digest.
    `key` None: the request resends no history (completions, a non-list `input`)."""

    key: str | None = None
    elements: list[Any] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    tools: Any = None
    tools_digest: str | None = None
    instructions: str | None = None
    instructions_digest: str | None = None

    def item_digests(self) -> list[str]:
        """Every item this request references (history first), without repeats."""
        out = dict.fromkeys(self.digests)
        for d in (self.tools_digest, self.instructions_digest):
            if d is not None:
                out[d] = None
        return list(out)


@dataclass
class TrajectoryItems:
    """The conversation items of one trajectory known while a batch is sanitized: digest ->
    sanitized content (and database id once stored), for the items stored already and those
    sanitized earlier in the batch. One object per trajectory, shared by its exchanges like the
    PlaceholderState (governance/sanitizing.py fills it)."""

    content: dict[str, Any] = field(default_factory=dict)
    identifiers: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)


def history_of(endpoint: str, request: dict | None, digest: Callable[[bytes], str]) -> History:
    """Split a (raw) request into the items the store keeps. `digest`: the tenant's keyed
    hash (keyring.content_hasher)."""
    hist = History()
    if not isinstance(request, dict):
        return hist
    keyed = digest

    def digest(content: bytes) -> str:  # the address: its first DIGEST_HEX hex digits
        return keyed(content)[:DIGEST_HEX]

    key = HISTORY_KEYS.get(endpoint)
    if key is not None and isinstance(request.get(key), list):
        hist.key = key
        hist.elements = request[key]
        hist.digests = [KIND_PREFIX["message"] + digest(b"message\0" + canonical(m))
                        for m in hist.elements]
    tools = request.get("tools")
    if isinstance(tools, list) and tools:
        hist.tools = tools
        hist.tools_digest = KIND_PREFIX["tools"] + digest(b"tools\0" + canonical(tools))
    instructions = request.get("instructions")
    if endpoint == "responses" and isinstance(instructions, str) and instructions:
        hist.instructions = instructions
        hist.instructions_digest = (KIND_PREFIX["instructions"]
                                    + digest(b"instructions\0" + canonical(instructions)))
    return hist


def without_items(request: dict, hist: History) -> dict:
    """The request minus what its items hold (sanitized on its own: model, params, user...)."""
    drop = {hist.key} if hist.key else set()
    if hist.tools_digest:
        drop.add("tools")
    if hist.instructions_digest:
        drop.add("instructions")
    return {k: v for k, v in request.items() if k not in drop}


def with_items(rest: dict, hist: History, content: dict[str, Any]) -> dict:
    """The (sanitized) request rebuilt: `rest` plus each item's content by digest."""
    out = dict(rest)
    if hist.key:
        out[hist.key] = [content[d] for d in hist.digests]
    if hist.tools_digest:
        out["tools"] = content[hist.tools_digest]
    if hist.instructions_digest:
        out["instructions"] = content[hist.instructions_digest]
    return out


def chain_digests(digests: Sequence[str]) -> list[str]:
    """c[i] = sha256(c[i-1] | digests[i]): c[i] names the first i+1 messages, so a lookup of a
    request's chain digests finds every stored step whose whole history is one of its
    prefixes."""
    return [link.hex()[:DIGEST_HEX] for link in chain_links(digests)]


def chain_links(digests: Iterable[str], prev: bytes = b"") -> list[bytes]:
    """The whole sha256 of each chain digest (chain_digests keeps a prefix of each), going on
    from the link `prev` (b"": from the start), so a chain can be continued
    (capture/session_memo.py)."""
    out: list[bytes] = []
    for d in digests:
        prev = hashlib.sha256(prev + b"|" + d.encode()).digest()
        out.append(prev)
    return out


def choose_parent(chains: Sequence[str], known: dict[str, tuple[Any, int]]
                  ) -> tuple[Any, int]:
    """(parent step id, messages kept) for a history with these chain digests; `known` maps a
    step's history digest to (step id, history length). (None, 0): no step shares a prefix."""
    for j in range(len(chains) - 1, -1, -1):
        hit = known.get(chains[j])
        if hit is not None:
            return hit[0], j + 1
    return None, 0


@dataclass(frozen=True)
class Layout:
    """How one step's history is stored (the Step columns of the same names)."""

    parent_step: Any
    kept: int
    appended: tuple[int, ...]


def materialize(layouts: dict[Any, Layout]) -> dict[Any, list[int]]:
    """Each step's full history as item ids, from the layouts of the steps and all their
    ancestors. Iterative (a 500-step chain is no recursion limit); a parent missing from
    `layouts` counts as empty (it cannot be: retention re-roots children first)."""
    done: dict[Any, list[int]] = {}
    for start in layouts:
        if start in done:
            continue
        path = []
        node = start
        while node is not None and node in layouts and node not in done:
            path.append(node)
            node = layouts[node].parent_step
        for sid in reversed(path):
            lay = layouts[sid]
            base = done.get(lay.parent_step, []) if lay.parent_step is not None else []
            done[sid] = base[:lay.kept] + list(lay.appended)
    return done


def ordered_observation(obs: dict) -> dict:
    keys = [k for k in OBSERVATION_ORDER if k in obs] + [k for k in obs
                                                         if k not in OBSERVATION_ORDER]
    return {k: obs[k] for k in keys}


# --- the database --------------------------------------------------------------------------

# By trajectory, not by digest: a long session's history is hundreds of digests, and quoting
# them into the query (psycopg binds client-side here) cost more than reading the rows.
_ITEM_IDS_SQL = ("SELECT trajectory_id::text, digest, id FROM governance_conversationitem "
                 "WHERE trajectory_id = ANY(%s::uuid[]) AND sanitizer_version = %s")


def known_items(trajectory_ids: Iterable[Any], digests: Iterable[str], version: str,
                memo: SessionMemo | None = None) -> dict[Any, TrajectoryItems]:
    """The stored items of these trajectories with these digests, sanitized under `version`:
    what a batch reuses instead of sanitizing again. With `memo` (the step builder's): the
    ids are read, and only the content the memo does not hold (items are never updated, so
    content kept by id is the row's)."""
    from django.db import connection

    from governance.models import ConversationItem

    out = {tid: TrajectoryItems() for tid in set(trajectory_ids)}
    wanted = set(digests)
    if not out or not wanted:
        return out
    if memo is None:
        items = ConversationItem.objects.filter(trajectory_id__in=list(out), digest__in=wanted,
                                                sanitizer_version=version)
        rows = list(items.values_list("trajectory_id", "digest", "pk", "content"))
        contents = resolve_answers({pk: content for _, _, pk, content in rows})
        for tid, digest, pk, _ in rows:
            out[tid].content[digest] = contents[pk]
            out[tid].ids[digest] = pk
        return out
    missing: dict[int, tuple[Any, str]] = {}
    # The ids in plain SQL: a long session's batch reads every item of its history, and
    # Django's row handling (a UUID object per row) cost more than the query.
    by_text = {str(tid): tid for tid in out}
    with connection.cursor() as cursor:
        cursor.execute(_ITEM_IDS_SQL, [list(by_text), version])
        rows = cursor.fetchall()
    for tid_text, digest, pk in rows:
        if digest not in wanted:
            continue
        tid = by_text[tid_text]
        out[tid].ids[digest] = pk
        data = memo.content(pk)
        if data is None:
            missing[pk] = (tid, digest)
        else:
            out[tid].content[digest] = orjson.loads(data)
    if missing:
        for pk, content in resolve_answers(dict(
                ConversationItem.objects.filter(pk__in=list(missing))
                .values_list("pk", "content"))).items():
            tid, digest = missing[pk]
            out[tid].content[digest] = content
            memo.keep_content(pk, orjson.dumps(content))
    return out


def known_histories(trajectory_ids: Iterable[Any], chains: Iterable[str], version: str
                    ) -> dict[Any, dict[str, tuple[Any, int]]]:
    """Per trajectory, the stored steps built under sanitizer `version` whose history digest
    is one of `chains`: history digest -> (step id, history length) (the newest step of equal
    histories). A step of another version references items of that version: extending it
    would reuse what the current policy has not sanitized."""
    from governance.models import Step

    out: dict[Any, dict[str, tuple[Any, int]]] = {tid: {} for tid in set(trajectory_ids)}
    wanted = set(chains)
    if not out or not wanted:
        return out
    rows = (Step.objects.filter(trajectory_id__in=list(out), history_digest__in=wanted,
                                sanitizer_version=version)
            .order_by("started_at")
            .values_list("trajectory_id", "history_digest", "pk", "history_length"))
    for tid, digest, pk, length in rows:
        out[tid][digest] = (pk, length)
    return out


def parent_candidates(chains: Sequence[str], hint: tuple[str, int] | None) -> list[str]:
    """The chain digests worth looking up for a history's parent: from the prefix `hint`
    names ((history digest, length) of a step known to exist, or to have existed) on, when
    the history starts with it — a longer stored prefix can only be among those — else all."""
    if hint is not None:
        digest, length = hint
        if 0 < length <= len(chains) and chains[length - 1] == digest:
            return list(chains[length - 1:])
    return list(chains)


def _layouts(step_ids: Iterable[Any]) -> dict[Any, Layout]:
    """The layouts of these steps and all their ancestors: one recursive query (under the
    caller's tenant scope: row-level security applies)."""
    from django.db import connection

    from governance.models import Step

    ids = [str(s) for s in step_ids]
    if not ids:
        return {}
    table = connection.ops.quote_name(Step._meta.db_table)
    sql = (f"WITH RECURSIVE chain AS ("  # noqa: S608 - the table name is ours
           f"SELECT id, parent_step, kept, appended FROM {table} WHERE id = ANY(%s::uuid[]) "
           f"UNION SELECT s.id, s.parent_step, s.kept, s.appended FROM {table} s "
           f"JOIN chain c ON s.id = c.parent_step) SELECT id, parent_step, kept, appended "
           f"FROM chain")
    with connection.cursor() as cur:
        cur.execute(sql, [ids])
        return {row[0]: Layout(row[1], row[2], tuple(row[3] or ())) for row in cur.fetchall()}


def step_histories(steps: Sequence[Any]) -> dict[Any, list[int]]:
    """Item ids of each given step's history (steps with `history_digest` only)."""
    compact = [s for s in steps if s.history_digest]
    if not compact:
        return {}
    mine = {s.pk: Layout(s.parent_step, s.kept, tuple(s.appended or ())) for s in compact}
    missing = {s.parent_step for s in compact if s.parent_step is not None} - set(mine)
    layouts = {**_layouts(missing), **mine} if missing else mine
    full = materialize(layouts)
    return {s.pk: full[s.pk] for s in compact}


def item_contents(ids: Iterable[int], steps: Iterable[Any] = ()) -> dict[int, Any]:
    """Items' content by id, answer references resolved (from `steps` where they point at
    one of them: resolve_answers)."""
    from governance.models import ConversationItem

    wanted = set(ids)
    if not wanted:
        return {}
    return resolve_answers(dict(ConversationItem.objects.filter(pk__in=wanted)
                                .values_list("pk", "content")), steps)


def resolve_answers(contents: dict[Any, Any], steps: Iterable[Any] = ()) -> dict[Any, Any]:
    """`contents` (item content by any key, as read from the table) with every AnswerRef
    replaced by the answer message it points at (decision 62): from `steps` (Step objects the
    caller holds, action loaded) where the step is one of them, else one query for all, in the
    caller's tenant scope. In place; returned for chaining. A reference whose step or message
    is gone raises: retention gives items their message before the step goes
    (keep_answers_of), so that is a broken invariant, not a missing value to paper over."""
    from governance.models import AnswerRef, Step

    refs = {key: v for key, v in contents.items() if isinstance(v, AnswerRef)}
    if not refs:
        return contents
    wanted = {r.step_id for r in refs.values()}
    actions = {s.pk: s.action for s in steps
               if s.pk in wanted and "action" not in s.get_deferred_fields()}
    if wanted - actions.keys():
        actions.update(Step.objects.filter(pk__in=wanted - actions.keys())
                       .values_list("pk", "action"))
    for key, ref in refs.items():
        messages = (actions.get(ref.step_id) or {}).get("messages")
        if not isinstance(messages, list) or ref.index >= len(messages):
            raise LookupError(f"conversation item {key} repeats message {ref.index} of step "
                              f"{ref.step_id}'s answer, which is not there")
        contents[key] = messages[ref.index]
    return contents


def answer_index(content: Any, answer: Any) -> int | None:
    """The index of the message of `answer` (a step's action) that `content` (a sanitized
    history message) is, or None: the same JSON value, key order aside (the store already
    treats two key orders of one message as one item: its digest sorts keys), types exact
    (1 is not true). Chat answers only: a Responses action's messages are a reading of its
    output items, not what its client sends back."""
    messages = answer.get("messages") if isinstance(answer, dict) else None
    if not isinstance(content, dict) or not isinstance(messages, list) or "output" in answer:
        return None
    wanted = canonical(content)
    for k, message in enumerate(messages[:65536]):
        if isinstance(message, dict) and canonical(message) == wanted:
            return k
    return None


def observations(steps: Sequence[Any]) -> dict[Any, dict]:
    """Each step's full observation (as the call sent it, sanitized), by step id."""
    histories = step_histories(steps)
    refs = {v for s in steps for v in (s.item_refs or {}).values()}
    contents = item_contents({i for h in histories.values() for i in h} | refs, steps)
    out: dict[Any, dict] = {}
    for s in steps:
        obs = dict(s.observation_rest or {})
        key = HISTORY_KEYS.get(s.endpoint)
        if s.history_digest and key is not None:
            obs[key] = [contents[i] for i in histories[s.pk]]
        for name, item_id in (s.item_refs or {}).items():
            obs[name] = contents[item_id]
        if s.history_digest or s.item_refs:
            obs = ordered_observation(obs)
        out[s.pk] = obs
    return out


def materialize_observations(steps: Sequence[Any]) -> Sequence[Any]:
    """Materialize the full observation of many steps at once (Step.observation reads it),
    for readers written against whole observations (the ATDP
    document, exports, the trainer's examples, evolution's failure signatures)."""
    full = observations(steps)
    for s in steps:
        s.set_full_observation(full[s.pk])
    return steps


def compact_form(steps: Sequence[Any]) -> dict[Any, dict]:
    """ATDP's optional compact form of each step's history: `parent_step` (the step id it
    extends, or null), `kept` (how many of that step's history messages it keeps) and
    `appended` (the history messages it adds, in full)."""
    contents = item_contents({i for s in steps if s.history_digest for i in s.appended or ()},
                             steps)
    return {s.pk: {"parent_step": str(s.parent_step) if s.parent_step else None,
                   "kept": s.kept, "appended": [contents[i] for i in s.appended or ()]}
            for s in steps if s.history_digest}


def reroot_children(step_ids: Sequence[Any]) -> int:
    """Before these steps are deleted (retention): every remaining step that extends one of
    them gets its full history as its own `appended` (parent none), so nothing it references
    goes with the parent. Returns how many were re-rooted."""
    from governance.models import Step

    doomed = set(step_ids)
    children = list(Step.objects.filter(parent_step__in=doomed).exclude(pk__in=doomed)
                    .only("pk", "parent_step", "kept", "appended", "history_digest"))
    if not children:
        return 0
    full = step_histories(children)
    for child in children:
        child.appended = full[child.pk]
        child.parent_step = None
        child.kept = 0
    Step.objects.bulk_update(children, ["appended", "parent_step", "kept"], batch_size=500)
    return len(children)


# Items whose content is an AnswerRef (ItemJSONField's format 3), with the step they point at.
_ANSWER_REFS_SQL = ("SELECT id, encode(substring(content from 2 for 16), 'hex')::uuid "
                    "FROM governance_conversationitem WHERE trajectory_id = ANY(%s::uuid[]) "
                    "AND get_byte(content, 0) = 3")


def keep_answers_of(trajectory_ids: Iterable[Any], doomed: Any) -> int:
    """Before steps are deleted (retention): every item of these trajectories that points at
    the answer of one of them (decision 62) and that a remaining step still references gets
    the answer message itself, so that step reads the same history after. `doomed`: a Step
    queryset of the steps that are going (their children re-rooted already: a remaining step
    then holds in its own `appended` every item it reads that a doomed step held). Items only
    doomed steps reference are left alone: delete_unreferenced_items deletes them after, and
    a month's drop would otherwise rewrite nearly every reference of the month. Returns how
    many items were given their message."""
    from django.db import connection

    from governance.models import ConversationItem, Step

    ids = [str(t) for t in set(trajectory_ids)]
    if not ids:
        return 0
    with connection.cursor() as cur:
        cur.execute(_ANSWER_REFS_SQL, [ids])
        refs = dict(cur.fetchall())
    if not refs:
        return 0
    going = set(doomed.filter(pk__in=set(refs.values())).values_list("pk", flat=True))
    candidates = {pk for pk, step in refs.items() if step in going}
    if not candidates:
        return 0
    held = set()
    for appended in (Step.objects.filter(trajectory_id__in=ids,
                                         appended__overlap=sorted(candidates))
                     .exclude(pk__in=doomed.values("pk")).values_list("appended", flat=True)):
        held.update(candidates.intersection(appended))
    if not held:
        return 0
    contents = item_contents(held)
    ConversationItem.objects.bulk_update(
        [ConversationItem(pk=pk, content=contents[pk]) for pk in sorted(held)], ["content"],
        batch_size=500)
    return len(held)


def delete_unreferenced_items(trajectory_ids: Iterable[Any]) -> int:
    """Delete the items of these trajectories no remaining step references (after steps were
    purged), with their findings and subject-index rows: what no step holds any more is not
    kept for it."""
    from django.db import connection

    from governance.models import ConversationItem, Step

    ids = [str(t) for t in set(trajectory_ids)]
    if not ids:
        return 0
    items = connection.ops.quote_name(ConversationItem._meta.db_table)
    steps = connection.ops.quote_name(Step._meta.db_table)
    sql = (f"SELECT i.id FROM {items} i WHERE i.trajectory_id = ANY(%s::uuid[]) "  # noqa: S608
           f"AND NOT EXISTS (SELECT 1 FROM {steps} s WHERE s.trajectory_id = i.trajectory_id "
           f"AND (i.id = ANY(s.appended) OR s.item_refs @> jsonb_build_object('tools', i.id) "
           f"OR s.item_refs @> jsonb_build_object('instructions', i.id)))")
    with connection.cursor() as cur:
        cur.execute(sql, [ids])
        doomed = [row[0] for row in cur.fetchall()]
    if not doomed:
        return 0
    ConversationItem.objects.filter(pk__in=doomed).delete()
    return len(doomed)
