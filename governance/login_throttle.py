"""Console login throttling: django-axes, configured in config/settings.py (AXES_*), audited here.

A username tried from one client address (`AXES_LOCKOUT_PARAMETERS`: username AND address, so a
stranger guessing at someone's password from elsewhere cannot lock them out everywhere) is
locked after `STEWARD_LOGIN_FAILURE_LIMIT` wrong passwords (default 5) for
`STEWARD_LOGIN_LOCKOUT_MINUTES` (default 15): even the right password is refused, with a page
that says why and for how long (HTTP 429). A successful login resets the count. REST tokens are
not passwords and are not throttled here.

Each lockout is an audit event `login.locked_out` (actor `system:login`): in every tenant the
user is a member of (so its auditors see it), or — for a username that is no account — one
event without a tenant, written in the system context. Only the first lockout of a username and
address within the lock period is recorded: the attempts made while locked are refused without
writing anything, so a locked-out guesser cannot grow the audit chain. The payload holds the
client address, and for an unknown username a keyed hash of it, never the typed name (which is
often a mistyped password).
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta
from typing import Any

from axes.signals import user_locked_out
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import AuthenticationForm
from django.core.validators import MaxLengthValidator
from django.dispatch import receiver
from django.utils import timezone

from governance.audit import record_event
from governance.models import AuditEvent
from governance.tenancy import system_context, tenant_context, user_memberships

ACTION = "login.locked_out"
ACTOR = "system:login"
SYSTEM_REASON = "login lockout of a username that is no account: a tenant-less audit event"


class LoginForm(AuthenticationForm):
    """Django's login form, with the username's length enforced before authentication: the
    stock form only sets it as a widget attribute, so a 10,000-character username reached the
    backends — and django-axes' attempt table (255 characters), a 500."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["username"]
        field.validators.append(MaxLengthValidator(field.max_length or 150))


def client_ip(request: Any) -> str | None:
    """The client address axes counts failures by: REMOTE_ADDR, or — behind a trusted front
    (deploy/nginx.conf) — the address that front saw, from X-Forwarded-For, when
    STEWARD_TRUSTED_PROXY_HOPS says how many fronts append to it (0: header ignored, since any
    client can send one)."""
    hops = getattr(settings, "STEWARD_TRUSTED_PROXY_HOPS", 0)
    if hops > 0:
        forwarded = [p.strip() for p in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
                     if p.strip()]
        if len(forwarded) >= hops:
            return forwarded[-hops]
    return request.META.get("REMOTE_ADDR")


def username_digest(username: str) -> str:
    from governance.keyring import master_key
    from wire.crypto import derive_key

    key = derive_key(master_key(), "login-username")
    return hmac.new(key, username.casefold().encode(), hashlib.sha256).hexdigest()


def _lock_period() -> timedelta:
    cooloff = settings.AXES_COOLOFF_TIME
    return cooloff if isinstance(cooloff, timedelta) else timedelta(hours=float(cooloff or 0))


@receiver(user_locked_out)
def audit_lockout(sender: Any, request: Any, username: str | None, ip_address: str | None,
                  **kwargs: Any) -> None:
    username = username or ""
    user = get_user_model().objects.filter(username=username).first() if username else None
    since = timezone.now() - _lock_period()
    payload = {"ip_address": ip_address, "failure_limit": settings.AXES_FAILURE_LIMIT,
               "locked_minutes": int(_lock_period().total_seconds() // 60)}
    if user is not None:
        for membership in user_memberships(user.pk):
            tenant_id = membership["tenant_id"]
            with tenant_context(tenant_id):
                if AuditEvent.objects.for_tenant(tenant_id).filter(
                        action=ACTION, object_id=str(user.pk), created_at__gte=since,
                        payload__ip_address=ip_address).exists():
                    continue  # an attempt while locked: recorded once already
                record_event(ACTOR, ACTION, tenant=tenant_id, object_type="user",
                             object_id=user.pk, payload=payload)
        return
    digest = username_digest(username)
    with system_context(SYSTEM_REASON):
        if AuditEvent.objects.filter(tenant__isnull=True, action=ACTION, created_at__gte=since,
                                     payload__username_hmac=digest,
                                     payload__ip_address=ip_address).exists():
            return
        record_event(ACTOR, ACTION, tenant=None, object_type="username",
                     payload={**payload, "username_hmac": digest})
