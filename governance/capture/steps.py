"""From one captured exchange (the exact request and response bytes) to the fields of an ATDP v1
step. Pure functions: no database, no network, no clock — the Celery task (governance/tasks.py)
decrypts the raw payload and calls `build_step_fields`, tests call it directly.

Endpoints: `chat.completions`, `completions`, `responses`, each plain JSON or SSE. Streams are
reassembled by wire/openai.py (the reassembler the proxy uses too), so a streamed step and a
non-streamed one look the same.

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

from wire.openai import (
    ENDPOINTS,
    ChatChoice,
    TokenAccumulator,
    int_list,
    int_or_none,
    message_text,
    reassemble_chat_stream,
    reassemble_completions_stream,
    reassemble_responses_stream,
    responses_message,
    responses_stream_ended,
)
from wire.sse import sse_json_events

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


# --- usage, tokens ---------------------------------------------------------------------------

def otel_usage(usage: Any) -> dict:
    """OpenAI usage (chat/completions: prompt/completion_tokens; responses: input/output_tokens)
    under the OTel GenAI names; the upstream's own object is kept under `raw`."""
    if not isinstance(usage, dict):
        return {}
    out: dict[str, Any] = {}
    inp = int_or_none(usage.get("prompt_tokens", usage.get("input_tokens")))
    outp = int_or_none(usage.get("completion_tokens", usage.get("output_tokens")))
    if inp is not None:
        out[INPUT_TOKENS] = inp
    if outp is not None:
        out[OUTPUT_TOKENS] = outp
    total = int_or_none(usage.get("total_tokens"))
    if total is not None:
        out["total_tokens"] = total
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    if isinstance(details, dict) and int_or_none(details.get("cached_tokens")) is not None:
        out["gen_ai.usage.cache_read.input_tokens"] = details["cached_tokens"]
    details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    if isinstance(details, dict) and int_or_none(details.get("reasoning_tokens")) is not None:
        out["gen_ai.usage.reasoning.output_tokens"] = details["reasoning_tokens"]
    out["raw"] = usage
    return out


def _merge_tokens(per_choice: list[tuple[int, dict]], top: dict) -> dict:
    """Step `tokens`: choice 0's fields at the top; every choice under `choices` when n > 1."""
    out: dict[str, Any] = {}
    first = next((t for i, t in per_choice if i == 0), per_choice[0][1] if per_choice else {})
    out.update(first)
    prompt_ids = int_list(top.get("prompt_token_ids")) or int_list(top.get("input_token_ids"))
    if prompt_ids and "prompt_token_ids" not in out:
        out["prompt_token_ids"] = prompt_ids
    top_ids = int_list(top.get("output_token_ids"))
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


def _chat_result(choices: dict[int, ChatChoice], top: dict) -> dict:
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
    choices: dict[int, ChatChoice] = {}
    for pos, ch in enumerate(body.get("choices") or []):
        if not isinstance(ch, dict):
            continue
        c = choices.setdefault(ch.get("index", pos), ChatChoice(ch.get("index", pos)))
        if isinstance(ch.get("message"), dict):
            c.apply_message(ch["message"])
        c.finish_reason = ch.get("finish_reason")
        c.tokens.absorb_choice(ch)
    return _chat_result(choices, body)


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


# --- responses -------------------------------------------------------------------------------

