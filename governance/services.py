"""Every mutation of governed state: one atomic function that takes the acting user (or a
"system:<component>" label) and writes its audit event in the same transaction.

Each runs in its tenant's row-level security scope (`tenant_atomic`, governance/tenancy.py):
one transaction that sees and writes only that tenant's rows — joined when the caller (a web
request, a task) is already in the same tenant's scope, refused inside another tenant's."""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from governance.audit import record_event
from governance.datasets import (
    SAMPLE_SIZE,
    eligible_trajectories,
    filter_of,
    version_content_hash,
)
from governance.models import (
    Agent,
    ApiToken,
    Approval,
    Classification,
    Dataset,
    DatasetVersion,
    DatasetVersionMember,
    Membership,
    ProxyKey,
    RetentionPolicy,
    Role,
    Tenant,
)
from governance.permissions import member_can
from governance.tenancy import tenant_atomic, tenant_context
from wire.crypto import new_token, token_hash

PROXY_KEY_PREFIX = "stw_"
API_TOKEN_PREFIX = "stwt_"


class ServiceError(ValueError):
    """A request that breaks a rule; the message is safe to show to the caller."""


@transaction.atomic
def create_tenant(actor: Any, slug: str, name: str = "") -> tuple[Tenant, bool]:
    tenant, created = Tenant.objects.get_or_create(slug=slug, defaults={"name": name or slug})
    if created:
        with tenant_context(tenant):  # the event belongs to the new tenant
            record_event(actor, "tenant.created", tenant=tenant, object_type="tenant",
                         object_id=tenant.pk, payload={"slug": slug})
    return tenant, created


@tenant_atomic("tenant")
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


@tenant_atomic("tenant")
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


@tenant_atomic("key.tenant_id")
def revoke_proxy_key(actor: Any, key: ProxyKey) -> ProxyKey:
    key = ProxyKey.objects.select_for_update().get(pk=key.pk)
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at", "updated_at"])
        record_event(actor, "proxy_key.revoked", tenant=key.tenant_id, object_type="proxy_key",
                     object_id=key.pk, payload={"prefix": key.prefix})
    return key


@tenant_atomic("tenant")
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


@tenant_atomic("tenant")
def create_api_token(actor: Any, tenant: Tenant, user: Any) -> IssuedSecret:
    """Issue a REST token acting as `user` in `tenant`. A person is issued a token only for
    themself: a token minted for someone else would let its holder act (read raw payloads,
    approve) as that person, and the audit log would blame them (separation of duties). Only
    the operator's bootstrap tools (a "system:..." actor, e.g. `manage.py create_api_token`)
    issue tokens to a named member."""
    person = _user(actor)
    if person is not None and person.pk != getattr(user, "pk", None):
        raise ServiceForbidden("an API token is issued only to yourself: the member creates "
                               "their own (an admin may revoke anyone's)")
    if not Membership.objects.filter(tenant=tenant, user=user).exists():
        raise ServiceError(f"{user} is not a member of {tenant.slug}")
    secret = new_token(API_TOKEN_PREFIX)
    token = ApiToken.objects.create(tenant=tenant, user=user, prefix=secret[:11],
                                    key_hash=token_hash(secret))
    record_event(actor, "api_token.created", tenant=tenant, object_type="api_token",
                 object_id=token.pk, payload={"user": user.pk, "prefix": token.prefix})
    return IssuedSecret(secret, token)


@tenant_atomic("token.tenant_id")
def revoke_api_token(actor: Any, token: ApiToken) -> ApiToken:
    """Revoke a REST token (idempotent): the next request with it answers 401."""
    token = ApiToken.objects.select_for_update().get(pk=token.pk)
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        record_event(actor, "api_token.revoked", tenant=token.tenant_id, object_type="api_token",
                     object_id=token.pk, payload={"user": token.user_id, "prefix": token.prefix})
    return token


