"""Console erasure pages: filing a request through the form (the subject never comes back),
live progress fragments, the certificate and its download, failures, roles and tenant scope."""

from __future__ import annotations

import json

import pytest

from governance import services as gov
from governance.erasure import erase_subject, request_erasure
from governance.keyring import subject_hash
from governance.models import AuditEvent, ErasureRequest, Trajectory
from governance.tenancy import tenant_context
from governance.views.erasure import pending_erasures_count
from tests.govdata import make_trajectory

EMAIL = "jane.roe@example.com"
ROLES_ALLOWED = ["admin", "compliance"]
ROLES_REFUSED = ["steward", "auditor"]
HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def erasure_dirs(settings, tmp_path):
    settings.STEWARD_SPOOL_DIR = tmp_path / "spool"
    settings.VAR_DIR = tmp_path / "var"
    settings.STEWARD_ERASURE_SPOOL_WAIT_S = 1
    return settings


@pytest.fixture
def jane(tenant):
    agent = gov.ensure_agent("system:test", tenant, "support-bot")
    return make_trajectory(tenant, agent, steps=2,
                           subject_hash=subject_hash(tenant.pk, EMAIL))


def _login(client, make_member, role: str):
    user = make_member(role)
    client.force_login(user)
    return user


@pytest.mark.parametrize("role", ROLES_ALLOWED)
def test_roles_with_erase_see_the_page(client, make_member, role):
    _login(client, make_member, role)
    body = client.get("/erasure/").content.decode()
    assert "File an erasure request" in body
    assert "No erasure requests yet" in body
    assert '<label for="erasure-subject">' in body


@pytest.mark.parametrize("role", ROLES_REFUSED)
def test_roles_without_erase_are_refused(client, make_member, tenant, role):
    req, _ = request_erasure("system:test", tenant, EMAIL)
    _login(client, make_member, role)
    assert client.get("/erasure/").status_code == 403
    filed = client.post("/erasure/", {"subject": "x@example.com", "confirm": "yes"})
    assert filed.status_code == 403
    assert client.get(f"/erasure/{req.pk}/").status_code == 403
    assert client.get(f"/erasure/{req.pk}/certificate.json").status_code == 403
    assert ErasureRequest.objects.count() == 1


def test_file_run_certificate_and_download(client, make_member, tenant, jane, erasure_dirs):
    user = _login(client, make_member, "compliance")
    response = client.post("/erasure/", {"subject": f" {EMAIL} ", "confirm": "yes"})
    req = ErasureRequest.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/erasure/{req.pk}/"
    assert req.subject_hash == subject_hash(tenant.pk, EMAIL)
    assert AuditEvent.objects.filter(action="erasure.requested", object_id=str(req.pk),
                                     actor=f"user:{user.pk}").exists()
    page = client.get(response["Location"]).content.decode()
    assert f"Erasure request #{req.pk} filed" in page
    assert EMAIL not in page.lower() and req.subject_hash in page
    assert "Waiting for a worker" in page and 'hx-trigger="every 2s"' in page
    listing = client.get("/erasure/").content.decode()
    assert EMAIL not in listing and 'value=""' in listing  # the form comes back empty
    assert 'hx-get="/erasure/?part=rows&amp;page=1" hx-trigger="every 2s"' in listing
    with tenant_context(tenant):
        assert pending_erasures_count(tenant) == 1
    # No certificate before the job ran: the download says so instead.
    early = client.get(f"/erasure/{req.pk}/certificate.json")
    assert early.status_code == 302

    assert erase_subject(req.pk, tenant.pk)["status"] == "completed"
    assert not Trajectory.objects.filter(pk=jane.pk).exists()
    with tenant_context(tenant):
        assert pending_erasures_count(tenant) == 0
    page = client.get(f"/erasure/{req.pk}/").content.decode()
    assert "Certificate" in page and "clean" in page
    assert 'hx-trigger="every 2s"' not in page  # finished: no more polling
    assert f"/erasure/{req.pk}/certificate.json" in page
    assert "Data keys destroyed" in page
    fragment = client.get("/erasure/?part=rows", **HTMX).content.decode()
    assert fragment.startswith('<tbody id="erasure-rows"') and "Completed" in fragment
    assert "every 2s" not in fragment  # nothing active: the list stops polling

    download = client.get(f"/erasure/{req.pk}/certificate.json")
    assert download.status_code == 200
    assert download["Content-Type"] == "application/json"
    assert download["Content-Disposition"] == (
        f'attachment; filename="erasure-{req.pk}-certificate.json"')
    body = json.loads(download.content)
    assert body["id"] == req.pk and body["status"] == "completed"
    cert = body["certificate"]
    assert cert["counts"]["trajectories"] == 1 and cert["counts"]["steps"] == 2
    assert cert["post_condition"]["clean"] is True
    assert cert["subject_hash"] == subject_hash(tenant.pk, EMAIL)
    assert EMAIL not in download.content.decode().lower()
    # The same representation as the REST API.
    from governance.api import ErasureRequestSerializer

    req.refresh_from_db()
    assert body["certificate"] == json.loads(json.dumps(ErasureRequestSerializer(req).data,
                                                        default=str))["certificate"]


