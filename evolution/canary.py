"""Canary routing and context updates (issue 7): the control plane's half of the traffic split.

A `PolicyRoute` tells the proxy (proxy/routing.py) to send `share` of an agent's NEW sessions to
a candidate — another upstream URL, another model name and/or a `ContextUpdate` (a system-prompt
snippet or rewritten tool schemas) — sticky per session; the proxy tags each trajectory with the
route and arm (Trajectory.route / route_arm). `compare_arms` compares the arms' late-bound
rewards; the beat task evolution.tasks.advance_evolution promotes or rolls back automatically
(actor "system:canary"); people can roll back at any time. Every change NOTIFYs the proxy
(trigger of migration 0007), which applies it on the next request.

Every mutation here follows governance/services.py: it takes the acting user (or a
"system:<component>" label), runs in its tenant's scope in one transaction, claims the row with a
conditional UPDATE on its status (so a person and the beat task deciding at the same moment
cannot both win) and writes its audit event in the same transaction. Free-text reasons are stored
on the row; the audit chain gets their SHA-256 only (as services do).

Lookups are tenant-scoped: `get_route(tenant, id)` / `get_context_update(tenant, id)` raise the
model's DoesNotExist for another tenant's object (and RLS would hide it anyway).

Lifecycle:
- ContextUpdate: draft -> canary (start_canary) -> active (promote_route) -> rolled_back; or
  draft -> active (activate_context_update); draft -> rejected (reject_context_update). At most
  one active update per agent and kind: activating one rolls back (supersedes) the previous one.
- PolicyRoute: canary -> promoted | rolled_back | stopped; promoted -> rolled_back | stopped.
  At most one canary-or-promoted route per agent: a new canary needs the promoted route stopped
  first (stop_route; e.g. once the promoted checkpoint has become the normal upstream).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from django.db import InterfaceError, OperationalError
from django.db.models import Count, Q
from django.utils import timezone

from evolution.gates import route_claimable_from
from evolution.models import ContextUpdate, PolicyRoute
from governance.audit import record_event
from governance.datasets import latest_reward_value
from governance.engines import candidate_engine_url
from governance.models import Agent, Interaction, Tenant, Trajectory
from governance.services import (
    ServiceConflict,
    ServiceError,
    acting_user,
    reason_digest,
    require_reason,
)
from governance.tenancy import tenant_atomic, tenant_context

log = logging.getLogger("steward.evolution")
CONTROL, CANDIDATE = "control", "candidate"
SYSTEM_ACTOR = "system:canary"
REWARD_NAME = "reward"  # the late-bound reward compared between arms
ALPHA = 0.05  # always-valid two-sided level of the sequential test (msprt)
# The mixing distribution of the mSPRT: the reward difference ~ N(0, tau^2) with tau this many
# pooled standard deviations of the per-session reward. It sets which effects the test is
# quickest to detect (about tau); the error rate holds whatever it is.
MSPRT_TAU_SD = 0.5
DEFAULT_MIN_SESSIONS_PER_ARM = 30
DEFAULT_MAX_ERROR_RATE_INCREASE = 0.05
# An error-rate rollback needs at least this many candidate interactions, so that one failed
# call out of two does not end a canary; it does not wait for min_sessions_per_arm.
MIN_ERROR_INTERACTIONS = 10
# Interaction.error_kind values that count as errors of the arm (a client hanging up does not).
NOT_AN_ERROR = {"", "client_disconnected"}
MAX_SNIPPET_CHARS = 20_000
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_KEYS = {"description", "parameters", "strict"}


_reason_digest, _user, _require_reason = reason_digest, acting_user, require_reason


def _agent_of(tenant: Tenant | int, agent: Agent | int) -> Agent:
    agent_id = agent if isinstance(agent, int) else agent.pk
    found = Agent.objects.for_tenant(tenant).filter(pk=agent_id).first()
    if found is None:
        raise Agent.DoesNotExist(f"agent {agent_id} does not exist in this tenant")
    return found


def get_route(tenant: Tenant | int, route_id: int) -> PolicyRoute:
    """The tenant's route `route_id`; PolicyRoute.DoesNotExist for another tenant's."""
    with tenant_context(tenant):
        return PolicyRoute.objects.for_tenant(tenant).get(pk=route_id)


def get_context_update(tenant: Tenant | int, update_id: int) -> ContextUpdate:
    with tenant_context(tenant):
        return ContextUpdate.objects.for_tenant(tenant).get(pk=update_id)


# --- context updates ------------------------------------------------------------------------


def validate_context_content(kind: str, content: Any) -> dict:
    """The content in canonical shape, or ServiceError. system_prompt: {"snippet": text};
    tool_schema: {"tools": {name: {description?, parameters?, strict?}}} (a replacement function
    definition per tool name; the proxy rewrites only tools the agent sends)."""
    if kind not in ContextUpdate.Kind.values:
        raise ServiceError(f"unknown kind {kind!r}; choose one of "
                           f"{', '.join(ContextUpdate.Kind.values)}")
    if not isinstance(content, dict):
        raise ServiceError("content must be a JSON object")
    if kind == ContextUpdate.Kind.SYSTEM_PROMPT:
        if set(content) != {"snippet"} or not isinstance(content["snippet"], str) \
                or not content["snippet"].strip():
            raise ServiceError('a system_prompt update is {"snippet": "<non-empty text>"}')
        if len(content["snippet"]) > MAX_SNIPPET_CHARS:
            raise ServiceError(f"the snippet is longer than {MAX_SNIPPET_CHARS} characters")
        return {"snippet": content["snippet"]}
    tools = content.get("tools")
    if set(content) != {"tools"} or not isinstance(tools, dict) or not tools:
        raise ServiceError('a tool_schema update is {"tools": {"<function name>": {...}}}')
    for name, definition in tools.items():
        if not TOOL_NAME.match(name):
            raise ServiceError(f"invalid tool name {name!r}")
        if not isinstance(definition, dict) or not definition:
            raise ServiceError(f"tool {name!r}: the definition must be a non-empty object")
        extra = set(definition) - TOOL_KEYS
        if extra:
            raise ServiceError(f"tool {name!r}: unknown keys {sorted(extra)}; allowed: "
                               f"{sorted(TOOL_KEYS)}")
        if "description" in definition and not isinstance(definition["description"], str):
            raise ServiceError(f"tool {name!r}: description must be a string")
        if "parameters" in definition and not isinstance(definition["parameters"], dict):
            raise ServiceError(f"tool {name!r}: parameters must be a JSON schema object")
        if "strict" in definition and not isinstance(definition["strict"], bool):
            raise ServiceError(f"tool {name!r}: strict must be a boolean")
    return {"tools": tools}


def context_content_hash(kind: str, content: dict) -> str:
    canonical = json.dumps({"kind": kind, "content": content}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@tenant_atomic("tenant")
def create_context_update(actor: Any, tenant: Tenant, agent: Agent | int, *, kind: str,
                          content: Any, reason: str = "") -> ContextUpdate:
    """A draft update for one agent; `version` is the agent's next number (the agent row is
    locked so two creations cannot take the same one)."""
    agent = _agent_of(tenant, agent)
    content = validate_context_content(kind, content)
    Agent.objects.filter(pk=agent.pk).select_for_update().get()
    last = (ContextUpdate.objects.for_tenant(tenant).filter(agent=agent)
            .order_by("-version").values_list("version", flat=True).first())
    update = ContextUpdate.objects.create(
        tenant=tenant, agent=agent, kind=kind, content=content, version=(last or 0) + 1,
        status=ContextUpdate.Status.DRAFT, content_hash=context_content_hash(kind, content),
        reason=reason or "", created_by=_user(actor))
    record_event(actor, "context_update.created", tenant=tenant, object_type="context_update",
                 object_id=update.pk,
                 payload={"agent": agent.pk, "kind": kind, "version": update.version,
                          "content_hash": update.content_hash,
                          "reason_sha256": _reason_digest(reason or "")})
    return update


def _supersede_active(actor: Any, update: ContextUpdate, now: Any) -> list[int]:
    """Roll back the agent's other active update of the same kind (one active per kind)."""
    previous = list(ContextUpdate.objects.for_tenant(update.tenant_id)
                    .filter(agent_id=update.agent_id, kind=update.kind,
                            status=ContextUpdate.Status.ACTIVE)
                    .exclude(pk=update.pk).values_list("pk", flat=True))
    if previous:
        ContextUpdate.objects.filter(pk__in=previous).update(
            status=ContextUpdate.Status.ROLLED_BACK, rolled_back_at=now, updated_at=now)
        for pk in previous:
            record_event(actor, "context_update.superseded", tenant=update.tenant_id,
                         object_type="context_update", object_id=pk,
                         payload={"by": update.pk})
    return previous


