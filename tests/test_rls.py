"""Tenancy's second wall: PostgreSQL row-level security (migration 0004, governance/tenancy.py).

- Every table with a tenant foreign key has RLS enabled AND forced, with the tenant policy; the
  app role is not the owner of any of them and cannot bypass RLS.
- As the app role: no tenant set -> nothing visible; tenant A set -> B's rows invisible, writes
  naming B refused (WITH CHECK), B's rows neither updatable nor deletable.
- The REST and console paths see only the request's tenant even where a view forgets the ORM
  filter (a leaky view, mounted for these tests only).
- Whole flows on a connection that is the app role throughout (as in production): services,
  the shipper with several tenants per batch, the Celery step builder, beat tasks, retention,
  bootstrap, REST, console, audit verification.
- Interleaved transactions of different tenants on a small pool of connections never leak.
- `manage.py migrate` as DATABASE_OWNER_URL (a non-superuser owner, so FORCE applies to it and
  the SECURITY DEFINER functions run under RLS), then the CLI as the app role.
"""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import psycopg
import pytest
from django.apps import apps
from django.contrib.auth.decorators import login_required
from django.db import DatabaseError, connection, transaction
from django.http import JsonResponse
from django.urls import include, path
from rest_framework.response import Response
from rest_framework.views import APIView

from governance.models import (
    Agent,
    ApiToken,
    Approval,
    AuditEvent,
    ConversationItem,
    DataKey,
    Dataset,
    DatasetVersion,
    DatasetVersionMember,
    ErasureRequest,
    Interaction,
    PendingInteraction,
    PlaceholderDelta,
    ProxyKey,
    Step,
    SubjectIndex,
    SuppressedSubject,
    Tenant,
    Trajectory,
)
from governance.tenancy import (
    POLICY_NAME,
    TenantScopeError,
    current_scope,
    system_context,
    tenant_context,
)
from tests.govdata import add_findings, make_trajectory
from tests.live import database_url_from_django
from trainer.models import Checkpoint, TrainingJob, TrainingMetric

ROOT = Path(__file__).resolve().parent.parent
APP_ROLE = "steward_app"
EXPECTED_TABLES = {
    "governance_membership", "governance_agent", "governance_proxykey", "governance_apitoken",
    "governance_datakey", "governance_trajectory", "governance_interaction", "governance_step",
    "governance_reward", "governance_auditevent", "governance_dataset",
    "governance_datasetversion", "governance_datasetversionmember", "governance_approval",
    "governance_retentionpolicy", "governance_finding", "governance_subjectindex",
    "trainer_trainingjob", "trainer_trainingmetric", "trainer_checkpoint",
}


def tenant_tables() -> list[str]:
    """Every table of a model with a foreign key to Tenant (today's models, not a list)."""
    out = set()
    for model in apps.get_models():
        for field in model._meta.concrete_fields:
            if field.many_to_one and field.related_model is Tenant:
                out.add(model._meta.db_table)
    return sorted(out)


@contextmanager
def as_app(tenant_id: int | None = None, system: bool = False):
    """A savepoint on the test's connection as the app role, with exactly these settings —
    raw SQL, independent of governance.tenancy."""
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT set_config('role', %s, true), "
                    "set_config('steward.tenant_id', %s, true), "
                    "set_config('steward.system', %s, true)",
                    [APP_ROLE, "" if tenant_id is None else str(tenant_id),
                     "on" if system else "off"])
        yield cur
        cur.execute("SELECT set_config('role', 'none', true), "
                    "set_config('steward.tenant_id', '', true), "
                    "set_config('steward.system', 'off', true)")


def refused(cur, sql: str, params: list | None = None) -> str:
    try:
        with transaction.atomic():
            cur.execute(sql, params or [])
    except DatabaseError as exc:
        return str(exc)
    return ""


# --- the schema ------------------------------------------------------------------------------


