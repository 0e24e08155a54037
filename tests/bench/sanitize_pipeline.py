"""Sanitizer pipeline lag: spooled calls -> real shipper -> Redis -> real Celery worker
(build_steps: decrypt, parse, sanitize in batches, write steps/findings/subject index).

    .venv/bin/python tests/bench/sanitize_pipeline.py [--rate 50] [--seconds 30]
        [--concurrency 2] [--session-steps 5] [--baseline /path/to/other/checkout]
        [--rounds 1]

`--baseline DIR` runs the same load against another checkout too (its own .venv, worker and
shipper; e.g. the main branch), alternating with this one (`--rounds` times each, the order
swapped every round), and prints both side by side: on a shared machine absolute lags drift
with the load, a comparison in one run does not. Besides the lags it reports the CPU seconds
the worker and the shipper spent per step (less sensitive to the machine's load than lags)
and the load average during the run.

Needs PostgreSQL (DATABASE_URL's server: a throwaway database `steward_bench_sanitize_<random>`
is created, migrated and dropped; no other database is touched) and Redis (CELERY_BROKER_URL,
a redis:// URL: every key the run creates carries a unique prefix — kombu's
`global_keyprefix`, set through a settings module written for the run — and only those keys
are deleted afterwards; nothing is flushed, and a worker of yours on the same Redis database
never sees the bench's tasks).

The load: `--rate` calls per second for `--seconds`, appended to a spool with the real
SpoolWriter exactly as the proxy does (t_request = the moment of appending), each call a
distinct request/response pair from the sanitizer evaluation corpus (tests/bench/corpus.py:
planted names, emails, phones, keys, tool arguments and results, chat / Responses /
completions; distinct, so that no cache of repeated strings flatters the figure beyond what
the corpus' own templates repeat), grouped into sessions of `--session-steps` calls. The
shipper (`manage.py ship_spool`, its default interval as in `steward up`) ships them, one
build_steps task per shipped batch; the worker (`celery worker -Q capture -c N --loglevel
INFO`, as `steward up` runs it, the sanitizer preloaded before the clock starts) builds the
steps, taking along other waiting interactions when it falls behind (adaptive batches, see
governance/tasks.py).

Lag of a call = its step's created_at - the call's t_request (proxy -> spool -> shipper ->
broker -> worker -> sanitized step committed). Target (issue 14): at 50 calls/s on 2 cores,
every call built and lag p95 < 5 s. Prints a table and one JSON line per run; the exit status
is 0 when every run of this checkout met the target.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[2]
TARGET_P95_S = 5.0


def with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def bodies(n_pairs: int) -> list[tuple[str, dict, dict]]:
    """`n_pairs` distinct (endpoint, request, response) triples from the corpus."""
    from tests.bench.corpus import generate

    cases = generate(2 * n_pairs, seed=11)
    return [(cases[i].endpoint, cases[i].body, cases[i + 1].body)
            for i in range(0, 2 * n_pairs, 2)]


def record(tenant_id: int, agent_id: int, endpoint: str, req: dict, resp: dict,
           trajectory_id: str, session: str) -> dict:
    t = time.time()
    path = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions",
            "responses": "/v1/responses"}[endpoint]
    return {
        "v": 1, "flow_id": uuid.uuid4().hex, "proxy_instance": "bench:0",
        "tenant_id": tenant_id, "agent_id": agent_id, "proxy_key_id": 1,
        "trajectory_id": trajectory_id, "trajectory_source": "session",
        "step_id": str(uuid.uuid4()), "session_id": session, "subject": f"user-{session}",
        "consent": "train", "endpoint": endpoint, "method": "POST", "path": path,
        "request_headers": [["content-type", "application/json"]],
        "request_body": base64.b64encode(json.dumps(req).encode()).decode(),
        "request_is_json": True, "response_status": 200,
        "response_headers": [["content-type", "application/json"]],
        "response_body": base64.b64encode(json.dumps(resp).encode()).decode(),
        "is_stream": False, "error": None,
        "t_request": t, "t_first_byte": t, "t_end": t,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its live descendants (the prefork pool)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total
    except psutil.NoSuchProcess:
        return 0.0


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """Terminate the run's processes (a worker with its pool), killing what outlives 20 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def drop_run_state(server: str, db_name: str | None, broker: str, prefix: str) -> None:
    """Drop the run's throwaway database (None: keep it) and delete its Redis keys (only
    those under the run's prefix)."""
    import psycopg
    import redis

    try:
        from django.db import connections

        connections.close_all()
    except Exception:  # noqa: BLE001 - django was never set up
        pass
    if db_name:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
    client = redis.Redis.from_url(broker)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)


