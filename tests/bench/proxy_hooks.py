"""CPU time of the addon's request hooks (requestheaders + request) for one chat completion,
in process (no sockets), per request, with the thread CPU clock (steadier than wall time on a
shared machine than the end-to-end proxy_overhead.py):

    .venv/bin/python tests/bench/proxy_hooks.py [REPO_ROOT]

REPO_ROOT (default: this checkout) lets two checkouts be compared, e.g. before and after a
change. The key table and spool are stand-ins (a lookup that returns one key, a spool that is
never full): what is measured is the hooks' own work — header pass, key and path checks, body
parse, trajectory inference, capture bookkeeping.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2])
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
from mitmproxy import http  # noqa: E402
from mitmproxy.test import tflow  # noqa: E402

import proxy.addon as addon  # noqa: E402
from proxy.keys import KeyInfo  # noqa: E402

N = 20_000


async def main() -> None:
    steward = addon.Steward()
    steward.settings = addon.Settings(
        spool_dir=None, spool_max_bytes=1, spool_full_policy="reject",
        max_request_bytes=10 * 1024 * 1024, upstream_timeout=600.0, upstream_api_key="sk",
        key_refresh_seconds=1.0, database_url="", master_key_env="", master_key_file="")
    fields = inspect.signature(KeyInfo).parameters
    key = KeyInfo(**{n: (1 if n.endswith("_id") else False if n == "revoked" else "x")
                     for n in fields})
    steward.keys = SimpleNamespace(lookup=lambda secret: key)
    steward.spool = SimpleNamespace(is_full=lambda: False)
    steward._upstream_auth = b"Bearer sk"
    body = orjson.dumps({"model": "demo-model",
                         "messages": [{"role": "user", "content": "what is 2+3?"}]})
    flows = []
    for _ in range(N):
        flow = tflow.tflow()
        flow.request = http.Request.make(
            "POST", "http://127.0.0.1:8080/v1/chat/completions", body,
            {"Host": "127.0.0.1:8080", "Authorization": "Bearer stw_x",
             "Content-Type": "application/json", "User-Agent": "OpenAI/Python 1.60",
             "Accept": "application/json", "X-Stainless-Lang": "python",
             "Content-Length": str(len(body))})
        flows.append(flow)
    started = time.thread_time()
    for flow in flows:
        steward.requestheaders(flow)
        steward.request(flow)
    took = time.thread_time() - started
    assert flows[0].metadata.get("steward") is not None, flows[0].response
    print(f"{ROOT}: {took / N * 1e6:.1f} µs CPU per request (requestheaders + request)")


if __name__ == "__main__":
    asyncio.run(main())
