"""`manage.py create_tenant SLUG [--name NAME]` — idempotent."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.core.validators import validate_slug

from governance import services
from governance.management.commands._common import CLI_ACTOR


class Command(BaseCommand):
    help = (
        "Create a tenant (an isolated customer/organisation: its agents, keys, data and users). "
        "Idempotent: an existing tenant is left as it is and reported as existing."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("slug", help="short identifier: letters, digits, '-' and '_', "
                                         "at most 64 characters (e.g. acme)")
        parser.add_argument("--name", default="", help="display name (default: the slug)")

    def handle(self, *args, slug: str, name: str, **options) -> None:
        try:
            validate_slug(slug)
        except ValidationError as exc:
            raise CommandError(f"invalid tenant slug {slug!r}: {exc.messages[0]}") from None
        if len(slug) > 64:
            raise CommandError(f"invalid tenant slug {slug!r}: at most 64 characters")
        tenant, created = services.create_tenant(CLI_ACTOR, slug, name)
        state = "created" if created else "exists"
        self.stdout.write(f"tenant {tenant.slug} {state} (id {tenant.pk}, name {tenant.name!r})")