def test_live_progress_fragment_while_running(client, make_member, tenant):
    req, _ = request_erasure("system:test", tenant, EMAIL)
    ErasureRequest.objects.filter(pk=req.pk).update(
        status="running", stage="delete",
        progress={"counts": {"trajectories": 4, "steps": 9}, "batches": 2})
    _login(client, make_member, "admin")
    fragment = client.get("/erasure/?part=rows", **HTMX).content.decode()
    assert "<html" not in fragment and f"#{req.pk}" in fragment
    assert 'hx-trigger="every 2s"' in fragment
    assert "stage 4 of 6" in fragment and "9 steps" in fragment and "4 trajectories" in fragment
    state = client.get(f"/erasure/{req.pk}/?part=state", **HTMX).content.decode()
    assert 'id="erasure-state"' in state and "<html" not in state
    assert "Stage 4 of 6" in state and "2 deletion batches" in state


def test_failed_request_shows_its_error_and_what_to_do(client, make_member, tenant):
    req, _ = request_erasure("system:test", tenant, EMAIL)
    ErasureRequest.objects.filter(pk=req.pk).update(
        status="failed", stage="exports", error="PermissionError in stage exports")
    _login(client, make_member, "compliance")
    page = client.get(f"/erasure/{req.pk}/").content.decode()
    assert "The erasure failed" in page and "PermissionError in stage exports" in page
    assert "File the request again" in page
    assert "PermissionError" in client.get("/erasure/").content.decode()


@pytest.mark.parametrize("subject,message", [
    ("   ", "subject must not be empty"),
    ("x" * 513, "at most 512 characters"),
])
def test_bad_subject_is_an_error_message_not_a_request(client, make_member, subject, message):
    _login(client, make_member, "compliance")
    response = client.post("/erasure/", {"subject": subject, "confirm": "yes"})
    assert response.status_code == 400
    body = response.content.decode()
    assert message in body and "was not filed" in body
    assert ErasureRequest.objects.count() == 0
    if subject.strip():
        assert subject in body  # the input is kept to be corrected


def test_same_subject_twice_answers_the_pending_request(client, make_member):
    _login(client, make_member, "compliance")
    first = client.post("/erasure/", {"subject": EMAIL, "confirm": "yes"})
    second = client.post("/erasure/", {"subject": EMAIL.upper(), "confirm": "yes"})
    assert first["Location"] == second["Location"]
    assert ErasureRequest.objects.count() == 1
    assert "already under way" in client.get(second["Location"]).content.decode()


def test_outsider_sees_nothing_and_gets_404(client, make_member, tenant, other_tenant):
    req, _ = request_erasure("system:test", tenant, EMAIL)
    _login(client, lambda role: make_member(role, "outsider", on=other_tenant), "admin")
    listing = client.get("/erasure/").content.decode()
    assert "No erasure requests yet" in listing and req.subject_hash[:12] not in listing
    assert client.get(f"/erasure/{req.pk}/").status_code == 404
    assert client.get(f"/erasure/{req.pk}/?part=state", **HTMX).status_code == 404
    rows = client.get("/erasure/?part=rows", **HTMX).content.decode()
    assert f"#{req.pk}" not in rows and "every 2s" not in rows
    assert client.get(f"/erasure/{req.pk}/certificate.json").status_code == 404
    with tenant_context(other_tenant):
        assert pending_erasures_count(other_tenant) == 0


def test_list_is_paginated(client, make_member, tenant):
    for i in range(51):
        ErasureRequest.objects.create(tenant=tenant, subject_hash=f"{i:064x}", status="completed")
    _login(client, make_member, "admin")
    first = client.get("/erasure/").content.decode()
    assert "Page 1 of 2" in first and "51 requests" in first and "?page=2" in first
    assert "Page 2 of 2" in client.get("/erasure/?page=2").content.decode()


def test_filing_needs_the_confirmation(client, make_member):
    _login(client, make_member, "compliance")
    response = client.post("/erasure/", {"subject": EMAIL})
    assert response.status_code == 400
    body = response.content.decode()
    assert "cannot be undone" in body and f'value="{EMAIL}"' in body
    assert ErasureRequest.objects.count() == 0


def test_post_condition_failure_shows_certificate_and_advice(client, make_member, tenant):
    req, _ = request_erasure("system:test", tenant, EMAIL)
    cert = {"erasure_request": req.pk, "counts": {"trajectories": 2}, "suppressed": True,
            "post_condition": {"clean": False, "remaining": {"trajectories": 1,
                                                             "interactions": 0,
                                                             "subject_index": 0,
                                                             "live_data_keys": 0}},
            "dataset_versions_invalidated": [7], "checkpoints_tainted": [3], "spool": {},
            "lookup_hashes": 2, "sanitizer_version": "s/1", "requested_at": "x",
            "finished_at": "y"}
    ErasureRequest.objects.filter(pk=req.pk).update(
        status="failed", stage="done", certificate=cert,
        error="post-condition: data of the subject is still present",
        progress={"verify_rounds": 3, "counts": {"suppressed_hashes": 2}})
    _login(client, make_member, "compliance")
    page = client.get(f"/erasure/{req.pk}/").content.decode()
    assert "The erasure failed" in page and "kept arriving" in page
    assert "not clean" in page and "<code>#7</code>" in page and "<code>#3</code>" in page
    assert "the subject is on the suppression list" in page
    download = client.get(f"/erasure/{req.pk}/certificate.json")
    assert json.loads(download.content)["certificate"]["post_condition"]["clean"] is False
