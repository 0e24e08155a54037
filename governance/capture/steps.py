"""From one captured exchange (the exact request and response bytes) to the fields of an ATDP v1
step. Pure functions: no database, no network, no clock — the Celery task (governance/tasks.py)
decrypts the raw payload and calls `build_step_fields`, tests call it directly.

Endpoints: `chat.completions`, `completions`, `responses`, each plain JSON or SSE. Streams are
reassembled the way the OpenAI clients do it (content deltas concatenated, tool-call deltas merged
by `index` with argument fragments concatenated), so a streamed step and a non-streamed one look
the same.

Decisions (documented in the ATDP schema too):
- A request body that is not a JSON object still yields a step: observation
  `{"non_json": true, "bytes": N}` (no raw text — the exact bytes stay only in the encrypted raw
  payload), metadata `steward.request.non_json: true` and an error of kind `non_json_request`.
  Such a step is never useful for training but the call did happen and is auditable.
- A failed exchange (transport error, HTTP status >= 400, an error event inside a stream) yields a
  step with `error = {status, kind, message, body}`; whatever partial output arrived is kept.
- `CaptureError` is raised only when nothing trustworthy can be built: an unknown endpoint, or an
  upstream that claims success (2xx, no transport error) but sent a body we cannot parse at all.
  The task quarantines the interaction then (never training-eligible).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import orjson

ENDPOINTS = ("chat.completions", "completions", "responses")
OPERATION_NAMES = {"chat.completions": "chat", "completions": "text_completion",
                   "responses": "chat"}

# Request keys that are the observation's content, not its sampling parameters.
CONTENT_KEYS = frozenset({"messages", "prompt", "input", "instructions", "tools", "tool_choice",
                          "model", "previous_response_id"})
# Step metadata: the parts of the raw payload no sanitizer pass saw (erasure scans those).
UNSCANNED_KEY = "steward.sanitizer.unscanned"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"


class CaptureError(ValueError):
    """The exchange cannot be turned into a step; the interaction is quarantined."""


# --- small helpers ---------------------------------------------------------------------------

def sha256_hex(data: str | bytes) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace: the same tools list always hashes the same."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _loads_object(data: bytes | None) -> dict | None:
    if not data:
        return None
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _loads_any(data: bytes | None) -> Any:
    if not data:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


_TEXT_PART_TYPES = {"text", "input_text", "output_text"}


def _is_text_part(kind: Any) -> bool:
    # `kind` comes from the agent: a list or an object there must not raise (unhashable).
    return isinstance(kind, str) and kind in _TEXT_PART_TYPES


def message_text(content: Any) -> str:
    """The text of an OpenAI message content: a string, or the text parts of a list joined
    (image/audio/file parts contribute nothing). Shared by the proxy's trajectory inference,
    the step builder and the trainer's prompt building, so all three read a message alike."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and _is_text_part(part.get("type", "text")):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
        return "".join(parts)
    return str(content)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def iter_sse(data: bytes) -> list[tuple[str | None, str]]:
    """Parse a `text/event-stream` body into (event name, data) pairs, per the WHATWG rules that
    matter here: CRLF or LF line ends, several `data:` lines joined by newlines, comments
    ignored, a trailing event without its blank line still counted (a cut-off stream)."""
    events: list[tuple[str | None, str]] = []
    event: str | None = None
    data_lines: list[str] = []
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    for line in text.split("\n"):
        if line == "":
            if data_lines:
                events.append((event, "\n".join(data_lines)))
            event, data_lines = None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data_lines.append(value)
        elif field == "event":
            event = value
    if data_lines:
        events.append((event, "\n".join(data_lines)))
    return events


def sse_json_events(data: bytes) -> tuple[list[tuple[str | None, dict]], int, bool]:
    """JSON objects of a stream, the number of data payloads that were not JSON, and whether
    the `[DONE]` terminator arrived."""
    out: list[tuple[str | None, dict]] = []
    bad = 0
    done = False
    for event, payload in iter_sse(data):
        if payload.strip() == "[DONE]":
            done = True
            continue
        try:
            value = orjson.loads(payload)
        except orjson.JSONDecodeError:
            bad += 1
            continue
        if isinstance(value, dict):
            out.append((event, value))
        else:
            bad += 1
    return out, bad, done


# --- usage, tokens ---------------------------------------------------------------------------