def sanitize_reward_comment(tenant: Tenant, comment: str) -> str:
    """A reward's comment as it may be stored: sanitized with the tenant's policy, like captured
    text (it is free text a person or a judge wrote — and a reference answer, which reaches
    training). A comment that was a JSON document stays one (placeholders hold no quotes)."""
    if not comment or not comment.strip():
        return comment
    from governance.sanitizer import get_sanitizer, policy_for_tenant

    return get_sanitizer().with_policy(policy_for_tenant(tenant)).sanitize_text(
        comment, path="$.comment").text


def record_reward(actor: Any, tenant: Tenant, *, value: float, response_id: str = "",
                  trajectory_id: Any = None, name: str = "reward", final: bool = True,
                  comment: str = "", source: str = "api") -> Any:
    """Append a late-bound reward naming a trajectory or an upstream response id (exactly one).
    The capture it names may not exist yet: rewards are joined when a trajectory is served,
    never copied, so nothing is checked against the steps here.

    The comment is sanitized first, outside the service's transaction: rewards are append-only,
    so it could not be rewritten later, and the raw text is never stored. (In a web request
    the request's own transaction is open, holding no lock yet; a comment has at most 10,000
    characters and most rewards have none, which skips NER altogether.)"""
    if bool(response_id) == (trajectory_id is not None):
        raise ServiceError("give exactly one of response_id or trajectory_id")
    if not math.isfinite(value):
        raise ServiceError("value must be a finite number")
    return _insert_reward(actor, tenant, value=value, response_id=response_id,
                          trajectory_id=trajectory_id, name=name, final=final,
                          comment=sanitize_reward_comment(tenant, comment), source=source)


@tenant_atomic("tenant")
def _insert_reward(actor: Any, tenant: Tenant, *, value: float, response_id: str,
                   trajectory_id: Any, name: str, final: bool, comment: str,
                   source: str) -> Any:
    from governance.models import Reward

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


# --- errors with an HTTP meaning ------------------------------------------------------------


class ServiceForbidden(ServiceError):
    """The actor may not do this (four eyes, wrong role): REST answers 403."""


class ServiceConflict(ServiceError):
    """The object is not in a state that allows this: REST answers 409."""


class ServiceGone(ServiceError):
    """The data existed but is destroyed for good (retention, crypto-shredding): REST answers
    410."""


def acting_user(actor: Any) -> Any:
    """The person behind `actor` (a Django user), None for a system actor ("system:...")."""
    return actor if hasattr(actor, "pk") else None


_user = acting_user


def reason_digest(reason: str) -> str:
    """Free text stays out of the audit chain (it may name people, and the chain is never
    rewritten); its SHA-256 ties the stored row to the event."""
    return hashlib.sha256((reason or "").encode()).hexdigest()


_reason_digest = reason_digest


def require_reason(reason: str, max_chars: int | None = None) -> str:
    """The stripped reason (cut to `max_chars`), or ServiceError when there is none."""
    reason = (reason or "").strip()
    if not reason:
        raise ServiceError("a reason is required")
    return reason[:max_chars] if max_chars else reason


def four_eyes_refusal(user: Any, version: Any) -> str:
    """Why `user` may not decide on dataset `version` ('' when the four-eyes rule allows):
    whoever froze it or asked for its approval never decides on it. The service refuses with
    this, and the console shows it before anyone clicks."""
    if version.requested_by_id and user.pk == version.requested_by_id:
        return ("You requested this version; a different compliance officer must approve it "
                "(four eyes).")
    if version.created_by_id and user.pk == version.created_by_id:
        return ("You froze this version; a different compliance officer must approve it "
                "(four eyes).")
    return ""


# --- append-only rewards: the one way to delete them ---------------------------------------


@contextmanager
def purge_allowed() -> Iterator[None]:
    """Inside the current transaction, let DELETE through the append-only trigger of
    governance_reward (erasure and retention only). The setting is transaction-local
    (set_config(..., true)) and switched off again on exit, so it never outlives the purge."""
    if not connection.in_atomic_block:
        raise RuntimeError("purge_allowed() must run inside a transaction")
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('steward.allow_purge', 'on', true)")
    try:
        yield
    finally:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT set_config('steward.allow_purge', 'off', true)")
        except DatabaseError:  # the transaction failed: its rollback drops the setting
            pass


