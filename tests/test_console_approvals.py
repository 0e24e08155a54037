"""Console: the compliance queue and the review page of a dataset version. Every role reads
them, an outsider never; the review shows size, classification mix, findings per entity type, a
sample to read and what approving allows; only a compliance officer decides, with a reason, and
never on a version they froze or requested (four eyes: the button is disabled with the reason,
a forced POST gets the service's refusal as a message, not a 500)."""

from __future__ import annotations

import pytest

from governance import services
from governance.models import Approval, AuditEvent, DatasetVersion, Step
from governance.views.approvals import pending_approvals_count
from tests.govdata import add_findings, make_trajectory

ROLES = ["admin", "steward", "compliance", "auditor"]
FOUR_EYES = ("You requested this version; a different compliance officer must approve it "
             "(four eyes).")


@pytest.fixture
def world(people, tenant, other_tenant):
    """A steward's dataset with a version pending approval (3 trajectories, 2 steps each,
    findings on two of them), a draft version, and another tenant's pending version."""
    users, _ = people
    support = services.ensure_agent("system:test", tenant, "support-bot")
    billing = services.ensure_agent("system:test", tenant, "billing-bot")
    t1 = make_trajectory(tenant, support)
    t2 = make_trajectory(tenant, support, classification="public")
    make_trajectory(tenant, billing)
    for traj, types in ((t1, ["EMAIL_ADDRESS", "EMAIL_ADDRESS", "PERSON"]),
                        (t2, ["PHONE_NUMBER"])):
        step = Step.objects.filter(trajectory=traj).order_by("started_at").first()
        add_findings(tenant, step, types)
    dataset = services.create_dataset(users["steward"], tenant, name="support-all")
    pending = services.freeze_dataset_version(users["steward"], dataset)
    services.request_approval(users["steward"], pending)
    draft = services.freeze_dataset_version(users["steward"], dataset)

    foreign_agent = services.ensure_agent("system:test", other_tenant, "bot")
    make_trajectory(other_tenant, foreign_agent)
    foreign = services.create_dataset(users["outsider"], other_tenant, name="globex-secret")
    foreign_version = services.freeze_dataset_version(users["outsider"], foreign)
    services.request_approval(users["outsider"], foreign_version)
    return {"users": users, "dataset": dataset, "pending": pending, "draft": draft,
            "foreign_version": foreign_version, "t1": t1}


def login(client, world, role):
    client.force_login(world["users"][role])
    return client


def decide(client, version, decision, reason, **kw):
    return client.post(f"/approvals/{version.pk}/decide/",
                       {"decision": decision, "reason": reason}, **kw)


# --- who sees what ----------------------------------------------------------------------------


@pytest.mark.parametrize("page", ["/approvals/", "/approvals/1/"])
def test_anonymous_is_sent_to_login(client, db, page):
    response = client.get(page)
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.parametrize("role", ROLES)
def test_every_role_reads_the_queue_and_the_review(client, world, role):
    login(client, world, role)
    pending = world["pending"]
    body = client.get("/approvals/").content.decode()
    assert "support-all v1" in body and f"/approvals/{pending.pk}/" in body
    assert "globex-secret" not in body
    assert "support-all v2" not in body  # a draft was never submitted
    review = client.get(f"/approvals/{pending.pk}/")
    assert review.status_code == 200
    text = review.content.decode()
    may_decide = role == "compliance"
    assert ('name="decision" value="approve"' in text) == may_decide
    if not may_decide:
        # Read-only, with who can decide: the compliance officers (none froze or requested).
        assert "Read-only" in text and "comp, comp2" in text
        assert "Read-only" in body


def test_outsider_sees_nothing_of_the_tenant(client, world):
    login(client, world, "outsider")
    body = client.get("/approvals/").content.decode()
    assert "globex-secret v1" in body and "support-all" not in body
    assert client.get(f"/approvals/{world['pending'].pk}/").status_code == 404
    # An admin of the other tenant has no `approve` there (nor anywhere as admin).
    assert decide(client, world["pending"], "approve", "ok").status_code == 403
    assert DatasetVersion.objects.get(pk=world["pending"].pk).status == "pending_approval"


def test_outsider_compliance_officer_gets_404(client, world, other_tenant, make_member):
    client.force_login(make_member("compliance", "globex-comp", on=other_tenant))
    assert decide(client, world["pending"], "approve", "looks fine").status_code == 404
    assert not Approval.objects.exists()


# --- the review -------------------------------------------------------------------------------


def test_review_shows_what_a_compliance_officer_needs(client, world):
    login(client, world, "compliance")
    pending = world["pending"]
    body = client.get(f"/approvals/{pending.pk}/").content.decode()
    # Size.
    assert "<dt>Trajectories</dt><dd>3</dd>" in body and "<dt>Steps</dt><dd>6</dd>" in body
    assert pending.content_hash in body
    # Classification mix (steps) and agents (trajectories).
    assert '<th scope="row">internal</th><td>4</td>' in body
    assert '<th scope="row">public</th><td>2</td>' in body
    assert '<th scope="row">support-bot</th><td>2</td>' in body
    # Findings per entity type, with the trajectories they touch.
    assert "4 findings in 2 of 3 trajectories" in body
    assert '<th scope="row">EMAIL_ADDRESS</th><td>2</td><td>1</td>' in body
    assert '<th scope="row">PERSON</th><td>1</td><td>1</td>' in body
    assert '<th scope="row">PHONE_NUMBER</th><td>1</td><td>1</td>' in body
    # A sample to read: links to the trajectories, with an excerpt of the conversation.
    assert sorted(pending.sample_ids) == sorted(str(m.trajectory_id)
                                                for m in pending.members.all())
    for tid in pending.sample_ids:
        assert f'href="/trajectories/{tid}/"' in body
    assert "<pre>hi</pre>" in body and "<pre>hello</pre>" in body
    assert "3 findings" in body  # t1's count in the sample
    # What approving allows.
    assert ("Approving lets stewards launch GRPO jobs and exports (verl parquet, ATDP JSONL) "
            "on these 3 trajectories") in body
    assert "erasure of a subject later invalidates it" in body.lower()
    # The history names the requester.
    assert "Approval requested" in body and "stew" in body


