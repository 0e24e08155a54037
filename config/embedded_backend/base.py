"""Django's PostgreSQL backend, starting the embedded server (config/embedded.py) on the first
connection instead of when settings load. So a command that never queries the database (e.g.
`manage.py sanitize` without --tenant) never starts PostgreSQL."""

from __future__ import annotations

import dj_database_url
from django.conf import settings
from django.db.backends.postgresql import base


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params):
        from config.embedded import ensure_embedded

        app_url, owner_url = ensure_embedded(settings.VAR_DIR)
        # The server decides its socket directory; connect where it actually listens.
        user = conn_params.get("user")
        actual = dj_database_url.parse(owner_url if user and user in owner_url else app_url)
        host = actual.get("OPTIONS", {}).get("host") or actual.get("HOST")
        if host:
            conn_params = {**conn_params, "host": host}
        return super().get_new_connection(conn_params)
