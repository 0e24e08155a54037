"""Sanitizer pipeline lag: spooled calls -> real shipper -> Redis -> real Celery worker
(build_steps: decrypt, parse, sanitize in batches, write steps/findings/subject index).

    .venv/bin/python tests/bench/sanitize_pipeline.py [--rate 50] [--seconds 30]
        [--concurrency 2] [--session-steps 5]

Needs PostgreSQL (DATABASE_URL, default postgresql://postgres@127.0.0.1:5432/steward: a
throwaway database `steward_bench_sanitize_<pid>` is created, migrated and dropped) and Redis
(CELERY_BROKER_URL, default redis://127.0.0.1:6379/13: its own Redis database, flushed).

The load: `--rate` calls per second for `--seconds`, appended to a spool with the real
SpoolWriter exactly as the proxy does (t_request = the moment of appending), bodies from the
sanitizer evaluation corpus (tests/bench/corpus.py: planted names, emails, phones, keys, tool
arguments and results, chat / Responses / completions), grouped into sessions of
`--session-steps` calls. The shipper (`manage.py ship_spool`, its default interval as in
`steward up`) ships them, one build_steps task per shipped batch; the worker
(`celery worker -Q capture -c N`, the sanitizer preloaded before the clock starts) builds the
steps, taking along other waiting interactions when it falls behind (adaptive batches of up
to 64, see governance/tasks.py).

Lag of a call = its step's created_at - the call's t_request (proxy -> spool -> shipper ->
broker -> worker -> sanitized step committed). Target (issue 3): at 50 calls/s on 2 cores,
p95 < 5 s. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[2]
PY = REPO / ".venv" / "bin" / "python"
sys.path.insert(0, str(REPO))


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
    from tests.bench.corpus import generate

    cases = generate(n_pairs, seed=11)
    return [(cases[i].endpoint, cases[i].body, cases[i + 1].body)
            for i in range(0, len(cases) - 1, 2)]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=50.0, help="calls per second")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=2, help="worker processes")
    ap.add_argument("--session-steps", type=int, default=5)
    ap.add_argument("--drain-timeout", type=float, default=180.0)
    ap.add_argument("--ship-interval", type=float, default=0.5,
                    help="shipper poll interval (manage.py ship_spool default: 0.5)")
    args = ap.parse_args(argv)

    server = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/steward")
    broker = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/13")
    db_name = f"steward_bench_sanitize_{os.getpid()}"
    db_url = with_db(server, db_name)
    env = {**os.environ, "DATABASE_URL": db_url, "CELERY_BROKER_URL": broker,
           "STEWARD_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
           "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(REPO)}
    env.pop("DATABASE_OWNER_URL", None)
    env.pop("STEWARD_TEST_DATABASE", None)

    import psycopg
    import redis

    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db_name}"')
    redis.Redis.from_url(broker).flushdb()
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="steward-bench-sanitize-"))
    try:
        subprocess.run([str(PY), "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env,
                       check=True)
        os.environ.update({k: env[k] for k in ("DATABASE_URL", "CELERY_BROKER_URL",
                                               "STEWARD_MASTER_KEY",
                                               "DJANGO_SETTINGS_MODULE")})
        import django

        django.setup()
        from django.db import connection

        from governance.keyring import master_key
        from governance.services import create_tenant, ensure_agent
        from proxy.spool import SpoolWriter

        tenant = create_tenant("system:bench", "bench", "Bench")[0]
        agent = ensure_agent("system:bench", tenant, "bench-agent")
        spool = tmp / "spool"
        worker_log = open(tmp / "worker.log", "wb")
        procs.append(subprocess.Popen(
            [str(PY), "-m", "celery", "-A", "config", "worker", "-Q", "capture", "-c",
             str(args.concurrency), "--without-gossip", "--without-mingle",
             "--without-heartbeat", "-l", "warning", "-n", f"bench-{os.getpid()}@%h"],
            cwd=REPO, env=env, stdout=worker_log, stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen(
            [str(PY), "manage.py", "ship_spool", "--interval", str(args.ship_interval),
             "--spool-dir",
             str(spool)], cwd=REPO, env=env, stdout=open(tmp / "shipper.log", "wb"),
            stderr=subprocess.STDOUT))

        pairs = bodies(400)
        writer = SpoolWriter(spool, master_key(), batch_ms=20)

        def count(sql: str) -> int:
            with connection.cursor() as cur:
                cur.execute(sql)
                return int(cur.fetchone()[0])

        # Warm-up (not measured): the worker is up, its sanitizer loaded, the path works.
        t0 = time.monotonic()
        ep, req, resp = pairs[0]
        writer.append(record(tenant.pk, agent.pk, ep, req, resp, str(uuid.uuid4()), "warm"))
        while count("SELECT count(*) FROM governance_step") < 1:
            if time.monotonic() - t0 > 300 or any(p.poll() is not None for p in procs):
                raise SystemExit("warm-up failed; see " + str(tmp))
            time.sleep(0.2)
        warm_s = time.monotonic() - t0
        with connection.cursor() as cur:
            for table in ("subjectindex", "finding", "step", "interaction"):
                cur.execute(f"DELETE FROM governance_{table}")  # noqa: S608

        # The load.
        total = int(args.rate * args.seconds)
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
            ep, req, resp = pairs[1 + i % (len(pairs) - 1)]
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
            cur.execute("SELECT count(*), count(DISTINCT step_id) FROM governance_finding")
            n_findings, steps_with = cur.fetchone()
            cur.execute("SELECT count(*), count(interaction_id) FROM governance_step")
            steps_total, steps_linked = cur.fetchone()
            cur.execute("SELECT count(*) FROM governance_auditevent "
                        "WHERE action = 'capture.steps_built'")
            tasks = int(cur.fetchone()[0])
        retries = (tmp / "worker.log").read_text(errors="replace").count("Retry in")
        result = {
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
            "build_batches": tasks, "retries": retries, "findings": n_findings,
            "steps_with_findings": steps_with, "warmup_s": round(warm_s, 1),
            "load_avg_1m_mean": round(statistics.mean(load), 2), "cpus": os.cpu_count(),
        }
        print(f"{'calls/s':>8} {'calls':>6} {'steps':>6} {'p50 s':>7} {'p95 s':>7} "
              f"{'max s':>7} {'batches':>8} {'load':>5}")
        print(f"{args.rate:>8.0f} {total:>6} {len(lags):>6} {result['lag_p50_s']:>7} "
              f"{result['lag_p95_s']:>7} {result['lag_max_s']:>7} {tasks:>8} "
              f"{result['load_avg_1m_mean']:>5}")
        print(json.dumps(result))
        ok = len(lags) + quarantined >= total and (result["lag_p95_s"] or 1e9) < 5.0
        return 0 if ok else 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        try:
            from django.db import connections

            connections.close_all()
        except Exception:  # django was never set up
            pass
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        redis.Redis.from_url(broker).flushdb()


if __name__ == "__main__":
    sys.exit(main())