def test_queue_puts_waiting_versions_first(client, world, tenant):
    users = world["users"]
    pending = world["pending"]
    # Decide the first one, submit the draft: the waiting one now comes first.
    services.approve_version(users["compliance"], pending, "fine")
    services.request_approval(users["steward"], world["draft"])
    login(client, world, "auditor")
    body = client.get("/approvals/").content.decode()
    assert body.index("Waiting for a decision") < body.index("support-all v2") \
        < body.index("Already decided") < body.index("support-all v1")
    assert "1 waiting" in body
    assert pending_approvals_count(tenant) == 1


def test_pending_approvals_count(world, tenant, other_tenant):
    assert pending_approvals_count(tenant) == 1
    assert pending_approvals_count(other_tenant) == 1
    services.request_approval(world["users"]["steward"], world["draft"])
    assert pending_approvals_count(tenant) == 2


# --- deciding ---------------------------------------------------------------------------------


def test_the_requester_is_refused_and_a_second_officer_approves(client, world, tenant):
    users = world["users"]
    pending = world["pending"]
    # The steward who froze and requested it becomes a compliance officer: four eyes still
    # keeps them from deciding on their own version.
    services.ensure_member("system:test", tenant, "stew", "compliance")
    login(client, world, "steward")
    body = client.get(f"/approvals/{pending.pk}/").content.decode()
    assert FOUR_EYES in body
    assert 'name="decision" value="approve" disabled' in body
    assert 'name="decision" value="reject" class="danger" disabled' in body

    forced = decide(client, pending, "approve", "I trust myself")
    assert forced.status_code == 403
    text = forced.content.decode()
    assert "four eyes: you froze or requested this version" in text
    assert "I trust myself" not in text or 'disabled' in text  # nothing to submit anyway
    pending.refresh_from_db()
    assert pending.status == "pending_approval"
    assert not Approval.objects.filter(version=pending).exists()
    assert not AuditEvent.objects.filter(action="dataset_version.approved").exists()

    login(client, world, "compliance2")
    response = decide(client, pending, "approve", "sample read, findings all redacted")
    assert response.status_code == 302 and response["Location"] == f"/approvals/{pending.pk}/"
    pending.refresh_from_db()
    assert pending.status == "approved"
    approval = Approval.objects.get(version=pending)
    assert approval.decided_by == users["compliance2"]
    assert approval.reason == "sample read, findings all redacted"
    assert AuditEvent.objects.filter(action="dataset_version.approved",
                                     object_id=str(pending.pk)).exists()
    page = client.get(response["Location"]).content.decode()
    assert "approved" in page and "sample read, findings all redacted" in page
    assert 'name="decision"' not in page  # decided: no more buttons
    # Deciding again is a conflict message, not a 500.
    again = decide(client, pending, "reject", "changed my mind")
    assert again.status_code == 409 and "only a version pending approval" in \
        again.content.decode()


def test_the_one_who_froze_it_is_refused_too(client, world, tenant):
    pending = world["pending"]
    DatasetVersion.objects.filter(pk=pending.pk).update(created_by=world["users"]["compliance"],
                                                        requested_by=world["users"]["steward"])
    login(client, world, "compliance")
    body = client.get(f"/approvals/{pending.pk}/").content.decode()
    assert "You froze this version; a different compliance officer must approve it" in body
    assert decide(client, pending, "approve", "mine").status_code == 403
    assert not Approval.objects.exists()


def test_reject_needs_a_reason(client, world):
    pending = world["pending"]
    login(client, world, "compliance")
    response = decide(client, pending, "reject", "   ")
    assert response.status_code == 400
    assert "a reason is required" in response.content.decode()
    pending.refresh_from_db()
    assert pending.status == "pending_approval"
    assert not AuditEvent.objects.filter(action="dataset_version.rejected").exists()

    assert decide(client, pending, "maybe", "hmm").status_code == 400

    response = decide(client, pending, "reject", "contains a customer's contract text",
                      follow=True)
    assert response.status_code == 200
    assert "rejected" in response.content.decode()
    pending.refresh_from_db()
    assert pending.status == "rejected"
    assert Approval.objects.get(version=pending).decision == "reject"
    assert AuditEvent.objects.filter(action="dataset_version.rejected",
                                     object_id=str(pending.pk)).exists()


@pytest.mark.parametrize("role", ["admin", "steward", "auditor"])
def test_roles_without_approve_cannot_decide(client, world, role):
    login(client, world, role)
    assert decide(client, world["pending"], "approve", "please").status_code == 403
    assert not Approval.objects.exists()


def test_a_draft_has_no_decision_form(client, world):
    login(client, world, "compliance")
    body = client.get(f"/approvals/{world['draft'].pk}/").content.decode()
    assert "Not submitted for approval yet" in body and 'name="decision"' not in body
    response = decide(client, world["draft"], "approve", "early")
    assert response.status_code == 409 and "only a version pending approval" in \
        response.content.decode()
