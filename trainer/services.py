"""Every mutation of training state: launch, cancel, resume, taint, export — each one atomic,
in its tenant's row-level security scope (governance.tenancy.tenant_atomic), writing its audit
event in the same transaction (governance.audit.record_event).

The gate: only an approved, never invalidated dataset version (trainer.taskdata.version_refusal)
whose content still hashes to what was approved is trained on or exported. The service checks
at launch; the task checks again when it starts and after every step (trainer/tasks.py), so an
approval withdrawn by erasure or retention stops a queued or running job too.

Imports no torch (web hosts have none): GRPOConfig (which pulls torch through trainer.grpo) is
imported inside the functions that validate a config.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from governance.audit import record_event
from governance.datasets import version_content_hash
from governance.models import DatasetVersion, DatasetVersionMember, Tenant
from governance.services import ServiceConflict, ServiceError, ServiceForbidden
from governance.tenancy import tenant_atomic
from trainer import rewards
from trainer.models import Checkpoint, TrainingJob
from trainer.runtime import TINY_BASE, rollout_engine_for, stale_after
from trainer.taskdata import version_refusal
from trainer.tasks import run_training_job

DEFAULT_REWARD_FN = "reference_answer"
# Small on purpose: a job states what it wants; these keep an unconfigured one short.
JOB_DEFAULTS: dict[str, Any] = {"total_steps": 10, "save_every": 5, "train_batch_size": 4,
                                "group_size": 4, "max_response_length": 64}
# The tiny model has 128 positions: prompt + response must fit.
TINY_DEFAULTS: dict[str, Any] = {"max_prompt_length": 96, "max_response_length": 16}
# Set by Steward, never by the caller: where weights come from and go to, provenance.
RESERVED_KEYS = {"model_path", "output_dir", "extra"}
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_REWARD_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def models_dir() -> Path:
    return Path(settings.VAR_DIR) / "models"


def train_root() -> Path:
    return Path(settings.VAR_DIR) / "train"


def job_output_dir(job: TrainingJob) -> Path:
    return train_root() / f"tenant-{job.tenant_id}" / f"job-{job.pk}"


def resolve_base_model(name: str) -> Path:
    """A base model is a directory name under VAR_DIR/models (never a free path: a REST
    caller must not point the trainer at arbitrary files of the host). The tiny model may be
    missing: the task builds it offline."""
    if not _MODEL_NAME.match(name or "") or ".." in name:
        raise ServiceError("base_model must be the name of a directory under the models "
                           "directory (letters, digits, '.', '_', '-')")
    path = models_dir() / name
    if name != TINY_BASE and not (path / "config.json").is_file():
        raise ServiceError(f"base model {name!r} not found in {models_dir()}")
    return path


def build_config(overrides: dict[str, Any] | None, base_model: str, base_path: Path,
                 output_dir: Path, provenance: dict[str, Any]) -> dict[str, Any]:
    """The job's GRPOConfig as a dict: defaults < caller's overrides < what Steward sets."""
    from trainer.config import GRPOConfig

    overrides = dict(overrides or {})
    reserved = sorted(RESERVED_KEYS & set(overrides))
    if reserved:
        raise ServiceError(f"config keys set by Steward, not by the caller: {', '.join(reserved)}")
    data = {**JOB_DEFAULTS, **(TINY_DEFAULTS if base_model == TINY_BASE else {}), **overrides,
            "model_path": str(base_path), "output_dir": str(output_dir), "extra": provenance}
    try:
        config = GRPOConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ServiceError(f"invalid training config: {exc}") from None
    if config.rollout_backend == "sglang" or config.rollout_url:
        # The worker sends the engine's key, prompts and (every step) weights to rollout_url:
        # only a rollout engine of the operator's, never one that serves agents.
        config.rollout_url = rollout_engine_for(config).url
    return config.to_dict()


def _check_trainable(version: DatasetVersion) -> None:
    reason = version_refusal(version)
    if reason:
        raise ServiceConflict(f"refused: {reason}")


def _enqueue(job_id: int) -> None:
    """After the commit (robust: a broker outage must not fail a request whose job is already
    queued; trainer.tasks.enqueue_queued_jobs sends such a job's message again later)."""
    run_training_job.delay(job_id)


@tenant_atomic("tenant")
def launch_training_job(actor: Any, tenant: Tenant, version: DatasetVersion, *,
                        config: dict[str, Any] | None = None,
                        reward_fn: str = DEFAULT_REWARD_FN,
                        reward_params: dict[str, Any] | None = None,
                        reference_reward: str = "reference",
                        base_model: str = TINY_BASE) -> TrainingJob:
    """Queue a GRPO job on an approved, non-invalidated version (else ServiceConflict, 409).
    The task is enqueued when this transaction commits (queue `gpu`)."""
    if version.tenant_id != tenant.pk:
        raise ServiceError("unknown dataset version")
    # The row lock orders this against a concurrent invalidation (erasure, retention).
    version = (DatasetVersion.objects.select_for_update(of=("self",)).select_related("approval")
               .get(pk=version.pk))
    _check_trainable(version)
    if reward_fn not in rewards.available():
        raise ServiceError(f"unknown reward function {reward_fn!r}; registered: "
                           f"{', '.join(rewards.available())}")
    if not _REWARD_NAME.match(reference_reward or ""):
        raise ServiceError("reference_reward must be a reward name")
    if reward_params is not None and not isinstance(reward_params, dict):
        raise ServiceError("reward_params must be an object")
    base_path = resolve_base_model(base_model)
    job = TrainingJob.objects.create(
        tenant=tenant, dataset_version=version, requested_by=actor if hasattr(actor, "pk")
        else None, reward_fn=reward_fn, reward_params=reward_params or {},
        reference_reward=reference_reward, base_model=base_model,
        base_model_path=str(base_path))
    out = job_output_dir(job)
    job.config = build_config(config, base_model, base_path, out,
                              {"job": job.pk, "tenant": tenant.pk, "dataset_version": version.pk})
    job.output_dir = str(out)
    job.total_steps = job.config["total_steps"]
    job.save(update_fields=["config", "output_dir", "total_steps"])
    record_event(actor, "training_job.launched", tenant=tenant, object_type="training_job",
                 object_id=job.pk,
                 payload={"dataset_version": version.pk, "content_hash": version.content_hash,
                          "approval": version.approval.pk, "reward_fn": reward_fn,
                          "base_model": base_model, "total_steps": job.total_steps,
                          "seed": job.config["seed"]})
    transaction.on_commit(lambda: _enqueue(job.pk), robust=True)
    return job


@tenant_atomic("job.tenant_id")
def cancel_training_job(actor: Any, job: TrainingJob) -> TrainingJob:
    """Queued: cancelled at once. Running: `cancelling` — the task sees it after the current
    step, writes a checkpoint (so the job can be resumed) and ends `cancelled`."""
    job = TrainingJob.objects.select_for_update().get(pk=job.pk)
    if job.status in TrainingJob.TERMINAL:
        raise ServiceConflict(f"job is {job.status}; only a queued or running job can be "
                              "cancelled")
    before = job.status
    # A running job whose worker stopped reporting (died) is not there to see the request.
    gone = job.heartbeat_at is not None and job.heartbeat_at < timezone.now() - stale_after()
    if job.status == TrainingJob.Status.QUEUED or gone:
        job.status = TrainingJob.Status.CANCELLED
        job.finished_at = timezone.now()
    else:
        job.status = TrainingJob.Status.CANCELLING
    job.cancel_requested_by = actor if hasattr(actor, "pk") else None
    job.save(update_fields=["status", "finished_at", "cancel_requested_by"])
    record_event(actor, "training_job.cancel_requested", tenant=job.tenant_id,
                 object_type="training_job", object_id=job.pk,
                 payload={"was": before, "now": job.status, "step": job.step})
    return job


@tenant_atomic("job.tenant_id")
def resume_training_job(actor: Any, job: TrainingJob, *, total_steps: int | None = None
                        ) -> TrainingJob:
    """Queue a cancelled or failed job again: it continues from its last checkpoint
    (resume_from="auto"). `total_steps` may extend (never shorten below the step reached)."""
    job = TrainingJob.objects.select_for_update().get(pk=job.pk)
    if job.status not in (TrainingJob.Status.CANCELLED, TrainingJob.Status.FAILED):
        raise ServiceConflict(f"job is {job.status}; only a cancelled or failed job can be "
                              "resumed")
    version = (DatasetVersion.objects.select_for_update(of=("self",)).select_related("approval")
               .get(pk=job.dataset_version_id))
    _check_trainable(version)
    if total_steps is not None:
        if total_steps < max(job.step, 1):
            raise ServiceError(f"total_steps must be at least the step reached ({job.step})")
        job.config = {**job.config, "total_steps": int(total_steps)}
        job.total_steps = int(total_steps)
    before = job.status
    job.status = TrainingJob.Status.QUEUED
    job.error = ""
    job.finished_at = None
    job.heartbeat_at = timezone.now()  # queued again now (enqueue_queued_jobs measures this)
    job.save(update_fields=["config", "total_steps", "status", "error", "finished_at",
                            "heartbeat_at"])
    record_event(actor, "training_job.resumed", tenant=job.tenant_id, object_type="training_job",
                 object_id=job.pk, payload={"was": before, "step": job.step,
                                            "total_steps": job.total_steps})
    transaction.on_commit(lambda: _enqueue(job.pk), robust=True)
    return job


@tenant_atomic("tenant")
def mark_checkpoints_tainted(actor: Any, tenant: Tenant | int, trajectory_ids: Any,
                             reason: str) -> list[int]:
    """Erasure: every checkpoint of a job whose dataset version held any of these trajectories
    becomes `tainted` (never exported, never promoted). Returns the checkpoint ids newly
    tainted. Call it BEFORE the trajectories are deleted: the version members that link
    them to the versions go with them (ON DELETE CASCADE)."""
    tenant_id = tenant if isinstance(tenant, int) else tenant.pk
    ids = [str(t) for t in trajectory_ids]
    if not ids:
        return []
    versions = (DatasetVersionMember.objects.for_tenant(tenant_id)
                .filter(trajectory_id__in=ids).values("version_id"))
    checkpoints = list(Checkpoint.objects.for_tenant(tenant_id)
                       .filter(job__dataset_version_id__in=versions,
                               status=Checkpoint.Status.OK)
                       .select_for_update().order_by("pk"))
    now = timezone.now()
    for ckpt in checkpoints:
        ckpt.status = Checkpoint.Status.TAINTED
        ckpt.tainted_reason = reason[:500]
        ckpt.tainted_at = now
        ckpt.save(update_fields=["status", "tainted_reason", "tainted_at"])
        record_event(actor, "checkpoint.tainted", tenant=tenant_id, object_type="checkpoint",
                     object_id=ckpt.pk,
                     payload={"job": ckpt.job_id, "step": ckpt.step,
                              "manifest_sha256": ckpt.manifest_sha256, "reason": reason[:500]})
    return [c.pk for c in checkpoints]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@tenant_atomic("version.tenant_id")
def export_dataset_version(actor: Any, version: DatasetVersion, fmt: str, out: str | Path,
                           *, reference_reward: str = "reference") -> dict[str, Any]:
    """Write an export of an approved, non-invalidated version whose content still hashes to
    what was approved (trainer/exports.py has the formats). Audited with the file's SHA-256.
    Refused: ServiceConflict."""
    from trainer.exports import FORMATS, write_export

    if fmt not in FORMATS:
        raise ServiceError(f"format must be one of {', '.join(FORMATS)}")
    version = (DatasetVersion.objects.select_related("approval", "dataset", "tenant")
               .get(pk=version.pk))
    _check_trainable(version)
    current, _ = version_content_hash(version)
    if current != version.content_hash:
        raise ServiceConflict("refused: the version's content changed since it was approved")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        summary = write_export(version, fmt, tmp, reference_reward)
        summary.update(format=fmt, sha256=_sha256_file(tmp), bytes=tmp.stat().st_size,
                       dataset_version=version.pk, content_hash=version.content_hash,
                       approval=version.approval.pk)
        record_event(actor, "dataset_version.exported", tenant=version.tenant_id,
                     object_type="dataset_version", object_id=version.pk, payload=summary)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return summary


@tenant_atomic("checkpoint.tenant_id")
def export_checkpoint(actor: Any, checkpoint: Checkpoint, out: str | Path) -> dict[str, Any]:
    """A tar of the checkpoint's weights, config, trainer state and manifest — refused for a
    tainted checkpoint, and for one whose files no longer match its manifest's hashes."""
    ckpt = Checkpoint.objects.select_for_update().get(pk=checkpoint.pk)
    if ckpt.status == Checkpoint.Status.TAINTED:
        raise ServiceForbidden(f"checkpoint {ckpt.pk} is tainted ({ckpt.tainted_reason}); "
                               "it can never be exported")
    root = Path(ckpt.path)
    if not root.resolve().is_relative_to(train_root().resolve()) or not root.is_dir():
        raise ServiceConflict(f"checkpoint {ckpt.pk}: its files are gone")
    files = dict(ckpt.manifest.get("files") or {})
    for rel, digest in files.items():
        if not (root / rel).is_file() or _sha256_file(root / rel) != digest:
            raise ServiceConflict(f"checkpoint {ckpt.pk}: {rel} does not match its manifest")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = sorted(files) + ["trainer_state.json", "manifest.json"]
    with tarfile.open(out, "w") as tar:
        for rel in names:
            tar.add(root / rel, arcname=f"checkpoint-{ckpt.pk}/{rel}")
    summary = {"checkpoint": ckpt.pk, "job": ckpt.job_id, "step": ckpt.step,
               "manifest_sha256": ckpt.manifest_sha256, "sha256": _sha256_file(out),
               "bytes": out.stat().st_size}
    record_event(actor, "checkpoint.exported", tenant=ckpt.tenant_id, object_type="checkpoint",
                 object_id=ckpt.pk, payload=summary)
    return summary