def _partitions(cur, tables: list[str]) -> list[str]:
    """The partitions of those tables that are partitioned (decision 33), at any depth."""
    cur.execute("SELECT c.relname FROM pg_class t "
                "CROSS JOIN LATERAL pg_partition_tree(t.oid) p "
                "JOIN pg_class c ON c.oid = p.relid "
                "WHERE t.relname = ANY(%s) AND t.relkind = 'p' AND p.level > 0", [tables])
    return sorted(row[0] for row in cur.fetchall())


def test_every_tenant_table_has_rls_enabled_forced_and_the_policy(db):
    from governance.partitions import PARTITIONED, ensure_partitions

    tables = tenant_tables()
    assert EXPECTED_TABLES <= set(tables)  # the known ones, and any model added since
    # Partitions made later (by beat) are covered the same way as the migration's.
    ensure_partitions(2, first=date(2031, 5, 1))
    with connection.cursor() as cur:
        partitions = _partitions(cur, tables)
        assert {f"{t}_p2031_06" for t in PARTITIONED} | {f"{t}_default" for t in PARTITIONED} \
            <= set(partitions)
        tables = sorted(set(tables) | set(partitions))
        cur.execute("SELECT relname, relrowsecurity, relforcerowsecurity FROM pg_class "
                    "WHERE relname = ANY(%s) AND relkind IN ('r', 'p')", [tables])
        flags = {name: (enabled, forced) for name, enabled, forced in cur.fetchall()}
        cur.execute("SELECT tablename, qual, with_check FROM pg_policies "
                    "WHERE policyname = %s", [POLICY_NAME])
        policies = {t: (q, w) for t, q, w in cur.fetchall()}
    missing = [t for t in tables if flags.get(t) != (True, True) or t not in policies]
    assert not missing, f"tables with tenant data but no forced RLS policy: {missing} — " \
                        "add governance.tenancy.tenant_rls_sql(table) to their migration"
    for table in tables:
        qual, check = policies[table]
        for expr in (qual, check):
            assert "steward.tenant_id" in expr and "steward.system" in expr, (table, expr)


def test_the_app_role_is_not_owner_and_cannot_bypass_rls(db):
    with connection.cursor() as cur:
        cur.execute("SELECT rolsuper, rolbypassrls, oid FROM pg_roles WHERE rolname = %s",
                    [APP_ROLE])
        superuser, bypass, oid = cur.fetchone()
        assert (superuser, bypass) == (False, False)
        cur.execute("SELECT relname FROM pg_class WHERE relowner = %s", [oid])
        assert cur.fetchall() == []  # owns nothing, so FORCE is not even needed against it
        cur.execute("SELECT has_table_privilege(%s, 'governance_auditevent', 'INSERT'), "
                    "has_table_privilege(%s, 'governance_auditevent', 'SELECT'), "
                    "has_table_privilege(%s, 'governance_auditevent', 'UPDATE'), "
                    "has_table_privilege(%s, 'governance_auditevent', 'DELETE'), "
                    "has_table_privilege(%s, 'governance_trajectory', 'DELETE')",
                    [APP_ROLE] * 5)
        assert cur.fetchone() == (True, True, False, False, True)


# --- the policy, as the app role ---------------------------------------------------------------


