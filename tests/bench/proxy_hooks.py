"""CPU time of the addon's per-request work for one chat completion, in process (no sockets),
per request, with the thread CPU clock (steadier than wall time on a shared machine than the
end-to-end proxy_overhead.py):

    .venv/bin/python tests/bench/proxy_hooks.py [REPO_ROOT ...]

Two figures per case: "request" is the request hooks (requestheaders + request: header pass,
key and path checks, body parse, trajectory inference, capture bookkeeping), what delays the
forwarding; "record" is what runs after the response went out (responseheaders with its SSE
tee, response and the record's `_finish`: the inference index learns the exchange, which
re-parses a streamed answer). Cases: a 2-message and a 60-message conversation (about 1 KB per
message), each without and with `X-Steward-Session` (an agent that always names its sessions),
answered by a 40-event SSE stream.

Each REPO_ROOT (default: this checkout) runs in its own process, so two checkouts are compared
side by side in one run, e.g. `proxy_hooks.py /tmp/main-checkout .`. The key table and spool
are stand-ins (a lookup that returns one key, a spool that is never full and drops records):
what is measured is the hooks' own work.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve()
N = {2: 3_000, 60: 600}  # requests per case, by conversation length
ROUNDS = 2
CASES = [(length, session) for length in N for session in (False, True)]


def conversation(length: int, salt: int) -> list[dict]:
    filler = "The customer reported that the invoice total does not match the order. " * 14
    messages: list[dict] = [{"role": "system", "content": "You are a support agent. " + filler}]
    for i in range(1, length):
        role = "user" if i % 2 else "assistant"
        messages.append({"role": role, "content": f"turn {i} of {salt}: {filler}"})
    return messages


def sse_answer() -> bytes:
    import orjson

    events = [{"id": "c1", "object": "chat.completion.chunk", "model": "demo-model",
               "choices": [{"index": 0, "delta": {"content": f"word{i} "}}]} for i in range(40)]
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


async def measure(root: Path) -> list[tuple[float, float]]:
    sys.path.insert(0, str(root))
    import orjson
    from mitmproxy import http
    from mitmproxy.test import tflow

    import proxy.addon as addon
    from proxy.keys import KeyInfo

    steward = addon.Steward()
    steward.settings = addon.Settings(
        spool_dir=None, spool_max_bytes=1, spool_full_policy="reject",
        max_request_bytes=10 * 1024 * 1024, upstream_timeout=600.0, upstream_api_key="sk",
        key_refresh_seconds=1.0, database_url="", master_key_env="", master_key_file="")
    fields = inspect.signature(KeyInfo).parameters

    def agent_key(agent_id: int) -> KeyInfo:
        return KeyInfo(**{n: (agent_id if n == "agent_id" else 1 if n.endswith("_id") else
                              False if n == "revoked" else "x") for n in fields})

    # The session cases are another agent's, one that always names its sessions.
    keys = {"stw_x": agent_key(1), "stw_s": agent_key(2)}
    steward.keys = SimpleNamespace(lookup=keys.get)
    steward.spool = SimpleNamespace(is_full=lambda: False, append=lambda record: None)
    steward._upstream_auth = b"Bearer sk"
    answer = sse_answer()
    results = []
    for length, session in CASES:
        flows = []
        for i in range(N[length]):
            # A distinct conversation per request: the index keeps growing as in production.
            body = orjson.dumps({"model": "demo-model", "stream": True,
                                 "messages": conversation(length, i)})
            headers = {"Host": "127.0.0.1:8080",
                       "Authorization": "Bearer stw_s" if session else "Bearer stw_x",
                       "Content-Type": "application/json", "User-Agent": "OpenAI/Python 1.60",
                       "Accept": "application/json", "X-Stainless-Lang": "python",
                       "Content-Length": str(len(body))}
            if session:
                headers["X-Steward-Session"] = f"session-{length}-{i}"
            flow = tflow.tflow()
            flow.request = http.Request.make(
                "POST", "http://127.0.0.1:8080/v1/chat/completions", body, headers)
            flows.append(flow)
        started = time.thread_time()
        for flow in flows:
            steward.requestheaders(flow)
            steward.request(flow)
        request_s = time.thread_time() - started
        assert flows[0].metadata.get("steward") is not None, flows[0].response
        started = time.thread_time()
        for flow in flows:
            flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
            steward.responseheaders(flow)
            flow.response.stream(answer)  # the tee, as mitmproxy calls it per chunk
            steward.response(flow)
            await asyncio.sleep(0)  # runs the _finish that response() call_soon'd
        record_s = time.thread_time() - started
        steward._pending.clear()
        results.append((request_s / len(flows) * 1e6, record_s / len(flows) * 1e6))
    return results


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--one"]
    if "--one" in sys.argv:
        for request_us, record_us in asyncio.run(measure(Path(args[0]).resolve())):
            print(f"{request_us:.1f} {record_us:.1f}")
        return
    roots = [Path(a).resolve() for a in args] or [HERE.parents[2]]
    figures: dict[Path, list[tuple[float, ...]]] = {}
    for _ in range(ROUNDS):  # interleaved; the best round is the least disturbed one
        for root in roots:
            out = subprocess.run([sys.executable, str(HERE), str(root), "--one"], check=True,
                                 capture_output=True, text=True).stdout.split("\n")
            got = [tuple(float(x) for x in line.split()) for line in out if line]
            figures[root] = [tuple(map(min, a, b)) for a, b in zip(figures[root], got,
                                                                    strict=True)] \
                if root in figures else got
    print(f"µs CPU per request, best of {ROUNDS} rounds: request = requestheaders + request "
          "(before forwarding), record = response hooks + _finish (after the response)")
    head = f"{'case':<34}" + "".join(f"{str(r)[-24:]:>28}" for r in roots)
    print(head)
    print(f"{'':<34}" + "".join(f"{'request':>14}{'record':>14}" for _ in roots))
    for i, (length, session) in enumerate(CASES):
        name = f"{length:>2} messages, {'X-Steward-Session' if session else 'no session'}"
        print(f"{name:<34}" + "".join(f"{figures[r][i][0]:>14.1f}{figures[r][i][1]:>14.1f}"
                                      for r in roots))


if __name__ == "__main__":
    main()