# --- datasets and four-eyes approval ------------------------------------------------------


def _validate_dataset_filter(tenant: Tenant, agent_ids: list[int], since: Any, until: Any,
                             reward_name: str, reward_min: float | None,
                             reward_max: float | None, classification: str) -> list[int]:


    ids = sorted({int(a) for a in agent_ids or []})
    if ids:
        known = set(Agent.objects.for_tenant(tenant).filter(pk__in=ids)
                    .values_list("pk", flat=True))
        unknown = [a for a in ids if a not in known]
        if unknown:
            raise ServiceError(f"unknown agent id(s): {', '.join(map(str, unknown))}")
    if since and until and since >= until:
        raise ServiceError("until must be after since")
    for bound in (reward_min, reward_max):
        if bound is not None and not math.isfinite(bound):
            raise ServiceError("reward bounds must be finite numbers")
    if (reward_min is not None or reward_max is not None) and not reward_name:
        raise ServiceError("reward_min/reward_max need reward_name")
    if reward_min is not None and reward_max is not None and reward_min > reward_max:
        raise ServiceError("reward_min must not exceed reward_max")
    if classification not in Classification.values:
        raise ServiceError(f"classification must be one of {', '.join(Classification.values)}")
    return ids


@tenant_atomic("tenant")
def create_dataset(actor: Any, tenant: Tenant, *, name: str, description: str = "",
                   agent_ids: list[int] | None = None, since: Any = None, until: Any = None,
                   reward_name: str = "", reward_min: float | None = None,
                   reward_max: float | None = None, classification: str = "internal") -> Any:

    name = (name or "").strip()
    if not name:
        raise ServiceError("name is required")
    ids = _validate_dataset_filter(tenant, agent_ids or [], since, until, reward_name,
                                   reward_min, reward_max, classification)
    if Dataset.objects.for_tenant(tenant).filter(name=name).exists():
        raise ServiceConflict(f"a dataset named {name!r} exists already")
    dataset = Dataset.objects.create(
        tenant=tenant, name=name, description=description, agent_ids=ids, since=since,
        until=until, reward_name=reward_name, reward_min=reward_min, reward_max=reward_max,
        classification=classification, created_by=_user(actor))
    record_event(actor, "dataset.created", tenant=tenant, object_type="dataset",
                 object_id=dataset.pk, payload={"name": name, "filter": filter_of(dataset)})
    return dataset


@tenant_atomic("dataset.tenant_id")
def preview_dataset_count(dataset: Any) -> int:
    """How many trajectories a freeze would take now (one COUNT; nothing written). Works on
    an unsaved Dataset too, to preview a filter before creating it."""
    return eligible_trajectories(dataset).count()


@tenant_atomic("dataset.tenant_id")
def freeze_dataset_version(actor: Any, dataset: Any) -> Any:
    """Freeze the dataset's current selection into a new draft DatasetVersion: members
    (INSERT ... SELECT, no round trip per trajectory), content hash, review sample."""


    # The row lock serialises version numbers of one dataset.
    dataset = Dataset.objects.select_for_update().get(pk=dataset.pk)
    last = dataset.versions.order_by("-number").values_list("number", flat=True).first()
    version = DatasetVersion.objects.create(
        tenant_id=dataset.tenant_id, dataset=dataset, number=(last or 0) + 1,
        filter=filter_of(dataset), content_hash="", created_by=_user(actor))
    sql, params = eligible_trajectories(dataset).values("pk").query.sql_with_params()
    table = DatasetVersionMember._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (tenant_id, version_id, trajectory_id) "  # noqa: S608
            f"SELECT %s, %s, e.pk FROM ({sql}) AS e",
            [dataset.tenant_id, version.pk, *params])
        size = cursor.rowcount
    if size == 0:
        raise ServiceError("no eligible trajectories: nothing to freeze (only sanitized, "
                           "consented, non-quarantined trajectories matching the filter "
                           "qualify)")
    version.content_hash, version.step_count = version_content_hash(version)
    version.size = size
    with connection.cursor() as cursor:
        # Deterministic, cheap sample: the members with the smallest md5(hash || id).
        cursor.execute(
            f"SELECT trajectory_id::text FROM {table} WHERE version_id = %s "  # noqa: S608
            f"ORDER BY md5(%s || trajectory_id::text) LIMIT %s",
            [version.pk, version.content_hash, SAMPLE_SIZE])
        version.sample_ids = sorted(row[0] for row in cursor.fetchall())
    version.save(update_fields=["content_hash", "step_count", "size", "sample_ids"])
    record_event(actor, "dataset_version.frozen", tenant=dataset.tenant_id,
                 object_type="dataset_version", object_id=version.pk,
                 payload={"dataset": dataset.pk, "number": version.number, "size": size,
                          "steps": version.step_count, "content_hash": version.content_hash})
    return version


