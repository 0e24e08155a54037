"""`manage.py create_proxy_key --tenant SLUG --agent NAME` — the key is the last output line."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from governance import services
from governance.management.commands._common import CLI_ACTOR, get_tenant


class Command(BaseCommand):
    help = (
        "Issue a new proxy key (stw_...) for an agent of a tenant; the agent is created if it "
        "does not exist. The agent sends the key as its OpenAI API key (Bearer token) to the "
        "Steward proxy. The key is printed once, as the last line, and only its hash is stored: "
        "copy it now. Existing keys of the agent stay valid (revoke them in the console)."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tenant", required=True, metavar="SLUG", help="the tenant's slug")
        parser.add_argument("--agent", required=True, metavar="NAME",
                            help="the agent's name within the tenant (created if needed)")

    def handle(self, *args, tenant: str, agent: str, **options) -> None:
        if not agent.strip() or len(agent) > 128:
            raise CommandError("--agent must be a non-empty name of at most 128 characters")
        tenant_obj = get_tenant(tenant)
        issued = services.create_proxy_key(CLI_ACTOR, tenant_obj, agent)
        key = issued.record
        self.stdout.write(
            f"proxy key {key.prefix}... created for agent {key.agent.name} "
            f"(tenant {tenant_obj.slug}); base_url http://<host>:{settings.STEWARD_PROXY_PORT}/v1"
        )
        self.stdout.write(issued.secret)