def _activate(actor: Any, update: ContextUpdate, allowed: list[str], now: Any) -> ContextUpdate:
    superseded = _supersede_active(actor, update, now)
    claimed = (ContextUpdate.objects.for_tenant(update.tenant_id)
               .filter(pk=update.pk, status__in=allowed)
               .update(status=ContextUpdate.Status.ACTIVE, activated_at=now, rolled_back_at=None,
                       updated_at=now))
    if not claimed:
        raise ServiceConflict(f"context update {update.pk} cannot be activated from status "
                              f"{update.status!r}")
    update.refresh_from_db()
    update._superseded = superseded  # for the caller's audit payload
    return update


@tenant_atomic("update.tenant_id")
def activate_context_update(actor: Any, update: ContextUpdate, reason: str) -> ContextUpdate:
    """Apply a draft (or previously rolled back) update to all of the agent's traffic now.
    An update in canary is activated by promoting its route instead."""
    reason = _require_reason(reason)
    update = _activate(actor, update, [ContextUpdate.Status.DRAFT,
                                       ContextUpdate.Status.ROLLED_BACK], timezone.now())
    record_event(actor, "context_update.activated", tenant=update.tenant_id,
                 object_type="context_update", object_id=update.pk,
                 payload={"agent": update.agent_id, "version": update.version,
                          "superseded": update._superseded,
                          "reason_sha256": _reason_digest(reason)})
    return update