def _locked_version(version: Any) -> Any:

    return DatasetVersion.objects.select_for_update().get(pk=version.pk)


@tenant_atomic("version.tenant_id")
def request_approval(actor: Any, version: Any) -> Any:

    if _user(actor) is None:
        raise ServiceForbidden("approval is requested by a person")
    version = _locked_version(version)
    if version.status != DatasetVersion.Status.DRAFT:
        raise ServiceConflict(f"version is {version.status}; only a draft can be submitted")
    version.status = DatasetVersion.Status.PENDING_APPROVAL
    version.requested_by = actor
    version.requested_at = timezone.now()
    version.save(update_fields=["status", "requested_by", "requested_at"])
    record_event(actor, "dataset_version.approval_requested", tenant=version.tenant_id,
                 object_type="dataset_version", object_id=version.pk,
                 payload={"dataset": version.dataset_id, "number": version.number,
                          "content_hash": version.content_hash})
    return version


def _decide(actor: Any, version: Any, reason: str, decision: str) -> Any:

    user = _user(actor)
    if user is None:
        raise ServiceForbidden("a decision is made by a person")
    version = _locked_version(version)
    membership = Membership.objects.filter(user=user, tenant_id=version.tenant_id).first()
    if not member_can(membership, "approve"):
        raise ServiceForbidden("only a compliance officer of this tenant may approve or reject "
                               "a dataset version")
    # Four eyes: whoever froze the version or asked for its approval never decides on it.
    if four_eyes_refusal(user, version):
        raise ServiceForbidden("four eyes: you froze or requested this version, so another "
                               "compliance officer must decide on it")
    if version.status != DatasetVersion.Status.PENDING_APPROVAL:
        raise ServiceConflict(f"version is {version.status}; only a version pending approval "
                              "can be decided")
    reason = require_reason(reason)
    if decision == Approval.Decision.APPROVE:
        # Approval covers exactly the frozen content: refuse if it drifted since.
        current, _ = version_content_hash(version)
        if current != version.content_hash:
            raise ServiceConflict("the version's content changed since it was frozen; "
                                  "freeze a new version")
    approval = Approval.objects.create(tenant_id=version.tenant_id, version=version,
                                       decided_by=user, decision=decision, reason=reason)
    version.status = (DatasetVersion.Status.APPROVED if decision == Approval.Decision.APPROVE
                      else DatasetVersion.Status.REJECTED)
    version.save(update_fields=["status"])
    record_event(actor, f"dataset_version.{version.status}", tenant=version.tenant_id,
                 object_type="dataset_version", object_id=version.pk,
                 payload={"dataset": version.dataset_id, "number": version.number,
                          "approval": approval.pk, "content_hash": version.content_hash,
                          "reason_sha256": _reason_digest(reason)})
    return approval


@tenant_atomic("version.tenant_id")
def approve_version(actor: Any, version: Any, reason: str) -> Any:
    """Approve a version pending approval (compliance officer, not its freezer/requester)."""
    return _decide(actor, version, reason, "approve")


@tenant_atomic("version.tenant_id")
def reject_version(actor: Any, version: Any, reason: str) -> Any:
    return _decide(actor, version, reason, "reject")