@pytest.fixture
def world(tenant, other_tenant, make_member):
    """Rows of both tenants in every tenant table (written as the test's superuser)."""
    from governance import services

    out = {}
    for t in (tenant, other_tenant):
        admin = make_member("admin", f"admin-{t.slug}", on=t)
        key = services.create_proxy_key("system:test", t, "bot").record
        services.create_api_token("system:test", t, admin)
        services.record_reward("system:test", t, value=1.0, response_id=f"resp-{t.slug}")
        services.set_retention_policy("system:test", t, "*", steps_days=30, raw_days=7,
                                      findings_days=30, audit_days=3650)
        traj = make_trajectory(t, key.agent, steps=2, subject_hash=f"s-{t.slug}")
        waiting = Interaction.objects.create(  # a call of it not built: a PendingInteraction
            flow_id=uuid.uuid4().hex, tenant=t, agent=key.agent, trajectory=traj,
            step_id=uuid.uuid4(), endpoint="chat.completions", method="POST",
            path="/v1/chat/completions", started_at=traj.started_at)
        PendingInteraction.objects.create(interaction=waiting, tenant=t, trajectory=traj,
                                          started_at=waiting.started_at)
        DataKey.objects.create(tenant=t, subject_hash=f"s-{t.slug}", wrapped_key=b"x")
        ds = Dataset.objects.create(tenant=t, name="ds")
        v = DatasetVersion.objects.create(tenant=t, dataset=ds, number=1, content_hash="h")
        DatasetVersionMember.objects.create(tenant=t, version=v, trajectory=traj)
        Approval.objects.create(tenant=t, version=v, decision="reject", reason="r")
        step = Step.objects.filter(trajectory=traj).first()
        ConversationItem.objects.create(tenant=t, trajectory=traj, digest=f"m:{t.slug}",
                                        sanitizer_version="test-1", content={"role": "user"})
        PlaceholderDelta.objects.create(tenant=t, trajectory=traj, seq=1,
                                        data=PlaceholderDelta.pack(
                                            {"labels": {"0123456789abcdef": "PERSON_1"}}))
        add_findings(t, step, ["EMAIL_ADDRESS"], path="$.x")
        SubjectIndex.objects.create(tenant=t, trajectory=traj, step=step,
                                    interaction=step.interaction, source="step",
                                    hashes=SubjectIndex.keys([uuid.uuid4().hex * 2]))
        job = TrainingJob.objects.create(tenant=t, dataset_version=v, reward_fn="exact_match",
                                         base_model="tiny-qwen2", base_model_path="/m")
        TrainingMetric.objects.create(tenant=t, job=job, step=1, reward_mean=0, reward_std=0,
                                      loss=0)
        Checkpoint.objects.create(tenant=t, job=job, step=1, path="/c", weight_version="1",
                                  manifest_sha256="0" * 64)
        erasure = ErasureRequest.objects.create(tenant=t, subject_hash=f"e-{t.slug}")
        SuppressedSubject.objects.create(tenant=t, subject_hash=f"e-{t.slug}",
                                         erasure_request=erasure)
        from evolution.models import ContextUpdate, PolicyRoute
        from governance.models import DeadLetter

        DeadLetter.objects.create(tenant=t, flow_id=f"dl-{t.slug}", reason="r")

        update = ContextUpdate.objects.create(tenant=t, agent=key.agent, kind="system_prompt",
                                              content={"snippet": "x"}, version=1,
                                              content_hash="0" * 64)
        PolicyRoute.objects.create(tenant=t, agent=key.agent, share=0.1, context_update=update)
        from governance.models import SanitizerPolicyChange

        SanitizerPolicyChange.objects.create(tenant=t, policy={"operators": {}},
                                             requested_by=admin)
        from evolution.models import (
            Candidate,
            EvolutionPolicy,
            FailureCluster,
            GateResult,
            Proposal,
        )

        EvolutionPolicy.objects.create(tenant=t)
        cand = Candidate.objects.create(tenant=t, agent=key.agent, kind="memory",
                                        context_update=update)
        GateResult.objects.create(tenant=t, candidate=cand, gate="shadow_eval", passed=True)
        cluster = FailureCluster.objects.create(tenant=t, key="k", signature="tool_error")
        Proposal.objects.create(tenant=t, cluster=cluster, kind="skill", rationale="r")
        out[t.pk] = {"trajectory": traj, "agent": key.agent, "admin": admin}
    AuditEvent.objects.create(seq=10_000, tenant=None, actor="system:test", action="x",
                              created_at=traj.started_at, prev_hash="0", hash="0")
    return out


def _counts(cur, tables: list[str]) -> dict[str, dict]:
    out = {}
    for table in tables:
        cur.execute(f'SELECT tenant_id, count(*) FROM "{table}" GROUP BY 1')  # noqa: S608
        out[table] = dict(cur.fetchall())
    return out


