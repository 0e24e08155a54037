"""Console pages of training: the jobs (live progress, launch form), one job (live curves,
cancel, resume, checkpoints), the checkpoints and one checkpoint's lineage (export).

Reading needs `read_training`; launching, cancelling, resuming and exporting need
`launch_training` (governance/permissions.py). Every mutation goes through trainer/services.py
(atomic, audited); a refusal is shown as a message on the page, never a 500. Like the rest of
the console, these pages import no torch (trainer.services imports it only while validating
a config).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from django import forms
from django.contrib import messages
from django.core.paginator import Paginator
from django.db.models import Count, Q
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import NoReverseMatch, reverse
from django.views.decorators.http import require_POST

from governance.models import DatasetVersion, Role, Tenant
from governance.permissions import ROLE_PERMISSIONS
from governance.services import ServiceError
from governance.views.common import can, console_view
from governance.workers import STALE_AFTER_SECONDS, workers_listening
from trainer import rewards
from trainer.models import Checkpoint, TrainingJob, TrainingMetric
from trainer.services import (
    DEFAULT_REWARD_FN,
    JOB_DEFAULTS,
    TINY_BASE,
    cancel_training_job,
    export_checkpoint,
    launch_training_job,
    models_dir,
    resume_training_job,
)

PAGE_SIZE = 50
ACTIVE = [str(s) for s in TrainingJob.ACTIVE]
# What erasure writes as a checkpoint's taint reason (governance/erasure.py).
_ERASURE_REASON = re.compile(r"\berasure request (\d+)\b")


# --- helpers ---------------------------------------------------------------------------------


def href(name: str, *args: Any, fallback: str) -> str:
    """A link to another area's page when that page is installed, else its fallback (the
    console's sections are built independently; a link must never 500 the page)."""
    try:
        return reverse(name, args=args)
    except NoReverseMatch:
        return fallback


def version_href(version_id: int) -> str:
    return href("dataset-version", version_id, fallback=href("datasets", fallback="/datasets/"))


def approval_href(version_id: int) -> str:
    return href("approval", version_id, fallback="/approvals/")


def erasure_href(request_id: int) -> str:
    return href("erasure-request", request_id, fallback=href("erasure", fallback="/erasure/"))


def roles_with(permission: str) -> list[str]:
    return [Role(r).label for r, perms in ROLE_PERMISSIONS.items() if permission in perms]


def approved_versions(tenant: Tenant) -> list[DatasetVersion]:
    """The versions a job may be launched on: approved (with an approval that says so) and
    never invalidated — the same rule as trainer.taskdata.version_refusal, as a query."""
    return list(DatasetVersion.objects.for_tenant(tenant)
                .filter(status=DatasetVersion.Status.APPROVED, invalidated_at__isnull=True,
                        approval__decision="approve")
                .select_related("dataset").order_by("dataset__name", "-number"))


def base_models() -> list[str]:
    """The tiny model (built by the task when missing) and every model directory under
    VAR_DIR/models — the only base models launch_training_job accepts."""
    names = {TINY_BASE}
    root = models_dir()
    if root.is_dir():
        names |= {p.name for p in root.iterdir() if (p / "config.json").is_file()}
    return sorted(names)


def taint_erasure(ckpt: Checkpoint) -> int | None:
    """The erasure request that tainted this checkpoint, when its reason names one."""
    match = _ERASURE_REASON.search(ckpt.tainted_reason or "")
    return int(match.group(1)) if match else None


def training_summary(tenant: Tenant) -> dict[str, Any]:
    """For the overview: how many jobs are running (and queued), and the latest job."""
    counts = TrainingJob.objects.for_tenant(tenant).aggregate(
        running=Count("pk", filter=Q(status__in=[TrainingJob.Status.RUNNING,
                                                 TrainingJob.Status.CANCELLING])),
        queued=Count("pk", filter=Q(status=TrainingJob.Status.QUEUED)))
    latest = (TrainingJob.objects.for_tenant(tenant).select_related("dataset_version__dataset")
              .defer("config").order_by("-created_at", "-pk").first())
    return {"running": counts["running"], "queued": counts["queued"], "latest": latest}


# --- the jobs and the launch form ----------------------------------------------------------