@tenant_atomic("tenant")
def invalidate_versions_containing(actor: Any, tenant: Tenant | int, trajectory_ids: Any,
                                   reason: str) -> list[int]:
    """Invalidate every draft, pending or approved version of `tenant` holding any of these
    trajectories (erasure, retention): an approval covers exactly its content, so once a
    member is gone it no longer holds. Returns the invalidated version ids."""
    tenant_id = tenant if isinstance(tenant, int) else tenant.pk
    live = [DatasetVersion.Status.DRAFT, DatasetVersion.Status.PENDING_APPROVAL,
            DatasetVersion.Status.APPROVED]
    holding = (DatasetVersionMember.objects.for_tenant(tenant_id)
               .filter(trajectory_id__in=list(trajectory_ids)).values("version_id"))
    versions = list(DatasetVersion.objects.for_tenant(tenant_id)
                    .filter(pk__in=holding, status__in=live)
                    .select_for_update().order_by("pk"))
    now = timezone.now()
    for version in versions:
        before = version.status
        version.status = DatasetVersion.Status.INVALIDATED
        version.invalidated_at = now
        version.invalidated_reason = reason[:500]
        version.save(update_fields=["status", "invalidated_at", "invalidated_reason"])
        record_event(actor, "dataset_version.invalidated", tenant=tenant_id,
                     object_type="dataset_version", object_id=version.pk,
                     payload={"dataset": version.dataset_id, "number": version.number,
                              "was": before, "reason": reason[:500]})
    return [v.pk for v in versions]


# --- retention policies --------------------------------------------------------------------


# Past this a deadline (now + days) leaves the dates Python and PostgreSQL can hold, and the
# column is a 32-bit integer: a bound the form and REST both report, never a 500.
MAX_RETENTION_DAYS = 36_500


@tenant_atomic("tenant")
def set_retention_policy(actor: Any, tenant: Tenant, classification: str, *, steps_days: int,
                         raw_days: int, findings_days: int, audit_days: int) -> Any:
    """Create or replace the tenant's policy for one classification ("*": the rest)."""
    if classification != RetentionPolicy.ANY and classification not in Classification.values:
        raise ServiceError("classification must be '*' or one of "
                           f"{', '.join(Classification.values)}")
    days = {"steps_days": steps_days, "raw_days": raw_days, "findings_days": findings_days,
            "audit_days": audit_days}
    for field, value in days.items():
        if not isinstance(value, int) or value < (0 if field == "raw_days" else 1):
            raise ServiceError(f"{field} must be a whole number of days "
                               f"({'0' if field == 'raw_days' else '1'} or more)")
        if value > MAX_RETENTION_DAYS:
            raise ServiceError(f"{field} must be at most {MAX_RETENTION_DAYS} days (100 years)")
    if raw_days > steps_days:
        raise ServiceError("raw_days must not exceed steps_days (a raw payload never "
                           "outlives its step)")
    if audit_days < max(steps_days, raw_days, findings_days):
        raise ServiceError("audit_days must be at least as long as every other retention "
                           "(the audit log outlives the data it describes)")
    policy, created = RetentionPolicy.objects.select_for_update().get_or_create(
        tenant=tenant, classification=classification,
        defaults={**days, "updated_by": _user(actor)})
    if not created:
        for field, value in days.items():
            setattr(policy, field, value)
        policy.updated_by = _user(actor)
        policy.save()
    record_event(actor, "retention_policy.created" if created else "retention_policy.updated",
                 tenant=tenant, object_type="retention_policy", object_id=policy.pk,
                 payload={"classification": classification, **days})
    return policy


@tenant_atomic("policy.tenant_id")
def delete_retention_policy(actor: Any, policy: Any) -> None:
    record_event(actor, "retention_policy.deleted", tenant=policy.tenant_id,
                 object_type="retention_policy", object_id=policy.pk,
                 payload={"classification": policy.classification})
    policy.delete()


# --- raw payloads and the sanitizer policy ----------------------------------------------------


@dataclass
class RawPayload:
    """A decrypted raw exchange, as the proxy captured it (request and response headers and
    the exact body bytes, base64)."""

    step: Any
    interaction: Any
    exchange: dict[str, Any]