def test_no_tenant_set_sees_nothing(world):
    tables = tenant_tables()
    with connection.cursor() as cur:
        everything = _counts(cur, tables)
    for table in tables:  # the superuser sees both tenants' rows: the test means something
        assert len([t for t in everything[table] if t is not None]) == 2, table
    with as_app() as cur:
        assert _counts(cur, tables) == {t: {} for t in tables}
        cur.execute("SELECT count(*) FROM governance_tenant")
        assert cur.fetchone()[0] == 2  # the tenant directory itself is not tenant data


def test_tenant_a_sees_only_its_rows_and_cannot_write_as_b(world, tenant, other_tenant):
    tables = tenant_tables()
    with connection.cursor() as cur:
        everything = _counts(cur, tables)
    b_agent = world[other_tenant.pk]["agent"]
    b_traj = world[other_tenant.pk]["trajectory"]
    with as_app(tenant.pk) as cur:
        for table, counts in _counts(cur, tables).items():
            assert counts == {tenant.pk: everything[table][tenant.pk]}, table
        # WITH CHECK: a row naming tenant B is refused, by INSERT or by UPDATE.
        assert "row-level security" in refused(
            cur, "INSERT INTO governance_agent (tenant_id, name, created_at) "
                 "VALUES (%s, 'sneaky', now())", [other_tenant.pk])
        assert "row-level security" in refused(
            cur, "UPDATE governance_agent SET tenant_id = %s WHERE tenant_id = %s",
            [other_tenant.pk, tenant.pk])
        assert "row-level security" in refused(
            cur, "INSERT INTO governance_auditevent (seq, tenant_id, actor, action, object_type,"
                 " object_id, payload, created_at, prev_hash, hash) VALUES (20000, NULL, 'x', "
                 "'x', '', '', '{}', now(), '0', '0')")
        # B's rows are not there to update or delete.
        cur.execute("UPDATE governance_agent SET name = 'renamed' WHERE id = %s", [b_agent.pk])
        assert cur.rowcount == 0
        cur.execute("DELETE FROM governance_step WHERE trajectory_id = %s", [b_traj.pk])
        assert cur.rowcount == 0
    assert Agent.objects.get(pk=b_agent.pk).name == "bot"
    assert Step.objects.filter(trajectory=b_traj).count() == 2


def test_system_context_sees_every_tenant_and_tenantless_audit_events(world, tenant):
    with as_app(system=True) as cur:
        cur.execute("SELECT count(*) FROM governance_auditevent WHERE tenant_id IS NULL")
        assert cur.fetchone()[0] == 1
        cur.execute("SELECT count(DISTINCT tenant_id) FROM governance_trajectory")
        assert cur.fetchone()[0] == 2
    with as_app(tenant.pk) as cur:
        cur.execute("SELECT count(*) FROM governance_auditevent WHERE tenant_id IS NULL")
        assert cur.fetchone()[0] == 0


def test_definer_functions_cross_tenants_even_with_a_non_superuser_owner(world, tenant):
    """The functions switch the system context on for their own query only. Owned here by a
    role that is subject to RLS (as in production, where the owner is no superuser)."""
    functions = ["steward_proxy_keys()", "steward_proxy_keys_version()",
                 "steward_api_token_lookup(text)",
                 "steward_user_memberships(bigint)", "steward_audit_head()",
                 "steward_interaction_tenants(bigint[])"]
    admin = world[tenant.pk]["admin"]
    ids = list(Interaction.objects.values_list("pk", flat=True))
    with connection.cursor() as cur:
        cur.execute("CREATE ROLE steward_test_definer NOLOGIN NOSUPERUSER NOBYPASSRLS")
        cur.execute("GRANT SELECT ON ALL TABLES IN SCHEMA public TO steward_test_definer")
        for fn in functions:
            cur.execute(f"ALTER FUNCTION {fn} OWNER TO steward_test_definer")
    token_hash = ApiToken.objects.filter(tenant=tenant).values_list("key_hash", flat=True)[0]
    n_keys = ProxyKey.objects.count()
    head = AuditEvent.objects.order_by("-seq").first().seq
    with as_app() as cur:
        cur.execute("SELECT count(*) FROM governance_proxykey")
        assert cur.fetchone()[0] == 0
        cur.execute("SELECT count(DISTINCT tenant_id), count(*) FROM steward_proxy_keys()")
        assert cur.fetchone() == (2, n_keys)
        cur.execute("SELECT key_count, max_updated_at IS NOT NULL "
                    "FROM steward_proxy_keys_version()")
        assert cur.fetchone() == (n_keys, True)
        cur.execute("SELECT tenant_id FROM steward_api_token_lookup(%s)", [token_hash])
        assert cur.fetchall() == [(tenant.pk,)]
        cur.execute("SELECT tenant_slug FROM steward_user_memberships(%s)", [admin.pk])
        assert cur.fetchall() == [(tenant.slug,)]
        cur.execute("SELECT seq FROM steward_audit_head()")
        assert cur.fetchone()[0] == head
        cur.execute("SELECT count(DISTINCT tenant_id), count(*) "
                    "FROM steward_interaction_tenants(%s)", [ids])
        assert cur.fetchone() == (2, len(ids))
        # ...and the system context ends with the function.
        cur.execute("SELECT current_setting('steward.system', true)")
        assert cur.fetchone()[0] == "off"
        cur.execute("SELECT count(*) FROM governance_proxykey")
        assert cur.fetchone()[0] == 0