@tenant_atomic("update.tenant_id")
def rollback_context_update(actor: Any, update: ContextUpdate, reason: str) -> ContextUpdate:
    """Stop applying an active or canary update: the proxy drops it on the next request."""
    reason = _require_reason(reason)
    now = timezone.now()
    claimed = (ContextUpdate.objects.for_tenant(update.tenant_id)
               .filter(pk=update.pk, status__in=[ContextUpdate.Status.ACTIVE,
                                                 ContextUpdate.Status.CANARY])
               .update(status=ContextUpdate.Status.ROLLED_BACK, rolled_back_at=now,
                       updated_at=now))
    if not claimed:
        raise ServiceConflict(f"context update {update.pk} is not active or in canary")
    update.refresh_from_db()
    record_event(actor, "context_update.rolled_back", tenant=update.tenant_id,
                 object_type="context_update", object_id=update.pk,
                 payload={"agent": update.agent_id, "version": update.version,
                          "reason_sha256": _reason_digest(reason)})
    return update


@tenant_atomic("update.tenant_id")
def reject_context_update(actor: Any, update: ContextUpdate, reason: str) -> ContextUpdate:
    """A draft that failed its gates (or a reviewer): it can never be applied."""
    reason = _require_reason(reason)
    claimed = (ContextUpdate.objects.for_tenant(update.tenant_id)
               .filter(pk=update.pk, status=ContextUpdate.Status.DRAFT)
               .update(status=ContextUpdate.Status.REJECTED, updated_at=timezone.now()))
    if not claimed:
        raise ServiceConflict(f"context update {update.pk} is not a draft")
    update.refresh_from_db()
    record_event(actor, "context_update.rejected", tenant=update.tenant_id,
                 object_type="context_update", object_id=update.pk,
                 payload={"reason_sha256": _reason_digest(reason)})
    return update


# --- routes ---------------------------------------------------------------------------------


