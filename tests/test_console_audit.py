"""Console audit log: roles, tenant scope, filters, keyset pages and the chain's verification
(a tampered row is reported with its sequence number)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from governance import services
from governance.models import AuditEvent
from governance.views.audit import VERIFY_SESSION_KEY

HTMX = {"HTTP_HX_REQUEST": "true"}


def _login(client, make_member, role: str, username: str | None = None):
    user = make_member(role, username)
    client.force_login(user)
    return user


def _rows(body: str) -> str:
    """The event table only (the filter form and datalists repeat action names)."""
    if "<tbody>" not in body:
        return ""
    return body[body.index("<tbody>"):body.index("</tbody>")]


def _tamper(seq: int) -> None:
    with connection.cursor() as cur:  # a superuser switches the trigger off and edits
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cur.execute("ALTER TABLE governance_auditevent DISABLE TRIGGER auditevent_append_only")
        cur.execute("UPDATE governance_auditevent SET payload = jsonb_set(payload, '{value}', "
                    "'100') WHERE seq = %s", [seq])
        cur.execute("ALTER TABLE governance_auditevent ENABLE TRIGGER auditevent_append_only")


@pytest.mark.parametrize("role,verify", [("admin", True), ("compliance", True),
                                         ("auditor", True)])
def test_roles_with_read_audit_see_the_log(client, make_member, tenant, role, verify):
    _login(client, make_member, role)
    body = client.get("/audit/").content.decode()
    assert "tenant.created" in _rows(body) and "membership.created" in _rows(body)
    assert ("Verify chain" in body) == verify
    assert "Not verified in this session" in body


def test_steward_is_refused(client, make_member):
    _login(client, make_member, "steward")
    assert client.get("/audit/").status_code == 403
    assert client.post("/audit/verify/").status_code == 403


def test_outsider_sees_only_their_tenant(client, make_member, tenant, other_tenant):
    services.create_proxy_key("system:test", tenant, "acme-bot")
    _login(client, make_member, "admin")  # acme's own view has the event
    assert "proxy_key.created" in _rows(client.get("/audit/").content.decode())
    client.logout()
    client.force_login(make_member("admin", "outsider", on=other_tenant))
    rows = _rows(client.get("/audit/").content.decode())
    assert "proxy_key.created" not in rows and "tenant.created" in rows
    for ev in AuditEvent.objects.filter(tenant=tenant):
        assert f"<td>{ev.seq}</td>" not in rows


def test_filters_narrow_the_list(client, make_member, tenant):
    admin = _login(client, make_member, "admin")
    key = services.create_proxy_key(admin, tenant, "billing-bot").record
    services.revoke_proxy_key(admin, key)
    reward = services.record_reward("system:test", tenant, value=1.0, response_id="r-1")

    rows = _rows(client.get("/audit/?action=proxy_key.created").content.decode())
    assert "proxy_key.created" in rows and "proxy_key.revoked" not in rows
    assert "reward.recorded" not in rows
    rows = _rows(client.get("/audit/?action=proxy_key.").content.decode())
    assert "proxy_key.created" in rows and "proxy_key.revoked" in rows
    assert "agent.created" not in rows
    rows = _rows(client.get(f"/audit/?actor=user:{admin.pk}").content.decode())
    assert "proxy_key.revoked" in rows and "reward.recorded" not in rows
    assert admin.username in rows  # the actor's name next to the id
    rows = _rows(client.get(f"/audit/?object_type=reward&object_id={reward.pk}")
                 .content.decode())
    assert "reward.recorded" in rows and rows.count("<tr>") == 1
    today = timezone.localdate()
    tomorrow, yesterday = today + timedelta(days=1), today - timedelta(days=1)
    assert "reward.recorded" in _rows(client.get(f"/audit/?since={today}&until={today}")
                                      .content.decode())
    empty = client.get(f"/audit/?since={tomorrow}").content.decode()
    assert _rows(empty) == "" and "No event matches these filters" in empty
    assert _rows(client.get(f"/audit/?until={yesterday}").content.decode()) == ""
    bad = client.get("/audit/?since=31.12.2025").content.decode()
    assert "From must be a date" in bad and "reward.recorded" in _rows(bad)
    assert 'value="31.12.2025"' in bad  # the input is kept


def test_keyset_pages(client, make_member, tenant):
    for i in range(60):
        services.record_reward("system:test", tenant, value=float(i), response_id=f"r-{i}")
    _login(client, make_member, "auditor")
    seqs = list(AuditEvent.objects.filter(tenant=tenant, action="reward.recorded")
                .order_by("-seq")
                .values_list("seq", flat=True))
    first = client.get("/audit/?action=reward.recorded").content.decode()
    assert _rows(first).count("<tr>") == 50
    older = seqs[49]
    assert f"action=reward.recorded&amp;before={older}" in first
    second = client.get(f"/audit/?action=reward.recorded&before={older}").content.decode()
    assert _rows(second).count("<tr>") == 10 and "Older" not in second
    assert f"<td>{older}</td>" not in _rows(second) and f"<td>{seqs[50]}</td>" in second


def test_verify_reports_ok_then_the_tampered_row(client, make_member, tenant):
    events = [services.record_reward("system:test", tenant, value=float(i),
                                     response_id=f"r-{i}") for i in range(3)]
    _login(client, make_member, "auditor")
    response = client.post("/audit/verify/")
    assert response.status_code == 302 and response["Location"] == "/audit/"
    page = client.get("/audit/").content.decode()
    assert "Audit chain verified" in page and "Intact." in page
    assert client.session[VERIFY_SESSION_KEY]["ok"] is True

    target = AuditEvent.objects.get(object_type="reward", object_id=str(events[1].pk)).seq
    _tamper(target)
    # Before the last verified event: "Verify chain" walks only what came since; the full
    # walk finds it, and from then on every click reports it.
    fragment = client.post("/audit/verify/", {"full": "1"}, **HTMX).content.decode()
    assert f"Broken at seq {target}" in fragment and "<html" not in fragment
    assert "content" in fragment
    page = client.get("/audit/").content.decode()
    assert f"Broken at seq {target}" in page  # remembered in the session, not re-run
    client.post("/audit/verify/")
    assert f"Audit chain broken at seq {target}" in client.get("/audit/").content.decode()


def test_verify_button_walks_only_new_events_and_counts_this_tenant(
        client, make_member, tenant, other_tenant):
    for i in range(3):
        services.record_reward("system:test", tenant, value=float(i), response_id=f"r-{i}")
        services.record_reward("system:test", other_tenant, value=1.0, response_id=f"o-{i}")
    _login(client, make_member, "auditor")
    client.post("/audit/verify/")
    mine = AuditEvent.objects.filter(tenant=tenant).count()
    page = client.get("/audit/").content.decode()
    assert f"This tenant has {mine} events" in page and "whole chain walked" in page
    services.record_reward("system:test", tenant, value=9.0, response_id="r-new")
    fragment = client.post("/audit/verify/", **HTMX).content.decode()
    assert "1 new event checked" in fragment and "Intact." in fragment
    assert f"This tenant has {mine + 1} events" in fragment


def test_no_verification_on_page_load(client, make_member, tenant, monkeypatch):
    import governance.views.audit as view

    def boom():
        raise AssertionError("no verification may run on a page load")

    monkeypatch.setattr(view, "verify_new_events", boom)
    monkeypatch.setattr(view, "verify_full_chain", boom)
    _login(client, make_member, "compliance")
    assert client.get("/audit/").status_code == 200


def test_actor_by_username_action_family_without_its_dot_and_people_only(
        client, make_member, tenant):
    """Issue 13.8: a username filters like its user:<id>; "proxy_key" is the family without the
    trailing dot; "people only" hides the system events around what people did; rows show
    the person's name."""
    admin = _login(client, make_member, "admin", "ada-admin")
    key = services.create_proxy_key(admin, tenant, "billing-bot").record
    services.revoke_proxy_key(admin, key)
    services.record_reward("system:test", tenant, value=1.0, response_id="r-1")

    rows = _rows(client.get("/audit/?actor=ada-admin").content.decode())
    assert "proxy_key.revoked" in rows and "reward.recorded" not in rows
    assert '<a href="?actor=ada-admin">ada-admin</a>' in rows
    unknown = client.get("/audit/?actor=nobody-here").content.decode()
    assert _rows(unknown) == "" and "no member of" in unknown and "nobody-here" in unknown

    rows = _rows(client.get("/audit/?action=proxy_key").content.decode())
    assert "proxy_key.created" in rows and "proxy_key.revoked" in rows
    assert "agent.created" not in rows and "reward.recorded" not in rows

    everyone = _rows(client.get("/audit/").content.decode())
    assert "system:test" in everyone
    people = _rows(client.get("/audit/?people=1").content.decode())
    assert "system:test" not in people and "reward.recorded" not in people
    assert "proxy_key.revoked" in people
    assert set(AuditEvent.objects.filter(tenant=tenant).values_list("actor", flat=True)) > {
        f"user:{admin.pk}"}