# --- the Python side -------------------------------------------------------------------------


def test_scopes_nest_restore_and_refuse_mixing_tenants(world, tenant, other_tenant):
    with tenant_context(tenant):
        assert set(Trajectory.objects.values_list("tenant_id", flat=True)) == {tenant.pk}
        with tenant_context(tenant.pk):  # the same tenant: joins
            assert current_scope().tenant_id == tenant.pk
        with pytest.raises(TenantScopeError):
            with tenant_context(other_tenant):
                pass
        with system_context("test: nested system read"):
            assert Trajectory.objects.values("tenant_id").distinct().count() == 2
        # The outer tenant is restored after the nested scopes.
        assert set(Trajectory.objects.values_list("tenant_id", flat=True)) == {tenant.pk}
    assert current_scope() is None
    # A failing block rolls back its scope with it.
    with pytest.raises(RuntimeError, match="boom"), tenant_context(other_tenant):
        Agent.objects.filter(tenant=other_tenant).update(name="changed")
        raise RuntimeError("boom")
    assert set(Agent.objects.values_list("name", flat=True)) == {"bot"}
    with tenant_context(other_tenant):
        assert set(Trajectory.objects.values_list("tenant_id", flat=True)) == {other_tenant.pk}
    with pytest.raises(ValueError):
        with system_context(""):
            pass


# --- REST and console with a forgotten ORM filter ----------------------------------------------


class LeakyApi(APIView):
    """A view that forgets every tenant filter (token-authenticated like the real API)."""

    def get(self, request):
        return Response({"trajectories": sorted(str(t) for t in Trajectory.objects.values_list(
            "pk", flat=True)), "agents": list(Agent.objects.values_list("tenant_id", flat=True))})


@login_required
def leaky_console(request):
    return JsonResponse({"trajectories": sorted(str(t) for t in Trajectory.objects.values_list(
        "pk", flat=True)), "steps": Step.objects.count()})


urlpatterns = [
    path("leak/api/", LeakyApi.as_view()),
    path("leak/console/", leaky_console),
    path("", include("config.urls")),
]


@pytest.mark.urls("tests.test_rls")
def test_rest_and_console_see_one_tenant_even_without_a_filter(world, tenant, other_tenant,
                                                               api_client_for, client):
    mine = str(world[tenant.pk]["trajectory"].pk)
    theirs = str(world[other_tenant.pk]["trajectory"].pk)
    admin = world[tenant.pk]["admin"]
    body = api_client_for(admin, tenant).get("/leak/api/").json()
    assert body == {"trajectories": [mine], "agents": [tenant.pk]}
    body = api_client_for(world[other_tenant.pk]["admin"], other_tenant).get(
        "/leak/api/").json()
    assert body["trajectories"] == [theirs]
    client.force_login(admin)
    body = client.get("/leak/console/").json()
    assert body == {"trajectories": [mine], "steps": 2}
    # No tenant at all (a bad token is refused; a user without membership sees nothing).
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.create_user("nobody", password="x" * 12))
    assert client.get("/leak/console/").json() == {"trajectories": [], "steps": 0}


