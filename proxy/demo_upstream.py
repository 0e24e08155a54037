"""A small OpenAI-compatible server with a deterministic rule-based "model" (aiohttp).

`steward up` runs it as the out-of-the-box upstream when STEWARD_UPSTREAM_URL is unset, and the
tests use it as the fake upstream:

    python -m proxy.demo_upstream --port 30000 [--host 127.0.0.1]

Endpoints: GET /v1/models; POST /v1/chat/completions, /v1/completions, /v1/responses (JSON, or
SSE with `stream: true`). The model answers simple arithmetic ("what is 12*7?" -> "12 * 7 =
84."), otherwise echoes the last user text. With `tools` and a user message last, it calls the
first tool (arguments `{"expression": ...}` when the text has arithmetic, else `{"input": ...}`);
after a `tool` message it reports the tool's result. The Responses API does the same with
function tools: a `function_call` output item after a user message, the result reported after
a `function_call_output` (as agents built on the OpenAI Agents SDK call their model). A model
name containing "reason" adds `reasoning_content`. `usage` is always in JSON answers, and in
streams when `stream_options.include_usage` is true.

Token ids and logprobs (SGLang-style): with `logprobs: true` each entry of
`choices[].logprobs.content[]` carries `token`, `logprob`, `bytes`, `top_logprobs` and
`token_id` (int); the legacy completions endpoint with `logprobs: N` returns
`choices[].logprobs` with `tokens`, `token_logprobs`, `token_ids`, `top_logprobs`,
`text_offset`. Tokens are whitespace-delimited pieces; ids and logprobs are deterministic.

Chat and completion ids and `created` are derived from the request body, so the same request
yields the same bytes (tests compare streams byte for byte); response ids of the Responses API
are unique (they chain conversations through `previous_response_id`).

Test controls: header `X-Demo-Sleep: <seconds>` or a model named `sleep-<seconds>` delays the
answer; header `X-Demo-Fail: <status>` or the model `fail-500` answers that status with an
OpenAI error. Streams: header `X-Demo-Stall: <seconds>` pauses a chat stream after its first
chunk; `X-Demo-Endless: 1` makes a chat stream send content chunks until the client goes away;
`X-Demo-Linger: <seconds>` waits that long between a chat stream's `data: [DONE]` and the end of
its body (a client that closes at `[DONE]` then leaves before the server ends).

With `debug=True` (the in-process test server; `--debug` on the command line, never under
`steward up`): `GET /_debug/requests` lists the requests received (method, path, headers,
body), `GET /_debug/last_request` the last one, `DELETE /_debug/requests` clears them. They are
this server's own paths; the proxy never forwards them (proxy/paths.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import re
import socket
import threading
import time
import uuid
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

MODELS = ["demo-model", "demo-reasoner"]
_ARITH = re.compile(r"(-?\d+(?:\.\d+)?)\s*([-+*/x×])\s*(-?\d+(?:\.\d+)?)")
_TOKEN = re.compile(r"\s*\S+")
RECORDED = web.AppKey("recorded", deque)


# -- the "model" --------------------------------------------------------------------------
def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def arithmetic(text: str) -> str | None:
    m = _ARITH.search(text)
    if not m:
        return None
    a, op, b = float(m.group(1)), m.group(2), float(m.group(3))
    if op in "x×*":
        value, op = a * b, "*"
    elif op == "/":
        if b == 0:
            return "Division by zero is undefined."
        value = a / b
    else:
        value = a + b if op == "+" else a - b
    return f"{_num(a)} {op} {_num(b)} = {_num(value)}."


def _num(v: float) -> str:
    return str(int(v)) if v.is_integer() else f"{v:g}"


def answer_text(prompt: str) -> str:
    return arithmetic(prompt) or f"You said: {prompt.strip()}"


@dataclass
class Answer:
    text: str | None
    tool_calls: list[dict] | None
    reasoning: str | None


def chat_model(body: dict) -> Answer:
    messages = body.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    reasoning = None
    if "reason" in str(body.get("model", "")):
        reasoning = "Let me look at the last message and answer it step by step."
    tools = body.get("tools") or []
    if last.get("role") == "tool":
        return Answer(f"The tool returned: {text_of(last.get('content'))}", None, reasoning)
    prompt = text_of(last.get("content"))
    if tools and last.get("role") == "user" and body.get("tool_choice") != "none":
        fn = (tools[0].get("function") or {}).get("name", "tool")
        call_id = "call_" + hashlib.sha256(orjson.dumps(messages)).hexdigest()[:24]
        return Answer(None, [{"id": call_id, "type": "function",
                              "function": {"name": fn, "arguments": tool_arguments(prompt)}}],
                      reasoning)
    return Answer(answer_text(prompt), None, reasoning)


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text) or [text]


def token_id(token: str) -> int:
    return zlib.crc32(token.encode()) % 50000


def token_logprob(i: int) -> float:
    return -round(0.05 + 0.1 * (i % 7), 4)


def chat_logprob_entry(tok: str, i: int) -> dict:
    return {"token": tok, "logprob": token_logprob(i), "bytes": list(tok.encode()),
            "top_logprobs": [], "token_id": token_id(tok)}


def count_tokens(text: str) -> int:
    return len(tokens(text)) if text else 0


def prompt_tokens(body: dict) -> int:
    if "messages" in body:
        return sum(count_tokens(text_of(m.get("content"))) + 3
                   for m in body["messages"] if isinstance(m, dict))
    prompt = body.get("prompt", body.get("input", ""))
    if isinstance(prompt, list):
        prompt = " ".join(text_of(p.get("content")) if isinstance(p, dict) else str(p)
                          for p in prompt)
    return count_tokens(str(prompt))


def stable_id(prefix: str, raw: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(raw).digest()
    return prefix + digest.hex()[:24], 1_700_000_000 + int.from_bytes(digest[:3], "big")


def sse(obj: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


def error_json(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "api_error", "param": None,
                                        "code": None}}, status=status, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


# -- handlers -----------------------------------------------------------------------------
async def _prelude(request: web.Request) -> tuple[dict | None, web.Response | None]:
    """Record the request, apply the test controls, parse the JSON body."""
    raw = await request.read()
    request.app[RECORDED].append({
        "method": request.method, "path": request.path_qs,
        "headers": [[k, v] for k, v in request.headers.items()],
        "body": raw.decode("utf-8", "replace"), "t": time.time(),
    })
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        body = None
    model = str(body.get("model", "")) if isinstance(body, dict) else ""
    sleep = request.headers.get("X-Demo-Sleep")
    if sleep is None and model.startswith("sleep-"):
        sleep = model[6:]
    if sleep:
        await asyncio.sleep(float(sleep))
    fail = request.headers.get("X-Demo-Fail") or ("500" if model == "fail-500" else None)
    if fail:
        return None, error_json(int(fail), f"demo upstream failure {fail}")
    if not isinstance(body, dict):
        return None, error_json(400, "request body is not a JSON object")
    return body, None


async def models(request: web.Request) -> web.Response:
    request.app[RECORDED].append({"method": request.method, "path": request.path_qs,
                                  "headers": [[k, v] for k, v in request.headers.items()],
                                  "body": "", "t": time.time()})
    return web.json_response({"object": "list", "data": [
        {"id": m, "object": "model", "created": 1_700_000_000, "owned_by": "steward-demo"}
        for m in MODELS]}, dumps=_dumps)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, failure = await _prelude(request)
    if failure:
        return failure
    assert body is not None
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        return error_json(400, "'messages' must be a non-empty list")
    ans = chat_model(body)
    cid, created = stable_id("chatcmpl-", await request.read())
    model = body.get("model", "demo-model")
    want_logprobs = bool(body.get("logprobs"))
    toks = tokens(ans.text) if ans.text else []
    completion_tokens = len(toks) + (8 if ans.tool_calls else 0)
    usage = {"prompt_tokens": prompt_tokens(body), "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens(body) + completion_tokens}
    finish = "tool_calls" if ans.tool_calls else "stop"

    if not body.get("stream"):
        message: dict[str, Any] = {"role": "assistant", "content": ans.text}
        if ans.tool_calls:
            message["tool_calls"] = ans.tool_calls
        if ans.reasoning:
            message["reasoning_content"] = ans.reasoning
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish,
                                  "logprobs": None}
        if want_logprobs:
            choice["logprobs"] = {"content": [chat_logprob_entry(t, i)
                                              for i, t in enumerate(toks)]}
        return web.json_response({"id": cid, "object": "chat.completion", "created": created,
                                  "model": model, "choices": [choice], "usage": usage},
                                 dumps=_dumps)

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)

    def chunk(delta: dict, finish_reason: str | None = None, logprobs: Any = None) -> bytes:
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [{"index": 0, "delta": delta,
                                                 "logprobs": logprobs,
                                                 "finish_reason": finish_reason}]})

    await resp.write(chunk({"role": "assistant", "content": ""}))
    stall = request.headers.get("X-Demo-Stall")
    if stall:
        await asyncio.sleep(float(stall))
    if request.headers.get("X-Demo-Endless"):
        filler = chunk({"content": "more " * 200})
        while True:  # until the client (or the proxy) closes the connection
            await resp.write(filler)
    if ans.reasoning:
        for tok in tokens(ans.reasoning):
            await resp.write(chunk({"reasoning_content": tok}))
    for i, tok in enumerate(toks):
        lp = {"content": [chat_logprob_entry(tok, i)]} if want_logprobs else None
        await resp.write(chunk({"content": tok}, logprobs=lp))
    for n, call in enumerate(ans.tool_calls or ()):
        await resp.write(chunk({"tool_calls": [{"index": n, "id": call["id"], "type": "function",
                                                "function": {"name": call["function"]["name"],
                                                             "arguments": ""}}]}))
        await resp.write(chunk({"tool_calls": [{"index": n, "function": {
            "arguments": call["function"]["arguments"]}}]}))
    await resp.write(chunk({}, finish))
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                              "model": model, "choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    linger = request.headers.get("X-Demo-Linger")
    if linger:
        await asyncio.sleep(float(linger))
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    body, failure = await _prelude(request)
    if failure:
        return failure
    assert body is not None
    prompt = body.get("prompt", "")
    prompt = prompt[0] if isinstance(prompt, list) and prompt else prompt
    text = " " + answer_text(str(prompt))
    cid, created = stable_id("cmpl-", await request.read())
    model = body.get("model", "demo-model")
    toks = tokens(text)
    n_logprobs = body.get("logprobs")
    usage = {"prompt_tokens": prompt_tokens(body), "completion_tokens": len(toks),
             "total_tokens": prompt_tokens(body) + len(toks)}

    def logprobs_for(part: list[str], start: int, offset: int) -> dict | None:
        if n_logprobs is None:
            return None
        offsets, pos = [], offset
        for t in part:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": part, "token_logprobs": [token_logprob(start + i)
                                                    for i in range(len(part))],
                "token_ids": [token_id(t) for t in part],
                "top_logprobs": [{t: token_logprob(start + i)} for i, t in enumerate(part)],
                "text_offset": offsets}

    if not body.get("stream"):
        return web.json_response({
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop",
                         "logprobs": logprobs_for(toks, 0, 0)}],
            "usage": usage}, dumps=_dumps)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    offset = 0
    for i, tok in enumerate(toks):
        await resp.write(sse({"id": cid, "object": "text_completion", "created": created,
                              "model": model, "choices": [{
                                  "index": 0, "text": tok, "logprobs": logprobs_for([tok], i,
                                                                                    offset),
                                  "finish_reason": "stop" if i == len(toks) - 1 else None}]}))
        offset += len(tok)
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(sse({"id": cid, "object": "text_completion", "created": created,
                              "model": model, "choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def tool_arguments(prompt: str) -> str:
    expr = _ARITH.search(prompt)
    return orjson.dumps({"expression": expr.group(0)} if expr else {"input": prompt}).decode()


def _last_turn(body: dict) -> dict:
    """The Responses input's last user message or function call output (a string input is a
    user message); {} when there is none."""
    items = body.get("input", "")
    if isinstance(items, str):
        return {"role": "user", "content": items}
    for item in reversed(items if isinstance(items, list) else []):
        if isinstance(item, dict) and (item.get("type") == "function_call_output"
                                       or item.get("role") == "user"):
            return item
    return {}


def responses_text(body: dict) -> str:
    """The model's text answer: the tool's result after a function call output, as chat does,
    else the answer to the last user message."""
    last = _last_turn(body)
    if last.get("type") == "function_call_output":
        return f"The tool returned: {text_of(last.get('output', ''))}"
    return answer_text(text_of(last.get("content")))


def responses_tool_call(body: dict) -> dict | None:
    """The `function_call` item the model answers with: its first function tool, when the last
    input item is a user message and `tool_choice` allows tools; else None."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)
             and t.get("type") == "function"]
    items = body.get("input")
    last = items[-1] if isinstance(items, list) and items and isinstance(items[-1], dict) else {}
    if not tools or body.get("tool_choice") == "none" or (
            last.get("role") != "user" and not isinstance(items, str)):
        return None
    digest = hashlib.sha256(orjson.dumps(items)).hexdigest()[:24]
    return {"type": "function_call", "id": "fc_" + digest, "call_id": "call_" + digest,
            "name": tools[0].get("name", "tool"), "status": "completed",
            "arguments": tool_arguments(text_of(_last_turn(body).get("content")))}


