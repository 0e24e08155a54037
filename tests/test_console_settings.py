"""Console settings: retention policies (read by every role, changed by manage_retention, each
change audited) and the sanitizer policy (operator per entity type, manage_sanitizer only; a bad
operator changes nothing)."""

from __future__ import annotations

import pytest

from governance import services
from governance.models import AuditEvent, RetentionPolicy, Tenant
from governance.retention import DEFAULT_AUDIT_DAYS, DEFAULT_STEPS_DAYS

ROLES = ["admin", "steward", "compliance", "auditor"]
MANAGE_RETENTION = {"admin", "compliance"}
MANAGE_SANITIZER = {"admin", "compliance"}
GOOD = {"classification": "confidential", "steps_days": "90", "raw_days": "3",
        "findings_days": "90", "audit_days": "400"}


def _login(client, make_member, role: str = "compliance"):
    user = make_member(role)
    client.force_login(user)
    return user


@pytest.mark.parametrize("role", ROLES)
def test_every_role_reads_what_it_may_change_shown(client, make_member, tenant, role):
    _login(client, make_member, role)
    body = client.get("/settings/").content.decode()
    assert "In force now" in body and "No policies: the defaults above apply" in body
    assert f"<td>{DEFAULT_STEPS_DAYS}</td>" in body and f"<td>{DEFAULT_AUDIT_DAYS}</td>" in body
    assert "EMAIL_ADDRESS" in body and "placeholder" in body
    assert ('action="/settings/retention/"' in body) == (role in MANAGE_RETENTION)
    assert ('name="op-EMAIL_ADDRESS"' in body) == (role in MANAGE_SANITIZER)
    if role not in MANAGE_SANITIZER:
        assert "needs the manage_sanitizer permission" in body


@pytest.mark.parametrize("role", ["steward", "auditor"])
def test_read_only_roles_cannot_change(client, make_member, tenant, role):
    policy = services.set_retention_policy("system:test", tenant, "*", steps_days=30,
                                           raw_days=1, findings_days=30, audit_days=30)
    _login(client, make_member, role)
    assert client.post("/settings/retention/", GOOD).status_code == 403
    assert client.post(f"/settings/retention/{policy.pk}/delete/").status_code == 403
    assert client.post("/settings/sanitizer/", {"op-EMAIL_ADDRESS": "hash",
                                                "score_threshold": "0.5"}).status_code == 403
    assert list(RetentionPolicy.objects.values_list("classification", flat=True)) == ["*"]
    assert Tenant.objects.get(pk=tenant.pk).sanitizer_policy == {}


def test_retention_create_change_delete_are_audited(client, make_member, tenant):
    user = _login(client, make_member, "compliance")
    response = client.post("/settings/retention/", GOOD)
    assert response.status_code == 302 and response["Location"] == "/settings/"
    policy = RetentionPolicy.objects.get(tenant=tenant)
    assert (policy.classification, policy.steps_days, policy.raw_days, policy.audit_days) == (
        "confidential", 90, 3, 400)
    created = AuditEvent.objects.get(action="retention_policy.created")
    assert created.actor == f"user:{user.pk}" and created.payload["steps_days"] == 90
    page = client.get("/settings/").content.decode()
    assert "Retention policy for confidential saved" in page
    assert "?classification=confidential#retention-form" in page
    # The change link fills the form with the policy's values.
    form = client.get("/settings/?classification=confidential").content.decode()
    assert 'value="confidential" selected' in form and 'value="400"' in form

    client.post("/settings/retention/", {**GOOD, "steps_days": "120", "findings_days": "120"})
    policy.refresh_from_db()
    assert policy.steps_days == 120 and RetentionPolicy.objects.count() == 1
    updated = AuditEvent.objects.get(action="retention_policy.updated")
    assert updated.payload["steps_days"] == 120 and updated.object_id == str(policy.pk)

    response = client.post(f"/settings/retention/{policy.pk}/delete/")
    assert response.status_code == 302
    assert not RetentionPolicy.objects.exists()
    deleted = AuditEvent.objects.get(action="retention_policy.deleted")
    assert deleted.actor == f"user:{user.pk}" and deleted.payload == {
        "classification": "confidential"}