# --- whole flows on a connection that is the app role throughout ------------------------------


@pytest.fixture
def app_connection(transactional_db, settings):
    """The test's Django connection becomes the app role for the whole test, exactly like a
    production service (no superuser anywhere, no per-scope role switch): anything that reads
    tenant data outside a tenant scope finds nothing here."""
    settings.STEWARD_DB_SCOPE_ROLE = ""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    saved = dict(options)
    connection.close()
    options["options"] = f"-c role={APP_ROLE}"
    with connection.cursor() as cur:
        cur.execute("SELECT current_user")
        assert cur.fetchone()[0] == APP_ROLE
    yield
    connection.close()
    options.clear()
    options.update(saved)


def superuser_rows(sql: str, params: list | None = None) -> list[tuple]:
    with psycopg.connect(database_url_from_django(), autocommit=True) as conn:
        return conn.execute(sql, params or []).fetchall()


def test_flows_as_the_app_role(app_connection, tmp_path, client, api_client_for, settings):
    from django.core.management import call_command

    from governance import services
    from governance.audit import verify_chain
    from governance.capture.shipper import Shipper
    from governance.retention import purge_expired
    from governance.tasks import build_pending_steps, build_steps
    from tests.pipeline import chat_response, make_record, write_records

    # Services: each in its tenant's scope.
    acme = services.create_tenant("system:test", "acme", "Acme")[0]
    globex = services.create_tenant("system:test", "globex", "Globex")[0]
    admins, agents = {}, {}
    for t in (acme, globex):
        admins[t.pk] = services.ensure_member("system:test", t, f"admin-{t.slug}", "admin",
                                              password="x" * 16)[0]
        agents[t.pk] = services.create_proxy_key("system:test", t, "bot").record.agent
    assert Agent.objects.count() == 0  # the test body itself is in no scope: sees nothing

    # The shipper: one batch with both tenants' records and a forged one (acme naming globex's
    # agent) -> each stored in its own tenant scope, the forgery dead-lettered.
    records = [make_record(t.pk, agents[t.pk].pk, response=chat_response(f"hi {t.slug}"),
                           subject=f"user@{t.slug}.example")
               for t in (acme, globex, acme, globex)]
    forged = make_record(acme.pk, agents[globex.pk].pk, response=chat_response())
    write_records(tmp_path, [*records, forged])
    collected: list[int] = []
    shipper = Shipper(tmp_path, enqueue=collected.extend)
    counts = shipper.ship_once().as_dict()
    assert (counts["inserted"], counts["dead_lettered"]) == (4, 1)
    assert "does not exist in tenant" in shipper.read_dead_letters()[0]["reason"]

    # The step builder routes the ids of both tenants to their scopes.
    assert build_steps(collected) == {"built": 4, "quarantined": 0, "skipped": 0}
    assert build_steps(collected) == {"built": 0, "quarantined": 0, "skipped": 4}
    assert build_pending_steps() == 0

    # REST: the token's tenant only; audit verification across the one chain.
    api = api_client_for(admins[acme.pk], acme)
    listed = api.get("/api/v1/trajectories/").json()["results"]
    assert {r["id"] for r in listed} == {r["trajectory_id"] for r in records[0::2]}
    verify = api.get("/api/v1/audit/verify/").json()
    total = superuser_rows("SELECT count(*) FROM governance_auditevent")[0][0]
    own = superuser_rows("SELECT count(*) FROM governance_auditevent WHERE tenant_id = %s",
                         [acme.pk])[0][0]
    # The whole chain is walked (the first verification); the count is acme's events only.
    assert verify == {"ok": True, "events": own, "first_bad_seq": None, "reason": "ok",
                      "checked": total, "from_seq": 1, "full": True}
    assert verify_chain() == (True, None, "ok")

    # Console: the session's tenant only.
    client.force_login(admins[globex.pk])
    page = client.get("/trajectories/").content.decode()
    assert records[1]["trajectory_id"] in page and records[0]["trajectory_id"] not in page

    # Retention: per-tenant batches, audited.
    services.set_retention_policy("system:test", acme, "*", steps_days=30, raw_days=0,
                                  findings_days=30, audit_days=3650)
    results = purge_expired()
    assert results[acme.pk]["raw_payloads"] == 2
    assert results[globex.pk].get("raw_payloads", 0) == 0

    # Bootstrap twice: the second run finds what the first made (it reads in the tenant's
    # scope) instead of issuing new credentials.
    settings.VAR_DIR = tmp_path
    with open(os.devnull, "w") as devnull:
        call_command("bootstrap_demo", "--json", stdout=devnull)
        call_command("bootstrap_demo", "--json", stdout=devnull)

    # What was written, as the superuser sees it.
    rows = dict(superuser_rows("SELECT t.slug, count(*) FROM governance_step s "
                               "JOIN governance_tenant t ON t.id = s.tenant_id GROUP BY 1"))
    assert rows == {"acme": 2, "globex": 2}
    assert superuser_rows("SELECT count(*) FROM governance_proxykey k JOIN governance_tenant t "
                          "ON t.id = k.tenant_id WHERE t.slug = 'demo'") == [(1,)]
    assert superuser_rows("SELECT count(*) FROM governance_interaction "
                          "WHERE raw_ciphertext IS NOT NULL") == [(2,)]
    assert superuser_rows("SELECT count(*) FROM governance_auditevent "
                          "WHERE action = 'retention.purged'") == [(1,)]


