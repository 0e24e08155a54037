"""Tenant settings: retention policies per classification and the sanitizer policy (operator
per entity type). Everyone with `read_retention` reads both; changing retention needs
`manage_retention`, changing the sanitizer policy `manage_sanitizer`. Every change goes through
governance.services (validated there, audited in the same transaction)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from governance.capture.atdp import CLASSIFICATION_ORDER
from governance.models import RetentionPolicy, SanitizerPolicyChange, Tenant
from governance.recognizers import IDENTIFIER_TYPES, NER_TYPES, SECRET_TYPES
from governance.retention import default_policy, effective_policies
from governance.sanitizer.policy import DEFAULT_OPERATORS, OPERATORS, Policy
from governance.services import (
    MAX_RETENTION_DAYS,
    ServiceError,
    decide_sanitizer_policy_change,
    delete_retention_policy,
    propose_sanitizer_policy,
    set_retention_policy,
)
from governance.views.common import can, console_view

DAY_FIELDS = ("steps_days", "raw_days", "findings_days", "audit_days")
DAY_LABELS = {"steps_days": "Steps", "raw_days": "Raw payloads", "findings_days": "Findings",
              "audit_days": "Audit events"}
CLASSIFICATIONS = (RetentionPolicy.ANY, *CLASSIFICATION_ORDER)
# Entity types the sanitizer knows, grouped as the page lists them.
ENTITY_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Identifiers of people", tuple(sorted(IDENTIFIER_TYPES))),
    ("Secrets", tuple(sorted(SECRET_TYPES))),
    ("Other entities", tuple(sorted((NER_TYPES - IDENTIFIER_TYPES) | {"DENY_LIST"}))),
)
ENTITY_TYPES = tuple(e for _, group in ENTITY_GROUPS for e in group)
OPERATOR_HELP = {
    "redact": "removed from the text",
    "placeholder": "replaced by a numbered label, e.g. <PERSON_1>, stable within a trajectory",
    "hash": "replaced by a keyed hash (linkable within the tenant)",
    "keep": "left in the text (still reported as a finding)",
}


def _retention_form(post: Any = None, classification: str = "") -> dict[str, Any]:
    if post is not None:
        return {"classification": post.get("classification", ""),
                **{f: post.get(f, "") for f in DAY_FIELDS}}
    base = default_policy(classification or RetentionPolicy.ANY)
    return {"classification": classification, **{f: getattr(base, f) for f in DAY_FIELDS}}


def _sanitizer_rows(policy: Policy, submitted: dict[str, str] | None) -> list[dict[str, Any]]:
    rows = []
    for group, entities in ENTITY_GROUPS:
        for entity in entities:
            override = policy.operators.get(entity, "")
            rows.append({
                "group": group,
                "entity": entity,
                "default": DEFAULT_OPERATORS.get(entity, "placeholder"),
                "override": override,
                "selected": submitted.get(entity, "") if submitted is not None else override,
                "effective": policy.operator_for(entity),
            })
    return rows


def _context(request: HttpRequest, *, retention_form: dict[str, Any] | None = None,
             sanitizer_submitted: dict[str, str] | None = None,
             sanitizer_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    tenant = request.tenant
    policies = list(RetentionPolicy.objects.for_tenant(tenant).select_related("updated_by")
                    .order_by("classification"))
    stored = Tenant.objects.filter(pk=tenant.pk).values_list("sanitizer_policy",
                                                             flat=True).first() or {}
    policy = Policy.from_dict(stored, secret=b"display-only")
    wanted = request.GET.get("classification", "")
    if retention_form is None:
        existing = next((p for p in policies if p.classification == wanted), None)
        retention_form = ({"classification": wanted, **{f: getattr(existing, f)
                                                         for f in DAY_FIELDS}}
                          if existing else _retention_form(classification=wanted))
    return {
        "policies": policies,
        "effective": list(effective_policies(tenant).values()),
        "defaults": default_policy(),
        "day_fields": [(f, DAY_LABELS[f]) for f in DAY_FIELDS],
        "classifications": CLASSIFICATIONS,
        "retention_form": retention_form,
        "can_manage_retention": can(request, "manage_retention"),
        "can_manage_sanitizer": can(request, "manage_sanitizer"),
        "policy_changes": list(SanitizerPolicyChange.objects.for_tenant(tenant)
                               .filter(status=SanitizerPolicyChange.Status.PENDING)
                               .select_related("requested_by").order_by("requested_at")),
        "sanitizer_rows": _sanitizer_rows(policy, sanitizer_submitted),
        "operators": OPERATORS,
        "operator_help": OPERATOR_HELP.items(),
        "sanitizer": {"score_threshold": policy.score_threshold,
                      "detect_organizations": policy.detect_organizations,
                      "allow_list": len(policy.allow_list), "deny_list": len(policy.deny_list),
                      **(sanitizer_extra or {})},
    }


@console_view(permission="read_retention")
def settings_page(request: HttpRequest) -> HttpResponse:
    return render(request, "console/settings.html", _context(request))


def _invalid(request: HttpRequest, message: str, **context: Any) -> HttpResponse:
    """The page again with the person's input and the reason; nothing was changed."""
    messages.error(request, message)
    return render(request, "console/settings.html", _context(request, **context), status=400)