@pytest.mark.parametrize("change,message", [
    ({"raw_days": "200"}, "raw_days must not exceed steps_days"),
    ({"audit_days": "10"}, "audit_days must be at least as long"),
    ({"steps_days": "ninety"}, "Steps: enter a whole number of days"),
    # "²" is a digit to str.isdigit() but no number (was a 500); past int32 overflowed the
    # column (was a 500); past 100 years the deadlines leave the representable dates.
    ({"steps_days": "²"}, "Steps: enter a whole number of days from 0 to 36500"),
    ({"audit_days": "2147483648"}, "Audit events: enter a whole number of days from 0 to"),
    ({"audit_days": "36501"}, "Audit events: enter a whole number of days from 0 to 36500"),
    ({"classification": "secret-ish"}, "classification must be"),
])
def test_bad_retention_is_a_message_and_keeps_the_input(client, make_member, tenant, change,
                                                        message):
    _login(client, make_member, "admin")
    before = AuditEvent.objects.count()
    response = client.post("/settings/retention/", {**GOOD, **change})
    assert response.status_code == 400
    body = response.content.decode()
    assert message in body
    for value in change.values():
        if value != "secret-ish":  # not an option of the select
            assert f'value="{value}"' in body
    assert not RetentionPolicy.objects.exists()
    assert AuditEvent.objects.count() == before


def test_sanitizer_operator_change_is_audited(client, make_member, tenant):
    user = _login(client, make_member, "compliance")
    # Stricter everywhere (weaker takes a second person: tests/test_sanitizer_four_eyes.py).
    response = client.post("/settings/sanitizer/", {
        "op-EMAIL_ADDRESS": "redact", "op-LOCATION": "redact", "op-PERSON": "",
        "score_threshold": "0.4", "detect_organizations": "on"})
    assert response.status_code == 302
    stored = Tenant.objects.get(pk=tenant.pk).sanitizer_policy
    assert stored["operators"] == {"EMAIL_ADDRESS": "redact", "LOCATION": "redact"}
    assert stored["score_threshold"] == 0.4 and stored["detect_organizations"] is True
    event = AuditEvent.objects.get(action="sanitizer_policy.updated")
    assert event.actor == f"user:{user.pk}"
    assert event.payload["operators"] == {"EMAIL_ADDRESS": "redact", "LOCATION": "redact"}
    page = client.get("/settings/").content.decode()
    assert "Sanitizer policy saved" in page
    select = page[page.index('name="op-EMAIL_ADDRESS"'):]
    select = select[:select.index("</select>")]
    assert '<option value="redact" selected>' in select
    # A read-only role sees the effective operator.
    client.force_login(make_member("auditor"))
    ro = client.get("/settings/").content.decode()
    row = ro[ro.index("<code>EMAIL_ADDRESS</code>"):]
    assert row[:row.index("</tr>")].count("<strong>redact</strong>") == 1
    assert "(tenant setting)" in row


def test_bad_sanitizer_operator_changes_nothing(client, make_member, tenant):
    services.set_sanitizer_policy("system:test", tenant, {"operators": {"PERSON": "hash"}})
    before_policy = Tenant.objects.get(pk=tenant.pk).sanitizer_policy
    _login(client, make_member, "admin")
    before_events = AuditEvent.objects.count()
    response = client.post("/settings/sanitizer/", {
        "op-EMAIL_ADDRESS": "shred", "op-PERSON": "keep", "score_threshold": "0.5"})
    assert response.status_code == 400
    body = response.content.decode()
    assert "The sanitizer policy was not saved" in body and "unknown operator" in body
    person = body[body.index('name="op-PERSON"'):]
    assert '<option value="keep" selected>' in person[:person.index("</select>")]
    assert Tenant.objects.get(pk=tenant.pk).sanitizer_policy == before_policy
    assert AuditEvent.objects.count() == before_events
    bad = client.post("/settings/sanitizer/", {"score_threshold": "2"})
    assert bad.status_code == 400 and "between 0 and 1" in bad.content.decode()
    assert Tenant.objects.get(pk=tenant.pk).sanitizer_policy == before_policy


def test_outsider_sees_and_deletes_nothing(client, make_member, tenant, other_tenant):
    policy = services.set_retention_policy("system:test", tenant, "restricted", steps_days=30,
                                           raw_days=1, findings_days=30, audit_days=30)
    services.set_sanitizer_policy("system:test", tenant, {"operators": {"PERSON": "keep"}})
    client.force_login(make_member("admin", "outsider", on=other_tenant))
    body = client.get("/settings/").content.decode()
    assert "No policies" in body and f"/settings/retention/{policy.pk}/delete/" not in body
    assert '<option value="keep" selected>' not in body
    assert client.post(f"/settings/retention/{policy.pk}/delete/").status_code == 404
    assert RetentionPolicy.objects.filter(pk=policy.pk).exists()