def parse_responses(resp: dict) -> dict:
    """A Responses API `response` object -> action (normalised chat-style messages plus the
    native `output` items), hidden state (reasoning items), tokens (output_text logprobs).
    The stored step keeps only `output`: its `messages` are read back from it
    (wire.openai.responses_message, governance.models.ActionField)."""
    output = resp.get("output") if isinstance(resp.get("output"), list) else []
    reasoning: list[str] = []
    toks = TokenAccumulator()
    for item in output:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or []:
                if (isinstance(part, dict) and part.get("type") == "output_text"
                        and isinstance(part.get("text"), str)):
                    toks.add_logprobs(part.get("logprobs"))
        elif kind == "reasoning":
            for key in ("content", "summary"):
                for part in item.get(key) or []:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        reasoning.append(part["text"])
                if reasoning:
                    break
    message = responses_message(output)
    tool_calls = message.get("tool_calls")
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
    completions) or the final `response` object (Responses, without the request fields it
    echoes: RESPONSES_ANSWER_KEYS). None for a failed call (status >= 400: see `error_body` /
    `error_text`) or when no body came."""

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
            if (isinstance(error, dict) and error.get("kind") == "client_disconnected"
                    and (done or (endpoint == "responses" and responses_stream_ended(events)))):
                # The agent had the whole answer: its client closed the connection after the
                # stream's last event, before the upstream's end of the body reached the proxy
                # (openai-python closes the response at `[DONE]`). Not a failed call: no
                # error, so the step stays training-eligible; the close is kept as metadata.
                ex.transport_error = None
                ex.stream_meta["steward.client_closed_after_end"] = True
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
    if endpoint == "responses" and isinstance(ex.response, dict):
        ex.response = {k: v for k, v in ex.response.items() if k in RESPONSES_ANSWER_KEYS}
    return ex


# What a step reads of a Responses API `response` object (parse_responses,
# fields_from_exchange). The rest of it echoes the request — `instructions`, `tools`,
# `metadata`, `text`, `reasoning`, `tool_choice`, ... — which the step holds from the request,
# sanitized there once a trajectory: sanitizing the echo again with every answer cost the
# sanitizer ~110 more strings a call on tau-bench's sessions and counted the instructions'
# identifiers as found in every answer (decision 57). The raw payload keeps the body whole.
RESPONSES_ANSWER_KEYS = frozenset({
    "id", "object", "created_at", "status", "model", "output", "usage", "incomplete_details",
    "error", "output_token_ids", "input_token_ids", "prompt_token_ids", "system_fingerprint"})


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


# --- what a step stores of its metadata, versions and usage (decision 39) -----------------------
#
# A step's metadata and versions repeat what its own columns say (operation, provider, status,
# response id, models, sanitizer version, the finish reason its action holds), and its usage's
# OTel names are a function of the upstream's own usage object, kept under `raw`. Stored, that
# was ~0.4 KB of every step row. Now an entry is left out when — and only when — it is exactly
# what `step_json` derives back from the row, so every reader sees the JSON the step was built
# with (rows stored whole before this read as they are).


def _derivable(step: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, versions) entries that the step's columns and action determine."""
    metadata: dict[str, Any] = {"gen_ai.provider.name": "openai"}
    if step.endpoint in OPERATION_NAMES:
        metadata["gen_ai.operation.name"] = OPERATION_NAMES[step.endpoint]
    if step.status_code is not None:
        metadata["http.response.status_code"] = step.status_code
    if step.response_id:
        metadata["gen_ai.response.id"] = step.response_id
    if step.sanitizer_version:
        metadata["steward.sanitizer.version"] = step.sanitizer_version
    finish = step.action.get("finish_reason") if isinstance(step.action, dict) else None
    if isinstance(finish, str):
        metadata["gen_ai.response.finish_reasons"] = [finish]
    versions = {"gen_ai.request.model": step.request_model or None,
                "gen_ai.response.model": step.response_model or None}
    return metadata, versions


# The two 64-hex hashes of `versions` (~170 bytes of JSON a step) are functions of the step's
# observation, which the conversation store gives back whole (decision 40): left out when they
# equal what the observation gives, computed again when read.
OBSERVATION_HASHES = ("system_prompt_hash", "tool_schema_hash")


def observation_hashes(endpoint: str, observation: dict) -> dict[str, str | None]:
    """`versions`' system prompt and tool schema hashes as `versions_of` computes them from a
    request, from the observation that holds the same messages, input, instructions and tools."""
    system = system_prompt_text(endpoint, observation)
    tools = observation.get("tools")
    return {"system_prompt_hash": sha256_hex(system) if system is not None else None,
            "tool_schema_hash": sha256_hex(canonical_json(tools)) if tools else None}


def compact_step_json(step: Any, observation: dict | None = None) -> None:
    """Leave out of a step about to be stored what `step_json` gives back the same.
    `observation`: the step's whole observation as built (the store keeps its history apart),
    for the hashes it determines; without it they are kept."""
    metadata, versions = _derivable(step)
    if observation is not None:
        versions.update(observation_hashes(step.endpoint, observation))
    step.metadata = {k: v for k, v in (step.metadata or {}).items()
                     if k not in metadata or metadata[k] != v}
    step.versions = {k: v for k, v in (step.versions or {}).items()
                     if k not in versions or versions[k] != v}
    usage = step.usage or {}
    if "raw" in usage and otel_usage(usage["raw"]) == usage:
        step.usage = {"raw": usage["raw"]}


def step_json(step: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(usage, versions, metadata) of a stored step, as it was built: what it stores, plus
    each derivable entry it does not. A derivable metadata entry missing from a whole row
    (stored before decision 39, or never part of it) is one the build always wrote when its
    source was there: the column, or the action's finish reason."""
    metadata, versions = _derivable(step)
    stored = step.versions or {}
    if any(k not in stored for k in OBSERVATION_HASHES):
        # Left out by compact_step_json (decision 40): from the materialized observation.
        versions.update(observation_hashes(step.endpoint, step.observation or {}))
    usage = step.usage or {}
    if set(usage) == {"raw"}:
        usage = otel_usage(usage["raw"])
    return (usage, {**versions, **stored}, {**metadata, **(step.metadata or {})})