# --- a small pool, interleaved transactions ----------------------------------------------------


def test_interleaved_transactions_on_a_small_pool_never_leak(transactional_db, tenant,
                                                            other_tenant):
    from governance import services

    for t in (tenant, other_tenant):
        services.create_proxy_key("system:test", t, "bot")
    expected = {t.pk: set(Agent.objects.filter(tenant=t).values_list("pk", flat=True))
                for t in (tenant, other_tenant)}
    url = database_url_from_django(APP_ROLE)
    pool: queue.Queue = queue.Queue()
    conns = [psycopg.connect(url) for _ in range(2)]  # two connections, eight workers
    for c in conns:
        pool.put(c)
    errors: list[str] = []
    rng = random.Random(7)

    def work(n: int) -> None:
        for i in range(25):
            tid = rng.choice([tenant.pk, other_tenant.pk, None])
            conn = pool.get()
            try:
                with conn.transaction():
                    if tid is not None:
                        conn.execute("SELECT set_config('steward.tenant_id', %s, true)",
                                     [str(tid)])
                    time.sleep(rng.random() / 200)  # let the others interleave
                    seen = {r[0] for r in conn.execute("SELECT id FROM governance_agent")}
                    want = expected[tid] if tid is not None else set()
                    if seen != want:
                        errors.append(f"worker {n} step {i}: tenant {tid} saw {seen}")
                # After COMMIT the connection carries nothing into the next transaction.
                left = conn.execute("SELECT current_setting('steward.tenant_id', true)")
                if left.fetchone()[0] not in ("", None):
                    errors.append(f"worker {n} step {i}: the tenant outlived its transaction")
                conn.commit()
            finally:
                pool.put(conn)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for c in conns:
        c.close()
    assert errors == []


def test_django_threads_interleaving_tenant_scopes(transactional_db, tenant, other_tenant):
    """The same through governance.tenancy on Django connections (one per thread, kept open
    between scopes like CONN_MAX_AGE keeps them between requests)."""
    from django.db import connections

    from governance import services

    for t in (tenant, other_tenant):
        services.create_proxy_key("system:test", t, "bot")
    errors: list[str] = []

    def work(n: int) -> None:
        rng = random.Random(n)
        try:
            for i in range(20):
                t = rng.choice([tenant, other_tenant])
                with tenant_context(t):
                    owners = set(Agent.objects.values_list("tenant_id", flat=True))
                    time.sleep(rng.random() / 500)
                    if owners != {t.pk}:
                        errors.append(f"thread {n} step {i}: {t.slug} saw tenants {owners}")
                with connection.cursor() as cur:  # between scopes: nothing set
                    cur.execute("SELECT current_setting('steward.tenant_id', true), "
                                "current_user")
                    setting, user = cur.fetchone()
                    if setting not in ("", None) or user == APP_ROLE:
                        errors.append(f"thread {n} step {i}: left {setting!r} as {user}")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert errors == []


