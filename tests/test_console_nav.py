"""The console's navigation: every section DESIGN.md names exists, each is guarded by the
permission its nav entry is shown for, and each role sees exactly what it may open."""

from __future__ import annotations

import pytest
from django.urls import resolve, reverse

from governance.permissions import role_has
from governance.views.common import NAV

ROLES = ["admin", "steward", "compliance", "auditor"]
DESIGN_PATHS = ["/", "/trajectories/", "/datasets/", "/approvals/", "/erasure/", "/training/",
                "/checkpoints/", "/audit/", "/keys/", "/settings/"]


@pytest.mark.parametrize("item", NAV, ids=[i.url_name for i in NAV])
def test_every_section_exists_and_is_guarded_by_its_nav_permission(item):
    view = resolve(reverse(item.url_name)).func
    assert getattr(view, "console_permission", "missing") == item.permission


def test_design_paths_are_the_sections():
    assert set(DESIGN_PATHS) <= {reverse(i.url_name) for i in NAV}


@pytest.mark.parametrize("role", ROLES)
def test_each_role_sees_only_what_it_may_open(client, make_member, role):
    client.force_login(make_member(role))
    body = client.get("/").content.decode()
    nav = body[body.index('<nav aria-label="Main">'):body.index("</nav>")]
    for item in NAV:
        href = f'href="{reverse(item.url_name)}"'
        allowed = item.permission is None or role_has(role, item.permission)
        assert (href in nav) == allowed, (role, item.url_name)
        status = client.get(reverse(item.url_name)).status_code
        assert status == (200 if allowed else 403), (role, item.url_name, status)


def test_a_database_error_in_a_view_is_a_plain_500(client, make_member, monkeypatch):
    """The request transaction is marked for rollback after a view's database error; leaving
    the tenant scope must not run SQL on it (that raised TransactionManagementError over the
    real error)."""
    from django.db import connection

    from governance.views import overview

    def broken(request, *args, **kwargs):
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table")

    client.force_login(make_member("admin"))
    from django.urls import path

    from config import urls

    monkeypatch.setattr(urls, "urlpatterns", [path("boom/", overview.console_view(broken)),
                                              *urls.urlpatterns])
    from django.urls import clear_url_caches

    clear_url_caches()
    from django.db.utils import ProgrammingError

    # The test client re-raises the last exception the handler logged: it must be the view's.
    try:
        with pytest.raises(ProgrammingError, match="no_such_table"):
            client.get("/boom/")
    finally:
        clear_url_caches()
