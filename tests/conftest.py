"""Shared fixtures: tenants, members of every role plus an outsider, REST clients.

Tests run against the real PostgreSQL named by DATABASE_URL (pytest-django creates the test
database, STEWARD_TEST_DATABASE, default test_steward)."""

from __future__ import annotations

import base64
import contextlib
import os
import sys

import pytest

# A master key for the test run, unless CI/the developer set one.
os.environ.setdefault("STEWARD_MASTER_KEY", base64.b64encode(os.urandom(32)).decode())

pytest_plugins = ["tests.live", "tests.browser"]


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Password hashing is deliberately slow; tests don't need that."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def fresh_recent_bodies():
    """The step builder's per-process cache of opened calls (rawstore.RecentBodies) starts
    empty in each test: a test's rows are rolled back after it, and a later test may reuse a
    flow id that the cache still holds (in production flow ids are unique and rows stay)."""
    tasks = sys.modules.get("governance.tasks")  # not imported here for tests that need none
    if tasks is not None:
        tasks.RECENT_BODIES = tasks.RecentBodies()
    # Likewise the builder's session memo (capture/session_memo.py): item ids and
    # trajectories of rolled-back rows.
    memo = sys.modules.get("governance.capture.session_memo")
    if memo is not None:
        memo.SESSION_MEMO.clear()
    yield


@pytest.fixture
def tenant(db):
    from governance.services import create_tenant

    return create_tenant("system:test", "acme", "Acme Bank")[0]


@pytest.fixture
def other_tenant(db):
    from governance.services import create_tenant

    return create_tenant("system:test", "globex", "Globex")[0]


@pytest.fixture
def make_member(tenant):
    from governance.services import ensure_member

    def make(role: str, username: str | None = None, on=None):
        user, _, _ = ensure_member("system:test", on or tenant, username or f"{role}-user",
                                   role, password="correct horse battery staple")
        return user

    return make


@pytest.fixture
def api_client_for():
    """api_client_for(user, tenant) -> a DRF APIClient authenticated with a fresh token."""
    from rest_framework.test import APIClient

    from governance.services import create_api_token

    def make(user, tenant):
        issued = create_api_token("system:test", tenant, user)
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.secret}")
        return client

    return make


# The role the services run as (NOBYPASSRLS, owns nothing), as in production.
APP_ROLE = "steward_app"


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """Test database set-up, after pytest-django created and migrated it as DATABASE_URL's user
    (the superuser, which owns the tables and bypasses row-level security):

    - The audit log and rewards refuse TRUNCATE (migration 0003) unless the database sets
      `steward.allow_truncate`; only the test database does, so Django can flush it between
      transactional tests.
    - Row-level security for real: the app role exists with production's grants
      (governance.tenancy.grant_app_privileges), and STEWARD_DB_SCOPE_ROLE makes every tenant,
      system and request scope (governance/tenancy.py) assume it for its transaction. So all
      code under test that runs in a scope — services, requests, tasks, the shipper, retention —
      sees only its tenant's rows and has only the app role's privileges, while fixtures and
      assertions outside any scope read and write as the superuser (across tenants, and able to
      tamper like a superuser would). tests/test_rls.py also runs flows on connections that are
      the app role throughout."""
    from django.conf import settings
    from django.db import DatabaseError, connection

    from governance.tenancy import ensure_app_role, grant_app_privileges

    with django_db_blocker.unblock():
        name = connection.settings_dict["NAME"]
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER DATABASE "{name}" SET steward.allow_truncate = \'on\'')
            ensure_app_role(cursor, APP_ROLE, login=False)
            grant_app_privileges(cursor, APP_ROLE)
        connection.close()  # new connections pick the setting up
    previous = settings.STEWARD_DB_SCOPE_ROLE
    settings.STEWARD_DB_SCOPE_ROLE = APP_ROLE
    yield
    settings.STEWARD_DB_SCOPE_ROLE = previous
    # A connection that a test's thread opened (a live server's, a fake upstream's) outlives
    # the test, and pytest-django's DROP DATABASE then fails ("being accessed by other users")
    # and leaves the test database on disk: end them first, as DROP DATABASE ... WITH (FORCE)
    # would. A role that may not end them leaves them, as before.
    with django_db_blocker.unblock(), contextlib.suppress(DatabaseError):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE datname = %s AND pid <> pg_backend_pid()", [name])


@pytest.fixture
def people(make_member, tenant, other_tenant, api_client_for):
    """(users, clients) keyed by role: an owner (admin), a steward, two compliance officers
    (four eyes needs a second), an auditor, and an outsider (admin of another tenant)."""
    users = {
        "admin": make_member("admin", "owner"),
        "steward": make_member("steward", "stew"),
        "compliance": make_member("compliance", "comp"),
        "compliance2": make_member("compliance", "comp2"),
        "auditor": make_member("auditor", "aud"),
        "outsider": make_member("admin", "outsider", on=other_tenant),
    }
    clients = {name: api_client_for(u, other_tenant if name == "outsider" else tenant)
               for name, u in users.items()}
    return users, clients
