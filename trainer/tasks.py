"""`run_training_job(job_id)`: one GRPO job on the Celery queue `gpu`.

1. Route: the job id's tenant comes from the SECURITY DEFINER function
   steward_training_job_tenant (migration 0002); everything after runs in that tenant's
   row-level security scope, in short transactions (never one around the whole run).
2. Claim with a conditional UPDATE: queued -> running. Also reclaimed: a job `running` under
   this same Celery task id when this is its retry, or when its heartbeat is stale (the worker
   died; acks_late redelivers the message). A duplicate delivery of a live job claims nothing,
   and a finished job is never run again (idempotent).
3. The gate, inside the task: the dataset version must be approved, never invalidated, and its
   members must still hash to the approved content hash — else the job ends `refused`
   (audited). Launching checked the same, but the version may have changed since.
4. Build tasks (trainer.taskdata: prompts from the sanitized steps, references from final
   late-bound rewards), load the base model (the tiny one is built offline on first use), and
   run trainer.loop.train with resume_from="auto" (a retried, redelivered or resumed job
   continues from its last checkpoint in its output dir).
5. on_step: one TrainingMetric row + the job's progress per step; a Checkpoint row with its
   lineage manifest (trainer.lineage, also written as manifest.json) per checkpoint written.
   should_stop (after every step): the job was cancelled, or the version is no longer
   approved / was invalidated -> the loop saves a checkpoint and returns; the job ends
   `cancelled` or `refused`.
6. Bounded retries (3) on database connection errors; any other error fails the job with its
   message.

torch and transformers are imported inside the task only (web hosts have no training extra).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import shared_task
from django.db import InterfaceError, OperationalError, connection
from django.db.models import Q
from django.utils import timezone

from governance import jobs
from governance.audit import record_event
from governance.datasets import version_content_hash
from governance.models import DatasetVersion
from governance.tenancy import tenant_context
from trainer.lineage import build_manifest, code_version, manifest_sha256, write_manifest
from trainer.models import Checkpoint, TrainingJob, TrainingMetric
from trainer.runtime import TINY_BASE, rollout_engine_for, stale_after
from trainer.taskdata import (
    Example,
    iter_examples,
    member_trajectory_ids,
    prompt_key,
    sanitizer_versions,
    version_refusal,
)

log = logging.getLogger("steward.trainer")
ACTOR = "system:trainer"
MAX_RETRIES = 3
METRIC_FIELDS = ("reward_mean", "reward_std", "loss", "kl", "entropy", "clip_frac", "grad_norm",
                 "response_length_mean", "tokens_per_s", "step_s", "groups_kept", "groups")


class Refused(Exception):
    """The dataset version may not (or no longer) be trained on."""


def job_tenant(job_id: int) -> int | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT steward_training_job_tenant(%s)", [job_id])
        row = cursor.fetchone()
    return row[0] if row else None


def claim(job_id: int, tenant_id: int, task_id: str, is_retry: bool) -> bool:
    """The claim rule of governance.jobs (a live run's redelivered message claims nothing)."""
    with tenant_context(tenant_id):  # the claim and its audit event commit together
        updated = jobs.claim(TrainingJob, job_id, tenant_id, task_id,
                             waiting=TrainingJob.Status.QUEUED, is_retry=is_retry,
                             stale_after=stale_after(), started_at=timezone.now(), error="")
        if updated:
            job = TrainingJob.objects.get(pk=job_id)
            job.attempts += 1
            job.save(update_fields=["attempts"])
            record_event(ACTOR, "training_job.started", tenant=tenant_id,
                         object_type="training_job", object_id=job_id,
                         payload={"attempt": job.attempts, "task_id": task_id,
                                  "from_step": job.step})
    return bool(updated)


def finish(job_id: int, tenant_id: int, status: str, error: str = "",
           payload: dict[str, Any] | None = None) -> None:
    with tenant_context(tenant_id):
        job = TrainingJob.objects.select_for_update().get(pk=job_id)
        job.status = status
        job.error = error[:4000]
        job.finished_at = timezone.now()
        job.save(update_fields=["status", "error", "finished_at"])
        record_event(ACTOR, f"training_job.{status}", tenant=tenant_id,
                     object_type="training_job", object_id=job_id,
                     payload={"step": job.step, "total_steps": job.total_steps,
                              **({"error": error[:500]} if error else {}), **(payload or {})})


def requeue(job_id: int, tenant_id: int) -> None:
    """Back to queued before a retry (best effort: the database may be what failed)."""
    try:
        with tenant_context(tenant_id):
            TrainingJob.objects.filter(pk=job_id, status=TrainingJob.Status.RUNNING).update(
                status=TrainingJob.Status.QUEUED)
    except (OperationalError, InterfaceError):
        pass


# --- the data ------------------------------------------------------------------------------


def load_version(tenant_id: int, version_id: int) -> DatasetVersion:
    with tenant_context(tenant_id):
        return (DatasetVersion.objects.select_related("approval", "dataset", "tenant")
                .get(pk=version_id))


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> list[int]:
    """Token ids of the conversation up to the assistant turn: the tokenizer's chat template
    (with the generation prompt) when it has one; else "role: content" lines and
    "assistant: " (the tiny model's character tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, tools=tools or None,
                                            add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return list(ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return list(tokenizer(text)["input_ids"])


def build_tasks(examples: list[Example], tokenizer: Any, job: TrainingJob,
                max_prompt_length: int, skipped: Counter[str]) -> list[Any]:
    """trainer.loop.Task per example (per distinct prompt for the `logged` reward)."""
    from trainer.loop import Task

    params = {k: v for k, v in (job.reward_params or {}).items() if k != "reward_name"}
    tasks: list[Task] = []
    if job.reward_fn == "logged":
        pooled: dict[str, list[Example]] = {}
        for ex in examples:
            if ex.logged_reward is None or ex.completion is None:
                skipped["no logged reward"] += 1
                continue
            pooled.setdefault(prompt_key(ex.prompt), []).append(ex)
        for group in pooled.values():
            ids = render_prompt(tokenizer, group[0].prompt, group[0].tools)
            if len(ids) > max_prompt_length:
                skipped["prompt too long"] += len(group)
                continue
            logged = [{"completion": ex.completion["content"], "reward": ex.logged_reward}
                      for ex in group if ex.completion]
            tasks.append(Task(ids, {**params, "logged": logged}, group[0].trajectory_id))
        return tasks
    for ex in examples:
        if ex.reference is None:
            skipped["no reference"] += 1
            continue
        ids = render_prompt(tokenizer, ex.prompt, ex.tools)
        if not ids or len(ids) > max_prompt_length:
            skipped["prompt too long"] += 1
            continue
        tasks.append(Task(ids, {**params, **ex.reference}, ex.trajectory_id))
    return tasks


def ensure_tiny_base(path: Path) -> Path:
    """The tiny Qwen2-style model (trainer.tiny), built offline into `path` on first use."""
    if (path / "config.json").is_file():
        return path
    from trainer.tiny import build_tiny, save_tiny

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    model, tokenizer = build_tiny(seed=0)
    save_tiny(model, tokenizer, tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another worker built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_policy(job: TrainingJob) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(job.base_model_path)
    if job.base_model == TINY_BASE:
        ensure_tiny_base(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


# --- the run -------------------------------------------------------------------------------


class JobRun:
    """The callbacks of one run: progress, metrics and checkpoints into the database."""

    def __init__(self, job: TrainingJob, version: DatasetVersion, trajectory_ids: list[str],
                 sanitizers: list[str]) -> None:
        self.job = job
        self.tenant_id = job.tenant_id
        self.version = version
        self.trajectory_ids = trajectory_ids
        self.sanitizers = sanitizers
        self.code = code_version()
        self.stop_reason: str | None = None  # "cancelled" | "refused: ..."

    def on_step(self, m: dict[str, Any]) -> None:
        step = int(m["step"])
        values = {f: m.get(f, 0.0) for f in METRIC_FIELDS}
        extra = {k: v for k, v in m.items() if k not in METRIC_FIELDS and k != "step"}
        last = {k: v for k, v in m.items() if isinstance(v, int | float | str)}
        with tenant_context(self.tenant_id):
            TrainingMetric.objects.update_or_create(
                job_id=self.job.pk, step=step,
                defaults={"tenant_id": self.tenant_id, **values, "extra": extra})
            jobs.heartbeat(TrainingJob, self.job.pk, self.tenant_id, step=step, last_metrics=last)
            if "checkpoint" in m:
                self.record_checkpoint(Path(m["checkpoint"]))

    def record_checkpoint(self, path: Path) -> Checkpoint:
        """The Checkpoint row and manifest.json of a checkpoint the loop just wrote (inside
        on_step's transaction)."""
        raw = (path / "trainer_state.json").read_bytes()
        state = json.loads(raw)
        state["_sha256"] = hashlib.sha256(raw).hexdigest()
        parent = None
        if state.get("parent"):
            parent = (Checkpoint.objects.filter(job_id=self.job.pk, path=state["parent"])
                      .first())
        version = DatasetVersion.objects.select_related("approval").get(pk=self.version.pk)
        config = json.loads((path / "config.json").read_text())
        manifest = build_manifest(
            job=self.job, version=version, trajectory_ids=self.trajectory_ids,
            approval_ids=[version.approval.pk], sanitizer_versions=self.sanitizers,
            trainer_state=state, parent=parent, config=config, code=self.code)
        write_manifest(path, manifest)
        refusal = version_refusal(version)
        ckpt, _ = Checkpoint.objects.update_or_create(
            job_id=self.job.pk, step=int(state["step"]),
            defaults={"tenant_id": self.tenant_id, "path": str(path),
                      "weight_version": str(state["weight_version"]), "parent": parent,
                      "manifest": manifest, "manifest_sha256": manifest_sha256(manifest),
                      # Written after its data lost its approval: never usable.
                      "status": Checkpoint.Status.TAINTED if refusal else Checkpoint.Status.OK,
                      "tainted_reason": (refusal or "")[:500],
                      "tainted_at": timezone.now() if refusal else None})
        record_event(ACTOR, "checkpoint.created", tenant=self.tenant_id,
                     object_type="checkpoint", object_id=ckpt.pk,
                     payload={"job": self.job.pk, "step": ckpt.step, "status": ckpt.status,
                              "manifest_sha256": ckpt.manifest_sha256,
                              "merkle_root": manifest["trajectories_merkle_root"],
                              "parent": parent.pk if parent else None})
        return ckpt

    def should_stop(self) -> bool:
        with tenant_context(self.tenant_id):
            status = (TrainingJob.objects.filter(pk=self.job.pk)
                      .values_list("status", flat=True).first())
            refusal = version_refusal(DatasetVersion.objects.select_related("approval")
                                      .get(pk=self.version.pk))
        if refusal:
            self.stop_reason = f"refused: {refusal}"
        elif status == TrainingJob.Status.CANCELLING:
            self.stop_reason = "cancelled"
        return self.stop_reason is not None


def rollout_backend(config: Any) -> Any:
    """The job's rollout engine: None for "hf" (the loop samples from the policy it trains), an
    SGLangRollout for "sglang". Weights reach SGLang through `<output_dir>/sglang-weights`, a
    directory the worker and the SGLang server must both see (same host, or a shared volume)."""
    if config.rollout_backend == "hf":
        return None
    from governance.services import ServiceError
    from trainer.rollout import SGLangRollout

    try:
        engine = rollout_engine_for(config)
    except ServiceError as exc:  # never a request to it: the job is refused with the reason
        raise Refused(str(exc)) from None
    return SGLangRollout(engine.url, staging_dir=Path(config.output_dir) / "sglang-weights",
                         api_key=engine.api_key or None)


def run_job(job_id: int, tenant_id: int) -> str:
    """Steps 3-5 of the module docstring for a claimed job; returns its final status."""
    # 3. The gate, then everything the run needs from the database, in one short read.
    with tenant_context(tenant_id):
        job = TrainingJob.objects.get(pk=job_id)
        version = (DatasetVersion.objects.select_related("approval", "dataset", "tenant")
                   .get(pk=job.dataset_version_id))
        refusal = version_refusal(version)
        if refusal:
            raise Refused(refusal)
        current, _ = version_content_hash(version)
        if current != version.content_hash:
            raise Refused(f"dataset version {version.pk}: its content no longer matches the "
                          "approved content hash")
        skipped: Counter[str] = Counter()
        logged = (job.reward_params or {}).get("reward_name", "reward") \
            if job.reward_fn == "logged" else None
        examples = list(iter_examples(version, reference_reward=job.reference_reward,
                                      logged_reward=logged, skipped=skipped))
        trajectory_ids = member_trajectory_ids(version)
        sanitizers = sanitizer_versions(version)

    # 4. Model, tasks, config (no transaction open while torch works).
    from trainer.config import GRPOConfig
    from trainer.loop import train

    config = GRPOConfig.from_dict(job.config)
    model, tokenizer = load_policy(job)
    tasks = build_tasks(examples, tokenizer, job, config.max_prompt_length, skipped)
    summary = {"members": len(trajectory_ids), "examples": len(examples), "tasks": len(tasks),
               "skipped": dict(skipped)}
    with tenant_context(tenant_id):
        TrainingJob.objects.filter(pk=job_id).update(data_summary=summary)
    if not tasks:
        raise ValueError(f"no trainable tasks in dataset version {version.pk}: {summary}")

    run = JobRun(job, version, trajectory_ids, sanitizers)
    train(config, model, tokenizer, tasks, job.reward_fn, rollout_backend(config),
          on_step=run.on_step, should_stop=run.should_stop, resume_from="auto")

    # 5. How it ended.
    if run.stop_reason and run.stop_reason.startswith("refused"):
        finish(job_id, tenant_id, TrainingJob.Status.REFUSED, run.stop_reason)
        return TrainingJob.Status.REFUSED
    if run.stop_reason == "cancelled":
        finish(job_id, tenant_id, TrainingJob.Status.CANCELLED)
        return TrainingJob.Status.CANCELLED
    finish(job_id, tenant_id, TrainingJob.Status.COMPLETED, payload={"data": summary})
    return TrainingJob.Status.COMPLETED


@shared_task(bind=True, name="trainer.tasks.run_training_job", max_retries=MAX_RETRIES,
             acks_late=True)
def run_training_job(self: Any, job_id: int) -> str:
    tenant_id = job_tenant(job_id)
    if tenant_id is None:
        log.warning("training job %s does not exist", job_id)
        return "missing"
    task_id = self.request.id or f"local-{os.getpid()}"
    if not claim(job_id, tenant_id, task_id, is_retry=bool(self.request.retries)):
        log.info("training job %s: not claimable (finished, cancelled or running elsewhere)",
                 job_id)
        return "skipped"
    try:
        return run_job(job_id, tenant_id)
    except Refused as exc:
        finish(job_id, tenant_id, TrainingJob.Status.REFUSED, f"refused: {exc}")
        return TrainingJob.Status.REFUSED
    except (OperationalError, InterfaceError) as exc:
        if self.request.retries < MAX_RETRIES:
            log.warning("training job %s: database error, retrying: %s", job_id, exc)
            requeue(job_id, tenant_id)
            raise self.retry(exc=exc, countdown=5 * 2 ** self.request.retries) from exc
        finish(job_id, tenant_id, TrainingJob.Status.FAILED, f"database error: {exc}")
        return TrainingJob.Status.FAILED
    except Exception as exc:  # the job fails with the reason; the worker goes on
        log.exception("training job %s failed", job_id)
        finish(job_id, tenant_id, TrainingJob.Status.FAILED, f"{type(exc).__name__}: {exc}")
        return TrainingJob.Status.FAILED


@shared_task(name="trainer.tasks.enqueue_queued_jobs")
def enqueue_queued_jobs(older_than_s: float = 300.0) -> int:
    """Celery beat: send the message again for jobs still `queued` a while after their launch
    or resume (the message was lost: broker down at commit, purged queue). A duplicate is
    harmless: only one delivery can claim the job."""
    from governance.models import Tenant

    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    sent = 0
    for tenant_id in Tenant.objects.values_list("pk", flat=True):
        with tenant_context(tenant_id):
            ids = list(TrainingJob.objects.filter(status=TrainingJob.Status.QUEUED)
                       .filter(Q(heartbeat_at__lt=cutoff)
                               | Q(heartbeat_at__isnull=True, created_at__lt=cutoff))
                       .values_list("pk", flat=True))
        for job_id in ids:
            run_training_job.delay(job_id)
            sent += 1
    return sent