class LaunchForm(forms.Form):
    """The launch form's fields; the version is checked by the service (the gate), not by a
    list of choices, so a forged id gets the service's reason."""

    dataset_version = forms.IntegerField(min_value=1)
    reward_fn = forms.ChoiceField(initial=DEFAULT_REWARD_FN)
    reference_reward = forms.RegexField(regex=r"^[A-Za-z0-9_.-]{1,64}$", initial="reference",
                                        max_length=64)
    base_model = forms.ChoiceField(initial=TINY_BASE)
    total_steps = forms.IntegerField(min_value=1, max_value=100_000,
                                     initial=JOB_DEFAULTS["total_steps"])
    save_every = forms.IntegerField(min_value=1, max_value=100_000,
                                    initial=JOB_DEFAULTS["save_every"])
    train_batch_size = forms.IntegerField(min_value=1, max_value=4096,
                                          initial=JOB_DEFAULTS["train_batch_size"])
    group_size = forms.IntegerField(min_value=1, max_value=256,
                                    initial=JOB_DEFAULTS["group_size"])
    lr = forms.FloatField(min_value=0.0, max_value=1.0, initial=1e-6)
    seed = forms.IntegerField(min_value=0, max_value=2**31 - 1, initial=0)

    CONFIG_FIELDS = ("total_steps", "save_every", "train_batch_size", "group_size", "lr", "seed")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["reward_fn"].choices = [(n, n) for n in rewards.available()]
        self.fields["base_model"].choices = [(n, n) for n in base_models()]

    def config(self) -> dict[str, Any]:
        return {k: self.cleaned_data[k] for k in self.CONFIG_FIELDS}


def _form_errors(form: forms.Form) -> str:
    parts = []
    for name, errors in form.errors.items():
        label = (form.fields[name].label or name.replace("_", " ")) if name in form.fields else ""
        parts.append(f"{label}: {' '.join(errors)}" if label else " ".join(errors))
    return "; ".join(parts)


def _launch(request: HttpRequest, form: LaunchForm) -> TrainingJob | None:
    """Run the launch; None (and an error message) when refused."""
    if not form.is_valid():
        messages.error(request, f"Not launched: {_form_errors(form)}")
        return None
    version = (DatasetVersion.objects.for_tenant(request.tenant)
               .filter(pk=form.cleaned_data["dataset_version"]).first())
    if version is None:
        messages.error(request, "Not launched: unknown dataset version.")
        return None
    try:
        job = launch_training_job(request.user, request.tenant, version, config=form.config(),
                                  reward_fn=form.cleaned_data["reward_fn"],
                                  reference_reward=form.cleaned_data["reference_reward"],
                                  base_model=form.cleaned_data["base_model"])
    except ServiceError as exc:
        messages.error(request, f"Not launched: {exc}")
        return None
    return job


@console_view(permission="read_training")
def training(request: HttpRequest) -> HttpResponse:
    """GET: the jobs (htmx polls the table while one is active). POST: launch a job."""
    can_launch = can(request, "launch_training")
    form = LaunchForm()
    status = 200
    if request.method == "POST":
        if not can_launch:
            messages.error(request, "Your role may not launch training jobs (needs "
                                    "launch_training).")
            return redirect("training")
        form = LaunchForm(request.POST)
        job = _launch(request, form)
        if job is not None:
            messages.success(request, f"Training job {job.pk} queued: {job.total_steps} steps "
                                      f"on dataset version {job.dataset_version_id}.")
            return redirect("training-job", job.pk)
        status = 400  # the page again, with the person's input and the reason
    qs = (TrainingJob.objects.for_tenant(request.tenant)
          .select_related("dataset_version__dataset", "requested_by")
          .defer("config").order_by("-created_at", "-pk"))
    page = Paginator(qs, PAGE_SIZE).get_page(request.GET.get("page"))
    context = {"page": page, "active": ACTIVE,
               "polling": any(j.status in ACTIVE for j in page)}
    if request.htmx and request.method == "GET":
        return render(request, "console/training.html#jobs", context)
    versions = approved_versions(request.tenant)
    selected = str(form["dataset_version"].value() or "")
    context.update({
        # One primary-key-table query (governance/workers.py); no broker round trip.
        "gpu_workers": workers_listening("gpu"), "gpu_stale_seconds": int(STALE_AFTER_SECONDS),
        "form": form, "can_launch": can_launch, "versions": versions, "selected": selected,
        "launchers": roles_with("launch_training"), "approvers": roles_with("approve"),
        "datasets_href": href("datasets", fallback="/datasets/"),
        "approvals_href": href("approvals", fallback="/approvals/"),
    })
    return render(request, "console/training.html", context, status=status)


