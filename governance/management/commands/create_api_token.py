"""`manage.py create_api_token --tenant SLUG --user NAME --role ROLE` — token on the last line."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from governance import services
from governance.management.commands._common import CLI_ACTOR, ROLE_CHOICES, get_tenant


class Command(BaseCommand):
    help = (
        "Issue a REST API token (stwt_...) for a user of a tenant, for "
        "'Authorization: Bearer <token>' on /api/v1/. The user and their membership are "
        "created if needed (a new user gets a random password nobody is shown: use create_user "
        "to give them a console login); an existing member is given ROLE. The token is "
        "printed once, as the last line."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tenant", required=True, metavar="SLUG", help="the tenant's slug")
        parser.add_argument("--user", required=True, metavar="NAME", help="the user name")
        parser.add_argument("--role", required=True, choices=ROLE_CHOICES,
                            help="the user's role in the tenant")

    def handle(self, *args, tenant: str, user: str, role: str, **options) -> None:
        if not user.strip() or len(user) > 150:
            raise CommandError("--user must be a non-empty name of at most 150 characters")
        tenant_obj = get_tenant(tenant)
        try:
            user_obj, membership, _ = services.ensure_member(CLI_ACTOR, tenant_obj, user, role)
            issued = services.create_api_token(CLI_ACTOR, tenant_obj, user_obj)
        except services.ServiceError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"API token {issued.record.prefix}... created for {user_obj.username} "
            f"({membership.role} of {tenant_obj.slug})"
        )
        self.stdout.write(issued.secret)
