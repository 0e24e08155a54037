"""Console keys page: proxy keys shown once with a ready-to-paste snippet, revocation with a
confirmation (audited), API tokens (only ever for oneself), roles and tenant scope."""

from __future__ import annotations

import re

import pytest
from django.conf import settings

from governance import services
from governance.models import ApiToken, AuditEvent, ProxyKey
from wire.crypto import token_hash

PROXY_SECRET = re.compile(r"stw_[A-Za-z0-9_\-]{20,}")
TOKEN_SECRET = re.compile(r"stwt_[A-Za-z0-9_\-]{20,}")


def _login(client, make_member, role: str = "admin"):
    user = make_member(role)
    client.force_login(user)
    return user


def test_admin_sees_keys_and_tokens(client, make_member, tenant):
    key = services.create_proxy_key("system:test", tenant, "billing-bot").record
    _login(client, make_member)
    body = client.get("/keys/").content.decode()
    assert "Create a proxy key" in body and '<label for="key-agent">' in body
    assert f"{key.prefix}…" in body and "billing-bot" in body and "active" in body
    assert f"/keys/{key.pk}/revoke/" in body
    assert "API tokens" in body and "Create my API token" in body
    # No member picker: a token is only ever issued to the person asking for it.
    assert '<label for="token-user">' not in body and 'name="user"' not in body


@pytest.mark.parametrize("role", ["steward", "compliance", "auditor"])
def test_other_roles_are_refused(client, make_member, tenant, role):
    key = services.create_proxy_key("system:test", tenant, "billing-bot").record
    _login(client, make_member, role)
    assert client.get("/keys/").status_code == 403
    assert client.post("/keys/", {"agent": "x"}).status_code == 403
    assert client.post(f"/keys/{key.pk}/revoke/").status_code == 403
    assert client.post("/keys/api-tokens/", {"user": "1"}).status_code == 403
    key.refresh_from_db()
    assert key.revoked_at is None and ProxyKey.objects.count() == 1


def test_new_key_is_shown_once(client, make_member, tenant):
    admin = _login(client, make_member)
    response = client.post("/keys/", {"agent": " support-bot "})
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    body = response.content.decode()
    secret = PROXY_SECRET.search(body).group(0)
    key = ProxyKey.objects.select_related("agent").get()
    assert key.key_hash == token_hash(secret) and key.agent.name == "support-bot"
    assert key.created_by == admin
    base_url = f"http://testserver:{settings.STEWARD_PROXY_PORT}/v1"
    assert f'OpenAI(base_url="{base_url}", api_key="{secret}")' in body
    assert "only time it is shown" in body
    assert AuditEvent.objects.filter(action="proxy_key.created", object_id=str(key.pk),
                                     actor=f"user:{admin.pk}").exists()
    # Never again: the list (and the pages after it) show the prefix only.
    listing = client.get("/keys/").content.decode()
    assert secret not in listing and f"{key.prefix}…" in listing
    assert PROXY_SECRET.search(listing) is None


def test_missing_agent_is_an_error_and_no_key(client, make_member):
    _login(client, make_member)
    response = client.post("/keys/", {"agent": "  "})
    assert response.status_code == 400
    assert "No key was created" in response.content.decode()
    response = client.post("/keys/", {"agent": "a" * 129})
    assert response.status_code == 400 and 'value="' + "a" * 129 + '"' in (
        response.content.decode())
    assert ProxyKey.objects.count() == 0


def test_revoke_confirms_then_revokes_and_audits(client, make_member, tenant):
    key = services.create_proxy_key("system:test", tenant, "billing-bot").record
    admin = _login(client, make_member)
    confirm = client.get(f"/keys/{key.pk}/revoke/").content.decode()
    assert "Revoke key" in confirm and "billing-bot" in confirm and "cannot be undone" in confirm
    key.refresh_from_db()
    assert key.revoked_at is None  # the GET changes nothing
    response = client.post(f"/keys/{key.pk}/revoke/")
    assert response.status_code == 302 and response["Location"] == "/keys/"
    key.refresh_from_db()
    assert key.revoked_at is not None
    event = AuditEvent.objects.get(action="proxy_key.revoked", object_id=str(key.pk))
    assert event.actor == f"user:{admin.pk}" and event.payload == {"prefix": key.prefix}
    listing = client.get("/keys/").content.decode()
    assert "is revoked" in listing and "revoked " in listing
    assert f"/keys/{key.pk}/revoke/" not in listing
    # Again: nothing new is written.
    client.post(f"/keys/{key.pk}/revoke/")
    assert AuditEvent.objects.filter(action="proxy_key.revoked").count() == 1


def test_outsider_cannot_see_or_revoke(client, make_member, tenant, other_tenant):
    key = services.create_proxy_key("system:test", tenant, "billing-bot").record
    client.force_login(make_member("admin", "outsider", on=other_tenant))
    listing = client.get("/keys/").content.decode()
    assert key.prefix not in listing and "No proxy keys yet" in listing
    assert client.get(f"/keys/{key.pk}/revoke/").status_code == 404
    assert client.post(f"/keys/{key.pk}/revoke/").status_code == 404
    key.refresh_from_db()
    assert key.revoked_at is None