def otel_usage(usage: Any) -> dict:
    """OpenAI usage (chat/completions: prompt/completion_tokens; responses: input/output_tokens)
    under the OTel GenAI names; the upstream's own object is kept under `raw`."""
    if not isinstance(usage, dict):
        return {}
    out: dict[str, Any] = {}
    inp = _int_or_none(usage.get("prompt_tokens", usage.get("input_tokens")))
    outp = _int_or_none(usage.get("completion_tokens", usage.get("output_tokens")))
    if inp is not None:
        out[INPUT_TOKENS] = inp
    if outp is not None:
        out[OUTPUT_TOKENS] = outp
    total = _int_or_none(usage.get("total_tokens"))
    if total is not None:
        out["total_tokens"] = total
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    if isinstance(details, dict) and _int_or_none(details.get("cached_tokens")) is not None:
        out["gen_ai.usage.cache_read.input_tokens"] = details["cached_tokens"]
    details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    if isinstance(details, dict) and _int_or_none(details.get("reasoning_tokens")) is not None:
        out["gen_ai.usage.reasoning.output_tokens"] = details["reasoning_tokens"]
    out["raw"] = usage
    return out


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in value):
        return value
    return None


class TokenAccumulator:
    """Token ids and logprobs of one choice, from whichever shape the upstream uses:
    - OpenAI `logprobs.content` entries (`token`, `logprob`, `bytes`, `top_logprobs`), some
      servers add `token_id` per entry;
    - vLLM `token_ids` on the choice (`prompt_token_ids` top level or on the choice);
    - SGLang `output_token_ids` on the choice or top level, and `meta_info` with
      `output_token_logprobs` as `[logprob, token_id, text]` triples (and `output_ids`);
    - legacy completions `logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.ids_from_logprobs: list[int] = []
        self.logprobs: list[Any] = []
        self.legacy: dict[str, list] | None = None
        self.prompt_token_ids: list[int] | None = None

    def add_logprobs(self, logprobs: Any) -> None:
        if isinstance(logprobs, dict):
            content = logprobs.get("content")
            if isinstance(content, list):
                self.logprobs.extend(content)
                for entry in content:
                    if isinstance(entry, dict) and _int_or_none(entry.get("token_id")) is not None:
                        self.ids_from_logprobs.append(entry["token_id"])
            elif any(k in logprobs for k in ("tokens", "token_logprobs")):
                legacy = self.legacy if self.legacy is not None else {}
                for key, value in logprobs.items():
                    if isinstance(value, list):
                        legacy.setdefault(key, []).extend(value)
                self.legacy = legacy
        elif isinstance(logprobs, list):  # responses output_text.logprobs, or a bare list
            self.logprobs.extend(logprobs)
            for entry in logprobs:
                if isinstance(entry, dict) and _int_or_none(entry.get("token_id")) is not None:
                    self.ids_from_logprobs.append(entry["token_id"])

    def add_ids(self, ids: Any) -> None:
        ids = _int_list(ids)
        if ids:
            self.token_ids.extend(ids)

    def add_meta_info(self, meta: Any) -> None:
        if not isinstance(meta, dict):
            return
        triples = meta.get("output_token_logprobs")
        if isinstance(triples, list) and triples:
            ids = []
            for t in triples:
                if isinstance(t, (list, tuple)) and len(t) >= 2:
                    self.logprobs.append({"logprob": t[0], "token_id": t[1],
                                          "token": t[2] if len(t) > 2 else None})
                    if _int_or_none(t[1]) is not None:
                        ids.append(t[1])
            if ids and not self.token_ids:
                self.ids_from_logprobs.extend(ids)
        self.add_ids(meta.get("output_ids") or meta.get("output_token_ids"))
        if self.prompt_token_ids is None:
            self.prompt_token_ids = _int_list(meta.get("input_token_ids") or meta.get("input_ids"))

    def absorb_choice(self, choice: dict) -> None:
        self.add_logprobs(choice.get("logprobs"))
        self.add_ids(choice.get("token_ids"))
        self.add_ids(choice.get("output_token_ids"))
        self.add_meta_info(choice.get("meta_info"))
        if self.prompt_token_ids is None:
            self.prompt_token_ids = _int_list(choice.get("prompt_token_ids"))

    def choice_fields(self) -> dict:
        """What was accumulated, as the fields of one non-streamed choice (a reassembled
        stream): absorbing them again gives the same `result()`."""
        out: dict[str, Any] = {}
        if self.logprobs:
            out["logprobs"] = {"content": self.logprobs}
        elif self.legacy:
            out["logprobs"] = self.legacy
        ids = self.token_ids or self.ids_from_logprobs
        if ids:
            out["token_ids"] = ids
        if self.prompt_token_ids:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out

    def result(self) -> dict:
        out: dict[str, Any] = {}
        ids = self.token_ids or self.ids_from_logprobs
        if ids:
            out["token_ids"] = ids
        if self.logprobs:
            out["logprobs"] = self.logprobs
        elif self.legacy:
            out["logprobs"] = self.legacy
        if self.prompt_token_ids:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out


def _merge_tokens(per_choice: list[tuple[int, dict]], top: dict) -> dict:
    """Step `tokens`: choice 0's fields at the top; every choice under `choices` when n > 1."""
    out: dict[str, Any] = {}
    first = next((t for i, t in per_choice if i == 0), per_choice[0][1] if per_choice else {})
    out.update(first)
    prompt_ids = _int_list(top.get("prompt_token_ids")) or _int_list(top.get("input_token_ids"))
    if prompt_ids and "prompt_token_ids" not in out:
        out["prompt_token_ids"] = prompt_ids
    top_ids = _int_list(top.get("output_token_ids"))
    if top_ids and "token_ids" not in out:
        out["token_ids"] = top_ids
    if len(per_choice) > 1:
        out["choices"] = [{"index": i, **t} for i, t in per_choice if t]
    return out