@tenant_atomic("tenant")
def start_canary(actor: Any, tenant: Tenant, agent: Agent | int, *, candidate_ref: str,
                 share: float, upstream_url: str = "", model: str = "",
                 context_update: ContextUpdate | int | None = None,
                 min_sessions_per_arm: int = DEFAULT_MIN_SESSIONS_PER_ARM,
                 max_error_rate_increase: float = DEFAULT_MAX_ERROR_RATE_INCREASE
                 ) -> PolicyRoute:
    """Send `share` (0 < share <= 1) of the agent's new sessions to the candidate. The candidate
    must change something (upstream, model or a draft context update of the same agent, which
    moves to `canary`). ServiceConflict when the agent already has a canary or promoted
    route."""
    agent = _agent_of(tenant, agent)
    if isinstance(share, bool) or not isinstance(share, (int, float)) \
            or not math.isfinite(share) or not 0 < share <= 1:
        raise ServiceError("share must be a number with 0 < share <= 1")
    if isinstance(min_sessions_per_arm, bool) or not isinstance(min_sessions_per_arm, int) \
            or min_sessions_per_arm < 2:
        raise ServiceError("min_sessions_per_arm must be an integer >= 2")
    if isinstance(max_error_rate_increase, bool) \
            or not isinstance(max_error_rate_increase, (int, float)) \
            or not 0 <= max_error_rate_increase <= 1:
        raise ServiceError("max_error_rate_increase must be between 0 and 1")
    # Never a free URL: the proxy sends live agent calls there (governance/engines.py).
    upstream_url = candidate_engine_url(upstream_url, "upstream_url")
    model = (model or "").strip()
    if len(model) > 256:
        raise ServiceError("model is longer than 256 characters")
    update = None
    if context_update is not None:
        update_id = context_update if isinstance(context_update, int) else context_update.pk
        update = ContextUpdate.objects.for_tenant(tenant).filter(pk=update_id).first()
        if update is None:
            raise ContextUpdate.DoesNotExist(f"context update {update_id} does not exist in "
                                             "this tenant")
        if update.agent_id != agent.pk:
            raise ServiceError("the context update belongs to another agent")
    if not (upstream_url or model or update):
        raise ServiceError("the candidate changes nothing: give upstream_url, model or "
                           "context_update")
    Agent.objects.filter(pk=agent.pk).select_for_update().get()  # one start at a time
    live = (PolicyRoute.objects.for_tenant(tenant).filter(
        agent=agent, status__in=[PolicyRoute.Status.CANARY, PolicyRoute.Status.PROMOTED])
        .first())
    if live is not None:
        hint = " (stop it first with stop_route)" if live.status == "promoted" else ""
        raise ServiceConflict(f"agent {agent.name!r} already has route {live.pk} in status "
                              f"{live.status}{hint}")
    now = timezone.now()
    if update is not None:
        claimed = (ContextUpdate.objects.filter(pk=update.pk, status=ContextUpdate.Status.DRAFT)
                   .update(status=ContextUpdate.Status.CANARY, updated_at=now))
        if not claimed:
            raise ServiceConflict(f"context update {update.pk} is {update.status}, not a draft")
    route = PolicyRoute.objects.create(
        tenant=tenant, agent=agent, candidate_ref=(candidate_ref or "")[:200],
        candidate_upstream_url=upstream_url, candidate_model=model, context_update=update,
        share=float(share), status=PolicyRoute.Status.CANARY,
        min_sessions_per_arm=min_sessions_per_arm,
        max_error_rate_increase=float(max_error_rate_increase), created_by=_user(actor))
    record_event(actor, "route.canary_started", tenant=tenant, object_type="policy_route",
                 object_id=route.pk,
                 payload={"agent": agent.pk, "candidate_ref": route.candidate_ref,
                          "share": route.share, "upstream_url": bool(upstream_url),
                          "model": model, "context_update": update.pk if update else None,
                          "min_sessions_per_arm": min_sessions_per_arm,
                          "max_error_rate_increase": route.max_error_rate_increase})
    return route


