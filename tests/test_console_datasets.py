"""Console: the Datasets pages. Every role of the tenant reads them, an outsider never sees them;
defining a dataset through the form (a refused filter re-renders the form with what was typed
and the reason), the live count as the filter changes, freezing a version and requesting its
approval — each mutation audited, each refusal a message, never a 500."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from governance import services
from governance.models import AuditEvent, Dataset, DatasetVersion
from tests.govdata import make_trajectory

ROLES = ["admin", "steward", "compliance", "auditor"]
MANAGERS = {"admin", "steward"}          # manage_datasets
REQUESTERS = {"admin", "steward"}        # request_approval


@pytest.fixture
def world(people, tenant, other_tenant):
    """Two agents with eligible trajectories (2 support-bot, 1 billing-bot), one dataset over
    everything with a frozen draft version, and another tenant's dataset."""
    users, _ = people
    support = services.ensure_agent("system:test", tenant, "support-bot")
    billing = services.ensure_agent("system:test", tenant, "billing-bot")
    make_trajectory(tenant, support)
    make_trajectory(tenant, support, started=timezone.now() - timedelta(days=3))
    make_trajectory(tenant, billing)
    make_trajectory(tenant, support, consent="no-train")  # never eligible
    dataset = services.create_dataset(users["steward"], tenant, name="support-all",
                                      description="every support conversation")
    version = services.freeze_dataset_version(users["steward"], dataset)
    foreign_agent = services.ensure_agent("system:test", other_tenant, "support-bot")
    make_trajectory(other_tenant, foreign_agent)
    foreign = services.create_dataset(users["outsider"], other_tenant, name="globex-secret")
    foreign_version = services.freeze_dataset_version(users["outsider"], foreign)
    return {"users": users, "support": support, "billing": billing, "dataset": dataset,
            "version": version, "foreign": foreign, "foreign_version": foreign_version}


def login(client, world, role):
    client.force_login(world["users"][role])
    return client


def count_in(body: str) -> int | None:
    m = re.search(r'class="preview-count" data-count="(\d+)"', body)
    return int(m.group(1)) if m else None


def audited(action: str, object_id) -> bool:
    return AuditEvent.objects.filter(action=action, object_id=str(object_id)).exists()


# --- who sees what ----------------------------------------------------------------------------


@pytest.mark.parametrize("page", ["/datasets/", "/datasets/preview/"])
def test_anonymous_is_sent_to_login(client, db, page):
    response = client.get(page)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


@pytest.mark.parametrize("role", ROLES)
def test_every_role_reads_the_datasets_pages(client, world, role):
    login(client, world, role)
    ds, version = world["dataset"], world["version"]
    body = client.get("/datasets/").content.decode()
    assert "support-all" in body and f"/datasets/versions/{version.pk}/" in body
    assert "globex-secret" not in body
    assert ("Define a dataset" in body) == (role in MANAGERS)

    detail = client.get(f"/datasets/{ds.pk}/")
    assert detail.status_code == 200
    text = detail.content.decode()
    assert "every agent" in text and "classification up to internal" in text
    # The live count loads with the page: 3 eligible (the no-train one never).
    assert f'hx-get="/datasets/{ds.pk}/count/" hx-trigger="load"' in text
    assert count_in(client.get(f"/datasets/{ds.pk}/count/").content.decode()) == 3
    assert ("Freeze a new version" in text) == (role in MANAGERS)
    assert ("Request approval" in text) == (role in REQUESTERS)

    page = client.get(f"/datasets/versions/{version.pk}/")
    assert page.status_code == 200
    text = page.content.decode()
    assert version.content_hash in text
    assert "3 trajectories, 6 steps" in text
    assert "Draft" in text and "Frozen" in text and "stew" in text


def test_owner_sees_everything_and_may_define(client, world):
    # The owner of the tenant is its admin: reads, defines, freezes, requests.
    login(client, world, "admin")
    body = client.get("/datasets/").content.decode()
    assert "Define a dataset" in body
    # The form asks for the count of its default filter once the page has loaded.
    assert 'hx-trigger="load, change"' in body
    assert count_in(client.get("/datasets/preview/", {"classification": "internal"})
                    .content.decode()) == 3


def test_outsider_sees_nothing_of_the_tenant(client, world):
    login(client, world, "outsider")
    body = client.get("/datasets/").content.decode()
    assert "globex-secret" in body and "support-all" not in body
    assert client.get(f"/datasets/{world['dataset'].pk}/").status_code == 404
    assert client.get(f"/datasets/versions/{world['version'].pk}/").status_code == 404
    assert client.get(f"/datasets/{world['dataset'].pk}/count/").status_code == 404
    assert client.post(f"/datasets/{world['dataset'].pk}/freeze/").status_code == 404
    assert client.post(f"/datasets/versions/{world['version'].pk}/request-approval/") \
        .status_code == 404
    # The live count only ever counts the outsider's own tenant.
    assert count_in(client.get("/datasets/preview/").content.decode()) == 1


