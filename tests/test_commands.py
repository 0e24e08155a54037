"""The bootstrap management commands: create_tenant, create_proxy_key, create_api_token,
create_user, verify_audit, bootstrap_demo — in-process (call_command) for behaviour and audit
events, and as real `manage.py` subprocesses for exit codes and the "secret on the last line"
contract that scripts rely on."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import RequestFactory

from governance.auth import ApiTokenAuthentication
from governance.models import (
    Agent,
    ApiToken,
    AuditEvent,
    Membership,
    ProxyKey,
    Tenant,
)
from wire.crypto import token_hash

REPO = Path(__file__).resolve().parent.parent


def run_cmd(*args: str, **kwargs) -> list[str]:
    out = io.StringIO()
    call_command(*args, stdout=out, **kwargs)
    return out.getvalue().strip().splitlines()


def actions() -> list[str]:
    return list(AuditEvent.objects.order_by("seq").values_list("action", flat=True))


# --- create_tenant ------------------------------------------------------------------------


@pytest.mark.django_db
def test_create_tenant_is_idempotent_and_audited():
    lines = run_cmd("create_tenant", "acme", "--name", "Acme Bank")
    assert "created" in lines[-1]
    assert Tenant.objects.get(slug="acme").name == "Acme Bank"
    lines = run_cmd("create_tenant", "acme")
    assert "exists" in lines[-1]
    assert Tenant.objects.filter(slug="acme").count() == 1
    assert actions() == ["tenant.created"]
    ev = AuditEvent.objects.get()
    assert ev.actor == "system:cli"


@pytest.mark.django_db
def test_create_tenant_rejects_bad_slug():
    with pytest.raises(CommandError, match="invalid tenant slug"):
        run_cmd("create_tenant", "not a slug!")
    assert not Tenant.objects.exists()


# --- create_proxy_key -----------------------------------------------------------------------


@pytest.mark.django_db
def test_create_proxy_key_prints_key_last_and_stores_only_its_hash(tenant):
    lines = run_cmd("create_proxy_key", "--tenant", "acme", "--agent", "support-bot")
    key = lines[-1]
    assert key.startswith("stw_") and len(key) > 30
    assert len(lines) >= 2 and key not in "\n".join(lines[:-1])  # shown once
    agent = Agent.objects.get(tenant=tenant, name="support-bot")
    stored = ProxyKey.objects.get(agent=agent)
    assert stored.key_hash == token_hash(key)
    assert key not in json.dumps(list(ProxyKey.objects.values("prefix", "key_hash")))
    # A second key for the same agent reuses the agent.
    key2 = run_cmd("create_proxy_key", "--tenant", "acme", "--agent", "support-bot")[-1]
    assert key2 != key
    assert Agent.objects.filter(tenant=tenant).count() == 1
    assert ProxyKey.objects.filter(agent=agent).count() == 2
    assert actions().count("proxy_key.created") == 2
    assert actions().count("agent.created") == 1


@pytest.mark.django_db
def test_create_proxy_key_unknown_tenant():
    with pytest.raises(CommandError, match="unknown tenant 'nope'"):
        run_cmd("create_proxy_key", "--tenant", "nope", "--agent", "a")
    assert not Agent.objects.exists()


# --- create_api_token -----------------------------------------------------------------------


@pytest.mark.django_db
def test_create_api_token_creates_user_and_token_authenticates(tenant):
    token = run_cmd("create_api_token", "--tenant", "acme", "--user", "carol",
                    "--role", "compliance")[-1]
    assert token.startswith("stwt_")
    user = get_user_model().objects.get(username="carol")
    assert Membership.objects.get(user=user, tenant=tenant).role == "compliance"
    assert ApiToken.objects.get(user=user).key_hash == token_hash(token)

    request = RequestFactory().get("/api/v1/trajectories/", HTTP_AUTHORIZATION=f"Bearer {token}")
    from rest_framework.request import Request

    drf_request = Request(request)
    authed_user, _ = ApiTokenAuthentication().authenticate(drf_request)
    assert authed_user == user
    assert request.tenant == tenant

    # Existing user: another token, role updated (audited), still one user.
    token2 = run_cmd("create_api_token", "--tenant", "acme", "--user", "carol",
                     "--role", "auditor")[-1]
    assert token2 != token
    assert get_user_model().objects.filter(username="carol").count() == 1
    assert Membership.objects.get(user=user, tenant=tenant).role == "auditor"
    assert "membership.role_changed" in actions()
    assert actions().count("api_token.created") == 2


@pytest.mark.django_db
def test_create_api_token_bad_role_and_tenant(tenant):
    with pytest.raises(CommandError, match="invalid choice"):
        run_cmd("create_api_token", "--tenant", "acme", "--user", "x", "--role", "root")
    with pytest.raises(CommandError, match="unknown tenant"):
        run_cmd("create_api_token", "--tenant", "nope", "--user", "x", "--role", "admin")
    assert not get_user_model().objects.filter(username="x").exists()


# --- create_user ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_create_user_generated_password_is_last_line(tenant, monkeypatch):
    monkeypatch.delenv("STEWARD_PASSWORD", raising=False)
    lines = run_cmd("create_user", "--tenant", "acme", "--user", "dave", "--role", "steward")
    user = get_user_model().objects.get(username="dave")
    assert user.check_password(lines[-1])
    assert Membership.objects.get(user=user, tenant=tenant).role == "steward"

    # Re-run: the password stays (nothing printed that looks like one) ...
    lines2 = run_cmd("create_user", "--tenant", "acme", "--user", "dave", "--role", "steward")
    assert "password unchanged" in lines2[-1]
    user.refresh_from_db()
    assert user.check_password(lines[-1])
    # ... unless a reset is asked for.
    lines3 = run_cmd("create_user", "--tenant", "acme", "--user", "dave", "--role", "steward",
                     "--reset-password")
    user.refresh_from_db()
    assert lines3[-1] != lines[-1] and user.check_password(lines3[-1])


@pytest.mark.django_db
def test_create_user_password_from_env(tenant, monkeypatch):
    monkeypatch.setenv("STEWARD_PASSWORD", "a long enough passphrase 42")
    lines = run_cmd("create_user", "--tenant", "acme", "--user", "erin", "--role", "auditor")
    assert "a long enough passphrase 42" not in "\n".join(lines)
    assert get_user_model().objects.get(username="erin").check_password(
        "a long enough passphrase 42")

    monkeypatch.setenv("STEWARD_PASSWORD", "short")
    with pytest.raises(CommandError, match="STEWARD_PASSWORD rejected"):
        run_cmd("create_user", "--tenant", "acme", "--user", "frank", "--role", "auditor")
    assert not get_user_model().objects.filter(username="frank").exists()


# --- verify_audit ---------------------------------------------------------------------------


def _tamper(seq: int) -> None:
    # The audit table may carry an append-only trigger; the test (a superuser) switches
    # triggers off for the forged UPDATE, like an attacker with direct database access.
    with connection.cursor() as cur:
        cur.execute("SET session_replication_role = replica")
        cur.execute("UPDATE governance_auditevent SET payload = '{\"forged\": true}' "
                    "WHERE seq = %s", [seq])
        cur.execute("RESET session_replication_role")


@pytest.mark.django_db
def test_verify_audit_ok_then_broken(tenant):
    run_cmd("create_proxy_key", "--tenant", "acme", "--agent", "a")
    n = AuditEvent.objects.count()
    assert n >= 3
    assert run_cmd("verify_audit")[-1] == f"audit chain OK: {n} events"
    _tamper(2)
    with pytest.raises(CommandError, match=r"seq 2\b"):
        run_cmd("verify_audit")


# --- bootstrap_demo -------------------------------------------------------------------------


@pytest.mark.django_db
def test_bootstrap_demo_stores_and_reprints_credentials(settings, tmp_path):
    settings.VAR_DIR = tmp_path
    path = tmp_path / "demo-credentials.json"
    run_cmd("bootstrap_demo")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    creds = json.loads(path.read_text())
    assert creds["tenant"] == "demo" and creds["username"] == "demo-admin"
    tenant = Tenant.objects.get(slug="demo")
    user = get_user_model().objects.get(username="demo-admin")
    assert user.check_password(creds["password"])
    assert Membership.objects.get(user=user, tenant=tenant).role == "admin"
    assert ProxyKey.objects.get(key_hash=token_hash(creds["proxy_key"])).agent.name == "demo-agent"
    assert ApiToken.objects.get(key_hash=token_hash(creds["api_token"])).user == user
    events = AuditEvent.objects.count()

    # Second run: same secrets, nothing new in the database or the audit log.
    lines = run_cmd("bootstrap_demo")
    assert json.loads(path.read_text()) == creds
    assert creds["proxy_key"] in "\n".join(lines) and creds["password"] in "\n".join(lines)
    assert ProxyKey.objects.count() == 1 and ApiToken.objects.count() == 1
    assert AuditEvent.objects.count() == events
    out = json.loads(run_cmd("bootstrap_demo", "--json")[-1])
    assert out == creds

    # The file is gone (secrets unknown): everything is issued anew and works.
    path.unlink()
    run_cmd("bootstrap_demo")
    new = json.loads(path.read_text())
    assert new["proxy_key"] != creds["proxy_key"] and new["api_token"] != creds["api_token"]
    assert new["password"] != creds["password"]
    user.refresh_from_db()
    assert user.check_password(new["password"])
    assert ProxyKey.objects.filter(key_hash=token_hash(new["proxy_key"])).exists()
    assert Tenant.objects.filter(slug="demo").count() == 1

    # A revoked key is replaced; the other secrets are kept.
    from governance.services import revoke_proxy_key

    revoke_proxy_key("system:test", ProxyKey.objects.get(key_hash=token_hash(new["proxy_key"])))
    run_cmd("bootstrap_demo")
    newer = json.loads(path.read_text())
    assert newer["proxy_key"] != new["proxy_key"]
    assert newer["api_token"] == new["api_token"] and newer["password"] == new["password"]


# --- as real processes ----------------------------------------------------------------------


def _manage(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    s = connection.settings_dict
    env = dict(os.environ)
    # The subprocess must see the test database (committed data: transactional_db).
    env["DATABASE_URL"] = (f"postgresql://{s['USER']}:{s['PASSWORD'] or ''}@{s['HOST']}:"
                           f"{s['PORT'] or 5432}/{s['NAME']}")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(REPO / "manage.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.django_db(transaction=True)
def test_commands_as_processes_exit_codes_and_last_line(tmp_path):
    from governance.services import create_tenant

    create_tenant("system:test", "acme", "Acme")

    r = _manage("create_proxy_key", "--tenant", "acme", "--agent", "bot")
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip().splitlines()[-1]
    assert ProxyKey.objects.filter(key_hash=token_hash(key), agent__name="bot").exists()

    r = _manage("create_proxy_key", "--tenant", "nope", "--agent", "bot")
    assert r.returncode == 1
    assert "unknown tenant 'nope'" in r.stderr
    assert "Traceback" not in r.stderr

    r = _manage("create_api_token", "--tenant", "acme", "--user", "u1", "--role", "admin")
    assert r.returncode == 0, r.stderr
    assert ApiToken.objects.filter(key_hash=token_hash(r.stdout.strip().splitlines()[-1])).exists()

    r = _manage("create_tenant", "acme")
    assert r.returncode == 0 and "exists" in r.stdout

    r = _manage("verify_audit")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"audit chain OK: {AuditEvent.objects.count()} events"
    _tamper(3)
    r = _manage("verify_audit")
    assert r.returncode != 0
    assert "seq 3" in r.stderr

    r = _manage("bootstrap_demo", "--json", env_extra={"STEWARD_VAR_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    creds = json.loads(r.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "demo-credentials.json").read_text()) == creds

    r = _manage("create_user", "--help")
    assert r.returncode == 0 and "STEWARD_PASSWORD" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_steward_manage_works_as_the_readme_writes_it_on_the_embedded_database(tmp_path):
    """Issue 13.3: `.venv/bin/steward manage ...` (no activated venv, nothing configured: the
    embedded PostgreSQL under STEWARD_VAR_DIR) runs the command, and pgserver's INFO lines do
    not drown its output."""
    from config.embedded import stop_embedded

    steward = Path(sys.executable).parent / "steward"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DATABASE_", "CELERY_", "DJANGO_", "STEWARD_", "VIRTUAL_ENV"))}
    env.update(STEWARD_VAR_DIR=str(tmp_path / "var"), STEWARD_MASTER_KEY=os.environ[
        "STEWARD_MASTER_KEY"], PATH="/usr/bin:/bin")  # no .venv/bin on PATH
    try:
        for args in (["migrate", "--noinput", "-v", "0"], ["create_tenant", "newco"]):
            proc = subprocess.run([str(steward), "manage", *args], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=240)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "INFO pgserver" not in proc.stdout + proc.stderr
        assert "newco" in proc.stdout + proc.stderr
    finally:
        stop_embedded(tmp_path / "var")


def test_steward_manage_passes_every_option_through(capsys):
    from config.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["manage", "create_tenant", "--help"])
    assert exc.value.code == 0
    assert "usage: steward manage create_tenant" in capsys.readouterr().out
