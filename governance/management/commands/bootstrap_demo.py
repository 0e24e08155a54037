"""`manage.py bootstrap_demo` — the demo tenant, login, proxy key and API token of `steward up`.

Keys, tokens and passwords are shown once and stored only hashed, so the first run writes them
to var/demo-credentials.json (mode 0600) and later runs re-print them from there. Each stored
secret is checked against the database first: whatever no longer works (file lost, database
reset, key revoked) is issued anew and the file rewritten.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.utils import timezone

from governance import services
from governance.management.commands._common import CLI_ACTOR
from governance.models import ApiToken, Membership, ProxyKey, Role
from governance.tenancy import tenant_context
from wire.crypto import token_hash

DEMO_TENANT = "demo"
DEMO_ADMIN = "demo-admin"
DEMO_AGENT = "demo-agent"


def credentials_path() -> Path:
    return Path(settings.VAR_DIR) / "demo-credentials.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict[str, Any]) -> None:
    """Write the file atomically, never readable by others (not even for a moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class Command(BaseCommand):
    help = (
        f"Create the demo set-up used by `steward up`: tenant '{DEMO_TENANT}', an admin console "
        f"login '{DEMO_ADMIN}' with a generated password, a proxy key for agent '{DEMO_AGENT}' "
        f"and a REST API token for '{DEMO_ADMIN}'. The secrets are stored in "
        "<STEWARD_VAR_DIR>/demo-credentials.json (mode 0600) on first creation and re-printed "
        "from there on later runs; any that no longer work are re-issued. Not for production."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json",
                            help="print the credentials as one JSON object (last line)")

    def handle(self, *args, as_json: bool = False, **options) -> None:
        path = credentials_path()
        stored = _read(path)
        creds, changed = self.ensure(stored)
        if changed or stored != creds:
            _write(path, creds)
        if as_json:
            self.stdout.write(json.dumps(creds))
            return
        state = "created" if changed else "unchanged"
        self.stdout.write(f"demo tenant:      {creds['tenant']}")
        self.stdout.write(f"console login:    {creds['username']} / {creds['password']}")
        self.stdout.write(f"proxy key ({creds['agent']}): {creds['proxy_key']}")
        self.stdout.write(f"API token ({creds['username']}): {creds['api_token']}")
        self.stdout.write(f"credentials {state}: {path} (mode 0600)")

    def ensure(self, stored: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        tenant, _ = services.create_tenant(CLI_ACTOR, DEMO_TENANT, "Demo")
        # The checks below read the demo tenant's rows: row-level security shows them only
        # inside its scope (the services called here join it).
        with tenant_context(tenant):
            return self._ensure(tenant, stored)

    def _ensure(self, tenant: Any, stored: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        changed = False

        user = get_user_model().objects.filter(username=DEMO_ADMIN).first()
        password = stored.get("password")
        password_ok = bool(
            user is not None and isinstance(password, str) and user.check_password(password)
        )
        is_admin = user is not None and Membership.objects.filter(
            user=user, tenant=tenant, role=Role.ADMIN).exists()
        if not password_ok:
            password = secrets.token_urlsafe(12)
            changed = True
        if not password_ok or not is_admin:
            user, _, _ = services.ensure_member(
                CLI_ACTOR, tenant, DEMO_ADMIN, Role.ADMIN,
                password=None if password_ok else password)

        proxy_key = stored.get("proxy_key")
        if not (isinstance(proxy_key, str) and ProxyKey.objects.filter(
                tenant=tenant, agent__name=DEMO_AGENT, key_hash=token_hash(proxy_key),
                revoked_at__isnull=True).exists()):
            proxy_key = services.create_proxy_key(CLI_ACTOR, tenant, DEMO_AGENT).secret
            changed = True

        api_token = stored.get("api_token")
        if not (isinstance(api_token, str) and ApiToken.objects.filter(
                tenant=tenant, user=user, key_hash=token_hash(api_token),
                revoked_at__isnull=True).exists()):
            api_token = services.create_api_token(CLI_ACTOR, tenant, user).secret
            changed = True

        creds = {
            "tenant": DEMO_TENANT,
            "username": DEMO_ADMIN,
            "password": password,
            "agent": DEMO_AGENT,
            "proxy_key": proxy_key,
            "api_token": api_token,
            "updated_at": stored.get("updated_at") if not changed else timezone.now().isoformat(),
        }
        return creds, changed