# --- define a dataset -------------------------------------------------------------------------


def test_steward_defines_a_dataset_through_the_form(client, world, tenant):
    login(client, world, "steward")
    response = client.post("/datasets/", {
        "name": "billing-good", "description": "billing, judged well",
        "agents": [world["billing"].pk], "classification": "internal"})
    dataset = Dataset.objects.get(tenant=tenant, name="billing-good")
    assert response.status_code == 302 and response["Location"] == f"/datasets/{dataset.pk}/"
    assert dataset.agent_ids == [world["billing"].pk]
    assert dataset.created_by == world["users"]["steward"]
    assert audited("dataset.created", dataset.pk)
    page = client.get(response["Location"]).content.decode()
    assert "defined" in page and "agents: billing-bot" in page
    assert count_in(client.get(f"/datasets/{dataset.pk}/count/").content.decode()) == 1


def test_a_refused_filter_shows_why_and_loses_nothing(client, world, tenant):
    login(client, world, "steward")
    before = AuditEvent.objects.count()
    form = {"name": "late-window", "description": "keep this text",
            "agents": [world["support"].pk], "since": "2026-03-01T10:00",
            "until": "2026-02-01T10:00", "reward_name": "judge", "reward_min": "0.5",
            "classification": "confidential"}
    response = client.post("/datasets/", form)
    assert response.status_code == 400
    body = response.content.decode()
    assert "until must be after since" in body
    # Everything typed is still in the form.
    assert 'value="late-window"' in body and "keep this text" in body
    assert 'value="2026-03-01T10:00"' in body and 'value="2026-02-01T10:00"' in body
    assert 'value="judge"' in body and 'value="0.5"' in body
    assert re.search(rf'value="{world["support"].pk}"[^>]*checked', body)
    assert re.search(r'<option value="confidential" selected', body)
    assert not Dataset.objects.filter(name="late-window").exists()
    assert AuditEvent.objects.count() == before

    # Other refusals read the same way: reward bounds without a reward name, a taken name,
    # a missing name, a bound that is not a number.
    body = client.post("/datasets/", {"name": "x", "reward_min": "1",
                                      "classification": "internal"}).content.decode()
    assert "reward_min/reward_max need reward_name" in body
    response = client.post("/datasets/", {"name": "support-all", "classification": "internal"})
    assert response.status_code == 400
    assert "a dataset named &#x27;support-all&#x27; exists already" in response.content.decode()
    assert client.post("/datasets/", {"name": "", "classification": "internal"}).status_code \
        == 400
    body = client.post("/datasets/", {"name": "y", "reward_name": "judge", "reward_min": "lots",
                                      "classification": "internal"}).content.decode()
    assert "Enter a number." in body and 'value="y"' in body
    assert Dataset.objects.filter(tenant=tenant).count() == 1


@pytest.mark.parametrize("role", ["compliance", "auditor"])
def test_roles_without_manage_datasets_cannot_define_or_freeze(client, world, role):
    login(client, world, role)
    assert client.post("/datasets/", {"name": "sneaky", "classification": "internal"}) \
        .status_code == 403
    assert not Dataset.objects.filter(name="sneaky").exists()
    assert client.post(f"/datasets/{world['dataset'].pk}/freeze/").status_code == 403
    assert DatasetVersion.objects.filter(dataset=world["dataset"]).count() == 1


