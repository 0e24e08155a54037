"""The OpenAI wire format as both sides read it: message text, token ids and logprobs of a
choice, and the one stream reassembler of each endpoint (`chat.completions`, `completions`,
`responses`), used by the step builder (governance/capture/steps.py) for the whole step and by
the proxy's trajectory inference (proxy/inference.py) for the answer it indexes. Streams are
reassembled the way the OpenAI clients do it: content deltas concatenated, tool-call deltas
merged by `index` with argument fragments concatenated, so a streamed exchange and a
non-streamed one look the same. Events come from wire/sse.py. Pure functions, no Django.
"""

from __future__ import annotations

from typing import Any

import orjson

from wire.sse import data_payloads

ENDPOINTS = ("chat.completions", "completions", "responses")


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


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def int_list(value: Any) -> list[int] | None:
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
                    if isinstance(entry, dict) and int_or_none(entry.get("token_id")) is not None:
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
                if isinstance(entry, dict) and int_or_none(entry.get("token_id")) is not None:
                    self.ids_from_logprobs.append(entry["token_id"])

    def add_ids(self, ids: Any) -> None:
        ids = int_list(ids)
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
                    if int_or_none(t[1]) is not None:
                        ids.append(t[1])
            if ids and not self.token_ids:
                self.ids_from_logprobs.extend(ids)
        self.add_ids(meta.get("output_ids") or meta.get("output_token_ids"))
        if self.prompt_token_ids is None:
            self.prompt_token_ids = int_list(meta.get("input_token_ids") or meta.get("input_ids"))

    def absorb_choice(self, choice: dict) -> None:
        self.add_logprobs(choice.get("logprobs"))
        self.add_ids(choice.get("token_ids"))
        self.add_ids(choice.get("output_token_ids"))
        self.add_meta_info(choice.get("meta_info"))
        if self.prompt_token_ids is None:
            self.prompt_token_ids = int_list(choice.get("prompt_token_ids"))

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


class ChatChoice:
    """One choice of a chat completion being read: a non-streamed `message`
    (`apply_message`) or a stream's deltas (`apply_delta`), with its tokens."""

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
        # One delta per token: the common case (content only) costs one dict lookup per key.
        if "content" in delta:
            self.content = self._cat(self.content, delta["content"])
        if "reasoning_content" in delta or "reasoning" in delta:
            self.reasoning = self._cat(self.reasoning, delta.get("reasoning_content"))
            self.reasoning = self._cat(self.reasoning, delta.get("reasoning"))
        if "refusal" in delta:
            self.refusal = self._cat(self.refusal, delta["refusal"])
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


def reassemble_chat_stream(events: list[tuple[str | None, dict]]) -> tuple[dict, dict | None]:
    """A chat stream as the `chat.completion` object a non-streamed call would have returned
    (content and tool-call argument fragments joined, logprobs and token ids gathered), and
    the stream's error event or None. `parse_chat` of it is the streamed step."""
    choices, top, error = chat_stream_choices(events)
    body = {**top, "object": "chat.completion",
            "choices": [choices[k].as_choice() for k in sorted(choices)]}
    return body, error


def chat_stream_choices(events: list[tuple[str | None, dict]], *, tokens: bool = True
                        ) -> tuple[dict[int, ChatChoice], dict, dict | None]:
    """The reassembly itself: each choice by index, the top-level fields (id, model, usage,
    token ids) and the stream's error event or None. `tokens=False` skips the token ids and
    logprobs (the proxy's event loop needs only the message: a third of the time)."""
    choices: dict[int, ChatChoice] = {}
    top: dict[str, Any] = {}
    error = None
    for _, chunk in events:
        if "error" in chunk and not chunk.get("choices"):
            error = chunk["error"]
            continue
        for key in ("id", "model", "created", "system_fingerprint"):
            if key not in top and chunk.get(key) is not None:
                top[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):
            top["usage"] = chunk["usage"]
        for key in ("prompt_token_ids", "output_token_ids"):
            if key in chunk:
                if key == "prompt_token_ids":
                    top.setdefault(key, chunk[key])
                else:
                    top.setdefault(key, []).extend(int_list(chunk[key]) or [])
        for pos, ch in enumerate(chunk.get("choices") or []):
            if not isinstance(ch, dict):
                continue
            idx = ch.get("index", pos)
            c = choices.setdefault(idx, ChatChoice(idx))
            if isinstance(ch.get("delta"), dict):
                c.apply_delta(ch["delta"])
            elif isinstance(ch.get("message"), dict):
                c.apply_message(ch["message"])
            if ch.get("finish_reason"):
                c.finish_reason = ch["finish_reason"]
            if tokens:
                c.tokens.absorb_choice(ch)
    return choices, top, error


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
            if key not in top and chunk.get(key) is not None:
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