@console_view(permission="manage_retention")
@require_POST
def retention_set(request: HttpRequest) -> HttpResponse:
    form = _retention_form(request.POST)
    days: dict[str, int] = {}
    for field in DAY_FIELDS:
        # Django's IntegerField, not str.isdigit(): "²" is a digit to Python but no number, and
        # the bound keeps the value inside the column and the dates it makes.
        parser = forms.IntegerField(min_value=0, max_value=MAX_RETENTION_DAYS)
        try:
            days[field] = parser.clean(str(form[field]).strip())
        except forms.ValidationError:
            return _invalid(request, f"{DAY_LABELS[field]}: enter a whole number of days "
                            f"from 0 to {MAX_RETENTION_DAYS}.", retention_form=form)
    try:
        policy = set_retention_policy(request.user, request.tenant, form["classification"],
                                      **days)
    except ServiceError as exc:
        return _invalid(request, f"The retention policy was not saved: {exc}.",
                        retention_form=form)
    messages.success(request, f"Retention policy for {policy.classification} saved.")
    return redirect("settings")


@console_view(permission="manage_retention")
@require_POST
def retention_delete(request: HttpRequest, policy_id: int) -> HttpResponse:
    policy = RetentionPolicy.objects.for_tenant(request.tenant).filter(pk=policy_id).first()
    if policy is None:
        raise Http404("no such retention policy")
    classification = policy.classification
    delete_retention_policy(request.user, policy)
    messages.success(request, f"Retention policy for {classification} deleted; "
                     "the '*' policy or the defaults apply to it now.")
    return redirect("settings")


@console_view(permission="manage_sanitizer")
@require_POST
def sanitizer_set(request: HttpRequest) -> HttpResponse:
    submitted = {e: request.POST.get(f"op-{e}", "").strip() for e in ENTITY_TYPES}
    threshold = request.POST.get("score_threshold", "").strip()
    organizations = request.POST.get("detect_organizations") == "on"
    extra = {"score_threshold": threshold, "detect_organizations": organizations}
    stored = Tenant.objects.filter(pk=request.tenant.pk).values_list(
        "sanitizer_policy", flat=True).first() or {}
    try:
        score = float(threshold)
    except ValueError:
        return _invalid(request, "Score threshold: enter a number between 0 and 1.",
                        sanitizer_submitted=submitted, sanitizer_extra=extra)
    if not 0.0 <= score <= 1.0:
        return _invalid(request, "Score threshold: enter a number between 0 and 1.",
                        sanitizer_submitted=submitted, sanitizer_extra=extra)
    # The lists are kept as they are (edited elsewhere: they may name people).
    policy = {"operators": {e: op for e, op in submitted.items() if op},
              "allow_list": list(stored.get("allow_list", [])),
              "deny_list": list(stored.get("deny_list", [])),
              "score_threshold": score, "detect_organizations": organizations}
    try:
        change = propose_sanitizer_policy(request.user, request.tenant, policy)
    except ServiceError as exc:
        return _invalid(request, f"The sanitizer policy was not saved: {exc}.",
                        sanitizer_submitted=submitted, sanitizer_extra=extra)
    if change is not None:
        messages.warning(request, "This change lets more identifying data through ("
                         + "; ".join(change.weakenings) + "): it is waiting for another "
                         "person who may manage the sanitizer to approve it. The policy in "
                         "force is unchanged until then.")
        return redirect("settings")
    messages.success(request, "Sanitizer policy saved. It applies to calls sanitized from now "
                     "on; steps already built keep their sanitizer version.")
    return redirect("settings")


@console_view(permission="manage_sanitizer")
@require_POST
def sanitizer_change_decide(request: HttpRequest, change_id: int) -> HttpResponse:
    """Approve or reject a pending weakening of the sanitizer policy (four eyes, enforced by
    services.decide_sanitizer_policy_change)."""
    change = (SanitizerPolicyChange.objects.for_tenant(request.tenant).filter(pk=change_id)
              .first())
    if change is None:
        raise Http404("no such sanitizer policy change")
    approve = request.POST.get("decision") == "approve"
    try:
        decide_sanitizer_policy_change(request.user, change, approve=approve)
    except ServiceError as exc:
        return _invalid(request, f"Not decided: {exc}.")
    messages.success(request, "Sanitizer policy change approved: it applies to calls sanitized "
                     "from now on." if approve else "Sanitizer policy change rejected.")
    return redirect("settings")