def _claim(route: PolicyRoute, to_status: str, reason: str, now: Any) -> PolicyRoute:
    """Move the route to `to_status` from a status the lifecycle allows (gates.ROUTE_ENDINGS,
    shared with the candidate's canary gate), by a conditional UPDATE."""
    claimed = (PolicyRoute.objects.for_tenant(route.tenant_id)
               .filter(pk=route.pk, status__in=route_claimable_from(to_status))
               .update(status=to_status, decision_reason=reason, decided_at=now,
                       updated_at=now))
    if not claimed:
        current = PolicyRoute.objects.for_tenant(route.tenant_id).get(pk=route.pk)
        raise ServiceConflict(f"route {route.pk} is {current.status}; cannot move it to "
                              f"{to_status}")
    route.refresh_from_db()
    return route


@tenant_atomic("route.tenant_id")
def promote_route(actor: Any, route: PolicyRoute, reason: str,
                  comparison: CanaryComparison | None = None) -> PolicyRoute:
    """All NEW sessions take the candidate config (sessions already on control stay there);
    the route's context update becomes the agent's active one of its kind."""
    reason = _require_reason(reason)
    now = timezone.now()
    route = _claim(route, PolicyRoute.Status.PROMOTED, reason, now)
    superseded: list[int] = []
    if route.context_update_id:
        update = ContextUpdate.objects.get(pk=route.context_update_id)
        if update.status == ContextUpdate.Status.CANARY:
            update = _activate(actor, update, [ContextUpdate.Status.CANARY], now)
            superseded = update._superseded
    record_event(actor, "route.promoted", tenant=route.tenant_id, object_type="policy_route",
                 object_id=route.pk,
                 payload={"candidate_ref": route.candidate_ref,
                          "context_update": route.context_update_id,
                          "superseded_context_updates": superseded,
                          "comparison": comparison.as_dict() if comparison else None,
                          "reason_sha256": _reason_digest(reason)})
    return route


@tenant_atomic("route.tenant_id")
def rollback_route(actor: Any, route: PolicyRoute, reason: str,
                   comparison: CanaryComparison | None = None) -> PolicyRoute:
    """Stop routing to the candidate (manual or automatic; canary or promoted). The proxy is
    NOTIFYed at commit and sends the next request of every session to control; the route's
    context update is rolled back and disappears from upstream requests."""
    reason = _require_reason(reason)
    now = timezone.now()
    route = _claim(route, PolicyRoute.Status.ROLLED_BACK, reason, now)
    rolled_back_update = None
    if route.context_update_id:
        rolled_back_update = route.context_update_id if (
            ContextUpdate.objects.filter(pk=route.context_update_id, status__in=[
                ContextUpdate.Status.CANARY, ContextUpdate.Status.ACTIVE])
            .update(status=ContextUpdate.Status.ROLLED_BACK, rolled_back_at=now,
                    updated_at=now)) else None
    record_event(actor, "route.rolled_back", tenant=route.tenant_id, object_type="policy_route",
                 object_id=route.pk,
                 payload={"candidate_ref": route.candidate_ref,
                          "context_update_rolled_back": rolled_back_update,
                          "automatic": isinstance(actor, str) and actor.startswith("system:"),
                          "comparison": comparison.as_dict() if comparison else None,
                          "reason_sha256": _reason_digest(reason)})
    return route


@tenant_atomic("route.tenant_id")
def stop_route(actor: Any, route: PolicyRoute, reason: str) -> PolicyRoute:
    """End a route without judging it: new sessions go back to the normal config. An update
    the route made active stays active (roll it back separately if wanted); one still in
    canary is rolled back."""
    reason = _require_reason(reason)
    now = timezone.now()
    route = _claim(route, PolicyRoute.Status.STOPPED, reason, now)
    if route.context_update_id:
        ContextUpdate.objects.filter(pk=route.context_update_id,
                                     status=ContextUpdate.Status.CANARY).update(
            status=ContextUpdate.Status.ROLLED_BACK, rolled_back_at=now, updated_at=now)
    record_event(actor, "route.stopped", tenant=route.tenant_id, object_type="policy_route",
                 object_id=route.pk, payload={"reason_sha256": _reason_digest(reason)})
    return route