def test_own_api_token_is_shown_once(client, make_member, tenant, other_tenant):
    admin = _login(client, make_member)
    response = client.post("/keys/api-tokens/")
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    secret = TOKEN_SECRET.search(response.content.decode()).group(0)
    token = ApiToken.objects.get(user=admin)
    assert token.key_hash == token_hash(secret) and token.tenant_id == tenant.pk
    assert AuditEvent.objects.filter(action="api_token.created", object_id=str(token.pk),
                                     actor=f"user:{admin.pk}").exists()
    listing = client.get("/keys/").content.decode()
    assert secret not in listing and f"{token.prefix}…" in listing
    # Naming oneself explicitly is the same thing.
    assert client.post("/keys/api-tokens/", {"user": str(admin.pk)}).status_code == 200
    assert ApiToken.objects.filter(user=admin).count() == 2
    # Someone who is not a member of this tenant gets no token.
    outsider = make_member("admin", "outsider", on=other_tenant)
    response = client.post("/keys/api-tokens/", {"user": str(outsider.pk)}, follow=True)
    assert "choose a member of this tenant" in response.content.decode()
    assert not ApiToken.objects.filter(user=outsider).exists()


@pytest.mark.parametrize("role", ["compliance", "steward", "auditor", "admin"])
def test_admin_cannot_mint_a_token_for_another_member(client, make_member, tenant, role):
    """Separation of duties: a token minted for a compliance officer would let the admin read
    raw payloads and approve as the officer, with the audit log blaming the officer."""
    _login(client, make_member)
    other = make_member(role, f"other-{role}")
    response = client.post("/keys/api-tokens/", {"user": str(other.pk)}, follow=True)
    body = response.content.decode()
    assert "No token was created" in body and "only to yourself" in body
    assert TOKEN_SECRET.search(body) is None
    assert not ApiToken.objects.filter(user=other).exists()
    assert not AuditEvent.objects.filter(action="api_token.created").exists()


def test_api_token_revoke_is_audited_and_the_token_stops_working(client, make_member, tenant,
                                                                 other_tenant, api_client_for):
    from governance.services import create_api_token

    admin = _login(client, make_member)
    auditor = make_member("auditor")
    issued = create_api_token("system:test", tenant, auditor)
    rest = api_client_for(auditor, tenant)
    rest.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.secret}")
    assert rest.get("/api/v1/trajectories/").status_code == 200
    listing = client.get("/keys/").content.decode()
    url = f"/keys/api-tokens/{issued.record.pk}/revoke/"
    # The list links to a confirmation step, as for proxy keys (issue 13.8: one click revoked):
    # no form on the list posts there, and the GET changes nothing.
    assert f'<a href="{url}"' in listing and f'action="{url}"' not in listing
    confirm = client.get(url)
    assert confirm.status_code == 200
    body = confirm.content.decode()
    assert "Revoke API token" in body and auditor.username in body
    assert f'<form method="post" action="{url}">' in body and "Cancel" in body
    assert not AuditEvent.objects.filter(action="api_token.revoked").exists()
    assert rest.get("/api/v1/trajectories/").status_code == 200
    response = client.post(f"/keys/api-tokens/{issued.record.pk}/revoke/", follow=True)
    assert "is revoked" in response.content.decode()
    assert rest.get("/api/v1/trajectories/").status_code == 401
    assert AuditEvent.objects.filter(action="api_token.revoked",
                                     object_id=str(issued.record.pk),
                                     actor=f"user:{admin.pk}").count() == 1
    # Again: nothing more is written.
    client.post(f"/keys/api-tokens/{issued.record.pk}/revoke/")
    assert AuditEvent.objects.filter(action="api_token.revoked").count() == 1
    # Another tenant's token is not found; a steward may not revoke.
    theirs = create_api_token("system:test", other_tenant,
                              make_member("admin", "outsider", on=other_tenant))
    assert client.post(f"/keys/api-tokens/{theirs.record.pk}/revoke/").status_code == 404
    client.force_login(make_member("steward"))
    assert client.post(f"/keys/api-tokens/{theirs.record.pk}/revoke/").status_code == 403


def test_keys_filter_by_agent_and_paginate(client, make_member, tenant):
    keys = [services.create_proxy_key("system:test", tenant, f"bot-{i % 2}").record
            for i in range(52)]
    _login(client, make_member)
    first = client.get("/keys/").content.decode()
    assert "Page 1 of 2" in first and "52 keys" in first
    bot1 = client.get("/keys/?agent=bot-1").content.decode()
    assert "26 keys" in bot1 and "Page 1 of 1" in bot1
    assert keys[0].prefix not in bot1 and keys[1].prefix in bot1
    assert "No keys for nobody" in client.get("/keys/?agent=nobody").content.decode()
