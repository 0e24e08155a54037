"""Datasets: the tenant's dataset definitions (filters) with their frozen versions, the form that
defines one with a live count of what it would take, a dataset's page (filter, live count,
versions, freeze) and a version's page (content hash, size, state, approval history, request
approval).

The rules live in governance/services.py (create_dataset, freeze_dataset_version,
request_approval); the selection in governance/datasets.py. The form here only parses types and
asks the service's own filter check, so the live preview and the REST API refuse the same
filters with the same words."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Prefetch
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from governance import services
from governance.datasets import filter_of
from governance.models import Agent, Approval, Classification, Dataset, DatasetVersion
from governance.services import (
    ServiceError,
    create_dataset,
    freeze_dataset_version,
    preview_dataset_count,
    request_approval,
)
from governance.views.common import can, console_view, missing_permission

PAGE_SIZE = 25
VERSIONS_IN_LIST = 5  # the latest versions shown per dataset on the list page

CLASSIFICATION_HELP = {
    Classification.PUBLIC: "public steps only",
    Classification.INTERNAL: "public and internal steps",
    Classification.CONFIDENTIAL: "up to confidential steps",
    Classification.RESTRICTED: "every classification",
}

DATETIME_FORMAT = "%Y-%m-%dT%H:%M"


class DatetimeLocalInput(forms.DateTimeInput):
    input_type = "datetime-local"

    def __init__(self, attrs: dict[str, Any] | None = None) -> None:
        super().__init__(attrs=attrs, format=DATETIME_FORMAT)


class DatasetForm(forms.Form):
    """A dataset definition as the console's form sends it. Types are parsed here; the filter's
    rules (agents of this tenant, since < until, reward bounds) are the service's."""

    name = forms.CharField(max_length=200, required=False)
    description = forms.CharField(max_length=10_000, required=False,
                                  widget=forms.Textarea(attrs={"rows": 2}))
    agents = forms.TypedMultipleChoiceField(coerce=int, required=False,
                                            widget=forms.CheckboxSelectMultiple)
    since = forms.DateTimeField(required=False, widget=DatetimeLocalInput())
    until = forms.DateTimeField(required=False, widget=DatetimeLocalInput())
    reward_name = forms.CharField(max_length=64, required=False)
    reward_min = forms.FloatField(required=False,
                                  widget=forms.NumberInput(attrs={"step": "any"}))
    reward_max = forms.FloatField(required=False,
                                  widget=forms.NumberInput(attrs={"step": "any"}))
    classification = forms.ChoiceField(choices=Classification.choices, required=False,
                                       initial=Classification.INTERNAL)

    def __init__(self, *args: Any, tenant: Any, require_name: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tenant = tenant
        self.fields["agents"].choices = [
            (a.pk, a.name) for a in Agent.objects.for_tenant(tenant).order_by("name")]
        self.fields["name"].required = require_name

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if any(field != "name" for field in self.errors):
            return data  # a filter field did not parse: its own message says why
        data["reward_name"] = (data.get("reward_name") or "").strip()
        try:
            # The service's own check (create_dataset runs it again, inside its transaction).
            services._validate_dataset_filter(  # noqa: SLF001 — one rule set, not two
                self.tenant, data.get("agents") or [], data.get("since"), data.get("until"),
                data["reward_name"], data.get("reward_min"), data.get("reward_max"),
                data.get("classification") or Classification.INTERNAL)
        except ServiceError as exc:
            raise forms.ValidationError(str(exc)) from exc
        return data

    def filter_kwargs(self) -> dict[str, Any]:
        d = self.cleaned_data
        return {"agent_ids": sorted(d.get("agents") or []), "since": d.get("since"),
                "until": d.get("until"), "reward_name": d.get("reward_name") or "",
                "reward_min": d.get("reward_min"), "reward_max": d.get("reward_max"),
                "classification": d.get("classification") or Classification.INTERNAL}


# --- helpers shared with the approvals pages ------------------------------------------------


def counted(n: int, one: str, many: str) -> str:
    """'1 trajectory', '3 trajectories'."""
    return f"{n} {one if n == 1 else many}"


def size_text(version: DatasetVersion) -> str:
    return (f"{counted(version.size, 'trajectory', 'trajectories')}, "
            f"{counted(version.step_count, 'step', 'steps')}")


def agent_names(tenant: Any) -> dict[int, str]:
    return dict(Agent.objects.for_tenant(tenant).values_list("pk", "name"))


def _when(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return value
    return value.strftime("%Y-%m-%d %H:%M") if value else ""


def describe_filter(f: dict[str, Any], agents: dict[int, str]) -> list[str]:
    """A filter (governance.datasets.filter_of's JSON, as frozen on a version) in words."""
    out = []
    ids = f.get("agent_ids") or []
    if ids:
        out.append("agents: " + ", ".join(agents.get(int(a), f"#{a} (gone)") for a in ids))
    else:
        out.append("every agent")
    since, until = f.get("since"), f.get("until")
    if since and until:
        out.append(f"started {_when(since)} – {_when(until)} UTC")
    elif since:
        out.append(f"started at or after {_when(since)} UTC")
    elif until:
        out.append(f"started before {_when(until)} UTC")
    name, lo, hi = f.get("reward_name"), f.get("reward_min"), f.get("reward_max")
    if name and (lo is not None or hi is not None):
        if lo is not None and hi is not None:
            out.append(f"latest final reward “{name}” in [{lo:g}, {hi:g}]")
        elif lo is not None:
            out.append(f"latest final reward “{name}” ≥ {lo:g}")
        else:
            out.append(f"latest final reward “{name}” ≤ {hi:g}")
    cls = f.get("classification") or Classification.INTERNAL
    out.append(f"classification up to {cls} ({CLASSIFICATION_HELP.get(cls, cls)})")
    return out


def status_hint(version: DatasetVersion) -> str:
    """What a version's state means, in one sentence."""
    s = DatasetVersion.Status
    return {
        s.DRAFT: "Frozen, not yet submitted: a steward requests approval.",
        s.PENDING_APPROVAL: "Waiting for a compliance officer who neither froze nor "
                            "requested it.",
        s.APPROVED: "Approved: GRPO jobs and exports may use it.",
        s.REJECTED: "Rejected: nothing may train on it; freeze a new version.",
        s.INVALIDATED: "Invalidated (a member was erased or expired): nothing may train on "
                       "it any more.",
    }.get(version.status, "")


def get_dataset(request: HttpRequest, dataset_id: int) -> Dataset:
    dataset = (Dataset.objects.for_tenant(request.tenant).select_related("created_by")
               .filter(pk=dataset_id).first())
    if dataset is None:
        raise Http404("no such dataset")
    return dataset


def get_version(request: HttpRequest, version_id: int) -> DatasetVersion:
    version = (DatasetVersion.objects.for_tenant(request.tenant)
               .select_related("dataset", "created_by", "requested_by", "approval",
                               "approval__decided_by")
               .filter(pk=version_id).first())
    if version is None:
        raise Http404("no such dataset version")
    return version


def version_history(version: DatasetVersion) -> list[dict[str, Any]]:
    """The version's life, oldest first: frozen, submitted, decided, invalidated."""
    events = [{"at": version.created_at, "what": "Frozen", "who": version.created_by,
               "detail": size_text(version)}]
    if version.requested_at:
        events.append({"at": version.requested_at, "what": "Approval requested",
                       "who": version.requested_by, "detail": ""})
    approval = approval_of(version)
    if approval is not None:
        events.append({"at": approval.decided_at, "what": approval.get_decision_display(),
                       "who": approval.decided_by, "detail": approval.reason})
    if version.invalidated_at:
        events.append({"at": version.invalidated_at, "what": "Invalidated", "who": None,
                       "detail": version.invalidated_reason})
    return sorted(events, key=lambda e: e["at"])


def approval_of(version: DatasetVersion) -> Approval | None:
    """The decision on a version, None before one (the reverse one-to-one raises then)."""
    try:
        return version.approval
    except Approval.DoesNotExist:
        return None


# --- pages ----------------------------------------------------------------------------------


def _preview(request: HttpRequest, form: DatasetForm) -> dict[str, Any]:
    """{"count": n} for a valid filter (an unbound form: the default one), {"errors": [...]}
    otherwise. Nothing is written: the count runs on an unsaved Dataset."""
    kwargs: dict[str, Any] = {}
    if form.is_bound:
        if not form.is_valid():
            errors = [e if field == "__all__" else f"{form[field].label}: {e}"
                      for field, errs in form.errors.items() if field != "name"
                      for e in errs]
            if errors:
                return {"errors": errors}
        kwargs = form.filter_kwargs()
    probe = Dataset(tenant=request.tenant, name="(preview)", **kwargs)
    return {"count": preview_dataset_count(probe)}


@console_view(permission="read_datasets")
def dataset_list(request: HttpRequest) -> HttpResponse:
    """GET: the list and (for managers) an empty form. POST: create a dataset; a refused
    definition re-renders the form with what was typed and the reason."""
    status = 200
    preview = None
    if request.method == "POST":
        if not can(request, "manage_datasets"):
            raise PermissionDenied(missing_permission(request, "manage_datasets"))
        form = DatasetForm(request.POST, tenant=request.tenant)
        preview = _preview(request, form)  # before a refusal by the service joins the errors
        if form.is_valid():
            try:
                dataset = create_dataset(
                    request.user, request.tenant, name=form.cleaned_data["name"].strip(),
                    description=form.cleaned_data.get("description") or "",
                    **form.filter_kwargs())
            except ServiceError as exc:
                form.add_error(None, str(exc))
            else:
                messages.success(request, f"Dataset “{dataset.name}” defined. Freeze a "
                                          "version to submit it for approval.")
                return redirect("dataset", dataset.pk)
        status = 400
    else:
        form = DatasetForm(tenant=request.tenant)

    versions = Prefetch("versions", queryset=DatasetVersion.objects.order_by("-number"),
                        to_attr="all_versions")
    qs = (Dataset.objects.for_tenant(request.tenant).select_related("created_by")
          .prefetch_related(versions).order_by("-created_at", "-pk"))
    page = Paginator(qs, PAGE_SIZE).get_page(request.GET.get("page"))
    agents = agent_names(request.tenant)
    rows = [{"dataset": d, "filter": describe_filter(filter_of(d), agents),
             "versions": d.all_versions[:VERSIONS_IN_LIST],
             "more": max(len(d.all_versions) - VERSIONS_IN_LIST, 0)} for d in page]
    context = {"page": page, "rows": rows, "form": form,
               "can_manage": can(request, "manage_datasets")}
    # A refused POST shows the count of what was typed at once; otherwise the form asks for
    # it when the page has loaded (the count is one query over every trajectory: the list
    # itself stays fast on a large tenant).
    context["preview"] = preview
    return render(request, "console/datasets.html", context, status=status)


@console_view(permission="read_datasets")
def dataset_preview(request: HttpRequest) -> HttpResponse:
    """The live count (htmx fragment): how many trajectories the form's filter admits now."""
    form = DatasetForm(request.GET, tenant=request.tenant, require_name=False)
    return render(request, "console/dataset_preview.html", {"preview": _preview(request, form)})


@console_view(permission="read_datasets")
def dataset_detail(request: HttpRequest, dataset_id: int) -> HttpResponse:
    dataset = get_dataset(request, dataset_id)
    versions = (DatasetVersion.objects.for_tenant(request.tenant).filter(dataset=dataset)
                .select_related("created_by", "requested_by", "approval",
                                "approval__decided_by").order_by("-number"))
    context = {
        "dataset": dataset,
        "filter": describe_filter(filter_of(dataset), agent_names(request.tenant)),
        "versions": versions,
        "can_manage": can(request, "manage_datasets"),
        "can_request": can(request, "request_approval"),
    }
    return render(request, "console/dataset.html", context)


@console_view(permission="read_datasets")
def dataset_count(request: HttpRequest, dataset_id: int) -> HttpResponse:
    """The dataset's live count (htmx fragment, loaded by its page): what a freeze would take
    now."""
    dataset = get_dataset(request, dataset_id)
    return render(request, "console/dataset_preview.html",
                  {"preview": {"count": preview_dataset_count(dataset)}})


@console_view(permission="manage_datasets")
@require_POST
def dataset_freeze(request: HttpRequest, dataset_id: int) -> HttpResponse:
    dataset = get_dataset(request, dataset_id)
    try:
        version = freeze_dataset_version(request.user, dataset)
    except ServiceError as exc:
        messages.error(request, f"Nothing frozen: {exc}")
        return redirect("dataset", dataset.pk)
    messages.success(request, f"Froze version {version.number}: {size_text(version)}. Review "
                              "it, then request approval.")
    return redirect("dataset-version", version.pk)


@console_view(permission="read_datasets")
def version_detail(request: HttpRequest, version_id: int) -> HttpResponse:
    version = get_version(request, version_id)
    context = {
        "version": version,
        "dataset": version.dataset,
        "filter": describe_filter(version.filter or {}, agent_names(request.tenant)),
        "status_hint": status_hint(version),
        "history": version_history(version),
        "can_request": can(request, "request_approval"),
    }
    return render(request, "console/dataset_version.html", context)


@console_view(permission="request_approval")
@require_POST
def version_request_approval(request: HttpRequest, version_id: int) -> HttpResponse:
    version = get_version(request, version_id)
    try:
        request_approval(request.user, version)
    except ServiceError as exc:
        messages.error(request, f"Not submitted: {exc}")
    else:
        messages.success(request, f"Version {version.number} of “{version.dataset.name}” is "
                                  "in the compliance queue. A compliance officer other than "
                                  "you decides on it.")
    return redirect("dataset-version", version.pk)