# --- the comparison -------------------------------------------------------------------------


@dataclass(frozen=True)
class CanaryComparison:
    n_control: int  # trajectories of the arm with a final reward
    n_candidate: int
    mean_control: float | None
    mean_candidate: float | None
    std_control: float | None  # sample standard deviation (n - 1)
    std_candidate: float | None
    error_rate_control: float | None  # errored interactions / interactions of the arm
    error_rate_candidate: float | None
    p_value: float | None  # always-valid mSPRT p-value; None until both arms have 2 rewards
    decision: str  # "promote" | "rollback" | "wait"
    reason: str
    sessions_control: int = 0  # trajectories assigned to the arm (rewarded or not)
    sessions_candidate: int = 0
    interactions_control: int = 0
    interactions_candidate: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    mean = math.fsum(values) / len(values)
    if len(values) < 2:
        return mean, None
    var = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var)


def _variance(values: list[float], mean: float) -> float:
    return math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)


def msprt_log_likelihood_ratio(delta: float, variance: float, tau2: float) -> float:
    """log Lambda of the normal-mixture sequential probability ratio test (mSPRT; Robbins
    1970, as used for A/B tests by Johari, Koomen, Pekelis & Walsh, "Always valid inference:
    continuous monitoring of A/B tests", Operations Research 2022).

    `delta` is the observed difference of means (candidate - control), `variance` its
    variance (sigma_c^2 / n_c + sigma_k^2 / n_k), `tau2` the variance of the normal mixing
    distribution over the true difference theta (H0: theta = 0). Mixing the Gaussian
    likelihood ratio over theta ~ N(0, tau2) gives

        Lambda = sqrt(V / (V + tau2)) * exp(tau2 * delta^2 / (2 V (V + tau2))),

    a nonnegative martingale under H0 as information (1/V) accrues, so by Ville's
    inequality P(Lambda ever >= 1/alpha) <= alpha: the test may be looked at after every
    session and stopped at the first crossing without inflating the error rate (unlike a
    fixed-sample test repeated, tests/test_canary.py). Computed in logs (no overflow)."""
    if variance <= 0:
        return math.inf if delta != 0 else 0.0
    return 0.5 * math.log(variance / (variance + tau2)) \
        + tau2 * delta * delta / (2.0 * variance * (variance + tau2))


def msprt(n_control: int, mean_control: float, var_control: float, n_candidate: int,
          mean_candidate: float, var_candidate: float, *, tau_sd: float = MSPRT_TAU_SD
          ) -> tuple[float, float]:
    """(always-valid two-sided p-value, log Lambda) for mean_candidate - mean_control from
    each arm's size, mean and sample variance (both arms need n >= 2). The variances are
    plugged in (the large-sample version of Johari et al.; the canary waits for
    min_sessions_per_arm first), and tau = tau_sd pooled standard deviations, so the test
    does not depend on the reward's scale. p = min(1, 1/Lambda): rejecting when p <= alpha
    at the first look where it happens keeps the error rate at alpha however often one
    looks (each evaluation of a canary is a look; it stops at the first crossing)."""
    variance = var_control / n_control + var_candidate / n_candidate
    pooled = (var_control + var_candidate) / 2.0
    log_lr = msprt_log_likelihood_ratio(mean_candidate - mean_control, variance,
                                        (tau_sd * tau_sd) * pooled)
    return (math.exp(-log_lr) if log_lr > 0 else 1.0), log_lr


def sequential_decision(n_control: int, mean_control: float, var_control: float,
                        n_candidate: int, mean_candidate: float, var_candidate: float, *,
                        alpha: float = ALPHA, tau_sd: float = MSPRT_TAU_SD
                        ) -> tuple[str, float]:
    """The reward rule of one look, on summary statistics: ("promote" | "rollback" |
    "wait", always-valid p). Promote when the mSPRT rejects "no difference" at `alpha` with
    the candidate ahead, roll back when it rejects with the candidate behind."""
    p, _ = msprt(n_control, mean_control, var_control, n_candidate, mean_candidate,
                 var_candidate, tau_sd=tau_sd)
    if p <= alpha and mean_candidate > mean_control:
        return "promote", p
    if p <= alpha and mean_candidate < mean_control:
        return "rollback", p
    return "wait", p