# --- the observation -------------------------------------------------------------------------

def _params(req: dict) -> dict:
    return {k: v for k, v in req.items() if k not in CONTENT_KEYS}


def observation_of(endpoint: str, req: dict) -> dict:
    obs: dict[str, Any] = {}
    if endpoint == "chat.completions":
        obs["messages"] = req.get("messages")
    elif endpoint == "completions":
        obs["prompt"] = req.get("prompt")
    else:
        obs["input"] = req.get("input")
        if "instructions" in req:
            obs["instructions"] = req.get("instructions")
        if req.get("previous_response_id"):
            obs["previous_response_id"] = req["previous_response_id"]
    if req.get("tools") is not None:
        obs["tools"] = req.get("tools")
    if req.get("tool_choice") is not None:
        obs["tool_choice"] = req.get("tool_choice")
    obs["params"] = _params(req)
    return obs


def system_prompt_text(endpoint: str, req: dict) -> str | None:
    """The system (and developer) instructions of the request, joined; None when there are
    none. Part of a step's `versions`: the same prompt -> the same hash across steps."""
    texts: list[str] = []
    if endpoint == "responses" and isinstance(req.get("instructions"), str):
        texts.append(req["instructions"])
    messages = req.get("messages") if endpoint == "chat.completions" else req.get("input")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict) and m.get("role") in ("system", "developer"):
                texts.append(message_text(m.get("content")))
    return "\n".join(texts) if texts else None


def versions_of(endpoint: str, req: dict, response_model: str, harness_version: str,
                routing: dict | None = None) -> dict:
    system = system_prompt_text(endpoint, req)
    tools = req.get("tools")
    versions = {
        "gen_ai.request.model": req.get("model") if isinstance(req.get("model"), str) else None,
        "gen_ai.response.model": response_model or None,
        "system_prompt_hash": sha256_hex(system) if system is not None else None,
        "tool_schema_hash": sha256_hex(canonical_json(tools)) if tools else None,
        "harness_version": harness_version or None,
    }
    versions.update(routing_versions(routing))
    return versions


def routing_versions(routing: Any) -> dict:
    """The canary route/arm and the context updates the proxy applied (issue 7; the spool
    record's `routing`, see proxy/routing.py): `route` {"id", "arm"}, `context_update`
    {"id", "version", "hash"} (the newest applied one) and `context_updates` (all applied,
    one per kind). Keys are absent when nothing applied."""
    out: dict[str, Any] = {}
    if not isinstance(routing, dict):
        return out
    route = routing.get("route")
    if isinstance(route, dict) and isinstance(route.get("id"), int):
        out["route"] = {"id": route["id"], "arm": str(route.get("arm") or "")}
    updates = [{"id": u["id"], "version": u.get("version"), "hash": u.get("hash"),
                "kind": u.get("kind")}
               for u in routing.get("context_updates") or ()
               if isinstance(u, dict) and isinstance(u.get("id"), int)]
    if updates:
        newest = max(updates, key=lambda u: (u.get("version") or 0, u["id"]))
        out["context_update"] = {k: newest[k] for k in ("id", "version", "hash")}
        out["context_updates"] = updates
    return out


# --- chat.completions ------------------------------------------------------------------------

