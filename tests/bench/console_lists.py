"""Console benchmark: server time of the console's pages on a tenant with 100,000 trajectories.

    .venv/bin/python tests/bench/console_lists.py [--trajectories 100000] [--requests 30] [--keep]

Needs PostgreSQL (DATABASE_URL, default postgresql://postgres@127.0.0.1:5432/steward): a database
`steward_bench_console` is created and migrated (kept with --keep, and then reused if it already
holds the data). Seeding goes through the ORM's bulk_create (so it follows the models): one
tenant with 5 agents; N trajectories, one interaction and one step each (2 % captured-not-built,
0.5 % quarantined), a final reward on every other trajectory, N audit events, 500 erasure
requests, 60 datasets with frozen versions, 200 training jobs with 100 metric rows each and
their checkpoints; a second tenant with 1,000 trajectories (another tenant's rows exist, as in
production). Then ANALYZE.

Measured: Django's test client in this process, as the tenant's compliance officer (the role that
sees most pages) and, for launch forms, the admin — i.e. the full request through middleware,
views, templates and the database, every scope under the NOBYPASSRLS app role as in production,
without network. Each page: 3 warm-up requests, then --requests timed ones; p50 / p95 / max ms.
Target (issue 5): p95 under 300 ms for the list pages. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[2]
PY = REPO / ".venv" / "bin" / "python"
sys.path.insert(0, str(REPO))
APP_ROLE = "steward_app"
DB_NAME = "steward_bench_console"
BATCH = 5_000


def with_db(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


def seed(n: int) -> dict[str, int]:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.utils import timezone

    from governance import services as gov
    from governance.models import (
        AuditEvent,
        Dataset,
        DatasetVersion,
        ErasureRequest,
        Interaction,
        PendingInteraction,
        Reward,
        Step,
        Trajectory,
    )

    tenant = gov.create_tenant("system:bench", "bench", "Bench Bank")[0]
    other = gov.create_tenant("system:bench", "other", "Other Corp")[0]
    agents = [gov.ensure_agent("system:bench", tenant, f"agent-{i}") for i in range(5)]
    other_agent = gov.ensure_agent("system:bench", other, "their-agent")
    for role in ("admin", "steward", "compliance", "auditor"):
        gov.ensure_member("system:bench", tenant, f"bench-{role}", role, password="x" * 16)
    now = timezone.now()

    def make(tenant_obj, agent_list, count: int, prefix: str) -> None:
        for start in range(0, count, BATCH):
            trajs, ias, steps, rewards = [], [], [], []
            pending: list[tuple[Interaction, str]] = []
            for i in range(start, min(count, start + BATCH)):
                t_at = now - timedelta(seconds=(count - i) * 20)
                agent = agent_list[i % len(agent_list)]
                tid = uuid.uuid4()
                trajs.append(Trajectory(
                    id=tid, tenant=tenant_obj, agent=agent, session_id=f"{prefix}-s{i}",
                    source="session", subject_hash=f"{i % 997:064x}", started_at=t_at,
                    last_step_at=t_at, step_count=1))
                state = (Interaction.State.QUARANTINED if i % 200 == 7 else
                         Interaction.State.CAPTURED if i % 50 == 3 else
                         Interaction.State.PROCESSED)
                sid = uuid.uuid4()
                ias.append(Interaction(
                    flow_id=f"{prefix}-f{i}", tenant=tenant_obj, agent=agent, trajectory_id=tid,
                    step_id=sid, endpoint="chat.completions", method="POST",
                    path="/v1/chat/completions", status_code=200, started_at=t_at,
                    first_byte_at=t_at, ended_at=t_at + timedelta(milliseconds=400),
                    proxy_instance="bench"))
                if state != Interaction.State.PROCESSED:
                    pending.append((ias[-1], state))
                if state == Interaction.State.PROCESSED:
                    steps.append(Step(
                        id=sid, tenant=tenant_obj, trajectory_id=tid, endpoint="chat.completions",
                        started_at=t_at, ended_at=t_at + timedelta(milliseconds=400),
                        status_code=200, request_model="demo", response_model="demo-1",
                        response_id=f"chatcmpl-{prefix}-{i}",
                        observation={"messages": [{"role": "user", "content":
                                                   f"<PERSON_1> asks about order {i}"}]},
                        action={"messages": [{"role": "assistant", "content": "On its way."}],
                                "finish_reason": "stop"},
                        usage={"input_tokens": 12, "output_tokens": 4},
                        sanitizer_version="bench-1", training_eligible=True))
                if i % 2 == 0:
                    rewards.append(Reward(tenant=tenant_obj, trajectory_id=tid, name="reward",
                                          value=(i % 10) / 10, final=True, source="bench"))
            Trajectory.objects.bulk_create(trajs)
            Interaction.objects.bulk_create(ias)
            Step.objects.bulk_create(steps)
            Reward.objects.bulk_create(rewards)
            # What the builder has not built (or quarantined): their pending rows.
            PendingInteraction.objects.bulk_create([
                PendingInteraction(interaction=ia, tenant=tenant_obj,
                                   trajectory_id=ia.trajectory_id, started_at=ia.started_at,
                                   state=state)
                for ia, state in pending])

    make(tenant, agents, n, "b")
    make(other, [other_agent], 1_000, "o")

    # Audit events: a valid-looking chain is not needed to list them (verification is a button).
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(max(seq), 0) FROM governance_auditevent")
        seq0 = cursor.fetchone()[0]
    events = []
    actions = ["trajectory.raw_read", "dataset.created", "dataset_version.frozen",
               "proxy_key.created", "retention.purged", "erasure.requested"]
    for i in range(n):
        events.append(AuditEvent(
            seq=seq0 + 1 + i, tenant=tenant, actor=f"user:{1 + i % 4}",
            action=actions[i % len(actions)], object_type="bench", object_id=str(i),
            payload={"i": i}, created_at=now - timedelta(seconds=n - i), prev_hash="0" * 64,
            hash=f"{i:064x}"))
        if len(events) == BATCH:
            AuditEvent.objects.bulk_create(events)
            events = []
    AuditEvent.objects.bulk_create(events)

    for i in range(500):
        ErasureRequest.objects.create(
            tenant=tenant, subject_hash=f"{i:064x}", status="completed",
            **({"certificate": {"counts": {"trajectories": 1}}}
               if hasattr(ErasureRequest, "certificate") else {}))
    user = get_user_model().objects.get(username="bench-steward")
    for i in range(60):
        ds = Dataset.objects.create(tenant=tenant, name=f"bench-{i}", created_by=user)
        DatasetVersion.objects.create(
            tenant=tenant, dataset=ds, number=1, content_hash=f"{i:064x}", size=1000,
            status=DatasetVersion.Status.APPROVED if i % 3 else
            DatasetVersion.Status.PENDING_APPROVAL)
    jobs = seed_training(tenant, user)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return {"trajectories": n, "audit_events": n, "training_jobs": jobs}


def seed_training(tenant, user) -> int:
    from governance.models import DatasetVersion
    from trainer.models import Checkpoint, TrainingJob, TrainingMetric

    version = DatasetVersion.objects.filter(tenant=tenant,
                                            status=DatasetVersion.Status.APPROVED).first()
    metrics = []
    for j in range(200):
        job = TrainingJob.objects.create(
            tenant=tenant, dataset_version=version, requested_by=user, reward_fn="exact_match",
            base_model="tiny", base_model_path="/nonexistent", status="completed", step=100,
            total_steps=100)
        for s in range(100):
            metrics.append(TrainingMetric(
                tenant=tenant, job=job, step=s + 1,
                **{k: v for k, v in {"reward_mean": s / 100, "reward_std": 0.1, "loss": 0.5,
                                     "kl": 0.01, "tokens_per_s": 900.0}.items()
                   if hasattr(TrainingMetric, k)}))
        Checkpoint.objects.create(tenant=tenant, job=job, step=100, path=f"/ckpt/{j}",
                                  weight_version=f"job{job.pk}-step100",
                                  manifest={"bench": True}, manifest_sha256="0" * 64)
    TrainingMetric.objects.bulk_create(metrics, batch_size=BATCH)
    return 200


def measure(client, path: str, requests: int) -> dict[str, float]:
    for _ in range(3):
        r = client.get(path)
        assert r.status_code == 200, (path, r.status_code, r.content[:300])
    times = []
    for _ in range(requests):
        t0 = time.perf_counter()
        r = client.get(path)
        times.append((time.perf_counter() - t0) * 1000)
        assert r.status_code == 200, (path, r.status_code)
    times.sort()
    return {"p50": statistics.median(times), "p95": times[max(0, int(len(times) * 0.95) - 1)],
            "max": times[-1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=100_000)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the database")
    args = ap.parse_args(argv)

    server = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/steward")
    os.environ.update({
        "DATABASE_URL": with_db(server, DB_NAME),
        "STEWARD_MASTER_KEY": os.environ.get("STEWARD_MASTER_KEY")
        or base64.b64encode(b"b" * 32).decode(),
        "DJANGO_SETTINGS_MODULE": "config.settings",
    })
    os.environ.pop("DATABASE_OWNER_URL", None)
    import psycopg

    server = with_db(server, "postgres")  # the maintenance database: creating and dropping
    with psycopg.connect(server, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                              [DB_NAME]).fetchone()
        if exists and not args.keep:
            conn.execute(f'DROP DATABASE "{DB_NAME}" WITH (FORCE)')
            exists = None
        if not exists:
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
    subprocess.run([str(PY), "manage.py", "migrate", "-v", "0"], cwd=REPO, check=True,
                   env=os.environ)
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client

    from governance.models import Trajectory
    from governance.tenancy import ensure_app_role, grant_app_privileges

    settings.ALLOWED_HOSTS = ["*"]
    warnings.filterwarnings("ignore", "No directory at")  # whitenoise: static not collected
    t0 = time.perf_counter()
    if Trajectory.objects.filter(tenant__slug="bench").count() < args.trajectories:
        seeded = seed(args.trajectories)
    else:
        seeded = {"trajectories": args.trajectories, "reused": True}
    seed_s = time.perf_counter() - t0
    with connection.cursor() as cursor:
        ensure_app_role(cursor, APP_ROLE, login=False)
        grant_app_privileges(cursor, APP_ROLE)
    settings.STEWARD_DB_SCOPE_ROLE = APP_ROLE  # every request scope under RLS, as in production

    users = {role: get_user_model().objects.get(username=f"bench-{role}")
             for role in ("admin", "compliance")}
    clients = {}
    for role, user in users.items():
        clients[role] = Client()
        clients[role].force_login(user)
    some = Trajectory.objects.filter(tenant__slug="bench").order_by("-started_at")[500]
    pages = [
        ("compliance", "overview", "/"),
        ("compliance", "trajectories", "/trajectories/"),
        ("compliance", "trajectories page 200 (deepest)", "/trajectories/?page=200"),
        ("compliance", "trajectories agent filter", "/trajectories/?agent=agent-3"),
        ("compliance", "trajectories session", f"/trajectories/?session={some.session_id}"),
        ("compliance", "trajectories reward>=0.8",
         "/trajectories/?reward_name=reward&reward_min=0.8"),
        ("compliance", "trajectories status=quarantined", "/trajectories/?status=quarantined"),
        ("compliance", "trajectory detail", f"/trajectories/{some.id}/"),
        ("compliance", "datasets", "/datasets/"),
        ("admin", "dataset live count (all)", "/datasets/preview/?classification=internal"),
        ("admin", "dataset live count (reward)",
         "/datasets/preview/?classification=internal&reward_name=reward&reward_min=0.5"),
        ("compliance", "approvals", "/approvals/"),
        ("compliance", "erasure", "/erasure/"),
        ("compliance", "training", "/training/"),
        ("compliance", "checkpoints", "/checkpoints/"),
        ("compliance", "audit", "/audit/"),
        ("compliance", "audit filtered", "/audit/?action=dataset.created"),
        ("compliance", "settings", "/settings/"),
        ("admin", "keys", "/keys/"),
        ("compliance", "evolution", "/evolution/"),
    ]
    rows = []
    for role, name, path in pages:
        try:
            m = measure(clients[role], path, args.requests)
        except AssertionError as exc:
            print(f"  {name:34s} FAILED {exc}", flush=True)
            rows.append({"page": name, "path": path, "error": str(exc)[:200]})
            continue
        rows.append({"page": name, "path": path, **{k: round(v, 1) for k, v in m.items()}})
        flag = "ok" if m["p95"] < 300 else "OVER"
        print(f"  {name:34s} p50 {m['p50']:7.1f} ms  p95 {m['p95']:7.1f} ms  "
              f"max {m['max']:7.1f} ms  {flag}", flush=True)
    worst = max((r["p95"] for r in rows if "p95" in r), default=None)
    print(json.dumps({"bench": "console_lists", "seed_s": round(seed_s, 1), **seeded,
                      "requests_per_page": args.requests, "worst_p95_ms": worst,
                      "pages": rows}))
    if not args.keep:
        connection.close()
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