async def responses(request: web.Request) -> web.StreamResponse:
    body, failure = await _prelude(request)
    if failure:
        return failure
    assert body is not None
    call = responses_tool_call(body)
    text = "" if call else responses_text(body)
    rid, msg_id = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex
    model = body.get("model", "demo-model")
    toks = tokens(text)
    in_tokens = prompt_tokens(body)
    usage = {"input_tokens": in_tokens, "output_tokens": len(toks) + (8 if call else 0),
             "total_tokens": in_tokens + len(toks),
             "input_tokens_details": {"cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}
    part = {"type": "output_text", "text": text, "annotations": []}
    item = call or {"type": "message", "id": msg_id, "status": "completed", "role": "assistant",
                    "content": [part]}

    def response_obj(status: str, output: list, with_usage: bool) -> dict:
        return {"id": rid, "object": "response", "created_at": int(time.time()),
                "status": status, "model": model, "output": output,
                "previous_response_id": body.get("previous_response_id"),
                "instructions": body.get("instructions"), "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": [], "error": None, "incomplete_details": None,
                "metadata": {}, "temperature": 1.0, "top_p": 1.0, "text": {"format": {
                    "type": "text"}}, "usage": usage if with_usage else None}

    if not body.get("stream"):
        return web.json_response(response_obj("completed", [item], True), dumps=_dumps)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    seq = 0

    async def emit(event_type: str, **fields: Any) -> None:
        nonlocal seq
        await resp.write(sse({"type": event_type, "sequence_number": seq, **fields}, event_type))
        seq += 1

    await emit("response.created", response=response_obj("in_progress", [], False))
    if call:
        await emit("response.output_item.added", output_index=0,
                   item={**call, "status": "in_progress", "arguments": ""})
        await emit("response.function_call_arguments.delta", item_id=call["id"], output_index=0,
                   delta=call["arguments"])
        await emit("response.function_call_arguments.done", item_id=call["id"], output_index=0,
                   arguments=call["arguments"])
        await emit("response.output_item.done", output_index=0, item=call)
        await emit("response.completed", response=response_obj("completed", [call], True))
        await resp.write_eof()
        return resp
    await emit("response.output_item.added", output_index=0,
               item={**item, "status": "in_progress", "content": []})
    await emit("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
               part={**part, "text": ""})
    for tok in toks:
        await emit("response.output_text.delta", item_id=msg_id, output_index=0,
                   content_index=0, delta=tok, logprobs=[])
    await emit("response.output_text.done", item_id=msg_id, output_index=0, content_index=0,
               text=text, logprobs=[])
    await emit("response.content_part.done", item_id=msg_id, output_index=0, content_index=0,
               part=part)
    await emit("response.output_item.done", output_index=0, item=item)
    await emit("response.completed", response=response_obj("completed", [item], True))
    await resp.write_eof()
    return resp


async def debug_requests(request: web.Request) -> web.Response:
    if request.method == "DELETE":
        request.app[RECORDED].clear()
        return web.json_response({"cleared": True})
    return web.json_response(list(request.app[RECORDED]), dumps=_dumps)


async def debug_last_request(request: web.Request) -> web.Response:
    recorded = request.app[RECORDED]
    if not recorded:
        return web.json_response({"error": "no request yet"}, status=404)
    return web.json_response(recorded[-1], dumps=_dumps)


def build_app(max_recorded: int = 1000, debug: bool = False) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[RECORDED] = deque(maxlen=max_recorded)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    if debug:
        app.router.add_get("/_debug/requests", debug_requests)
        app.router.add_delete("/_debug/requests", debug_requests)
        app.router.add_get("/_debug/last_request", debug_last_request)
    return app


# -- running it ---------------------------------------------------------------------------
class UpstreamServer:
    """The demo upstream on a background thread (its own event loop). `url` is the server root
    (no /v1); `requests` is the live list of recorded requests."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, debug: bool = True) -> None:
        self.app = build_app(debug=debug)
        self.host = host
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-upstream", daemon=True)

    @property
    def requests(self) -> deque:
        return self.app[RECORDED]

    def last_request(self) -> dict | None:
        return self.app[RECORDED][-1] if self.app[RECORDED] else None

    def clear(self) -> None:
        self.app[RECORDED].clear()  # deque.clear is atomic

    def start(self) -> UpstreamServer:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("demo upstream did not start")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.SockSite(self._runner, self._sock)
        self._loop.run_until_complete(site.start())
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def start_in_thread(host: str = "127.0.0.1", port: int = 0, debug: bool = True
                    ) -> UpstreamServer:
    """Start the demo upstream on a free port in a background thread; `.url` is its base URL.
    `debug`: serve the /_debug/ paths (on by default: tests read them directly)."""
    return UpstreamServer(host, port, debug).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--debug", action="store_true",
                        help="serve /_debug/ (the requests received, prompts included)")
    args = parser.parse_args(argv)
    print(f"demo upstream on http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(build_app(debug=args.debug), host=args.host, port=args.port, access_log=None,
                print=None)


if __name__ == "__main__":
    main()