def test_the_live_count_follows_the_filter(client, world):
    login(client, world, "steward")

    def preview(**params):
        response = client.get("/datasets/preview/", {"classification": "internal", **params},
                              headers={"HX-Request": "true"})
        assert response.status_code == 200
        body = response.content.decode()
        assert "<html" not in body  # a fragment, not a page
        return body

    assert count_in(preview()) == 3
    assert count_in(preview(agents=[world["billing"].pk])) == 1
    assert count_in(preview(agents=[world["billing"].pk, world["support"].pk])) == 3
    since = (timezone.now() - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    assert count_in(preview(since=since)) == 2
    assert count_in(preview(classification="public")) == 0
    services.record_reward("system:test", world["dataset"].tenant, value=0.9, name="judge",
                           trajectory_id=world["version"].members.first().trajectory_id)
    assert count_in(preview(reward_name="judge", reward_min="0.5")) == 1
    # A filter the service refuses answers with its reason instead of a number.
    body = preview(reward_min="0.5")
    assert count_in(body) is None and "reward_min/reward_max need reward_name" in body
    assert count_in(preview(agents=["999999"])) is None
    # Nothing was written by previewing.
    assert not Dataset.objects.filter(name="(preview)").exists()


def test_the_form_asks_for_the_count_on_change(client, world):
    login(client, world, "steward")
    body = client.get("/datasets/").content.decode()
    assert 'hx-get="/datasets/preview/"' in body and 'hx-trigger="load, change"' in body
    assert 'hx-target="#dataset-preview"' in body


# --- freeze and request approval --------------------------------------------------------------


def test_freeze_a_version(client, world):
    login(client, world, "steward")
    ds = world["dataset"]
    make_trajectory(ds.tenant, world["billing"])  # one more since v1
    response = client.post(f"/datasets/{ds.pk}/freeze/")
    v2 = DatasetVersion.objects.get(dataset=ds, number=2)
    assert response.status_code == 302
    assert response["Location"] == f"/datasets/versions/{v2.pk}/"
    assert v2.size == 4 and v2.status == "draft" and v2.created_by == world["users"]["steward"]
    assert audited("dataset_version.frozen", v2.pk)
    page = client.get(response["Location"]).content.decode()
    assert "Froze version 2: 4 trajectories" in page and v2.content_hash in page
    assert client.get(f"/datasets/{ds.pk}/freeze/").status_code == 405


def test_freezing_nothing_is_a_message_not_an_empty_version(client, world, tenant):
    login(client, world, "steward")
    client.post("/datasets/", {"name": "public-only", "classification": "public"})
    ds = Dataset.objects.get(tenant=tenant, name="public-only")
    assert count_in(client.get(f"/datasets/{ds.pk}/count/").content.decode()) == 0
    response = client.post(f"/datasets/{ds.pk}/freeze/", follow=True)
    assert response.status_code == 200
    assert "Nothing frozen: no eligible trajectories" in response.content.decode()
    assert not DatasetVersion.objects.filter(dataset=ds).exists()
    assert not AuditEvent.objects.filter(action="dataset_version.frozen",
                                         payload__dataset=ds.pk).exists()


def test_request_approval(client, world):
    version = world["version"]
    login(client, world, "compliance")  # may read, may not submit
    assert client.post(f"/datasets/versions/{version.pk}/request-approval/").status_code == 403

    login(client, world, "steward")
    response = client.post(f"/datasets/versions/{version.pk}/request-approval/", follow=True)
    version.refresh_from_db()
    assert version.status == "pending_approval"
    assert version.requested_by == world["users"]["steward"]
    assert audited("dataset_version.approval_requested", version.pk)
    body = response.content.decode()
    assert "in the compliance queue" in body and "Approval requested" in body
    assert "Pending approval" in body

    # Asking again is a message (the service's refusal), not an error page.
    again = client.post(f"/datasets/versions/{version.pk}/request-approval/", follow=True)
    assert again.status_code == 200
    assert "Not submitted: version is pending_approval" in again.content.decode()
    assert AuditEvent.objects.filter(action="dataset_version.approval_requested",
                                     object_id=str(version.pk)).count() == 1


def test_datasets_list_is_paginated(client, world, tenant):
    for i in range(30):
        services.create_dataset("system:test", tenant, name=f"bulk-{i:02d}")
    login(client, world, "auditor")
    body = client.get("/datasets/").content.decode()
    assert "Page 1 of 2" in body and "31 datasets" in body
    assert "bulk-29" in body and "support-all" not in body
    assert "support-all" in client.get("/datasets/?page=2").content.decode()


# --- in a real browser ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_define_freeze_submit_and_approve_in_the_browser(console, world, tenant):
    """The whole path in Chromium: the live count follows the ticked agent (htmx), the form
    defines the dataset, its page loads its count, freeze, request approval; a second
    compliance officer reads the review and approves."""
    steward = console(world["users"]["steward"])
    page = steward.page
    steward.go("/datasets/")
    page.locator('.preview-count[data-count="3"]').wait_for()
    page.get_by_label("billing-bot").check()
    page.locator('.preview-count[data-count="1"]').wait_for()
    page.get_by_label("Name", exact=True).fill("billing-browser")
    steward.shot("datasets-form")
    page.get_by_role("button", name="Define dataset").click()
    page.wait_for_url("**/datasets/*/")
    page.locator('#dataset-preview .preview-count[data-count="1"]').wait_for()
    page.get_by_role("button", name="Freeze a new version").click()
    page.wait_for_url("**/datasets/versions/*/")
    assert "Froze version 1: 1 trajectory, 2 steps" in page.locator("main").inner_text()
    page.get_by_role("button", name="Request approval").click()
    page.wait_for_url("**/datasets/versions/*/")
    assert "in the compliance queue" in page.locator("main").inner_text()
    steward.shot("dataset-version")
    steward.assert_clean()

    version = DatasetVersion.objects.get(dataset__name="billing-browser")
    officer = console(world["users"]["compliance2"])
    page = officer.page
    officer.go("/approvals/")
    page.locator(f"a[href='/approvals/{version.pk}/']").click()
    page.wait_for_url(f"**/approvals/{version.pk}/")
    assert "Approving lets stewards launch GRPO jobs" in page.locator("main").inner_text()
    page.get_by_label("Reason").fill("sample read; nothing identifying left")
    officer.shot("approval-review")
    page.get_by_role("button", name="Approve").click()
    page.wait_for_url(f"**/approvals/{version.pk}/")
    assert "approved" in page.locator("main").inner_text()
    officer.assert_clean()
    version.refresh_from_db()
    assert version.status == "approved"
