"""CPU per built step, in process: what the capture worker spends in `build_group` (decrypt,
parse, sanitize, write) per step, measured with time.process_time, with an optional cProfile.

    .venv/bin/python -m tests.bench.step_cpu [--calls 300] [--sessions 4] [--session-calls 20]
        [--window-kb 0] [--batch 25] [--baseline /path/to/other/checkout] [--rounds 1]
        [--profile [--sort tottime] [--top 40] [--pstats FILE]]

The load: `--calls` distinct one-off calls of the sanitizer evaluation corpus
(tests/bench/corpus.py, sessions of 5 like tests/bench/sanitize_pipeline.py) and `--sessions`
long sessions of `--session-calls` calls shaped like tests/bench/long_sessions.py's (the whole
conversation resent with every call, ~`--new-kb` of PII-dense tool output new per call). They
are written to a spool with the real SpoolWriter, shipped with the real Shipper (deltas
included), then built with `governance.tasks.build_group` in batches of `--batch` interactions
in spool order (one transaction each, as build_steps runs it; no coalescing, so every checkout
builds the same batches). The sanitizer is loaded and warmed up as a worker does when it
starts (`governance.tasks._preload_sanitizer`), then once more for the tenant, before the
clock starts. Only the build is timed: CPU seconds of this process (user + system;
PostgreSQL's own CPU is not in it), so a busy shared machine moves the figure little.

Everything is deterministic: a fixed master key, fixed ids and times, so two checkouts (or two
rounds of one) in the same run build the same rows. Only within a run: the calls are
generated once per run, and the corpus has dates relative to now, so separate runs differ.
`output sha256` is a digest of the stored steps, findings, conversation items, subject-index
rows and placeholder deltas (every column but creation times): a change meant to preserve
behaviour must leave it unchanged.

`--baseline DIR` runs another checkout (its own .venv, or this one's when it has none) in the
same run, alternating with this one `--rounds` times (order swapped each round), and prints
both side by side; the exit status is 1 when their outputs differ. `--profile` runs
cProfile around the build (slower: its ms/step are not
comparable with unprofiled runs) and prints the top functions.

Needs PostgreSQL (DATABASE_URL's server): a throwaway database `steward_bench_stepcpu_<random>`
is created (through the server's `postgres` maintenance database), migrated and dropped per
run; no other database is touched. No Redis, no worker.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A bench-only master key (fixed, so placeholder labels and subject hashes repeat run to run).
BENCH_MASTER_KEY = base64.b64encode(hashlib.sha256(b"steward step_cpu bench").digest()).decode()
T0 = datetime(2026, 11, 2, 9, 0, tzinfo=UTC).timestamp()
PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses"}
# Columns left out of the output digest: when a row was written, not what it holds.
VOLATILE = {"created_at", "updated_at", "shipped_at"}
DIGEST_TABLES = ("step", "finding", "conversationitem", "subjectindex", "placeholderdelta")


def _record(rng: random.Random, i: int, tenant_id: int, agent_id: int, endpoint: str,
            req: dict, resp: dict, trajectory_id: str, session: str) -> dict:
    t = T0 + i * 0.02
    return {
        "v": 1, "flow_id": uuid.UUID(int=rng.getrandbits(128)).hex, "proxy_instance": "bench:0",
        "tenant_id": tenant_id, "agent_id": agent_id, "proxy_key_id": 1,
        "trajectory_id": trajectory_id, "trajectory_source": "session",
        "step_id": str(uuid.UUID(int=rng.getrandbits(128))), "session_id": session,
        "subject": f"user-{session}", "consent": "train", "endpoint": endpoint,
        "method": "POST", "path": PATHS[endpoint],
        "request_headers": [["content-type", "application/json"]],
        "request_body": base64.b64encode(json.dumps(req).encode()).decode(),
        "request_is_json": True, "response_status": 200,
        "response_headers": [["content-type", "application/json"]],
        "response_body": base64.b64encode(json.dumps(resp).encode()).decode(),
        "is_stream": False, "error": None, "t_request": t, "t_first_byte": t, "t_end": t + 0.01,
    }


def calls(args: argparse.Namespace) -> list[tuple[str, dict, dict, str]]:
    """(endpoint, request, response, session) of every call, in spool order: the one-off
    corpus calls and the long sessions' calls interleaved (as concurrent agents would)."""
    from tests.bench import long_sessions
    from tests.bench.corpus import generate
    from tests.bench.long_sessions import assistant_for, request_messages, script

    long_sessions.WINDOW_KB = args.window_kb  # read by request_messages
    cases = generate(2 * args.calls, seed=11)
    oneoff = [(cases[i].endpoint, cases[i].body, cases[i + 1].body, f"c{i // 10}")
              for i in range(0, 2 * args.calls, 2)]
    sessions = []
    for s in range(args.sessions):
        turns = script(100 + s, args.session_calls, int(args.new_kb * 1024))
        out = []
        for k in range(len(turns)):
            reply = assistant_for(turns[k][-1])
            resp = {"id": f"chatcmpl-{s}-{k}", "object": "chat.completion", "created": 1,
                    "model": "bench-model", "choices": [{"index": 0, "message": reply,
                                                         "finish_reason": "tool_calls"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
            out.append(("chat.completions", {"model": "bench-model",
                                             "messages": request_messages(turns, k, "session")},
                        resp, f"long{s}"))
        sessions.append(out)
    order: list[tuple[str, dict, dict, str]] = []
    n_sess = sum(len(s) for s in sessions)
    total = len(oneoff) + n_sess
    # Spread the session calls evenly through the one-off ones.
    si = 0
    flat = [c for k in range(args.session_calls) for s in sessions if k < len(s) for c in [s[k]]]
    for j in range(total):
        if si < len(flat) and (j * n_sess) // total >= si:
            order.append(flat[si])
            si += 1
        elif oneoff:
            order.append(oneoff.pop(0))
    return order + oneoff + flat[si:]


# A step's columns stored packed (decision 60: bytea, hex in row_to_json), read as the JSON
# values they hold, so a checkout that stores them as JSONB builds the same digest.
PACKED_STEP_COLUMNS = ("action", "usage", "timings", "versions")


def unpacked(table: str, row: dict) -> dict:
    if table == "conversationitem":
        # The value, not its bytes: items are zlib'd (0033) or packed against a dictionary
        # (0037), and two checkouts that store the same value in two formats agree here.
        value = row.get("content")
        if isinstance(value, str) and value.startswith("\\x"):
            from governance import models

            field = getattr(models, "ItemJSONField", None) or models.PackedJSONField
            row["content"] = field.unpack(bytes.fromhex(value[2:]))
        return row
    if table != "step":
        return row
    for column in PACKED_STEP_COLUMNS:
        value = row.get(column)
        if isinstance(value, str) and value.startswith("\\x"):
            # Only a checkout that packs them has the field (a baseline's are JSONB).
            from governance.models import StepJSONField

            row[column] = StepJSONField.unpack(bytes.fromhex(value[2:]))
    return row


def digest_output() -> tuple[str, dict[str, int]]:
    from django.db import connection

    h = hashlib.sha256()
    counts: dict[str, int] = {}
    with connection.cursor() as cur:
        for table in DIGEST_TABLES:
            cur.execute(f"SELECT row_to_json(t)::text FROM governance_{table} t")  # noqa: S608
            rows = []
            for (text,) in cur.fetchall():
                row = unpacked(table, json.loads(text))
                rows.append(json.dumps({k: v for k, v in row.items() if k not in VOLATILE},
                                       sort_keys=True))
            rows.sort()
            counts[table] = len(rows)
            if os.environ.get("STEP_CPU_DUMP"):
                Path(os.environ["STEP_CPU_DUMP"] + f".{table}").write_text("\n".join(rows))
            h.update(table.encode() + b"\0")
            for r in rows:
                h.update(r.encode() + b"\n")
    return h.hexdigest(), counts


def scenario(args: argparse.Namespace) -> dict:
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    from tests.bench.sanitize_pipeline import with_db

    py = _python(repo)
    server = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/steward")
    run_id = uuid.uuid4().hex[:12]
    db_name = f"steward_bench_stepcpu_{run_id}"
    tmp = Path(tempfile.mkdtemp(prefix="steward-bench-stepcpu-"))
    env = {**os.environ, "DATABASE_URL": with_db(server, db_name),
           "STEWARD_MASTER_KEY": BENCH_MASTER_KEY, "STEWARD_VAR_DIR": str(tmp / "var"),
           "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(repo)}
    for name in ("DATABASE_OWNER_URL", "STEWARD_TEST_DATABASE", "STEWARD_MASTER_KEY_FILE"):
        env.pop(name, None)
    import psycopg

    with psycopg.connect(with_db(server, "postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    try:
        subprocess.run([str(py), "manage.py", "migrate", "-v", "0"], cwd=repo, env=env,
                       check=True)
        os.environ.clear()
        os.environ.update(env)
        import logging

        import django

        django.setup()
        logging.disable(logging.WARNING)
        from django.db import transaction

        from governance.capture.shipper import Shipper
        from governance.keyring import master_key
        from governance.services import create_tenant, ensure_agent
        from governance.tasks import _WARM_UP_BODY, _preload_sanitizer, build_group
        from proxy.spool import SpoolWriter

        tenant = create_tenant("system:bench", "bench", "Bench")[0]
        agent = ensure_agent("system:bench", tenant, "bench-agent")
        rng = random.Random(7)
        spool = tmp / "spool"
        writer = SpoolWriter(spool, master_key(), batch_ms=5)
        trajectories: dict[str, str] = {}
        all_calls = ([tuple(c) for c in json.loads(Path(args.bodies).read_text())]
                     if args.bodies else calls(args))
        for i, (ep, req, resp, session) in enumerate(all_calls):
            traj = trajectories.setdefault(session, str(uuid.UUID(int=rng.getrandbits(128))))
            writer.append(_record(rng, i, tenant.pk, agent.pk, ep, req, resp, traj, session))
        writer.close()
        ids: list[int] = []
        Shipper(spool, master_key=master_key(), enqueue=ids.extend).ship_once()
        from governance.models import Interaction
        from governance.tenancy import tenant_context

        with tenant_context(tenant.pk):
            order = dict(Interaction.objects.filter(pk__in=ids)
                         .values_list("pk", "started_at"))
        ids.sort(key=lambda pk: (order[pk], pk))

        from governance.sanitizing import sanitizer_for_tenant

        # As a worker starts (its worker_init hook), then the tenant's sanitizer once.
        _preload_sanitizer()
        sanitizer_for_tenant(tenant).sanitize_bodies([("request", _WARM_UP_BODY)])
        import gc

        gc_cpu = [0.0, 0.0, [0, 0, 0]]  # total, started at, collections per generation

        def gc_clock(phase: str, info: dict) -> None:
            if phase == "start":
                gc_cpu[1] = time.process_time()
            else:
                gc_cpu[0] += time.process_time() - gc_cpu[1]
                gc_cpu[2][info["generation"]] += 1

        gc.callbacks.append(gc_clock)
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
        batches = [ids[i:i + args.batch] for i in range(0, len(ids), args.batch)]
        built = quarantined = 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profiler:
            profiler.enable()
        for chunk in batches:
            with transaction.atomic():
                done = build_group(tenant.pk, chunk, "", coalesce=False)
            built += len(done["built"])
            quarantined += len(done["quarantined"])
        if profiler:
            profiler.disable()
        cpu = time.process_time() - cpu0
        gc.callbacks.remove(gc_clock)
        wall = time.perf_counter() - wall0
        digest, counts = digest_output()
        result = {"calls": len(all_calls), "built": built, "quarantined": quarantined,
                  "batches": len(batches), "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
                  "cpu_ms_per_step": round(1000 * cpu / max(1, built), 2),
                  "gc_cpu_s": round(gc_cpu[0], 2), "gc_collections": gc_cpu[2],
                  "gc_tracked": len(gc.get_objects()), "profiled": bool(profiler),
                  "rows": counts, "output_sha256": digest}
        if profiler:
            import io
            import pstats

            if args.pstats:
                profiler.dump_stats(args.pstats)
            buf = io.StringIO()
            stats = pstats.Stats(profiler, stream=buf)
            stats.sort_stats(args.sort).print_stats(args.top)
            print(buf.getvalue(), file=sys.stderr)
        return result
    finally:
        try:
            from django.db import connections

            connections.close_all()
        except Exception:  # noqa: BLE001 - django was never set up
            pass
        with psycopg.connect(with_db(server, "postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        shutil.rmtree(tmp, ignore_errors=True)


def _python(repo: Path) -> Path:
    own = repo / ".venv" / "bin" / "python"
    return own if own.exists() else REPO / ".venv" / "bin" / "python"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="CPU ms per built step (governance.tasks.build_group), in process, on a "
                    "throwaway database; optionally against another checkout and with "
                    "cProfile. See the module docstring.")
    ap.add_argument("--calls", type=int, default=300, help="one-off corpus calls (default 300)")
    ap.add_argument("--sessions", type=int, default=4, help="long sessions (default 4)")
    ap.add_argument("--session-calls", type=int, default=20,
                    help="calls per long session (default 20)")
    ap.add_argument("--new-kb", type=float, default=3.0,
                    help="new content per long-session call, KB (default 3)")
    ap.add_argument("--window-kb", type=float, default=0,
                    help="long-session requests carry at most this many KB of messages, the "
                         "oldest turns after the first user message dropped (long_sessions.py's "
                         "--window-kb; default 0: the whole history)")
    ap.add_argument("--batch", type=int, default=25,
                    help="interactions per build_group call (default 25: the shipper's batch "
                         "at 50 calls/s and its 0.5 s interval)")
    ap.add_argument("--baseline", help="another checkout to measure in the same run")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each checkout")
    ap.add_argument("--profile", action="store_true", help="cProfile the build, print top")
    ap.add_argument("--sort", default="tottime", help="pstats sort key (default tottime)")
    ap.add_argument("--top", type=int, default=40, help="functions printed (default 40)")
    ap.add_argument("--pstats", help="also write the profile to this file")
    ap.add_argument("--scenario", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repo", default=str(REPO), help=argparse.SUPPRESS)
    ap.add_argument("--bodies", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scenario:
        print(json.dumps(scenario(args)), flush=True)
        return 0
    from tests.bench.sanitize_pipeline import alternating

    order = alternating(REPO, args.baseline, args.rounds)
    passthrough = ["--calls", str(args.calls), "--sessions", str(args.sessions),
                   "--session-calls", str(args.session_calls), "--new-kb", str(args.new_kb),
                   "--batch", str(args.batch), "--sort", args.sort, "--top", str(args.top)]
    if args.profile:
        passthrough.append("--profile")
    if args.pstats:
        passthrough += ["--pstats", str(Path(args.pstats).resolve())]
    # The calls are generated once, here: the corpus has dates relative to now, and every
    # checkout of the run must build the same bodies.
    sys.path.insert(0, str(REPO))
    tmp = Path(tempfile.mkdtemp(prefix="steward-bench-stepcpu-bodies-"))
    body_file = tmp / "calls.json"
    body_file.write_text(json.dumps(calls(args)))
    passthrough += ["--bodies", str(body_file)]
    results = []
    try:
        results = _run_all(order, passthrough)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'checkout':>9} {'steps':>6} {'quar':>5} {'cpu s':>7} {'wall s':>7} "
          f"{'cpu ms/step':>11}  output sha256")
    for r in results:
        print(f"{r['checkout']:>9} {r['built']:>6} {r['quarantined']:>5} {r['cpu_s']:>7} "
              f"{r['wall_s']:>7} {r['cpu_ms_per_step']:>11}  {r['output_sha256'][:16]}")
    same = len({r["output_sha256"] for r in results}) == 1
    print("outputs identical" if same else "OUTPUTS DIFFER")
    return 0 if same else 1


def _run_all(order: list[tuple[str, Path]], passthrough: list[str]) -> list[dict]:
    results = []
    for label, repo in order:
        out = subprocess.run(
            [str(_python(repo)), str(Path(__file__).resolve()), "--scenario", "--repo",
             str(repo), *passthrough], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
            check=True, stdout=subprocess.PIPE, text=True).stdout
        result = {"checkout": label, "repo": str(repo),
                  **json.loads(out.strip().splitlines()[-1])}
        results.append(result)
        print(json.dumps(result), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
