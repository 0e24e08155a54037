"""Trajectory inference: which trajectory does a call belong to? Pure functions + one index.

Rules, first match wins:
1. `X-Steward-Session` header -> uuid5(tenant, agent, session)                  ("session")
2. Responses API `previous_response_id` naming a response this proxy saw       ("previous_response")
3. Chat completions: the longest strict prefix of the request's messages that is a known
   conversation state, and is a *continuation* of it                           ("prefix")
3b. Responses API without `previous_response_id`: the same rule over the `input` items a
   stateless agent resends (the OpenAI Agents SDK's default, and `store: false`)  ("prefix")
4. Chat completions, and Responses input as in 3b: the request carries an earlier call's last
   message and the answer to it, with something after them, but not that call's whole
   history: a sliding window dropped the oldest messages                        ("window")
5. Otherwise a new uuid4                                                       ("new")

Chat prefix matching. After each exchange the index stores, per (tenant, agent), two
conversation states: H(request messages) and H(request messages + returned assistant message).
A new request with messages m[0..n-1] continues a stored state at length k (1 <= k < n) when
either the state stored at k included the model's answer (the agent appended tool results or a
user turn after it), or the state at k was a request and m[k] is an assistant message (the agent
re-serialised the answer differently, e.g. dropped reasoning). The longest such k wins. A request
identical to a stored one (k == n) is a retry or a different conversation with the same opening,
never a continuation, so it starts a new trajectory.

Hashes are a chain (h_k = H(h_{k-1} || canon(m_{k-1}))), so all prefixes of a request cost O(n).
Messages are canonicalised to (role, text, tool calls (id, name, arguments; a legacy
`function_call` as one call without an id), tool_call_id), so
cosmetic differences — `content: null` vs missing, text parts vs a string, extra fields such as
`refusal`, `annotations` or `reasoning_content` that SDKs add when echoing an answer back, tool
arguments serialized again (whitespace, key order, escapes: the JSON they hold is compared) — do
not break matching. The index is a bounded LRU per (tenant, agent); when two conversations reach an
identical state, the later one wins.

Sliding windows (rule 4). An agent that keeps its context under a budget by dropping the oldest
messages, the first user message included (LangChain's `trim_messages(strategy="last")`, many
memory-bounded agents), sends requests that no stored state is a prefix of. After each answered
exchange the index also stores T(last request message, answer) -> trajectory; a request whose
prefix matched nothing is looked up by the pair ending at each of its newest assistant messages
(at most WINDOW_LOOKBACK of them, newest first), with at least one message after the pair.
Tool-call answers carry their call ids, so the pair names one conversation; two conversations
whose same user message got the same plain-text answer, both seen through a window, are merged
(the later one wins, as for identical states). A window that keeps the first user message is
still rule 3: the first call's state is a prefix of every later request.

Responses API input (rule 3b, decision 54). An agent that does not chain by
`previous_response_id` resends its whole conversation as `input` items: its messages, the
model's output items it got back (messages, `function_call`s) and its `function_call_output`s.
The index hashes those items as it hashes chat messages (`canonical_item`: a message by role and
text, so `input_text` vs `output_text` parts do not matter; a function call by call id, name and
arguments; ids and `status` left out, as an echo may drop them) and stores, after each answered
exchange, H(input) and H(input + the response's output items). Reasoning items are left out on
both sides: an agent that cannot send them back (no `encrypted_content`, `store: false`) drops
them, which must not end its trajectory. A request naming state held upstream
(`previous_response_id`, `conversation`) resends no history and is left to rule 2. Rule 4 reads
Responses input too: its key is the exchange's last input item and the answer's first output
item (reasoning left out), looked up at each item that starts a run of model items.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from wire.ids import new_id, session_trajectory_id
from wire.openai import message_text

SESSION, PREFIX, PREVIOUS_RESPONSE, WINDOW, NEW = (
    "session", "prefix", "previous_response", "window", "new")
# Rule 4 looks at this many of a request's newest assistant messages (a window keeps the last
# answers; one beyond these is an older conversation's, not this call's previous one).
WINDOW_LOOKBACK = 4

Scope = tuple[int, int]  # (tenant id, agent id)


@dataclass(frozen=True, slots=True)
class Decision:
    trajectory_id: str
    source: str


def canonical_message(message: Any) -> bytes:
    if not isinstance(message, dict):
        return orjson.dumps(["?", str(message)])
    # Agents send what they like: every field may have any JSON type (a `tool_calls` that is a
    # string, a `function` that is a list). Anything not of the expected shape is hashed as
    # its JSON form instead of raising, so such a request is still captured (and continues a
    # trajectory only when the agent repeats the same malformed value).
    calls: list[Any] = []
    tool_calls = message.get("tool_calls")
    if not tool_calls and message.get("function_call"):
        # The legacy `functions` API: one call, no id. Without it, every such answer would
        # read as the same empty assistant message, and conversations sharing an opening merge.
        tool_calls = [{"id": "", "function": message["function_call"]}]
    for call in tool_calls if isinstance(tool_calls, list) else (
            [tool_calls] if tool_calls else ()):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            calls.append([_text(call.get("id")), _text(fn.get("name")),
                          _arguments(fn.get("arguments"))])
        else:
            calls.append(["?", _text(call)])
    return orjson.dumps([_text(message.get("role")), message_text(message.get("content")),
                         calls, _text(message.get("tool_call_id"))])


def _arguments(value: Any) -> str:
    """Tool-call arguments by the JSON document they hold, not its bytes: SDKs that parse the
    model's arguments and serialize them again when they send the answer back (LangChain's
    AIMessage.tool_calls: json.dumps, a space after every separator, non-ASCII escaped) echo
    the same call in other bytes, and rule 4's key holds the answer as the model sent it
    (decision 58). Arguments that are not a JSON object or array are kept as they are."""
    if isinstance(value, str):
        if value.lstrip()[:1] in ("{", "["):
            try:
                return orjson.dumps(orjson.loads(value), option=orjson.OPT_SORT_KEYS).decode()
            except orjson.JSONDecodeError:  # not JSON after all, or numbers orjson cannot hold
                pass
        return value
    return _text(value)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if not value:
        return ""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def canonical_item(item: Any) -> bytes:
    """A Responses API input item as rule 3b hashes it (module docstring)."""
    if not isinstance(item, dict):
        return orjson.dumps(["?", str(item)])
    kind = item.get("type")
    if kind is None or kind == "message":
        return canonical_message({"role": item.get("role"), "content": item.get("content")})
    if kind == "function_call":
        return orjson.dumps(["function_call", _text(item.get("call_id")),
                             _text(item.get("name")), _arguments(item.get("arguments"))])
    if kind == "function_call_output":
        output = item.get("output")
        return orjson.dumps(["function_call_output", _text(item.get("call_id")),
                             output if isinstance(output, str) else message_text(output)])
    # Other items (tool calls of built-in tools, item references, ...): their JSON without
    # what an echo may change. An item_reference's id is what it says, so it stays.
    kept = {k: v for k, v in item.items()
            if k != "status" and (k != "id" or kind == "item_reference")}
    return orjson.dumps([_text(kind), _text(kept)])


def responses_items(body: dict) -> list[Any] | None:
    """The conversation a Responses API request resends, as rule 3b reads it: its `input`
    items (a string input is one user message), reasoning items left out. None when the
    request names conversation state held upstream or resends nothing."""
    if isinstance(body.get("previous_response_id"), str) or body.get("conversation"):
        return None
    value = body.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}] if value else None
    if not isinstance(value, list):
        return None
    return [item for item in value if not _is_reasoning(item)] or None


def _is_reasoning(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "reasoning"


def is_model_item(item: Any) -> bool:
    """Whether a Responses input item is one the model produced (an echoed output item)."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type")
    return item.get("role") == "assistant" or (isinstance(kind, str) and kind.endswith("_call"))