class _ChatChoice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.role = "assistant"
        self.content: str | None = None
        self.reasoning: str | None = None
        self.refusal: str | None = None
        self.tool_calls: dict[int, dict] = {}
        self.function_call: dict | None = None  # legacy functions API
        self.finish_reason: str | None = None
        self.tokens = TokenAccumulator()

    @staticmethod
    def _cat(old: str | None, new: Any) -> str | None:
        if not isinstance(new, str):
            return old
        return (old or "") + new

    def apply_delta(self, delta: dict) -> None:
        if isinstance(delta.get("role"), str):
            self.role = delta["role"]
        self.content = self._cat(self.content, delta.get("content"))
        self.reasoning = self._cat(self.reasoning, delta.get("reasoning_content"))
        self.reasoning = self._cat(self.reasoning, delta.get("reasoning"))
        self.refusal = self._cat(self.refusal, delta.get("refusal"))
        for pos, tc in enumerate(delta.get("tool_calls") or []):
            if not isinstance(tc, dict):
                continue
            idx = tc.get("index", pos)
            cur = self.tool_calls.setdefault(
                idx, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            if tc.get("id"):
                cur["id"] = tc["id"]
            if tc.get("type"):
                cur["type"] = tc["type"]
            fn = tc.get("function") or {}
            if isinstance(fn.get("name"), str):
                # The name normally comes whole in the first delta; servers that repeat it in
                # every chunk must not produce "get_weatherget_weather".
                if not cur["function"]["name"] or not fn["name"].startswith(
                        cur["function"]["name"]):
                    cur["function"]["name"] += fn["name"]
                else:
                    cur["function"]["name"] = fn["name"]
            if isinstance(fn.get("arguments"), str):
                cur["function"]["arguments"] += fn["arguments"]
        fc = delta.get("function_call")
        if isinstance(fc, dict):
            cur = self.function_call or {"name": "", "arguments": ""}
            cur["name"] += fc.get("name") or ""
            cur["arguments"] += fc.get("arguments") or ""
            self.function_call = cur

    def apply_message(self, msg: dict) -> None:
        if isinstance(msg.get("role"), str):
            self.role = msg["role"]
        self.content = msg.get("content") if isinstance(msg.get("content"), str) else (
            message_text(msg.get("content")) or None)
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        self.reasoning = reasoning if isinstance(reasoning, str) else None
        self.refusal = msg.get("refusal") if isinstance(msg.get("refusal"), str) else None
        for pos, tc in enumerate(msg.get("tool_calls") or []):
            if isinstance(tc, dict):
                self.tool_calls[pos] = {k: v for k, v in tc.items() if k != "index"}
        if isinstance(msg.get("function_call"), dict):
            self.function_call = msg["function_call"]

    def as_choice(self) -> dict:
        """This choice as a non-streamed `choices[]` entry (message, reasoning, tokens)."""
        msg = self.message()
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        return {"index": self.index, "message": msg, "finish_reason": self.finish_reason,
                **self.tokens.choice_fields()}

    def message(self) -> dict:
        msg: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [self.tool_calls[k] for k in sorted(self.tool_calls)]
        if self.function_call:
            msg["function_call"] = self.function_call
        if self.refusal:
            msg["refusal"] = self.refusal
        return msg


def _chat_result(choices: dict[int, _ChatChoice], top: dict) -> dict:
    ordered = [choices[k] for k in sorted(choices)]
    action: dict[str, Any] = {"messages": [c.message() for c in ordered],
                              "finish_reason": ordered[0].finish_reason if ordered else None}
    if len(ordered) > 1:
        action["finish_reasons"] = [c.finish_reason for c in ordered]
    hidden: dict[str, Any] = {}
    if ordered and ordered[0].reasoning:
        hidden["reasoning_content"] = ordered[0].reasoning
    if len(ordered) > 1 and any(c.reasoning for c in ordered[1:]):
        hidden["choices"] = [{"index": c.index, "reasoning_content": c.reasoning}
                             for c in ordered]
    tokens = _merge_tokens([(c.index, c.tokens.result()) for c in ordered], top)
    return {"action": action, "hidden_state": hidden, "tokens": tokens,
            "finish_reasons": [c.finish_reason for c in ordered]}


def parse_chat(body: dict) -> dict:
    choices: dict[int, _ChatChoice] = {}
    for pos, ch in enumerate(body.get("choices") or []):
        if not isinstance(ch, dict):
            continue
        c = choices.setdefault(ch.get("index", pos), _ChatChoice(ch.get("index", pos)))
        if isinstance(ch.get("message"), dict):
            c.apply_message(ch["message"])
        c.finish_reason = ch.get("finish_reason")
        c.tokens.absorb_choice(ch)
    return _chat_result(choices, body)


def parse_chat_stream(events: list[tuple[str | None, dict]]) -> tuple[dict, dict, dict | None]:
    """(parsed result, top-level fields, error event or None)."""
    body, error = reassemble_chat_stream(events)
    return parse_chat(body), body, error


def reassemble_chat_stream(events: list[tuple[str | None, dict]]) -> tuple[dict, dict | None]:
    """A chat stream as the `chat.completion` object a non-streamed call would have returned
    (content and tool-call argument fragments joined, logprobs and token ids gathered), and
    the stream's error event or None. `parse_chat` of it is the streamed step."""
    choices: dict[int, _ChatChoice] = {}
    top: dict[str, Any] = {}
    error = None
    for _, chunk in events:
        if "error" in chunk and not chunk.get("choices"):
            error = chunk["error"]
            continue
        for key in ("id", "model", "created", "system_fingerprint"):
            if chunk.get(key) is not None and key not in top:
                top[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):
            top["usage"] = chunk["usage"]
        for key in ("prompt_token_ids", "output_token_ids"):
            if key in chunk:
                if key == "prompt_token_ids":
                    top.setdefault(key, chunk[key])
                else:
                    top.setdefault(key, []).extend(_int_list(chunk[key]) or [])
        for pos, ch in enumerate(chunk.get("choices") or []):
            if not isinstance(ch, dict):
                continue
            idx = ch.get("index", pos)
            c = choices.setdefault(idx, _ChatChoice(idx))
            if isinstance(ch.get("delta"), dict):
                c.apply_delta(ch["delta"])
            elif isinstance(ch.get("message"), dict):
                c.apply_message(ch["message"])
            if ch.get("finish_reason"):
                c.finish_reason = ch["finish_reason"]
            c.tokens.absorb_choice(ch)
    body = {**top, "object": "chat.completion",
            "choices": [choices[k].as_choice() for k in sorted(choices)]}
    return body, error


# --- completions -----------------------------------------------------------------------------

def _completions_result(choices: dict[int, dict], toks: dict[int, TokenAccumulator],
                        top: dict) -> dict:
    ordered = [choices[k] for k in sorted(choices)]
    action: dict[str, Any] = {
        "text": ordered[0]["text"] if ordered else None,
        "finish_reason": ordered[0]["finish_reason"] if ordered else None,
    }
    if len(ordered) > 1:
        action["choices"] = ordered
    tokens = _merge_tokens([(k, toks[k].result()) for k in sorted(toks)], top)
    return {"action": action, "hidden_state": {}, "tokens": tokens,
            "finish_reasons": [c["finish_reason"] for c in ordered]}


def parse_completions(body: dict) -> dict:
    choices: dict[int, dict] = {}
    toks: dict[int, TokenAccumulator] = {}
    for pos, ch in enumerate(body.get("choices") or []):
        if not isinstance(ch, dict):
            continue
        idx = ch.get("index", pos)
        choices[idx] = {"index": idx, "text": ch.get("text") if isinstance(ch.get("text"), str)
                        else None, "finish_reason": ch.get("finish_reason")}
        toks.setdefault(idx, TokenAccumulator()).absorb_choice(ch)
    return _completions_result(choices, toks, body)


def parse_completions_stream(events: list[tuple[str | None, dict]]
                             ) -> tuple[dict, dict, dict | None]:
    body, error = reassemble_completions_stream(events)
    return parse_completions(body), body, error


def reassemble_completions_stream(events: list[tuple[str | None, dict]]
                                  ) -> tuple[dict, dict | None]:
    """A completions stream as the `text_completion` object of a non-streamed call, and the
    stream's error event or None."""
    choices: dict[int, dict] = {}
    toks: dict[int, TokenAccumulator] = {}
    top: dict[str, Any] = {}
    error = None
    for _, chunk in events:
        if "error" in chunk and not chunk.get("choices"):
            error = chunk["error"]
            continue
        for key in ("id", "model", "created", "system_fingerprint", "prompt_token_ids"):
            if chunk.get(key) is not None and key not in top:
                top[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):
            top["usage"] = chunk["usage"]
        for pos, ch in enumerate(chunk.get("choices") or []):
            if not isinstance(ch, dict):
                continue
            idx = ch.get("index", pos)
            c = choices.setdefault(idx, {"index": idx, "text": "", "finish_reason": None})
            if isinstance(ch.get("text"), str):
                c["text"] += ch["text"]
            if ch.get("finish_reason"):
                c["finish_reason"] = ch["finish_reason"]
            toks.setdefault(idx, TokenAccumulator()).absorb_choice(ch)
    body = {**top, "object": "text_completion",
            "choices": [{**choices[k], **toks[k].choice_fields()} for k in sorted(choices)]}
    return body, error


# --- responses -------------------------------------------------------------------------------

def parse_responses(resp: dict) -> dict:
    """A Responses API `response` object -> action (normalised chat-style messages plus the
    native `output` items), hidden state (reasoning items), tokens (output_text logprobs)."""
    output = resp.get("output") if isinstance(resp.get("output"), list) else []
    texts: list[str] = []
    refusals: list[str] = []
    tool_calls: list[dict] = []
    reasoning: list[str] = []
    toks = TokenAccumulator()
    for item in output:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or []:
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                    toks.add_logprobs(part.get("logprobs"))
                elif part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                    refusals.append(part["refusal"])
        elif kind == "function_call":
            tool_calls.append({"id": item.get("call_id") or item.get("id"), "type": "function",
                               "function": {"name": item.get("name") or "",
                                            "arguments": item.get("arguments") or ""}})
        elif kind == "reasoning":
            for key in ("content", "summary"):
                for part in item.get(key) or []:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        reasoning.append(part["text"])
                if reasoning:
                    break
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if refusals:
        message["refusal"] = "".join(refusals)
    status = resp.get("status")
    incomplete = resp.get("incomplete_details")
    if isinstance(incomplete, dict) and incomplete.get("reason"):
        finish = incomplete["reason"]
    elif tool_calls:
        finish = "tool_calls"
    elif status == "completed":
        finish = "stop"
    else:
        finish = status if isinstance(status, str) else None
    action = {"messages": [message], "finish_reason": finish, "status": status,
              "output": output}
    hidden = {"reasoning": reasoning} if reasoning else {}
    toks.add_ids(resp.get("output_token_ids"))
    tokens = _merge_tokens([(0, toks.result())], resp)
    return {"action": action, "hidden_state": hidden, "tokens": tokens,
            "finish_reasons": [finish] if finish else []}


def reassemble_responses_stream(events: list[tuple[str | None, dict]]
                                ) -> tuple[dict, dict | None]:
    """The final `response` object of a Responses stream: the one carried by
    `response.completed` (or `.failed` / `.incomplete`) when it arrived, else rebuilt from the
    output-item and delta events (a cut-off stream). Returns (response, error)."""
    final: dict | None = None
    latest: dict = {}
    items: dict[int, dict] = {}
    error = None
    for event, ev in events:
        kind = ev.get("type") or event or ""
        if kind in ("response.completed", "response.failed", "response.incomplete"):
            if isinstance(ev.get("response"), dict):
                final = ev["response"]
            if kind == "response.failed" and isinstance(final, dict):
                error = final.get("error") or {"message": "response.failed"}
        elif kind in ("response.created", "response.in_progress"):
            if isinstance(ev.get("response"), dict):
                latest = ev["response"]
        elif kind == "error":
            error = ev.get("error") if isinstance(ev.get("error"), dict) else {
                k: v for k, v in ev.items() if k != "type"}
        elif kind == "response.output_item.added" or kind == "response.output_item.done":
            if isinstance(ev.get("item"), dict):
                item = dict(ev["item"])
                if kind == "response.output_item.added" and item.get("type") == "message":
                    item.setdefault("content", [])
                items[ev.get("output_index", len(items))] = item
        elif kind == "response.output_text.delta":
            item = items.setdefault(ev.get("output_index", 0),
                                    {"type": "message", "role": "assistant", "content": []})
            content = item.setdefault("content", [])
            ci = ev.get("content_index", 0)
            while len(content) <= ci:
                content.append({"type": "output_text", "text": ""})
            part = content[ci]
            part["text"] = (part.get("text") or "") + (ev.get("delta") or "")
            if isinstance(ev.get("logprobs"), list):
                part.setdefault("logprobs", []).extend(ev["logprobs"])
        elif kind == "response.function_call_arguments.delta":
            item = items.setdefault(ev.get("output_index", 0),
                                    {"type": "function_call", "arguments": ""})
            item["arguments"] = (item.get("arguments") or "") + (ev.get("delta") or "")
        elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            item = items.setdefault(ev.get("output_index", 0), {"type": "reasoning"})
            key = "content" if kind == "response.reasoning_text.delta" else "summary"
            parts = item.setdefault(key, [])
            if not parts:
                parts.append({"type": "reasoning_text", "text": ""})
            parts[-1]["text"] = (parts[-1].get("text") or "") + (ev.get("delta") or "")
    if final is not None:
        return final, error
    rebuilt = dict(latest)
    rebuilt["output"] = [items[k] for k in sorted(items)]
    rebuilt.setdefault("status", "incomplete")
    return rebuilt, error


# --- the step ---------------------------------------------------------------------------------

# How much of a non-JSON error body a step keeps (sanitized) as the error message.
ERROR_TEXT_CHARS = 500


@dataclass
class Exchange:
    """One exchange parsed into JSON values, before anything is stored: what the sanitizer
    rewrites (`request`, `response`, `error_body`, `error_text`, `stream_error`, the transport
    error's message) and the facts it never touches. `fields_from_exchange` turns it into the
    step, so a step is only ever built from these values — sanitized by the caller.

    `response` is the body the agent received as one JSON object: the upstream's JSON, or a
    stream reassembled into the object a non-streamed call would have returned (chat and
    completions) or the final `response` object (Responses). None for a failed call (status
    >= 400: see `error_body` / `error_text`) or when no body came."""

    endpoint: str
    request: dict | None  # None: the request body is not a JSON object
    request_bytes: int
    response: dict | None
    response_status: int | None
    is_stream: bool
    transport_error: dict | None = None
    error_body: Any = None  # status >= 400: the body parsed as JSON (object or array)
    error_text: str | None = None  # status >= 400 and not JSON: its first characters
    stream_error: Any = None  # an error event inside a stream
    stream_meta: dict = field(default_factory=dict)
    routing: dict | None = None  # canary route / context updates applied (proxy/routing.py)
    # Parts of the raw exchange the sanitizer never sees (a non-JSON request body, the rest of
    # a long non-JSON error body, stream events that are not JSON): noted in the step's
    # metadata as `steward.sanitizer.unscanned`, so erasure knows to scan the raw payload.
    unscanned: list[str] = field(default_factory=list)

    @property
    def non_json_request(self) -> bool:
        return self.request is None


def parse_exchange(*, endpoint: str, request_body: bytes, response_body: bytes | None,
                   response_status: int | None, is_stream: bool,
                   error: dict | None = None, routing: dict | None = None,
                   truncated: Any = None) -> Exchange:
    """Parse the exact bytes of an exchange (streams reassembled). Raises `CaptureError` only
    when nothing trustworthy can be built (see the module docstring). `truncated`: the proxy
    kept only the first bytes of the response (STEWARD_MAX_CAPTURE_BYTES; the agent got all):
    `{"captured_bytes", "total_bytes"}`, into the step's metadata; a cut JSON body is then no
    answer rather than an error."""
    if endpoint not in ENDPOINTS:
        raise CaptureError(f"unknown endpoint {endpoint!r}")
    request_body = request_body or b""
    ex = Exchange(endpoint=endpoint, request=_loads_object(request_body),
                  request_bytes=len(request_body), response=None,
                  response_status=response_status, is_stream=is_stream,
                  transport_error=dict(error) if isinstance(error, dict) else None,
                  routing=routing if isinstance(routing, dict) else None)
    if ex.request is None and request_body:
        ex.unscanned.append("request_body")

    if isinstance(truncated, dict):
        ex.stream_meta["steward.response.truncated"] = {
            k: truncated.get(k) for k in ("captured_bytes", "total_bytes")}
    transport_failed = bool(error) and error.get("kind") not in (None, "client_disconnected")
    succeeded = (response_status is not None and 200 <= response_status < 300
                 and not transport_failed)
    if response_body and response_status is not None and response_status < 400:
        if is_stream:
            events, bad, done = sse_json_events(response_body)
            if not events and succeeded and error is None:
                raise CaptureError(f"{endpoint} stream has no parseable event "
                                   f"({bad} undecodable)")
            if bad:
                ex.stream_meta["steward.stream.undecodable_events"] = bad
                ex.unscanned.append("response_body")
            ex.stream_meta["steward.stream.done"] = done
            if endpoint == "chat.completions":
                ex.response, ex.stream_error = reassemble_chat_stream(events)
            elif endpoint == "completions":
                ex.response, ex.stream_error = reassemble_completions_stream(events)
            else:
                ex.response, ex.stream_error = reassemble_responses_stream(events)
        else:
            ex.response = _loads_object(response_body)
            if ex.response is None and succeeded and error is None and not truncated:
                raise CaptureError(f"{endpoint} response ({response_status}) is not a JSON "
                                   "object")
    elif succeeded and not response_body and error is None:
        raise CaptureError(f"{endpoint} response ({response_status}) has an empty body")
    if response_status is not None and response_status >= 400 and response_body:
        body = _loads_any(response_body)
        if isinstance(body, (dict, list)):
            ex.error_body = body
        elif body is None:
            ex.error_text = response_body[:ERROR_TEXT_CHARS].decode("utf-8", errors="replace")
            if len(response_body) > ERROR_TEXT_CHARS:
                ex.unscanned.append("response_body")
        else:  # a JSON scalar: kept as text
            ex.error_text = str(body)[:ERROR_TEXT_CHARS]
    return ex


def _error_of(ex: Exchange) -> dict | None:
    status = ex.response_status
    body = ex.error_body
    transport_error = ex.transport_error
    if transport_error:
        kind = transport_error.get("kind") or "upstream_error"
        message = transport_error.get("message") or ""
    elif status is not None and status >= 400:
        kind = "http_error"
        message = ""
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message") or "")
        elif isinstance(body, dict) and isinstance(body.get("message"), str):
            message = body["message"]
        elif ex.error_text:
            message = ex.error_text
    elif ex.stream_error is not None:
        kind = "stream_error"
        stream_error = ex.stream_error
        message = str(stream_error.get("message") or "") if isinstance(stream_error, dict) \
            else str(stream_error)
        body = stream_error
    elif ex.non_json_request:
        kind = "non_json_request"
        message = "the request body is not a JSON object"
    else:
        return None
    return {"status": status, "kind": kind, "message": message if isinstance(message, str)
            else str(message), "body": body if isinstance(body, (dict, list)) else None}


def fields_from_exchange(ex: Exchange, *, t_request: float | None = None,
                         t_first_byte: float | None = None, t_end: float | None = None,
                         harness_version: str = "") -> dict:
    """The content fields of a `governance.models.Step` for one (sanitized) exchange:
    request_model, response_model, response_id, observation, hidden_state, action, tokens,
    usage, timings, versions, metadata, error."""
    endpoint = ex.endpoint
    metadata: dict[str, Any] = {"gen_ai.operation.name": OPERATION_NAMES[endpoint],
                                "gen_ai.provider.name": "openai",
                                "stream": ex.is_stream}
    if ex.response_status is not None:
        metadata["http.response.status_code"] = ex.response_status
    if ex.request is None:
        observation: dict[str, Any] = {"non_json": True, "bytes": ex.request_bytes}
        metadata["steward.request.non_json"] = True
        req: dict = {}
    else:
        req = ex.request
        observation = observation_of(endpoint, req)
    metadata.update(ex.stream_meta)
    if ex.unscanned:
        metadata[UNSCANNED_KEY] = sorted(set(ex.unscanned))

    parsed: dict[str, Any] = {"action": {}, "hidden_state": {}, "tokens": {},
                              "finish_reasons": []}
    top: dict[str, Any] = {}
    if ex.response is not None:
        top = ex.response
        if endpoint == "chat.completions":
            parsed = parse_chat(top)
        elif endpoint == "completions":
            parsed = parse_completions(top)
        else:
            parsed = parse_responses(top)

    response_model = top.get("model") if isinstance(top.get("model"), str) else ""
    response_id = top.get("id") if isinstance(top.get("id"), str) else ""
    request_model = req.get("model") if isinstance(req.get("model"), str) else ""
    if response_id:
        metadata["gen_ai.response.id"] = response_id
    if parsed["finish_reasons"]:
        metadata["gen_ai.response.finish_reasons"] = parsed["finish_reasons"]
    if isinstance(top.get("system_fingerprint"), str):
        metadata["system_fingerprint"] = top["system_fingerprint"]
    if ex.transport_error and ex.transport_error.get("kind") == "client_disconnected":
        metadata["steward.client_disconnected"] = True

    timings: dict[str, Any] = {}
    if t_request is not None and t_first_byte is not None:
        timings["ttfb_ms"] = round((t_first_byte - t_request) * 1000, 3)
    if t_request is not None and t_end is not None:
        timings["duration_ms"] = round((t_end - t_request) * 1000, 3)

    return {
        "request_model": request_model[:256],
        "response_model": response_model[:256],
        "response_id": response_id[:256],
        "observation": observation,
        "hidden_state": parsed["hidden_state"],
        "action": parsed["action"],
        "tokens": parsed["tokens"],
        "usage": otel_usage(top.get("usage")),
        "timings": timings,
        "versions": versions_of(endpoint, req, response_model, harness_version, ex.routing),
        "metadata": metadata,
        "error": _error_of(ex),
    }


def build_step_fields(*, endpoint: str, request_body: bytes, response_body: bytes | None,
                      response_status: int | None, is_stream: bool,
                      error: dict | None = None, t_request: float | None = None,
                      t_first_byte: float | None = None, t_end: float | None = None,
                      harness_version: str = "") -> dict:
    """The step fields of one exchange, unsanitized: `parse_exchange` then
    `fields_from_exchange`. The pipeline (governance/tasks.py) sanitizes in between; this is
    for tests and tools that look at the parser alone. Never raises on odd input except
    `CaptureError` (see module docstring)."""
    ex = parse_exchange(endpoint=endpoint, request_body=request_body,
                        response_body=response_body, response_status=response_status,
                        is_stream=is_stream, error=error)
    return fields_from_exchange(ex, t_request=t_request, t_first_byte=t_first_byte,
                                t_end=t_end, harness_version=harness_version)
