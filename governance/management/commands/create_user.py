"""`manage.py create_user --tenant SLUG --user NAME --role ROLE` — a console login."""

from __future__ import annotations

import os
import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from governance import services
from governance.management.commands._common import CLI_ACTOR, ROLE_CHOICES, get_tenant


class Command(BaseCommand):
    help = (
        "Create a console login (user + membership with ROLE in the tenant). The password is "
        "taken from the STEWARD_PASSWORD environment variable, or generated and printed once as "
        "the last line. For an existing user the role is updated and the password is left "
        "unchanged unless STEWARD_PASSWORD is set or --reset-password is given."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tenant", required=True, metavar="SLUG", help="the tenant's slug")
        parser.add_argument("--user", required=True, metavar="NAME", help="the login name")
        parser.add_argument("--role", required=True, choices=ROLE_CHOICES,
                            help="the user's role in the tenant")
        parser.add_argument("--reset-password", action="store_true",
                            help="give an existing user a new generated password")

    def handle(self, *args, tenant: str, user: str, role: str, reset_password: bool,
               **options) -> None:
        if not user.strip() or len(user) > 150:
            raise CommandError("--user must be a non-empty name of at most 150 characters")
        tenant_obj = get_tenant(tenant)
        exists = get_user_model().objects.filter(username=user).exists()
        from_env = os.environ.get("STEWARD_PASSWORD") or None
        password = from_env
        if password is None and (not exists or reset_password):
            password = secrets.token_urlsafe(12)
        if from_env is not None:
            try:
                validate_password(from_env, get_user_model()(username=user))
            except ValidationError as exc:
                raise CommandError("STEWARD_PASSWORD rejected: " + " ".join(exc.messages)) from None
        try:
            user_obj, membership, _ = services.ensure_member(
                CLI_ACTOR, tenant_obj, user, role, password=password)
        except services.ServiceError as exc:
            raise CommandError(str(exc)) from None
        verb = "updated" if exists else "created"
        self.stdout.write(f"user {user_obj.username} {verb} ({membership.role} of "
                          f"{tenant_obj.slug}); console login at /login/")
        if from_env is not None:
            self.stdout.write("password set from STEWARD_PASSWORD")
        elif password is not None:
            self.stdout.write(password)
        else:
            self.stdout.write("password unchanged (set STEWARD_PASSWORD or pass --reset-password "
                              "to set a new one)")