# --- migrate as the owner, the CLI as the app role ---------------------------------------------


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(300)
def test_migrate_as_owner_then_the_cli_as_the_app_role(tmp_path):
    base = os.environ.get("DATABASE_URL")
    if not base:
        pytest.skip("DATABASE_URL is not set")
    from urllib.parse import urlparse, urlunparse

    suffix = uuid.uuid4().hex[:8]
    owner, app, name = f"stw_owner_{suffix}", f"stw_app_{suffix}", f"steward_rls_{suffix}"
    admin = urlunparse(urlparse(base)._replace(path="/postgres", query=""))

    def url(user: str) -> str:
        parsed = urlparse(base)
        host = parsed.hostname or "127.0.0.1"
        return f"postgresql://{user}@{host}:{parsed.port or 5432}/{name}"

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{owner}" LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB')
        conn.execute(f'CREATE ROLE "{app}" LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB')
        conn.execute(f'CREATE DATABASE "{name}" OWNER "{owner}"')
    try:
        env = {k: v for k, v in os.environ.items()
               if k not in {"DATABASE_URL", "DATABASE_OWNER_URL", "STEWARD_DB_SCOPE_ROLE",
                            "DJANGO_SETTINGS_MODULE"}}
        env.update(DATABASE_URL=url(app), STEWARD_VAR_DIR=str(tmp_path),
                   CELERY_BROKER_URL="memory://")
        out = _run(["migrate", "--noinput"], {**env, "DATABASE_OWNER_URL": url(owner)})
        assert f"Granted the app role '{app}'" in out.stdout
        creds = [json.loads(_run(["bootstrap_demo", "--json"], env).stdout.splitlines()[-1])
                 for _ in range(2)]
        assert creds[0] == creds[1]  # the second run found everything the first made
        verified = _run(["verify_audit"], env).stdout.strip()

        with psycopg.connect(url(app), autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM governance_proxykey").fetchone()[0] == 0
            keys = conn.execute("SELECT tenant_slug, revoked FROM steward_proxy_keys()")
            assert keys.fetchall() == [("demo", False)]
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("UPDATE governance_auditevent SET action = 'x'")
        with psycopg.connect(urlunparse(urlparse(base)._replace(path=f"/{name}", query="")),
                             autocommit=True) as conn:
            events = conn.execute("SELECT count(*) FROM governance_auditevent").fetchone()[0]
            owners = conn.execute(
                "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND relkind = 'r'")
            assert owners.fetchall() == [(owner,)]
            forced = conn.execute(
                "SELECT bool_and(relforcerowsecurity) FROM pg_class "
                "WHERE relname = 'governance_trajectory'").fetchone()[0]
            assert forced
        assert verified == f"audit chain OK: {events} events" and events >= 5
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'DROP ROLE IF EXISTS "{app}"')
            conn.execute(f'DROP ROLE IF EXISTS "{owner}"')


def test_migrate_and_grants_cover_reward_and_retention_tables(db):
    """The app role's write grants follow the append-only rules (grant_app_privileges)."""
    with connection.cursor() as cur:
        cur.execute("SELECT has_table_privilege(%s, 'governance_reward', 'UPDATE'), "
                    "has_table_privilege(%s, 'governance_reward', 'DELETE'), "
                    "has_table_privilege(%s, 'django_migrations', 'INSERT'), "
                    "has_table_privilege(%s, 'governance_retentionpolicy', 'UPDATE')",
                    [APP_ROLE] * 4)
        assert cur.fetchone() == (False, True, False, True)