@tenant_atomic("step.tenant_id")
def read_raw_payload(actor: Any, step: Any, reason: str) -> RawPayload:
    """Decrypt the raw, unsanitized exchange behind a step — for a compliance officer
    (permission `read_raw_payloads`, checked by the caller), with a stated reason. The read is
    audited (`raw.read`) in the same transaction; the audit payload holds the reason's SHA-256
    and length only (the chain is pseudonymous). After the raw retention (ciphertext
    destroyed) or erasure (data key destroyed) it is gone: ServiceGone."""
    from governance.capture.rawstore import RawPayloadUnavailable, open_raw
    from governance.models import Interaction

    reason = (reason or "").strip()
    if not reason:
        raise ServiceError("a reason is required to read a raw payload")
    interaction = (Interaction.objects.for_tenant(step.tenant_id).select_related("data_key")
                   .filter(step__pk=step.pk).first())
    if interaction is None:
        raise ServiceGone("the raw payload of this step is gone: its interaction was purged")
    if interaction.raw_ciphertext is None:
        expired = interaction.raw_expires_at
        when = f" (raw retention ended {expired.isoformat()})" if expired else ""
        raise ServiceGone("the raw payload of this step was destroyed by its retention"
                          f"{when}; only the sanitized step remains")
    try:
        exchange = open_raw(interaction)
    except RawPayloadUnavailable as exc:
        raise ServiceGone(f"the raw payload of this step cannot be read any more: {exc}; "
                          "only the sanitized step remains") from exc
    except Exception as exc:  # tampered ciphertext or a wrong key: nothing to show
        raise ServiceGone("the raw payload of this step does not decrypt "
                          f"({type(exc).__name__}); only the sanitized step remains") from exc
    record_event(actor, "raw.read", tenant=step.tenant_id, object_type="step",
                 object_id=str(step.pk),
                 payload={"trajectory": str(step.trajectory_id),
                          "interaction": interaction.pk,
                          "reason_sha256": _reason_digest(reason),
                          "reason_length": len(reason)})
    return RawPayload(step, interaction, exchange)


def _validated_policy(policy: Any) -> dict[str, Any]:
    """The policy as stored (Policy.to_dict), or a ServiceError saying what is wrong."""
    from governance.sanitizer import Policy

    if not isinstance(policy, dict):
        raise ServiceError("the sanitizer policy is a JSON object")
    unknown = set(policy) - {"operators", "allow_list", "deny_list", "score_threshold",
                             "detect_organizations"}
    if unknown:
        raise ServiceError(f"unknown sanitizer policy fields: {', '.join(sorted(unknown))}")
    try:
        parsed = Policy.from_dict(policy, secret=b"validation-only")
    except (TypeError, ValueError) as exc:
        raise ServiceError(f"invalid sanitizer policy: {exc}") from exc
    return parsed.to_dict()


def _policy_summary(stored: dict[str, Any]) -> dict[str, Any]:
    """What the audit log says of a policy: operators and list sizes, never the lists (they
    may name people)."""
    return {"operators": stored["operators"], "allow_list": len(stored["allow_list"]),
            "deny_list": len(stored["deny_list"]), "score_threshold": stored["score_threshold"],
            "detect_organizations": stored["detect_organizations"]}