def decide(rewards_control: list[float], rewards_candidate: list[float], *,
           errors_control: int, interactions_control: int, errors_candidate: int,
           interactions_candidate: int, min_sessions_per_arm: int,
           max_error_rate_increase: float, sessions_control: int = 0,
           sessions_candidate: int = 0) -> CanaryComparison:
    """The decision rule, on plain numbers (compare_arms feeds it from the database):

    1. Error rate first, with no minimum of rewarded sessions: when the candidate has at least
       MIN_ERROR_INTERACTIONS interactions and its error rate exceeds control's by more than
       `max_error_rate_increase` (absolute), roll back.
    2. Until each arm has `min_sessions_per_arm` trajectories with a final reward: wait.
    3. The mixture sequential probability ratio test (msprt, sequential_decision) on the
       per-trajectory rewards, at ALPHA = 0.05 always-valid: the beat task looks every 30 s,
       and a test valid under continuous monitoring keeps the chance of ever promoting a
       candidate that is no better at ALPHA/2 or less (a fixed-sample Welch test repeated at
       every look promoted such a candidate far more often: tests/test_canary.py). A
       significantly higher candidate mean promotes, a lower one rolls back, anything else
       waits (a person can still decide).
    """
    err_c = errors_control / interactions_control if interactions_control else None
    err_k = errors_candidate / interactions_candidate if interactions_candidate else None
    mc, sc = _mean_std(rewards_control)
    mk, sk = _mean_std(rewards_candidate)
    base = dict(n_control=len(rewards_control), n_candidate=len(rewards_candidate),
                mean_control=mc, mean_candidate=mk, std_control=sc, std_candidate=sk,
                error_rate_control=err_c, error_rate_candidate=err_k,
                sessions_control=sessions_control, sessions_candidate=sessions_candidate,
                interactions_control=interactions_control,
                interactions_candidate=interactions_candidate)
    p = None
    if len(rewards_control) >= 2 and len(rewards_candidate) >= 2:
        assert mc is not None and mk is not None
        p = msprt(len(rewards_control), mc, _variance(rewards_control, mc),
                  len(rewards_candidate), mk, _variance(rewards_candidate, mk))[0]
    if err_k is not None and interactions_candidate >= MIN_ERROR_INTERACTIONS \
            and err_k - (err_c or 0.0) > max_error_rate_increase:
        return CanaryComparison(
            **base, p_value=p, decision="rollback",
            reason=f"error rate {err_k:.1%} on the candidate vs {(err_c or 0.0):.1%} on "
                   f"control exceeds the allowed increase of {max_error_rate_increase:.1%}")
    n = min(len(rewards_control), len(rewards_candidate))
    if n < min_sessions_per_arm:
        return CanaryComparison(
            **base, p_value=p, decision="wait",
            reason=f"{len(rewards_control)} control and {len(rewards_candidate)} candidate "
                   f"rewarded sessions; {min_sessions_per_arm} per arm needed")
    assert p is not None and mc is not None and mk is not None
    decision, p = sequential_decision(
        len(rewards_control), mc, _variance(rewards_control, mc), len(rewards_candidate), mk,
        _variance(rewards_candidate, mk))
    verdict = {"promote": "better", "rollback": "worse",
               "wait": "not significantly different"}[decision]
    return CanaryComparison(
        **base, p_value=p, decision=decision,
        reason=f"candidate mean reward {mk:.4g} vs control {mc:.4g} (n={len(rewards_candidate)}"
               f"/{len(rewards_control)}, always-valid mSPRT p={p:.3g}): {verdict}")


