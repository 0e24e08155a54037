"""Weakening the sanitizer policy is a four-eyes change (issue 12): a person's change that lets
more identifying data through — a secret's operator set to `keep`, a value hashed instead of
replaced, a higher score threshold, a new allow-list entry — is recorded as a request and takes
effect only when another person who may manage the sanitizer approves it; every step is
audited. A stricter change applies at once. Through the console (real views, sessions, CSRF-less
test client) and the services, on the real database."""

from __future__ import annotations

import pytest

from governance import services
from governance.models import AuditEvent, SanitizerPolicyChange, Tenant
from governance.sanitizer.policy import weakenings


def policy_of(tenant) -> dict:
    return Tenant.objects.get(pk=tenant.pk).sanitizer_policy


@pytest.mark.parametrize(("old", "new", "expected"), [
    ({}, {"operators": {"OPENAI_API_KEY": "keep"}}, ["OPENAI_API_KEY: redact -> keep"]),
    ({}, {"operators": {"EMAIL_ADDRESS": "hash"}}, ["EMAIL_ADDRESS: placeholder -> hash"]),
    # the override gone: back to the default
    ({"operators": {"LOCATION": "redact"}}, {}, ["LOCATION: redact -> placeholder"]),
    ({}, {"score_threshold": 0.9}, ["score threshold 0.5 -> 0.9 (fewer findings)"]),
    ({"detect_organizations": True}, {}, ["organizations no longer detected"]),
    ({}, {"allow_list": ["Maria"]}, ["allow list: 1 new entry"]),
    ({"deny_list": ["Falcon", "Hawk"]}, {"deny_list": ["falcon"]}, ["deny list: 1 entry removed"]),
])
def test_weakenings_name_what_gets_through(old, new, expected):
    assert weakenings(old, new) == expected
    assert "Maria" not in " ".join(weakenings(old, new))  # lists are never named


def test_stricter_changes_are_not_weakenings():
    assert weakenings({}, {"operators": {"EMAIL_ADDRESS": "redact", "LOCATION": "placeholder"},
                           "score_threshold": 0.3, "detect_organizations": True,
                           "deny_list": ["Falcon"]}) == []
    assert weakenings({"allow_list": ["a", "b"]}, {"allow_list": ["A"]}) == []


def test_a_person_cannot_weaken_the_policy_alone(tenant, make_member):
    officer = make_member("compliance", "comp")
    with pytest.raises(services.ServiceForbidden, match="four eyes"):
        services.set_sanitizer_policy(officer, tenant, {"operators": {"SECRET": "keep"}})
    assert policy_of(tenant) == {}
    # Stricter: at once. The operator's own tooling (a system actor): at once.
    services.set_sanitizer_policy(officer, tenant, {"operators": {"LOCATION": "redact"}})
    assert policy_of(tenant)["operators"] == {"LOCATION": "redact"}
    services.set_sanitizer_policy("system:bootstrap", tenant, {"operators": {}})
    assert policy_of(tenant)["operators"] == {}


def test_console_weakening_waits_for_another_person(client, make_member, tenant):
    first = make_member("compliance", "comp")
    second = make_member("admin", "owner")
    client.force_login(first)
    response = client.post("/settings/sanitizer/", {
        "op-OPENAI_API_KEY": "keep", "score_threshold": "0.5"}, follow=True)
    body = response.content.decode()
    assert "waiting for another person" in body and "OPENAI_API_KEY: redact -&gt; keep" in body
    assert policy_of(tenant) == {}  # nothing in force yet
    change = SanitizerPolicyChange.objects.get()
    assert (change.status, change.requested_by_id) == ("pending", first.pk)
    requested = AuditEvent.objects.get(action="sanitizer_policy.change_requested")
    assert requested.actor == f"user:{first.pk}"
    assert requested.payload["weakenings"] == ["OPENAI_API_KEY: redact -> keep"]
    # The requester sees it as theirs and cannot approve it, not even by posting.
    assert "(yours: another person decides)" in body
    url = f"/settings/sanitizer/changes/{change.pk}/decide/"
    refused = client.post(url, {"decision": "approve"})
    assert refused.status_code == 400 and "four eyes" in refused.content.decode()
    assert policy_of(tenant) == {}

    # An auditor may not decide at all.
    client.force_login(make_member("auditor", "aud"))
    assert client.post(url, {"decision": "approve"}).status_code == 403

    # Another person who may manage the sanitizer approves: it takes effect, audited.
    client.force_login(second)
    assert "Approve</button>" in client.get("/settings/").content.decode()
    assert client.post(url, {"decision": "approve"}).status_code == 302
    assert policy_of(tenant)["operators"] == {"OPENAI_API_KEY": "keep"}
    change.refresh_from_db()
    assert (change.status, change.decided_by_id) == ("approved", second.pk)
    approved = AuditEvent.objects.get(action="sanitizer_policy.change_approved")
    updated = AuditEvent.objects.get(action="sanitizer_policy.updated")
    assert approved.actor == updated.actor == f"user:{second.pk}"
    assert updated.payload["requested_by"] == first.pk and updated.payload["change"] == change.pk
    assert approved.seq < updated.seq
    # Decided once.
    assert client.post(url, {"decision": "reject"}).status_code == 400


def test_rejected_and_stale_changes_never_apply(tenant, make_member):
    a, b = make_member("compliance", "comp"), make_member("compliance", "comp2")
    first = services.propose_sanitizer_policy(a, tenant, {"operators": {"PERSON": "keep"}})
    second = services.propose_sanitizer_policy(a, tenant, {"operators": {"US_SSN": "hash"}})
    services.decide_sanitizer_policy_change(b, first, approve=False)
    assert policy_of(tenant) == {}
    assert AuditEvent.objects.filter(action="sanitizer_policy.change_rejected").count() == 1
    # The policy changes under the second request (a stricter change, applied at once) ...
    assert services.propose_sanitizer_policy(
        b, tenant, {"operators": {"LOCATION": "redact"}}) is None
    # ... so approving it would apply something nobody reviewed against what is in force.
    with pytest.raises(services.ServiceConflict, match="changed since"):
        services.decide_sanitizer_policy_change(b, second, approve=True)
    assert policy_of(tenant)["operators"] == {"LOCATION": "redact"}


def test_an_outsider_cannot_see_or_decide(client, make_member, tenant, other_tenant):
    change = services.propose_sanitizer_policy(make_member("compliance", "comp"), tenant,
                                               {"operators": {"SECRET": "keep"}})
    client.force_login(make_member("admin", "outsider", on=other_tenant))
    assert "SECRET: redact" not in client.get("/settings/").content.decode()
    assert client.post(f"/settings/sanitizer/changes/{change.pk}/decide/",
                       {"decision": "approve"}).status_code == 404
    assert policy_of(tenant) == {}
