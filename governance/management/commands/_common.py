"""Helpers shared by the bootstrap commands (the leading underscore keeps Django from listing
this module as a command)."""

from __future__ import annotations

from django.core.management.base import CommandError

from governance.models import Role, Tenant

# Every mutation made from the command line is audited under this actor.
CLI_ACTOR = "system:cli"
ROLE_CHOICES = list(Role.values)


def get_tenant(slug: str) -> Tenant:
    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        raise CommandError(
            f"unknown tenant {slug!r}; create it first: python manage.py create_tenant {slug}"
        )
    return tenant