# --- one job -----------------------------------------------------------------------------------


def _get_job(request: HttpRequest, job_id: int) -> TrainingJob:
    job = (TrainingJob.objects.for_tenant(request.tenant)
           .select_related("dataset_version__dataset", "requested_by", "cancel_requested_by")
           .filter(pk=job_id).first())
    if job is None:
        raise Http404("no such training job")
    return job


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def _finite(x: float | None) -> float | None:
    """A diverged step's NaN/inf as a gap: json_script would write NaN, which JSON.parse
    rejects (and the whole chart with it)."""
    return x if x is not None and math.isfinite(x) else None


def curves(job: TrainingJob) -> dict[str, dict[str, Any]]:
    """The job's curves in static/steward/charts.js's shape, from its TrainingMetric rows
    (one query; the reward's ±std is a shaded band around the mean)."""
    rows = [(r[0], *(_finite(x) for x in r[1:])) for r in
            TrainingMetric.objects.for_tenant(job.tenant_id).filter(job=job).order_by("step")
            .values_list("step", "reward_mean", "reward_std", "loss", "kl", "tokens_per_s")]
    steps = [r[0] for r in rows]
    mean = [r[1] for r in rows]
    std = [r[2] for r in rows]
    band = {"borderWidth": 1, "borderDash": [4, 4], "pointRadius": 0, "color": "#7aa2e3"}

    def line(label: str, data: list[float], y_label: str) -> dict[str, Any]:
        return {"type": "line", "labels": steps, "x_label": "step", "y_label": y_label,
                "begin_at_zero": False, "datasets": [{"label": label, "data": data}]}

    reward = line("reward mean", mean, "reward")
    reward["datasets"] += [
        {"label": "mean + std", "data": [None if m is None or s is None else m + s
                                         for m, s in zip(mean, std, strict=True)], **band},
        {"label": "mean − std", "data": [None if m is None or s is None else m - s
                                         for m, s in zip(mean, std, strict=True)],
         "fill": "-1", **band},
    ]
    reward["std"] = std  # the raw figures, for anyone reading the payload
    return {"reward": reward,
            "loss": line("loss", [r[3] for r in rows], "loss"),
            "kl": line("KL", [r[4] for r in rows], "KL"),
            "tokens": line("tokens/s", [r[5] for r in rows], "tokens/s")}


@console_view(permission="read_training")
def training_job(request: HttpRequest, job_id: int) -> HttpResponse:
    job = _get_job(request, job_id)
    checkpoints = (Checkpoint.objects.for_tenant(request.tenant).filter(job=job)
                   .defer("manifest").order_by("step"))
    skipped = sorted((job.data_summary or {}).get("skipped", {}).items(),
                     key=lambda kv: (-kv[1], kv[0]))
    context = {
        "job": job, "active": ACTIVE, "live": job.status in ACTIVE, "curves": curves(job),
        "checkpoints": checkpoints, "skipped": skipped,
        "can_launch": can(request, "launch_training"),
        "can_cancel": job.status in (TrainingJob.Status.QUEUED, TrainingJob.Status.RUNNING),
        "can_resume": job.status in (TrainingJob.Status.CANCELLED, TrainingJob.Status.FAILED),
        "version_href": version_href(job.dataset_version_id),
        "config_json": pretty_json(job.config),
    }
    if request.htmx:
        return render(request, "console/training_job.html#live", context)
    # A queued job with nothing to take it: say so (one query, only then).
    context["no_gpu_worker"] = (job.status == TrainingJob.Status.QUEUED
                                and not workers_listening("gpu"))
    context["gpu_stale_seconds"] = int(STALE_AFTER_SECONDS)
    return render(request, "console/training_job.html", context)


