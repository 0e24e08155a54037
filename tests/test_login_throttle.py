"""Console login throttling (issue 12): after STEWARD_LOGIN_FAILURE_LIMIT wrong passwords for a
username from one address, that username is locked from that address — the right password
included — with a page that says why (429); other addresses and other usernames are not; the
lock ends after the cool-off; each lockout is audited once. Through Django's real login view,
django-axes' real backend and middleware, and the real database."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.utils import timezone

from governance.models import AuditEvent

PASSWORD = "correct horse battery staple"
LIMIT = 5


def login(client, username: str, password: str, ip: str = "10.0.0.1"):
    return client.post("/login/", {"username": username, "password": password},
                       REMOTE_ADDR=ip)


@pytest.fixture
def olivia(make_member):
    return make_member("compliance", "olivia")


def test_wrong_passwords_lock_the_username_from_that_address(client, olivia, tenant):
    for _ in range(LIMIT - 1):
        assert login(client, "olivia", "wrong").status_code == 200  # the form again
    locked = login(client, "olivia", "wrong")
    assert locked.status_code == 429
    assert "Too many failed logins" in locked.content.decode()
    # Locked: even the right password is refused, from this address.
    right = login(client, "olivia", PASSWORD)
    assert right.status_code == 429 and "_auth_user_id" not in client.session
    # Another address, and another username from this address, still log in.
    assert login(client, "olivia", PASSWORD, ip="10.0.0.2").status_code == 302
    client.logout()
    assert login(client, "nobody-else", "wrong").status_code == 200

    # One audit event for the lockout, in the user's tenant, however often it was hit since.
    for _ in range(3):
        assert login(client, "olivia", "wrong").status_code == 429
    events = list(AuditEvent.objects.filter(action="login.locked_out"))
    assert len(events) == 1
    event = events[0]
    assert (event.tenant_id, event.actor, event.object_type, event.object_id) == (
        tenant.pk, "system:login", "user", str(olivia.pk))
    assert event.payload["ip_address"] == "10.0.0.1"
    assert event.payload["failure_limit"] == LIMIT
    assert "olivia" not in str(event.payload) and "wrong" not in str(event.payload)


def test_the_lock_ends_after_the_cool_off(client, olivia):
    for _ in range(LIMIT):
        login(client, "olivia", "wrong")
    assert login(client, "olivia", PASSWORD).status_code == 429
    AccessAttempt.objects.update(attempt_time=timezone.now() - timedelta(minutes=16))
    assert login(client, "olivia", PASSWORD).status_code == 302


def test_a_successful_login_resets_the_count(client, olivia):
    for _ in range(LIMIT - 1):
        login(client, "olivia", "wrong")
    assert login(client, "olivia", PASSWORD).status_code == 302
    client.logout()
    for _ in range(LIMIT - 1):
        assert login(client, "olivia", "wrong").status_code == 200
    assert login(client, "olivia", PASSWORD).status_code == 302


def test_an_unknown_username_is_locked_and_audited_without_a_tenant(client, db):
    for _ in range(LIMIT):
        login(client, "admin", "guess")
    assert login(client, "admin", "guess").status_code == 429
    event = AuditEvent.objects.get(action="login.locked_out")
    assert event.tenant_id is None and event.object_type == "username"
    assert "admin" not in str(event.payload) and len(event.payload["username_hmac"]) == 64
    from django.core.management import call_command

    call_command("verify_audit")  # the tenant-less event sits in the one chain


def test_the_forwarded_address_counts_only_behind_a_trusted_front(client, olivia, settings):
    # Without a trusted front, X-Forwarded-For is anyone's to send: ignored.
    for i in range(LIMIT):
        client.post("/login/", {"username": "olivia", "password": "wrong"},
                    REMOTE_ADDR="10.0.0.9", HTTP_X_FORWARDED_FOR=f"192.0.2.{i}")
    assert login(client, "olivia", PASSWORD, ip="10.0.0.9").status_code == 429
    # Behind nginx (one hop): the address nginx saw is the client's.
    settings.STEWARD_TRUSTED_PROXY_HOPS = 1
    ok = client.post("/login/", {"username": "olivia", "password": PASSWORD},
                     REMOTE_ADDR="10.0.0.9", HTTP_X_FORWARDED_FOR="spoofed, 198.51.100.7")
    assert ok.status_code == 302