def prefix_hashes(messages: list[Any],
                  canonical: Callable[[Any], bytes] = canonical_message) -> list[bytes]:
    """h[k-1] is the hash of messages[:k], for k = 1..len(messages)."""
    out: list[bytes] = []
    h = b""
    for message in messages:
        h = hashlib.blake2b(h + canonical(message), digest_size=16).digest()
        out.append(h)
    return out


def extend_hash(prev: bytes, message: Any,
                canonical: Callable[[Any], bytes] = canonical_message) -> bytes:
    return hashlib.blake2b(prev + canonical(message), digest_size=16).digest()


def is_assistant(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def tail_key(before: Any, answer: Any,
             canonical: Callable[[Any], bytes] = canonical_message) -> bytes:
    """Rule 4's key: an exchange's last request message and the answer to it (for Responses
    input, its last item and the answer's first item)."""
    return hashlib.blake2b(b"tail" + canonical(before) + canonical(answer),
                           digest_size=16).digest()


class TrajectoryIndex:
    """Per (tenant, agent) LRU maps: conversation-state hash -> (trajectory id, answered?),
    last exchange (tail_key) -> trajectory id (rule 4) and Responses-API response id ->
    trajectory id. Used from the event loop only (no locking)."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._states: dict[Scope, OrderedDict[bytes, tuple[str, bool]]] = {}
        self._tails: dict[Scope, OrderedDict[bytes, str]] = {}
        self._responses: dict[Scope, OrderedDict[str, str]] = {}

    @staticmethod
    def _put(table: OrderedDict, key: Any, value: Any, limit: int) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > limit:
            table.popitem(last=False)

    # -- chat completions ---------------------------------------------------------------
    def find_continuation(self, scope: Scope, messages: list[Any],
                          hashes: list[bytes] | None = None,
                          is_answer: Callable[[Any], bool] = is_assistant) -> str | None:
        """Rule 3 over chat messages, or (with `hashes` of `canonical_item` and
        `is_answer=is_model_item`) rule 3b over Responses input items."""
        table = self._states.get(scope)
        if not table or len(messages) < 2:
            return None
        hashes = hashes if hashes is not None else prefix_hashes(messages)
        for k in range(len(messages) - 1, 0, -1):  # longest strict prefix first
            hit = table.get(hashes[k - 1])
            if hit is None:
                continue
            trajectory_id, answered = hit
            if answered or is_answer(messages[k]):
                table.move_to_end(hashes[k - 1])
                return trajectory_id
        return None

    def find_window(self, scope: Scope, messages: list[Any], items: bool = False) -> str | None:
        """Rule 4: the trajectory whose answered exchange this request carries (its last
        request message, then the answer) with something after it. `items`: over Responses
        input items, where an answer is a run of model items and its first one is the key's."""
        table = self._tails.get(scope)
        if not table:
            return None
        is_answer, canonical = (is_model_item, canonical_item) if items else (
            is_assistant, canonical_message)
        looked = 0
        for j in range(len(messages) - 2, 0, -1):  # the newest answer first
            if not is_answer(messages[j]) or (items and is_answer(messages[j - 1])):
                continue
            key = tail_key(messages[j - 1], messages[j], canonical)
            hit = table.get(key)
            if hit is not None:
                table.move_to_end(key)
                return hit
            looked += 1
            if looked >= WINDOW_LOOKBACK:
                break
        return None

    def record_chat(self, scope: Scope, messages: list[Any], answer: dict | None,
                    trajectory_id: str, hashes: list[bytes] | None = None) -> None:
        if not messages:
            return
        table = self._states.setdefault(scope, OrderedDict())
        hashes = hashes if hashes is not None else prefix_hashes(messages)
        self._put(table, hashes[-1], (trajectory_id, False), self.max_entries)
        if answer is not None:
            self._put(table, extend_hash(hashes[-1], answer), (trajectory_id, True),
                      self.max_entries)
            self._put(self._tails.setdefault(scope, OrderedDict()),
                      tail_key(messages[-1], answer), trajectory_id, self.max_entries)

    # -- responses API ------------------------------------------------------------------
    def record_items(self, scope: Scope, items: list[Any], output: list[Any] | None,
                     trajectory_id: str, hashes: list[bytes] | None = None) -> None:
        """Rule 3b's states after an answered Responses call: H(input items) and
        H(input items + the response's output items, reasoning left out)."""
        if not items:
            return
        table = self._states.setdefault(scope, OrderedDict())
        hashes = hashes if hashes is not None else prefix_hashes(items, canonical_item)
        self._put(table, hashes[-1], (trajectory_id, False), self.max_entries)
        answer = [item for item in output or () if not _is_reasoning(item)]
        if answer:
            h = hashes[-1]
            for item in answer:
                h = extend_hash(h, item, canonical_item)
            self._put(table, h, (trajectory_id, True), self.max_entries)
            self._put(self._tails.setdefault(scope, OrderedDict()),
                      tail_key(items[-1], answer[0], canonical_item), trajectory_id,
                      self.max_entries)

    def find_response(self, scope: Scope, response_id: str) -> str | None:
        table = self._responses.get(scope)
        return table.get(response_id) if table else None

    def record_response(self, scope: Scope, response_id: str, trajectory_id: str) -> None:
        table = self._responses.setdefault(scope, OrderedDict())
        self._put(table, response_id, trajectory_id, self.max_entries)


def decide(index: TrajectoryIndex, scope: Scope, endpoint: str, body: Any,
           session: str | None, hashes: list[bytes] | None = None) -> Decision:
    """The trajectory of a request (rules in the module docstring). `body` is the parsed JSON
    request (anything else when it was not JSON)."""
    if session:
        return Decision(session_trajectory_id(scope[0], scope[1], session), SESSION)
    if isinstance(body, dict):
        if endpoint == "chat.completions":
            messages = body.get("messages")
            if isinstance(messages, list):
                found = index.find_continuation(scope, messages, hashes)
                if found:
                    return Decision(found, PREFIX)
                found = index.find_window(scope, messages)
                if found:
                    return Decision(found, WINDOW)
        elif endpoint == "responses":
            previous = body.get("previous_response_id")
            if isinstance(previous, str):
                found = index.find_response(scope, previous)
                if found:
                    return Decision(found, PREVIOUS_RESPONSE)
            items = responses_items(body)
            if items:
                found = index.find_continuation(
                    scope, items, hashes if hashes is not None else prefix_hashes(
                        items, canonical_item), is_answer=is_model_item)
                if found:
                    return Decision(found, PREFIX)
                found = index.find_window(scope, items, items=True)
                if found:
                    return Decision(found, WINDOW)
    return Decision(new_id(), NEW)
