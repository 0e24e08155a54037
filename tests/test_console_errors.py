"""Console error pages (issue 13.8): a 403, 404 or 500 has the console's layout and says why —
the person's role and the permission it lacks, what was not found."""

from __future__ import annotations

import uuid

from django.test import RequestFactory


def test_403_page_has_the_layout_and_names_the_role_and_the_missing_permission(
        client, make_member, tenant):
    client.force_login(make_member("auditor"))
    response = client.get("/keys/")
    assert response.status_code == 403
    body = response.content.decode()
    assert '<nav aria-label="Main">' in body and "console.css" in body
    assert (f"Your role in {tenant.name}, Auditor, may not do this: it needs the manage_keys "
            "permission.") in body


def test_404_page_has_the_layout_and_says_what_was_not_found(client, make_member):
    client.force_login(make_member("steward"))
    response = client.get(f"/trajectories/{uuid.uuid4()}/")
    assert response.status_code == 404
    body = response.content.decode()
    assert '<nav aria-label="Main">' in body and "No such trajectory" in body
    unknown = client.get("/no-such-page/")
    assert unknown.status_code == 404
    assert "There is no page at <code>/no-such-page/</code>" in unknown.content.decode()


def test_500_page_has_the_layout_without_touching_the_database(db, django_assert_num_queries):
    from django.views.defaults import server_error

    with django_assert_num_queries(0):  # the database may be what failed
        response = server_error(RequestFactory().get("/trajectories/"))
    body = response.content.decode()
    assert response.status_code == 500
    assert "console.css" in body and 'class="brand"' in body
    assert "Something went wrong on our side" in body


def test_an_erased_trajectory_answers_404_with_the_request_that_erased_it(
        client, make_member, tenant, settings, tmp_path):
    from governance import services as gov
    from governance.erasure import erase_subject, request_erasure
    from governance.keyring import subject_hash
    from governance.models import ErasureRequest
    from tests.govdata import make_trajectory

    settings.STEWARD_SPOOL_DIR = tmp_path / "spool"
    settings.VAR_DIR = tmp_path / "var"
    settings.STEWARD_ERASURE_SPOOL_WAIT_S = 1
    agent = gov.ensure_agent("system:test", tenant, "support-bot")
    erased = make_trajectory(tenant, agent, steps=1,
                             subject_hash=subject_hash(tenant.pk, "jane.roe@example.com"))
    req, _ = request_erasure(make_member("compliance"), tenant, "jane.roe@example.com")
    assert erase_subject(req.pk, tenant.pk)["status"] == "completed"
    client.force_login(make_member("steward"))
    response = client.get(f"/trajectories/{erased.pk}/")
    assert response.status_code == 404
    body = response.content.decode()
    assert f"This trajectory was erased by erasure request #{req.pk}" in body
    # The request keeps a hash of the id, not the id; its certificate holds neither.
    req.refresh_from_db()
    assert str(erased.pk) not in str(req.progress) and str(erased.pk) not in str(
        req.certificate)
    assert "erased_trajectories" not in req.certificate
    assert ErasureRequest.objects.count() == 1
    # Any other unknown id is a plain 404.
    assert "No such trajectory" in client.get(f"/trajectories/{uuid.uuid4()}/").content.decode()
