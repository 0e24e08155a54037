"""Training jobs, their per-step metrics and their checkpoints (with lineage manifests).

Every table has a `tenant` foreign key, is read through `for_tenant(...)` and sits behind the
row-level security policy (migration 0001 uses governance.tenancy.tenant_rls_sql). These
modules import no torch: web and proxy hosts install no training extra; only the Celery task
(trainer/tasks.py) loads torch, inside the task.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from governance.models import DatasetVersion, Tenant, TenantManager


class TrainingJob(models.Model):
    """One GRPO run on one approved dataset version (queue `gpu`)."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        CANCELLING = "cancelling", "Cancelling"
        CANCELLED = "cancelled", "Cancelled"
        COMPLETED = "completed", "Completed"
        FAILED = "failed", "Failed"
        # The version was not (or no longer) approved, or its content drifted, when the job
        # ran: the check inside the task, not only the one at launch.
        REFUSED = "refused", "Refused"

    ACTIVE = (Status.QUEUED, Status.RUNNING, Status.CANCELLING)
    TERMINAL = (Status.CANCELLED, Status.COMPLETED, Status.FAILED, Status.REFUSED)

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="training_jobs")
    dataset_version = models.ForeignKey(DatasetVersion, on_delete=models.PROTECT,
                                        related_name="training_jobs")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                     on_delete=models.SET_NULL, related_name="+")
    # GRPOConfig.to_dict() (model_path and output_dir filled in by the service).
    config = models.JSONField(default=dict)
    reward_fn = models.CharField(max_length=64)           # trainer.rewards registry name
    reward_params = models.JSONField(default=dict, blank=True)
    # The final late-bound reward whose rows carry each trajectory's ground truth.
    reference_reward = models.CharField(max_length=64, default="reference")
    base_model = models.CharField(max_length=200)          # name under VAR_DIR/models
    base_model_path = models.CharField(max_length=1000)
    output_dir = models.CharField(max_length=1000, blank=True, default="")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED,
                              db_index=True)
    step = models.PositiveIntegerField(default=0)
    total_steps = models.PositiveIntegerField(default=0)
    last_metrics = models.JSONField(default=dict, blank=True)
    # What the task built from the version: tasks used, trajectories skipped and why.
    data_summary = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    attempts = models.PositiveIntegerField(default=0)
    # The Celery task id that claimed the job: its own retry (or its redelivery after a
    # worker crash, once the heartbeat is stale) may claim it again; nothing else may.
    task_id = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                            on_delete=models.SET_NULL, related_name="+")

    objects = TenantManager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at"], name="trainjob_tenant_created")]

    def __str__(self) -> str:
        return f"training job {self.pk} ({self.status})"

    @property
    def progress(self) -> float:
        return self.step / self.total_steps if self.total_steps else 0.0


class TrainingMetric(models.Model):
    """One optimizer step's figures, for the console's progress bar and curves."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="metrics")
    step = models.PositiveIntegerField()
    reward_mean = models.FloatField()
    reward_std = models.FloatField()
    loss = models.FloatField()
    kl = models.FloatField(default=0.0)
    entropy = models.FloatField(default=0.0)
    clip_frac = models.FloatField(default=0.0)
    grad_norm = models.FloatField(default=0.0)
    response_length_mean = models.FloatField(default=0.0)
    tokens_per_s = models.FloatField(default=0.0)
    step_s = models.FloatField(default=0.0)
    groups_kept = models.PositiveIntegerField(default=0)
    groups = models.PositiveIntegerField(default=0)
    extra = models.JSONField(default=dict, blank=True)  # every other figure of the step
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            # A resumed run re-reports no step twice (the metric row is upserted).
            models.UniqueConstraint(fields=["job", "step"], name="trainmetric_job_step"),
        ]


class Checkpoint(models.Model):
    """A checkpoint directory written by the trainer, with its lineage manifest (also written
    as manifest.json next to it). `tainted`: data it was trained on was erased since — it can
    never be exported or promoted."""

    class Status(models.TextChoices):
        OK = "ok", "OK"
        TAINTED = "tainted", "Tainted"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="checkpoints")
    job = models.ForeignKey(TrainingJob, on_delete=models.PROTECT, related_name="checkpoints")
    step = models.PositiveIntegerField()
    path = models.CharField(max_length=1000)
    weight_version = models.CharField(max_length=64)
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT,
                               related_name="children")
    manifest = models.JSONField(default=dict)
    manifest_sha256 = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OK,
                              db_index=True)
    tainted_reason = models.CharField(max_length=500, blank=True, default="")
    tainted_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "step"], name="checkpoint_job_step"),
        ]

    def __str__(self) -> str:
        return f"checkpoint {self.pk} (job {self.job_id}, step {self.step}, {self.status})"
