"""Every mutation of governed state: one atomic function that takes the acting user (or a
"system:<component>" label) and writes its audit event in the same transaction."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from governance.audit import record_event
from governance.crypto import new_token, token_hash
from governance.models import Agent, ApiToken, Membership, ProxyKey, Role, Tenant

PROXY_KEY_PREFIX = "stw_"
API_TOKEN_PREFIX = "stwt_"


class ServiceError(ValueError):
    """A request that breaks a rule; the message is safe to show to the caller."""


@transaction.atomic
def create_tenant(actor: Any, slug: str, name: str = "") -> tuple[Tenant, bool]:
    tenant, created = Tenant.objects.get_or_create(slug=slug, defaults={"name": name or slug})
    if created:
        record_event(actor, "tenant.created", tenant=tenant, object_type="tenant",
                     object_id=tenant.pk, payload={"slug": slug})
    return tenant, created


@transaction.atomic
def ensure_agent(actor: Any, tenant: Tenant, name: str) -> Agent:
    agent, created = Agent.objects.get_or_create(tenant=tenant, name=name)
    if created:
        record_event(actor, "agent.created", tenant=tenant, object_type="agent",
                     object_id=agent.pk, payload={"name": name})
    return agent


@dataclass
class IssuedSecret:
    """A freshly created key or token: `secret` is shown once and never stored."""

    secret: str
    record: Any


@transaction.atomic
def create_proxy_key(actor: Any, tenant: Tenant, agent_name: str) -> IssuedSecret:
    agent = ensure_agent(actor, tenant, agent_name)
    secret = new_token(PROXY_KEY_PREFIX)
    key = ProxyKey.objects.create(
        tenant=tenant, agent=agent, prefix=secret[:10], key_hash=token_hash(secret),
        created_by=actor if hasattr(actor, "pk") else None,
    )
    record_event(actor, "proxy_key.created", tenant=tenant, object_type="proxy_key",
                 object_id=key.pk, payload={"agent": agent.pk, "prefix": key.prefix})
    return IssuedSecret(secret, key)


@transaction.atomic
def revoke_proxy_key(actor: Any, key: ProxyKey) -> ProxyKey:
    key = ProxyKey.objects.select_for_update().get(pk=key.pk)
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at", "updated_at"])
        record_event(actor, "proxy_key.revoked", tenant=key.tenant_id, object_type="proxy_key",
                     object_id=key.pk, payload={"prefix": key.prefix})
    return key


@transaction.atomic
def ensure_member(actor: Any, tenant: Tenant, username: str, role: str,
                  password: str | None = None) -> tuple[Any, Membership, str | None]:
    """Create the user if needed and give them `role` in `tenant`. Returns the generated
    password when one was set (a new user without an explicit password gets a random one)."""
    if role not in Role.values:
        raise ServiceError(f"unknown role {role!r}; choose one of {', '.join(Role.values)}")
    User = get_user_model()
    user, created = User.objects.get_or_create(username=username)
    generated = None
    if password is not None:
        user.set_password(password)
        user.save()
    elif created:
        generated = secrets.token_urlsafe(12)
        user.set_password(generated)
        user.save()
    membership, m_created = Membership.objects.get_or_create(
        user=user, tenant=tenant, defaults={"role": role})
    if not m_created and membership.role != role:
        old = membership.role
        membership.role = role
        membership.save(update_fields=["role"])
        record_event(actor, "membership.role_changed", tenant=tenant, object_type="membership",
                     object_id=membership.pk, payload={"user": user.pk, "from": old, "to": role})
    elif m_created:
        record_event(actor, "membership.created", tenant=tenant, object_type="membership",
                     object_id=membership.pk, payload={"user": user.pk, "role": role})
    if password is not None or created:
        record_event(actor, "user.password_set", tenant=tenant, object_type="user",
                     object_id=user.pk)
    return user, membership, generated


@transaction.atomic
def create_api_token(actor: Any, tenant: Tenant, user: Any) -> IssuedSecret:
    if not Membership.objects.filter(tenant=tenant, user=user).exists():
        raise ServiceError(f"{user} is not a member of {tenant.slug}")
    secret = new_token(API_TOKEN_PREFIX)
    token = ApiToken.objects.create(tenant=tenant, user=user, prefix=secret[:11],
                                    key_hash=token_hash(secret))
    record_event(actor, "api_token.created", tenant=tenant, object_type="api_token",
                 object_id=token.pk, payload={"user": user.pk, "prefix": token.prefix})
    return IssuedSecret(secret, token)


@transaction.atomic
def record_reward(actor: Any, tenant: Tenant, *, value: float, response_id: str = "",
                  trajectory_id: Any = None, name: str = "reward", final: bool = True,
                  comment: str = "", source: str = "api") -> Any:
    """Append a late-bound reward naming a trajectory or an upstream response id (exactly one).
    The capture it names may not exist yet: rewards are joined when a trajectory is served,
    never copied, so nothing is checked against the steps here."""
    import math

    from governance.models import Reward

    if bool(response_id) == (trajectory_id is not None):
        raise ServiceError("give exactly one of response_id or trajectory_id")
    if not math.isfinite(value):
        raise ServiceError("value must be a finite number")
    reward = Reward.objects.create(
        tenant=tenant, trajectory_id=trajectory_id, response_id=response_id or "", name=name,
        value=value, final=final, source=source, comment=comment,
        created_by=actor if hasattr(actor, "pk") else None,
    )
    # The comment is free text (may name people): it stays out of the audit payload.
    record_event(actor, "reward.recorded", tenant=tenant, object_type="reward",
                 object_id=reward.pk,
                 payload={"trajectory_id": str(trajectory_id) if trajectory_id else None,
                          "response_id": response_id or None, "name": name, "value": value,
                          "final": final, "source": source})
    return reward
