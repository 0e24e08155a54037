"""CPU and disk per spool record: the proxy's spool writer thread (spool_form + encrypt +
frame/line) and the shipper's read (read_batches) plus what it does to the bodies before
sealing the raw payload, for one record of a long agent session:

    .venv/bin/python tests/bench/spool_codec.py [REPO_ROOT ...]

The record is what `Steward._finish` builds: raw header fields, a 60-message chat request
(about 60 KB) and a 40-event SSE answer. Each REPO_ROOT (default: this checkout) runs in its
own process with its own proxy/ and wire/, so an older checkout (base64 lines) and this one
(binary frames) are compared side by side in one run, e.g. `spool_codec.py /tmp/main .`.
"write" is the writer thread's CPU per record (`SpoolWriter._encode`: the GIL it takes from
the event loop); "read+prep" is read_batches over a segment of such records plus, per record,
the shipper's body handling (a base64 body is validated; the raw payload's JSON holds the
bodies as base64 either way, governance/capture/rawstore.raw_plaintext) — timed with the
thread CPU clock, best of ROUNDS interleaved rounds.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
N = 400
ROUNDS = 3
RAW_FIELDS = ("method", "path", "request_headers", "request_body", "request_is_json",
              "response_status", "response_headers", "response_body", "is_stream", "error",
              "routing", "response_truncated")


def records(n: int) -> list[dict]:
    import orjson

    filler = "The customer reported that the invoice total does not match the order. " * 14
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i}: {filler}"}
                for i in range(60)]
    request = orjson.dumps({"model": "demo-model", "stream": True, "messages": messages})
    events = [{"id": "c1", "object": "chat.completion.chunk", "model": "demo-model",
               "choices": [{"index": 0, "delta": {"content": f"word{i} "}}]} for i in range(40)]
    answer = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    out = []
    for i in range(n):
        out.append({
            "v": 1, "flow_id": f"flow-{i}", "proxy_instance": "bench:0", "tenant_id": 1,
            "agent_id": 1, "proxy_key_id": 1, "trajectory_id": "t", "trajectory_source": "new",
            "step_id": "s", "session_id": None, "subject": None, "consent": "train",
            "endpoint": "chat.completions", "method": "POST", "path": b"/v1/chat/completions",
            "request_headers": ((b"Host", b"127.0.0.1"), (b"Authorization", b"Bearer stw_x"),
                                (b"Content-Type", b"application/json")),
            "request_body": request, "request_is_json": True, "response_status": 200,
            "response_headers": ((b"content-type", b"text/event-stream"),),
            "response_body": answer, "response_truncated": None, "is_stream": True,
            "error": None, "routing": None, "t_request": 1.0, "t_first_byte": 1.1, "t_end": 1.2,
        })
    return out


def shipper_prep(record: dict) -> bytes:
    """The shipper's handling of one read record's bodies, whatever its format."""
    import orjson

    for key in ("request_body", "response_body"):
        value = record.get(key)
        if isinstance(value, str):
            base64.b64decode(value, validate=True)
    return orjson.dumps({"v": 1, **{
        k: base64.b64encode(v).decode() if isinstance(v, bytes) else record.get(k)
        for k, v in ((k, record.get(k)) for k in RAW_FIELDS)}})


def measure(root: Path) -> tuple[float, float, float]:
    sys.path.insert(0, str(root))
    import proxy.addon as addon
    from proxy.spool import SpoolWriter
    from wire.spool import read_batches

    master = os.urandom(32)
    with tempfile.TemporaryDirectory() as tmp:
        writer = SpoolWriter(Path(tmp) / "w", master, prepare=addon.spool_form)
        items = records(N)
        started = time.thread_time()
        encoded = [writer._encode(item) for item in items]
        write_s = time.thread_time() - started
        writer.close()
        spool = Path(tmp) / "r"
        spool.mkdir()
        (spool / f"seg-1-{os.getpid()}-1.log").write_bytes(b"".join(encoded))
        started = time.thread_time()
        read = [r for batch in read_batches(spool, master) for r in batch.records]
        for record in read:
            shipper_prep(record)
        read_s = time.thread_time() - started
        assert len(read) == N
    size = sum(len(e) for e in encoded) / N
    return write_s / N * 1e6, size, read_s / N * 1e6


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--one"]
    if "--one" in sys.argv:
        print(*measure(Path(args[0]).resolve()))
        return
    roots = [Path(a).resolve() for a in args] or [HERE.parents[2]]
    best: dict[Path, tuple[float, ...]] = {}
    for _ in range(ROUNDS):
        for root in roots:
            out = subprocess.run([sys.executable, str(HERE), str(root), "--one"], check=True,
                                 capture_output=True, text=True).stdout
            got = tuple(float(x) for x in out.split())
            best[root] = tuple(map(min, best[root], got)) if root in best else got
    print(f"per spool record (60-message request, 40-event SSE answer), best of {ROUNDS}:")
    print(f"{'checkout':<30}{'write µs CPU':>14}{'bytes on disk':>15}{'read+prep µs':>14}")
    for root in roots:
        w, size, r = best[root]
        print(f"{str(root)[-30:]:<30}{w:>14.1f}{size:>15.0f}{r:>14.1f}")


if __name__ == "__main__":
    main()
