"""Shared fixtures: tenants, members of every role plus an outsider, REST clients.

Tests run against the real PostgreSQL named by DATABASE_URL (pytest-django creates the test
database, STEWARD_TEST_DATABASE, default test_steward)."""

from __future__ import annotations

import base64
import os

import pytest

# A master key for the test run, unless CI/the developer set one.
os.environ.setdefault("STEWARD_MASTER_KEY", base64.b64encode(os.urandom(32)).decode())

pytest_plugins = ["tests.live"]


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Password hashing is deliberately slow; tests don't need that."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


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


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """The audit log and rewards refuse TRUNCATE (migration 0003) unless the database sets
    `steward.allow_truncate`; only the test database does, so Django can flush it between
    transactional tests."""
    from django.db import connection

    with django_db_blocker.unblock():
        name = connection.settings_dict["NAME"]
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER DATABASE "{name}" SET steward.allow_truncate = \'on\'')
        connection.close()  # new connections pick the setting up