@console_view(permission="launch_training")
@require_POST
def training_job_cancel(request: HttpRequest, job_id: int) -> HttpResponse:
    job = _get_job(request, job_id)
    try:
        job = cancel_training_job(request.user, job)
    except ServiceError as exc:
        messages.error(request, f"Not cancelled: {exc}")
    else:
        messages.success(request, f"Training job {job.pk}: cancel requested ({job.status})."
                         if job.status == TrainingJob.Status.CANCELLING
                         else f"Training job {job.pk} cancelled.")
    return redirect("training-job", job.pk)


@console_view(permission="launch_training")
@require_POST
def training_job_resume(request: HttpRequest, job_id: int) -> HttpResponse:
    job = _get_job(request, job_id)
    raw = request.POST.get("total_steps", "").strip()
    total_steps = None
    if raw:
        if not raw.isdigit():
            messages.error(request, "Not resumed: total steps must be a whole number.")
            return redirect("training-job", job.pk)
        total_steps = int(raw)
    try:
        job = resume_training_job(request.user, job, total_steps=total_steps)
    except ServiceError as exc:
        messages.error(request, f"Not resumed: {exc}")
    else:
        messages.success(request, f"Training job {job.pk} queued again from step {job.step} "
                                  f"(of {job.total_steps}).")
    return redirect("training-job", job.pk)


# --- checkpoints -------------------------------------------------------------------------------


@console_view(permission="read_training")
def checkpoints(request: HttpRequest) -> HttpResponse:
    qs = (Checkpoint.objects.for_tenant(request.tenant)
          .select_related("job__dataset_version__dataset")
          .defer("manifest", "job__config").order_by("-created_at", "-pk"))
    status = request.GET.get("status", "")
    if status in Checkpoint.Status.values:
        qs = qs.filter(status=status)
    page = Paginator(qs, PAGE_SIZE).get_page(request.GET.get("page"))
    for ckpt in page:
        erasure = taint_erasure(ckpt)
        ckpt.erasure_href = erasure_href(erasure) if erasure else None
        ckpt.erasure_id = erasure
    return render(request, "console/checkpoints.html",
                  {"page": page, "status": status, "statuses": Checkpoint.Status.choices})


def _get_checkpoint(request: HttpRequest, checkpoint_id: int) -> Checkpoint:
    ckpt = (Checkpoint.objects.for_tenant(request.tenant)
            .select_related("job__dataset_version__dataset", "parent")
            .filter(pk=checkpoint_id).first())
    if ckpt is None:
        raise Http404("no such checkpoint")
    return ckpt


@console_view(permission="read_training")
def checkpoint(request: HttpRequest, checkpoint_id: int) -> HttpResponse:
    ckpt = _get_checkpoint(request, checkpoint_id)
    manifest = ckpt.manifest or {}
    version = manifest.get("dataset_version") or {}
    version_id = version.get("id") or ckpt.job.dataset_version_id
    parent = manifest.get("parent_checkpoint") or None
    erasure = taint_erasure(ckpt)
    config = manifest.get("config") or {}
    context = {
        "ckpt": ckpt, "job": ckpt.job, "manifest": manifest, "version": version,
        "version_id": version_id, "version_href": version_href(version_id),
        "approvals": [{"id": a, "href": approval_href(version_id)}
                      for a in manifest.get("approvals") or []],
        "config": sorted((k, v) for k, v in config.items() if k != "extra"),
        "code": manifest.get("code_version") or {},
        "parent": parent,
        "files": sorted((manifest.get("files") or {}).items()),
        "erasure_id": erasure, "erasure_href": erasure_href(erasure) if erasure else None,
        "can_export": can(request, "launch_training"),
        "tainted": ckpt.status == Checkpoint.Status.TAINTED,
        "manifest_json": pretty_json(manifest),
    }
    return render(request, "console/checkpoint.html", context)


@console_view(permission="launch_training")
@require_POST
def checkpoint_export(request: HttpRequest, checkpoint_id: int) -> HttpResponse:
    """The checkpoint as a tar download (audited) — refused for a tainted one, or one whose
    files no longer match its manifest: then back to its page with the reason."""
    from trainer.api import _file_response

    ckpt = _get_checkpoint(request, checkpoint_id)
    try:
        return _file_response(lambda path: export_checkpoint(request.user, ckpt, Path(path)),
                              f"checkpoint-{ckpt.pk}.tar", "application/x-tar")
    except ServiceError as exc:
        messages.error(request, f"Not exported: {exc}")
        return redirect("checkpoint", ckpt.pk)