SETTINGS_SHIM = """# Written by tests/bench/sanitize_pipeline.py for one run: the settings,
# with every Redis key of the run under its own prefix (nothing else there is touched).
from config.settings import *  # noqa: F403

CELERY_BROKER_TRANSPORT_OPTIONS = {{
    **globals().get("CELERY_BROKER_TRANSPORT_OPTIONS", {{}}),
    "global_keyprefix": {prefix!r},
}}
"""


def scenario(args: argparse.Namespace) -> dict:
    """One run against the checkout `args.repo` (this process runs with that checkout's
    interpreter and code). Returns the figures."""
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    py = repo / ".venv" / "bin" / "python"
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if not broker.startswith(("redis://", "rediss://")):
        raise SystemExit("CELERY_BROKER_URL must be a redis:// URL (your own Redis database)")
    server = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/steward")
    run_id = uuid.uuid4().hex[:12]
    db_name = f"steward_bench_sanitize_{run_id}"
    prefix = f"steward-bench-{run_id}:"
    tmp = Path(tempfile.mkdtemp(prefix="steward-bench-sanitize-"))
    (tmp / "steward_bench_settings.py").write_text(SETTINGS_SHIM.format(prefix=prefix))
    env = {**os.environ, "DATABASE_URL": with_db(server, db_name),
           "STEWARD_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
           "STEWARD_VAR_DIR": str(tmp / "var"),
           "DJANGO_SETTINGS_MODULE": "steward_bench_settings",
           "PYTHONPATH": f"{repo}{os.pathsep}{tmp}"}
    for name in ("DATABASE_OWNER_URL", "STEWARD_TEST_DATABASE", "STEWARD_MASTER_KEY_FILE"):
        env.pop(name, None)

    import psycopg

    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')  # fails rather than reuse a database
    procs: list[subprocess.Popen] = []
    keep_logs = True  # until the run completes: the worker's and shipper's logs stay in tmp
    try:
        subprocess.run([str(py), "manage.py", "migrate", "-v", "0"], cwd=repo, env=env,
                       check=True)
        os.environ.update({k: env[k] for k in ("DATABASE_URL", "STEWARD_MASTER_KEY",
                                               "STEWARD_VAR_DIR", "DJANGO_SETTINGS_MODULE")})
        sys.path.insert(0, str(tmp))
        os.environ.pop("STEWARD_MASTER_KEY_FILE", None)
        import django

        django.setup()
        from django.db import connection

        from governance.keyring import master_key
        from governance.services import create_tenant, ensure_agent
        from proxy.spool import SpoolWriter

        tenant = create_tenant("system:bench", "bench", "Bench")[0]
        agent = ensure_agent("system:bench", tenant, "bench-agent")
        spool = tmp / "spool"
        worker_log = open(tmp / "worker.log", "wb")  # noqa: SIM115 (closed with the worker)
        worker = subprocess.Popen(
            [str(py), "-m", "celery", "-A", "config", "worker", "-Q", "capture", "-c",
             str(args.concurrency), "--without-gossip", "--without-mingle",
             "--without-heartbeat", "--loglevel", args.loglevel, "-n",
             f"bench-{run_id}@%h"],
            cwd=repo, env=env, stdout=worker_log, stderr=subprocess.STDOUT)
        procs.append(worker)
        shipper = subprocess.Popen(
            [str(py), "manage.py", "ship_spool", "--interval", str(args.ship_interval),
             "--spool-dir", str(spool)], cwd=repo, env=env,
            stdout=open(tmp / "shipper.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
        procs.append(shipper)

        pairs = [tuple(p) for p in json.loads(Path(args.bodies).read_text())]
        writer = SpoolWriter(spool, master_key(), batch_ms=20)

        def count(sql: str) -> int:
            with connection.cursor() as cur:
                cur.execute(sql)
                return int(cur.fetchone()[0])

        # Warm-up (not measured): the worker is up, its sanitizer loaded, the path works. One
        # call per pool process, a shipper pass apart, so each process (busy with the one
        # before) takes one: a process whose first batch pays for lazy loading would skew the
        # figure (a checkout that warms its pool before forking needs no such help; what a
        # cold process costs shows in `warmup_s`).
        t0 = time.monotonic()
        ep, req, resp = pairs[0]
        for _ in range(args.concurrency):
            writer.append(record(tenant.pk, agent.pk, ep, req, resp, str(uuid.uuid4()),
                                 "warm"))
            time.sleep(args.ship_interval * 2)
        while count("SELECT count(*) FROM governance_step") < args.concurrency:
            if time.monotonic() - t0 > 300 or any(p.poll() is not None for p in procs):
                raise SystemExit("warm-up failed; see " + str(tmp))
            time.sleep(0.2)
        warm_s = time.monotonic() - t0
        with connection.cursor() as cur:
            for table in ("subjectindex", "finding", "step", "interaction"):
                cur.execute(f"DELETE FROM governance_{table}")  # noqa: S608

        # The load.
        total = int(args.rate * args.seconds)
        if len(pairs) < total + 1:
            raise SystemExit(f"{len(pairs)} bodies for {total} calls")
        cpu0 = {"worker": cpu_seconds(worker.pid), "shipper": cpu_seconds(shipper.pid)}
        start = time.monotonic()
        traj = str(uuid.uuid4())
        session = "s0"
        load = [os.getloadavg()[0]]
        for i in range(total):
            due = start + i / args.rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if i % args.session_steps == 0:
                traj, session = str(uuid.uuid4()), f"s{i}"
            ep, req, resp = pairs[1 + i]
            writer.append(record(tenant.pk, agent.pk, ep, req, resp, traj, session))
            if i % int(args.rate) == 0:
                load.append(os.getloadavg()[0])
        produced_s = time.monotonic() - start
        deadline = time.monotonic() + args.drain_timeout
        while True:
            done = count("SELECT count(*) FROM governance_interaction "
                         "WHERE state <> 'captured'")
            if done >= total or time.monotonic() > deadline:
                break
            load.append(os.getloadavg()[0])
            time.sleep(0.25)
        drained_s = time.monotonic() - start
        cpu = {k: cpu_seconds(p.pid) - cpu0[k]
               for k, p in (("worker", worker), ("shipper", shipper))}
        writer.close()

        with connection.cursor() as cur:
            cur.execute("SELECT extract(epoch FROM s.created_at - i.started_at), "
                        "extract(epoch FROM i.shipped_at - i.started_at) "
                        "FROM governance_step s JOIN governance_interaction i "
                        "ON i.id = s.interaction_id JOIN governance_trajectory t "
                        "ON t.id = i.trajectory_id WHERE t.session_id <> 'warm'")
            rows = cur.fetchall()
            lags = [float(r[0]) for r in rows]
            ship_lags = [float(r[1]) for r in rows]
            cur.execute("SELECT count(*) FROM governance_interaction "
                        "WHERE state = 'quarantined'")
            quarantined = int(cur.fetchone()[0])
            cur.execute("SELECT coalesce(sum(total), 0), count(DISTINCT step_id) "
                        "FROM governance_finding")
            n_findings, steps_with = cur.fetchone()
            cur.execute("SELECT count(*), count(interaction_id) FROM governance_step")
            steps_total, steps_linked = cur.fetchone()
            cur.execute("SELECT count(*) FROM governance_auditevent "
                        "WHERE action = 'capture.steps_built'")
            tasks = int(cur.fetchone()[0])
        retries = (tmp / "worker.log").read_text(errors="replace").count("Retry in")
        keep_logs = False
        steps = max(1, len(lags))
        return {
            "rate": args.rate, "seconds": args.seconds, "concurrency": args.concurrency,
            "calls": total, "steps": len(lags), "steps_total": steps_total,
            "steps_linked": steps_linked, "quarantined": quarantined,
            "lag_p50_s": round(statistics.median(lags), 3) if lags else None,
            "lag_p95_s": round(percentile(lags, 95), 3) if lags else None,
            "lag_max_s": round(max(lags), 3) if lags else None,
            # Of which: until the shipper committed the interaction (spool -> PostgreSQL).
            "ship_lag_p50_s": round(statistics.median(ship_lags), 3) if lags else None,
            "ship_lag_p95_s": round(percentile(ship_lags, 95), 3) if lags else None,
            "produce_s": round(produced_s, 1), "drained_s": round(drained_s, 1),
            "worker_cpu_ms_per_step": round(1000 * cpu["worker"] / steps, 1),
            "shipper_cpu_ms_per_step": round(1000 * cpu["shipper"] / steps, 1),
            "build_batches": tasks, "retries": retries, "findings": n_findings,
            "steps_with_findings": steps_with, "warmup_s": round(warm_s, 1),
            "load_avg_1m_mean": round(statistics.mean(load), 2),
            "load_avg_1m_max": round(max(load), 2), "cpus": os.cpu_count(),
        }
    finally:
        stop_processes(procs)
        drop_run_state(server, db_name, broker, prefix)
        if keep_logs:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def alternating(repo: Path, baseline: str | None, rounds: int) -> list[tuple[str, Path]]:
    """The runs of a comparison: ("this", repo) — and ("baseline", baseline) before it —
    `rounds` times, the order swapped every round."""
    checkouts = [("this", repo)]
    if baseline:
        checkouts = [("baseline", Path(baseline).resolve()), ("this", repo)]
    order: list[tuple[str, Path]] = []
    for r in range(rounds):
        order += checkouts if r % 2 == 0 else checkouts[::-1]
    return order


def met(result: dict) -> bool:
    return (result["steps"] + result["quarantined"] >= result["calls"]
            and (result["lag_p95_s"] or 1e9) < TARGET_P95_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=50.0, help="calls per second")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=2, help="worker processes")
    ap.add_argument("--session-steps", type=int, default=5)
    ap.add_argument("--drain-timeout", type=float, default=180.0)
    ap.add_argument("--ship-interval", type=float, default=0.5,
                    help="shipper poll interval (manage.py ship_spool default: 0.5)")
    ap.add_argument("--loglevel", default="INFO", help="worker log level (steward up: INFO)")
    ap.add_argument("--baseline", help="another checkout to run the same load against")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each checkout")
    ap.add_argument("--scenario", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repo", default=str(REPO), help=argparse.SUPPRESS)
    ap.add_argument("--bodies", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.scenario:
        print(json.dumps(scenario(args)), flush=True)
        return 0

    sys.path.insert(0, str(REPO))
    total = int(args.rate * args.seconds)
    tmp = Path(tempfile.mkdtemp(prefix="steward-bench-bodies-"))
    body_file = tmp / "bodies.json"
    body_file.write_text(json.dumps(bodies(total + 1)))
    order = alternating(REPO, args.baseline, args.rounds)
    passthrough = ["--rate", str(args.rate), "--seconds", str(args.seconds),
                   "--concurrency", str(args.concurrency),
                   "--session-steps", str(args.session_steps),
                   "--drain-timeout", str(args.drain_timeout),
                   "--ship-interval", str(args.ship_interval), "--loglevel", args.loglevel]
    results: list[tuple[str, dict]] = []
    try:
        for label, repo in order:
            py = repo / ".venv" / "bin" / "python"
            out = subprocess.run(
                [str(py), str(Path(__file__).resolve()), "--scenario", "--repo", str(repo),
                 "--bodies", str(body_file), *passthrough],
                cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, check=True,
                stdout=subprocess.PIPE, text=True).stdout
            result = {"checkout": label, "repo": str(repo),
                      **json.loads(out.strip().splitlines()[-1])}
            results.append((label, result))
            print(json.dumps(result), flush=True)
    finally:
        body_file.unlink(missing_ok=True)
        tmp.rmdir()
    print(f"{'checkout':>9} {'calls/s':>7} {'calls':>6} {'steps':>6} {'p50 s':>7} "
          f"{'p95 s':>7} {'max s':>7} {'drain s':>7} {'cpu ms/step':>11} {'batches':>7} "
          f"{'load':>5}")
    for label, r in results:
        print(f"{label:>9} {r['rate']:>7.0f} {r['calls']:>6} {r['steps']:>6} "
              f"{r['lag_p50_s']!s:>7} {r['lag_p95_s']!s:>7} {r['lag_max_s']!s:>7} "
              f"{r['drained_s']:>7} {r['worker_cpu_ms_per_step']:>11} "
              f"{r['build_batches']:>7} {r['load_avg_1m_mean']:>5}")
    return 0 if all(met(r) for label, r in results if label == "this") else 1


if __name__ == "__main__":
    sys.exit(main())
