"""`manage.py migrate`, run as the schema owner.

The services connect as the app role (DATABASE_URL: owns nothing, NOBYPASSRLS, so row-level
security applies to it). Schema changes need the owner: when DATABASE_OWNER_URL is set, this
command swaps the default connection to it for the run, and afterwards grants the app role
(DATABASE_URL's user) its privileges on every table and sequence — new ones included — minus
the append-only refusals (governance.tenancy.grant_app_privileges). Without DATABASE_OWNER_URL
it is Django's migrate on DATABASE_URL, unchanged.
"""

from __future__ import annotations

from typing import Any

import dj_database_url
from django.conf import settings
from django.core.management.commands import migrate
from django.db import DEFAULT_DB_ALIAS, connections

from governance.tenancy import grant_app_privileges

SWAPPED = ("NAME", "USER", "PASSWORD", "HOST", "PORT", "OPTIONS")


class Command(migrate.Command):
    help = (migrate.Command.help + " Runs as DATABASE_OWNER_URL when set, then grants the app "
            "role (DATABASE_URL's user) its privileges.")

    def handle(self, *args: Any, **options: Any) -> None:
        owner_url = getattr(settings, "DATABASE_OWNER_URL", "")
        alias = options.get("database") or DEFAULT_DB_ALIAS
        if not owner_url or alias != DEFAULT_DB_ALIAS:
            return super().handle(*args, **options)
        conn = connections[alias]
        app_user = conn.settings_dict.get("USER") or ""
        owner = dj_database_url.parse(owner_url)
        saved = {k: conn.settings_dict.get(k) for k in SWAPPED}
        conn.close()
        conn.settings_dict.update({k: owner.get(k, saved[k]) for k in SWAPPED})
        conn.settings_dict["OPTIONS"] = owner.get("OPTIONS") or {}
        try:
            super().handle(*args, **options)
            if app_user and app_user != owner.get("USER"):
                with conn.cursor() as cursor:
                    grant_app_privileges(cursor, app_user)
                if options.get("verbosity", 1) >= 1:
                    self.stdout.write(f"Granted the app role {app_user!r} its privileges.")
        finally:
            conn.close()
            conn.settings_dict.update(saved)