def _apply_policy(actor: Any, tenant: Tenant, stored: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> Tenant:
    tenant.sanitizer_policy = stored
    tenant.save(update_fields=["sanitizer_policy"])
    record_event(actor, "sanitizer_policy.updated", tenant=tenant, object_type="tenant",
                 object_id=tenant.pk, payload={**_policy_summary(stored), **(extra or {})})
    return tenant


@tenant_atomic("tenant")
def set_sanitizer_policy(actor: Any, tenant: Tenant, policy: dict[str, Any]) -> Tenant:
    """Replace the tenant's sanitizer policy overrides (operators per entity type, allow and
    deny lists, score threshold, detect_organizations). Validated by building the Policy; the
    audit event carries the operators and the list sizes, not the lists (they may name
    people).

    Four eyes for weakening: a change by a person that lets more identifying data through
    (governance.sanitizer.policy.weakenings: an operator towards `keep`, a higher score
    threshold, a new allow-list entry, ...) is refused here — it is requested with
    propose_sanitizer_policy and takes effect when another person approves it. System actors
    (the operator's own commands and set-up) apply directly: whoever runs them holds the
    database anyway."""
    from governance.sanitizer.policy import weakenings

    stored = _validated_policy(policy)
    tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
    weaker = weakenings(tenant.sanitizer_policy, stored)
    if weaker and _user(actor) is not None:
        raise ServiceForbidden("four eyes: this change lets more identifying data through ("
                               + "; ".join(weaker) + "), so another person must approve it")
    return _apply_policy(actor, tenant, stored)


@tenant_atomic("tenant")
def propose_sanitizer_policy(actor: Any, tenant: Tenant, policy: dict[str, Any]) -> Any:
    """A person's change of the sanitizer policy: applied at once when it weakens nothing
    (returns None), else recorded as a pending SanitizerPolicyChange for a second person
    (returned; audited `sanitizer_policy.change_requested`)."""
    from governance.models import SanitizerPolicyChange
    from governance.sanitizer.policy import weakenings

    user = _user(actor)
    if user is None:
        raise ServiceForbidden("a sanitizer policy change is requested by a person")
    stored = _validated_policy(policy)
    tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
    weaker = weakenings(tenant.sanitizer_policy, stored)
    if not weaker:
        _apply_policy(actor, tenant, stored)
        return None
    change = SanitizerPolicyChange.objects.create(
        tenant=tenant, policy=stored, base=tenant.sanitizer_policy or {}, weakenings=weaker,
        requested_by=user)
    record_event(actor, "sanitizer_policy.change_requested", tenant=tenant,
                 object_type="sanitizer_policy_change", object_id=change.pk,
                 payload={**_policy_summary(stored), "weakenings": weaker})
    return change


@tenant_atomic("change.tenant_id")
def decide_sanitizer_policy_change(actor: Any, change: Any, *, approve: bool) -> Any:
    """Approve (the policy takes effect) or reject a pending weakening of the sanitizer policy.
    Four eyes: the decider is a person of the tenant allowed to manage the sanitizer, and not
    the requester. Approving a change requested against a policy that has changed since is
    refused (request it again, against what is in force now)."""
    from governance.models import SanitizerPolicyChange

    user = _user(actor)
    if user is None:
        raise ServiceForbidden("a sanitizer policy change is decided by a person")
    change = SanitizerPolicyChange.objects.select_for_update().get(pk=change.pk)
    membership = Membership.objects.filter(user=user, tenant_id=change.tenant_id).first()
    if not member_can(membership, "manage_sanitizer"):
        raise ServiceForbidden("only a member who may manage the sanitizer decides on its "
                               "policy")
    if user.pk == change.requested_by_id:
        raise ServiceForbidden("four eyes: you requested this change, so another person must "
                               "decide on it")
    if change.status != SanitizerPolicyChange.Status.PENDING:
        raise ServiceConflict(f"this change is {change.status} already")
    tenant = Tenant.objects.select_for_update().get(pk=change.tenant_id)
    if approve and (tenant.sanitizer_policy or {}) != (change.base or {}):
        raise ServiceConflict("the sanitizer policy changed since this was requested; "
                              "request the change again")
    change.status = (SanitizerPolicyChange.Status.APPROVED if approve
                     else SanitizerPolicyChange.Status.REJECTED)
    change.decided_by = user
    change.decided_at = timezone.now()
    change.save(update_fields=["status", "decided_by", "decided_at"])
    record_event(actor, f"sanitizer_policy.change_{change.status}", tenant=tenant,
                 object_type="sanitizer_policy_change", object_id=change.pk,
                 payload={"requested_by": change.requested_by_id,
                          "weakenings": change.weakenings})
    if approve:
        _apply_policy(actor, tenant, change.policy,
                      {"change": change.pk, "requested_by": change.requested_by_id})
    return change
