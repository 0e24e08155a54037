"""Erasure benchmark: one data subject among N steps (default 1,000,000) erased end to end.

    .venv/bin/python tests/bench/erasure_bench.py [--steps 1000000] [--subject-trajectories 10]

Needs PostgreSQL (DATABASE_URL, default postgresql://postgres@127.0.0.1:5432/steward): a
throwaway database `steward_bench_erasure_<pid>` is created, migrated and dropped.

Seeding is pure SQL (INSERT ... SELECT generate_series), as the superuser: trajectories of 10
steps, one interaction per step (with a small ciphertext), a finding per 10 steps, a
subject-index row per trajectory, a reward per trajectory, an approved dataset version over the
first 10,000 trajectories. The subject: half of its trajectories named by the X-Steward-Subject
header (trajectory + interactions carry the keyed hash, a data key exists), half found only
through the subject index (an email the sanitizer found). Then ANALYZE.

Measured: request_erasure + the erase_subject task (called in-process, exactly the code the
Celery worker runs) until the certificate is written — every scope under the NOBYPASSRLS app
role, as in production. Target (issue 4): < 10 s for one subject among 1,000,000 steps.
Prints seed time, erase time, rows touched, the lookup's plan, and one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[2]
PY = REPO / ".venv" / "bin" / "python"
sys.path.insert(0, str(REPO))
SUBJECT = "jane.roe@example.com"
STEPS_PER_TRAJECTORY = 10
APP_ROLE = "steward_app"


def with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def seed(cursor, tenant_id: int, agent_id: int, n_steps: int, subject_hash: str,
         index_hash: str, subject_trajs: int) -> dict[str, int]:
    from governance.capture.findings import clean, pack

    nt = n_steps // STEPS_PER_TRAJECTORY
    ts = "(now() - interval '2 days' + g * interval '10 ms')"
    traj = f"md5('t' || (g / {STEPS_PER_TRAJECTORY}))::uuid"
    cursor.execute(
        "INSERT INTO governance_trajectory (id, tenant_id, agent_id, session_id, source, "
        "subject_hash, consent, started_at, last_step_at, step_count, sanitizer_state, "
        "sanitizer_state_seq, route_arm, created_at) SELECT md5('t' || g)::uuid, %s, %s, '', "
        f"'new', '', 'train', now() - interval '2 days', now() - interval '1 day', "
        f"{STEPS_PER_TRAJECTORY}, '{{}}'::jsonb, 0, '', now() FROM generate_series(0, %s) g",
        [tenant_id, agent_id, nt - 1])
    cursor.execute(
        "INSERT INTO governance_interaction (flow_id, tenant_id, agent_id, trajectory_id, "
        "step_id, endpoint, method, path, status_code, is_stream, request_is_json, error_kind, "
        "error_message, subject_hash, consent, started_at, first_byte_at, ended_at, "
        "raw_ciphertext, raw_base_flow, proxy_instance, shipped_at) "
        f"SELECT 'f' || g, %s, %s, {traj}, md5('s' || g)::uuid, 'chat.completions', 'POST', "
        "'/v1/chat/completions', 200, false, true, '', '', '', 'train', "
        f"{ts}, {ts}, {ts}, decode(md5(g::text) || md5(g::text), 'hex'), '', "
        "'bench:0', now() FROM generate_series(0, %s) g", [tenant_id, agent_id, n_steps - 1])
    cursor.execute("SELECT min(id) FROM governance_interaction")
    first_ia = cursor.fetchone()[0]
    cursor.execute(
        "INSERT INTO governance_step (id, tenant_id, trajectory_id, interaction_id, endpoint, "
        "started_at, ended_at, status_code, request_model, response_model, response_id, "
        "observation, hidden_state, action, tokens, usage, timings, versions, metadata, "
        "classification, consent, sanitizer_version, training_eligible, created_at, kept, "
        "appended, item_refs, history_digest, history_length) "
        f"SELECT md5('s' || g)::uuid, %s, {traj}, %s + g, 'chat.completions', {ts}, {ts}, "
        "200, 'm', 'm-1', 'chatcmpl-' || g, "
        "'{\"messages\": [{\"role\": \"user\", \"content\": \"<EMAIL_ADDRESS_1> asks\"}]}', "
        "'{}', '{\"messages\": [{\"role\": \"assistant\", \"content\": \"ok\"}]}', '{}', "
        "'{}', '{}', '{}', '{}', 'internal', 'train', 'bench-1', true, now(), 0, '{}', '{}', "
        "'', 0 FROM generate_series(0, %s) g", [tenant_id, first_ia, n_steps - 1])
    cursor.execute(
        "INSERT INTO governance_finding (tenant_id, step_id, side, counts, total, spans, "
        "sanitizer_version, created_at) SELECT %s, md5('s' || g)::uuid, 'request', "
        "'{\"EMAIL_ADDRESS\": 1}', 1, %s, 'bench-1', now() "
        f"FROM generate_series(0, %s, {STEPS_PER_TRAJECTORY}) g",
        [tenant_id, pack([clean({"entity_type": "EMAIL_ADDRESS", "start": 0, "end": 10,
                                 "path": "$.messages[0].content", "score": 1.0,
                                 "recognizer": "email", "operator": "placeholder"})]),
         n_steps - 1])
    cursor.execute(
        "INSERT INTO governance_subjectindex (tenant_id, trajectory_id, step_id, "
        "interaction_id, source, hashes, created_at) "
        f"SELECT %s, {traj}, md5('s' || g)::uuid, %s + g, 'step', "
        "ARRAY[md5('h' || g)::uuid], now() "
        f"FROM generate_series(0, %s, {STEPS_PER_TRAJECTORY}) g",
        [tenant_id, first_ia, n_steps - 1])
    cursor.execute(
        "INSERT INTO governance_reward (tenant_id, trajectory_id, response_id, name, value, "
        "final, source, comment, created_at) SELECT %s, md5('t' || g)::uuid, '', 'reward', "
        "1.0, true, 'bench', '', now() FROM generate_series(0, %s) g", [tenant_id, nt - 1])
    # The subject: trajectories 0..k-1 by header, k..2k-1 through the subject index only.
    k = subject_trajs // 2
    cursor.execute("UPDATE governance_trajectory SET subject_hash = %s "
                   "WHERE id IN (SELECT md5('t' || g)::uuid FROM generate_series(0, %s) g)",
                   [subject_hash, k - 1])
    cursor.execute("UPDATE governance_interaction SET subject_hash = %s WHERE trajectory_id IN "
                   "(SELECT md5('t' || g)::uuid FROM generate_series(0, %s) g)",
                   [subject_hash, k - 1])
    cursor.execute("UPDATE governance_subjectindex SET hashes = ARRAY[%s::uuid] "
                   "WHERE trajectory_id IN "
                   "(SELECT md5('t' || g)::uuid FROM generate_series(%s, %s) g)",
                   [index_hash[:32], k, subject_trajs - 1])
    cursor.execute(
        "INSERT INTO governance_reward (tenant_id, trajectory_id, response_id, name, value, "
        "final, source, comment, created_at) SELECT %s, NULL, 'chatcmpl-' || g, 'reward', "
        "0.5, true, 'bench', '', now() FROM generate_series(0, %s) g",
        [tenant_id, subject_trajs * STEPS_PER_TRAJECTORY - 1])
    return {"trajectories": nt, "steps": n_steps, "interactions": n_steps,
            "findings": n_steps // STEPS_PER_TRAJECTORY,
            "subject_index": n_steps // STEPS_PER_TRAJECTORY}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--subject-trajectories", type=int, default=10)
    ap.add_argument("--keep", action="store_true", help="keep the database")
    args = ap.parse_args(argv)

    server = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/steward")
    db_name = f"steward_bench_erasure_{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix="steward-bench-erasure-"))
    env = {**os.environ, "DATABASE_URL": with_db(server, db_name),
           "STEWARD_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
           "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(REPO),
           "STEWARD_VAR_DIR": str(tmp / "var"), "STEWARD_SPOOL_DIR": str(tmp / "spool"),
           "STEWARD_ERASURE_SPOOL_WAIT_S": "1"}
    env.pop("DATABASE_OWNER_URL", None)
    env.pop("STEWARD_TEST_DATABASE", None)

    import psycopg

    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db_name}"')
    try:
        subprocess.run([str(PY), "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env,
                       check=True)
        os.environ.update({k: env[k] for k in ("DATABASE_URL", "STEWARD_MASTER_KEY",
                                               "DJANGO_SETTINGS_MODULE", "STEWARD_VAR_DIR",
                                               "STEWARD_SPOOL_DIR",
                                               "STEWARD_ERASURE_SPOOL_WAIT_S")})
        import django

        django.setup()
        from django.conf import settings
        from django.db import connection, transaction

        from governance import services as gov
        from governance.capture.rawstore import data_keys_for
        from governance.erasure import erase_subject, lookup_hashes, request_erasure
        from governance.keyring import subject_hash
        from governance.models import (
            Dataset,
            DatasetVersion,
            ErasureRequest,
            SubjectIndex,
            subject_keys_operator,
        )
        from governance.sanitizer import normalize_identifier
        from governance.tenancy import (
            ensure_app_role,
            grant_app_privileges,
            tenant_context,
        )

        tenant = gov.create_tenant("system:bench", "bench", "Bench")[0]
        agent = gov.ensure_agent("system:bench", tenant, "bench-agent")
        h = subject_hash(tenant.pk, SUBJECT)
        index_hash = subject_hash(tenant.pk, normalize_identifier("EMAIL_ADDRESS", SUBJECT))
        assert index_hash in lookup_hashes(tenant.pk, SUBJECT)

        t0 = time.perf_counter()
        with transaction.atomic(), tenant_context(tenant), connection.cursor() as cursor:
            seeded = seed(cursor, tenant.pk, agent.pk, args.steps, h, index_hash,
                          args.subject_trajectories)
            ds = Dataset.objects.create(tenant=tenant, name="bench")
            version = DatasetVersion.objects.create(
                tenant=tenant, dataset=ds, number=1, content_hash="0" * 64,
                status=DatasetVersion.Status.APPROVED,
                size=min(10_000, seeded["trajectories"]))
            cursor.execute(
                "INSERT INTO governance_datasetversionmember (tenant_id, version_id, "
                "trajectory_id) SELECT %s, %s, md5('t' || g)::uuid "
                "FROM generate_series(0, %s) g",
                [tenant.pk, version.pk, min(10_000, seeded["trajectories"]) - 1])
        with tenant_context(tenant):
            data_keys_for({(tenant.pk, h), (tenant.pk, "")})
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
            ensure_app_role(cursor, APP_ROLE, login=False)
            grant_app_privileges(cursor, APP_ROLE)
        seed_s = time.perf_counter() - t0
        settings.STEWARD_DB_SCOPE_ROLE = APP_ROLE  # every scope under RLS, as in production

        with tenant_context(tenant), connection.cursor() as cursor:
            cursor.execute(
                "EXPLAIN SELECT trajectory_id FROM governance_subjectindex "
                f"WHERE tenant_id = %s AND hashes {subject_keys_operator()} %s::uuid[]",
                [tenant.pk, SubjectIndex.keys(lookup_hashes(tenant.pk, SUBJECT))])
            plan_index = "\n".join(r[0] for r in cursor.fetchall())
            cursor.execute(
                "EXPLAIN SELECT trajectory_id FROM governance_interaction "
                "WHERE tenant_id = %s AND subject_hash = ANY(%s::text[]) "
                "AND subject_hash <> ''", [tenant.pk, lookup_hashes(tenant.pk, SUBJECT)])
            plan_interaction = "\n".join(r[0] for r in cursor.fetchall())

        # A worker has the sanitizer loaded already (governance.tasks._preload_sanitizer at
        # worker start, for the step builder): load it before the clock starts, as there.
        from governance.sanitizer import get_sanitizer

        get_sanitizer()

        t1 = time.perf_counter()
        req, _ = request_erasure("system:bench", tenant, SUBJECT)
        t2 = time.perf_counter()
        result = erase_subject(req.pk, tenant.pk)
        erase_s = time.perf_counter() - t1
        print(f"request     {t2 - t1:.3f} s (hashing, row, audit event)")
        with tenant_context(tenant):
            req = ErasureRequest.objects.get(pk=req.pk)
        cert = req.certificate or {}
        counts = cert.get("counts", {})
        touched = sum(v for k, v in counts.items()
                      if k not in ("suppressed_hashes", "exports_removed"))
        print(f"seeded      {seeded} in {seed_s:.1f} s")
        print(f"lookup plan (subject index):\n{plan_index}")
        print(f"lookup plan (interactions):\n{plan_interaction}")
        print(f"erase       {erase_s:.2f} s  status={req.status} ({result})")
        print(f"rows        {counts}  total {touched}")
        print(f"versions    invalidated {cert.get('dataset_versions_invalidated')}")
        print(f"post-check  {cert.get('post_condition')}")
        print(json.dumps({"steps": args.steps, "seed_s": round(seed_s, 1),
                          "erase_s": round(erase_s, 3), "status": req.status,
                          "rows_touched": touched, "counts": counts,
                          "target_s": 10, "ok": req.status == "completed" and erase_s < 10}))
        return 0 if req.status == "completed" and erase_s < 10 else 1
    finally:
        if not args.keep:
            from django.db import connections

            connections.close_all()
            with psycopg.connect(server, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


if __name__ == "__main__":
    sys.exit(main())