# The events that end a Responses stream (the final `response` object rides on them).
RESPONSES_END_EVENTS = frozenset({"response.completed", "response.failed",
                                  "response.incomplete"})


def _event_kind(event: str | None, ev: dict) -> str:
    return ev.get("type") or event or ""


def responses_stream_ended(events: list[tuple[str | None, dict]]) -> bool:
    """Whether a Responses stream's last event arrived (the answer is whole)."""
    return any(_event_kind(event, ev) in RESPONSES_END_EVENTS for event, ev in events)


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
        kind = _event_kind(event, ev)
        if kind in RESPONSES_END_EVENTS:
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


def responses_message(output: Any) -> dict[str, Any]:
    """The chat-style assistant message that a Responses API answer's `output` items say: the
    text of its `output_text` parts, its `function_call`s as `tool_calls`, its refusals. A pure
    function of the items, so a stored step keeps only the items and reads this back from them
    (governance.models.ActionField)."""
    texts: list[str] = []
    refusals: list[str] = []
    tool_calls: list[dict] = []
    for item in output if isinstance(output, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or []:
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                    refusals.append(part["refusal"])
        elif kind == "function_call":
            tool_calls.append({"id": item.get("call_id") or item.get("id"), "type": "function",
                               "function": {"name": item.get("name") or "",
                                            "arguments": item.get("arguments") or ""}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if refusals:
        message["refusal"] = "".join(refusals)
    return message


def chat_answer(body: bytes, is_stream: bool) -> dict | None:
    """The assistant message of choice 0 of a chat completion (JSON, or an SSE stream
    reassembled by `reassemble_chat_stream`), or None. The proxy's trajectory index hashes it
    (proxy/inference.py) to recognise the agent's next request."""
    if not is_stream:
        try:
            doc = orjson.loads(body)
            choice = (doc.get("choices") or [None])[0]
            message = choice.get("message") if isinstance(choice, dict) else None
            return message if isinstance(message, dict) else None
        except (orjson.JSONDecodeError, AttributeError):
            return None
    choices, _, _ = chat_stream_choices(
        [(None, doc) for doc in data_payloads(body) if isinstance(doc, dict)], tokens=False)
    first = choices.get(0)
    return first.message() if first is not None else None


def responses_answer(body: bytes, is_stream: bool) -> tuple[str | None, list | None]:
    """The id and the `output` items of a Responses API response (JSON, or a stream
    reassembled by `reassemble_responses_stream`), each None when absent, from one parse of the
    body. The proxy's trajectory index hashes the items (proxy/inference.py, rule 3b) to
    recognise the agent's next request."""
    if is_stream:
        doc, _ = reassemble_responses_stream(
            [(None, d) for d in data_payloads(body) if isinstance(d, dict)])
    else:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None, None
        if not isinstance(doc, dict):
            return None, None
    rid, output = doc.get("id"), doc.get("output")
    return (rid if isinstance(rid, str) else None, output if isinstance(output, list) else None)


def response_id(body: bytes, is_stream: bool) -> str | None:
    """The id of a Responses API response (JSON, or the first stream event carrying the
    `response` object)."""
    try:
        if not is_stream:
            doc = orjson.loads(body)
            rid = doc.get("id") if isinstance(doc, dict) else None
            return rid if isinstance(rid, str) else None
    except orjson.JSONDecodeError:
        return None
    for event in data_payloads(body):
        if isinstance(event, dict) and isinstance(event.get("response"), dict):
            rid = event["response"].get("id")
            if isinstance(rid, str):
                return rid
    return None