def compare_arms(route: PolicyRoute, reward_name: str = REWARD_NAME) -> CanaryComparison:
    """Compare the route's arms: per trajectory the latest FINAL reward `reward_name` (by
    trajectory id or a step's response id, governance.datasets.latest_reward_value); errors are
    interactions with upstream status >= 500 or a proxy error (not a client disconnect)."""
    tid = route.tenant_id
    with tenant_context(tid):
        trajs = (Trajectory.objects.for_tenant(tid)
                 .filter(route_id=route.pk, route_arm__in=[CONTROL, CANDIDATE])
                 .annotate(_reward=latest_reward_value(tid, reward_name))
                 .values_list("route_arm", "_reward"))
        rewards: dict[str, list[float]] = {CONTROL: [], CANDIDATE: []}
        sessions = {CONTROL: 0, CANDIDATE: 0}
        for arm, value in trajs:
            sessions[arm] += 1
            if value is not None and math.isfinite(value):
                rewards[arm].append(float(value))
        failed = Q(status_code__gte=500) | ~Q(error_kind__in=NOT_AN_ERROR)
        counts = {row["trajectory__route_arm"]: row for row in
                  Interaction.objects.for_tenant(tid)
                  .filter(trajectory__route_id=route.pk,
                          trajectory__route_arm__in=[CONTROL, CANDIDATE])
                  .values("trajectory__route_arm")
                  .annotate(total=Count("id"), errors=Count("id", filter=failed))}
    empty = {"total": 0, "errors": 0}
    c, k = counts.get(CONTROL, empty), counts.get(CANDIDATE, empty)
    return decide(rewards[CONTROL], rewards[CANDIDATE],
                  errors_control=c["errors"], interactions_control=c["total"],
                  errors_candidate=k["errors"], interactions_candidate=k["total"],
                  min_sessions_per_arm=route.min_sessions_per_arm,
                  max_error_rate_increase=route.max_error_rate_increase,
                  sessions_control=sessions[CONTROL], sessions_candidate=sessions[CANDIDATE])


def canary_tenants() -> list[int]:
    """Tenants with a route in canary (SECURITY DEFINER function of migration 0007: the beat
    task runs outside any tenant scope)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT DISTINCT tenant_id FROM steward_proxy_routes() "
                       "WHERE status = 'canary' ORDER BY 1")
        return [row[0] for row in cursor.fetchall()]


def evaluate_route(route: PolicyRoute) -> str:
    """Compare one canary route and act on the decision as "system:canary". Returns what was
    done: "promoted", "rolled_back", "wait" or "skipped" (someone else decided first)."""
    comparison = compare_arms(route)
    try:
        if comparison.decision == "promote":
            promote_route(SYSTEM_ACTOR, route, f"automatic: {comparison.reason}", comparison)
            return "promoted"
        if comparison.decision == "rollback":
            rollback_route(SYSTEM_ACTOR, route, f"automatic: {comparison.reason}", comparison)
            return "rolled_back"
    except ServiceConflict:  # a person (or another worker) decided meanwhile: nothing to do
        return "skipped"
    return "wait"


def evaluate_canaries(route_ids: list[int] | None = None) -> dict[str, int]:
    """The route half of the beat task evolution.tasks.advance_evolution: compare the arms of
    every canary route (or of `route_ids`) and promote or roll back automatically as
    "system:canary". Idempotent: each decision claims the route with a conditional update on
    its status, so a redelivered message, an overlapping run or a person deciding meanwhile
    changes nothing twice. Returns how many routes had each outcome of evaluate_route."""
    outcomes: Counter[str] = Counter()
    for tenant_id in canary_tenants():
        with tenant_context(tenant_id):
            routes = PolicyRoute.objects.for_tenant(tenant_id).filter(
                status=PolicyRoute.Status.CANARY)
            if route_ids is not None:
                routes = routes.filter(pk__in=route_ids)
            routes = list(routes.order_by("pk"))
        for route in routes:
            try:
                outcome = evaluate_route(route)
            except (OperationalError, InterfaceError):
                raise
            except Exception:  # one broken route must not stop the others
                log.exception("canary: evaluating route %s failed", route.pk)
                outcome = "failed"
            outcomes[outcome] += 1
            if outcome in ("promoted", "rolled_back"):
                log.warning("canary: route %s %s automatically", route.pk, outcome)
    return dict(outcomes)
