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


# --- the evolution control plane (issue 7; trainer/evolution.py, trainer/evolution_services.py)


class EvolutionPolicy(models.Model):
    """A tenant's gate thresholds. Absent (or a field left empty): trainer.evolution.Thresholds'
    default. One row per tenant, changed through evolution_services.set_evolution_policy."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE,
                                  related_name="evolution_policy")
    shadow_margin = models.FloatField(null=True, blank=True)
    replay_tolerance = models.FloatField(null=True, blank=True)
    refusal_max_drop = models.FloatField(null=True, blank=True)
    over_refusal_max_increase = models.FloatField(null=True, blank=True)
    degenerate_max_increase = models.FloatField(null=True, blank=True)
    canary_share = models.FloatField(null=True, blank=True)
    min_sessions_per_arm = models.PositiveIntegerField(null=True, blank=True)
    max_error_rate_increase = models.FloatField(null=True, blank=True)
    low_reward_threshold = models.FloatField(null=True, blank=True)
    min_cluster_size = models.PositiveIntegerField(null=True, blank=True)
    reward_name = models.CharField(max_length=64, blank=True, default="")
    # The held-out eval split (an approved version) the shadow eval uses when a candidate names
    # none; and the production policy a candidate served by an upstream is compared with.
    eval_version = models.ForeignKey(DatasetVersion, null=True, blank=True,
                                     on_delete=models.SET_NULL, related_name="+")
    baseline_upstream_url = models.CharField(max_length=500, blank=True, default="")
    baseline_model = models.CharField(max_length=256, blank=True, default="")
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantManager()

    THRESHOLD_FIELDS = ("shadow_margin", "replay_tolerance", "refusal_max_drop",
                        "over_refusal_max_increase", "degenerate_max_increase", "canary_share",
                        "min_sessions_per_arm", "max_error_rate_increase",
                        "low_reward_threshold", "min_cluster_size", "reward_name")


class Candidate(models.Model):
    """A proposed change to an agent's policy on its way through the five gates: new weights
    (a checkpoint, and/or a model served at `upstream_url`) or a context update (memory, skill,
    harness: a system-prompt snippet; tool_schema: tool definitions)."""

    class Kind(models.TextChoices):
        WEIGHTS = "weights", "Weight update"
        MEMORY = "memory", "Memory insertion"
        SKILL = "skill", "Skill patch"
        HARNESS = "harness", "Harness edit"
        TOOL_SCHEMA = "tool_schema", "Tool-schema change"

    class Stage(models.TextChoices):
        SHADOW_EVAL = "shadow_eval", "Shadow eval"
        REPLAY = "replay", "Replay check"
        SAFETY = "safety", "Regression & safety"
        CANARY = "canary", "Canary"
        PROMOTE = "promote", "Promote"

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"          # queued for the offline gates
        RUNNING = "running", "Running"          # offline gates running, or canary live
        PASSED = "passed", "Passed"             # offline gates passed, canary not started yet
        FAILED = "failed", "Failed"             # stopped by a gate (reason says which, why)
        PROMOTED = "promoted", "Promoted"
        ROLLED_BACK = "rolled_back", "Rolled back"
        # A weight push is recorded as intent first and done by a Celery task outside any
        # transaction (trainer.evolution_tasks.push_candidate_weights), which then records
        # the outcome: promoting -> promoted | push_failed; rolling_back -> rolled_back, or
        # back to promoted when the previous weights could not be restored.
        PROMOTING = "promoting", "Promoting (pushing weights)"
        ROLLING_BACK = "rolling_back", "Rolling back (pushing weights)"
        PUSH_FAILED = "push_failed", "Promote failed (weights not pushed)"

    CONTEXT_KINDS = (Kind.MEMORY, Kind.SKILL, Kind.HARNESS, Kind.TOOL_SCHEMA)
    PUSHING = (Status.PROMOTING, Status.ROLLING_BACK)
    LIVE = (Status.PENDING, Status.RUNNING, Status.PASSED, *PUSHING)

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="candidates")
    agent = models.ForeignKey("governance.Agent", on_delete=models.PROTECT,
                              related_name="candidates")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    checkpoint = models.ForeignKey(Checkpoint, null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="candidates")
    context_update = models.ForeignKey("governance.ContextUpdate", null=True, blank=True,
                                       on_delete=models.PROTECT, related_name="candidates")
    route = models.ForeignKey("governance.PolicyRoute", null=True, blank=True,
                              on_delete=models.SET_NULL, related_name="candidates")
    # Where the candidate is served for evaluation and the canary (optional for a checkpoint:
    # without it the gates run the checkpoint on the HF backend).
    upstream_url = models.CharField(max_length=500, blank=True, default="")
    model = models.CharField(max_length=256, blank=True, default="")
    eval_version = models.ForeignKey(DatasetVersion, null=True, blank=True,
                                     on_delete=models.SET_NULL, related_name="+")
    stage = models.CharField(max_length=16, choices=Stage.choices, default=Stage.SHADOW_EVAL)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING,
                              db_index=True)
    reason = models.TextField(blank=True, default="")
    # trainer.evolution.Thresholds as used (snapshotted when the gates start).
    thresholds = models.JSONField(default=dict, blank=True)
    # What the gates compared with, and what a promote/rollback changed on the serving engine.
    baseline = models.JSONField(default=dict, blank=True)
    serving = models.JSONField(default=dict, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    task_id = models.CharField(max_length=64, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = TenantManager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at"], name="candidate_tenant_created")]

    def __str__(self) -> str:
        return f"candidate {self.pk} ({self.kind}, {self.stage}/{self.status})"

    @property
    def is_context(self) -> bool:
        return self.kind in self.CONTEXT_KINDS


class GateResult(models.Model):
    """One gate's stored verdict for a candidate. Append-only (a trigger refuses UPDATE): a
    re-run adds a row; the latest per gate counts."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    candidate = models.ForeignKey(Candidate, on_delete=models.CASCADE,
                                  related_name="gate_results")
    gate = models.CharField(max_length=16, choices=Candidate.Stage.choices)
    passed = models.BooleanField()
    metrics = models.JSONField(default=dict, blank=True)
    thresholds = models.JSONField(default=dict, blank=True)
    reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        indexes = [models.Index(fields=["candidate", "gate", "-created_at"],
                                name="gateresult_candidate_gate")]


class UpdateKind(models.TextChoices):
    """The five governed updates of the ATDP paper, and no-op."""

    MEMORY = "memory", "Memory insertion"
    SKILL = "skill", "Skill patch"
    HARNESS = "harness", "Harness edit"
    TOOL_SCHEMA = "tool_schema", "Tool-schema change"
    WEIGHTS = "weights", "Weight update"
    NO_OP = "no_op", "No-op"


class FailureCluster(models.Model):
    """Low-reward trajectories of one tenant grouped by (agent, tool, error signature);
    agent null with `agents` listing several: a cross-agent cluster."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=64)  # sha256 of agent|tool|signature
    agent = models.ForeignKey("governance.Agent", null=True, blank=True,
                              on_delete=models.CASCADE, related_name="+")
    agents = models.JSONField(default=list, blank=True)  # agent names
    tool = models.CharField(max_length=200, blank=True, default="")
    signature = models.CharField(max_length=32)
    size = models.PositiveIntegerField(default=0)
    mean_reward = models.FloatField(default=0.0)
    sample = models.JSONField(default=list, blank=True)  # member trajectory ids (<= 10)
    first_seen = models.DateTimeField(auto_now_add=True)
    last_seen = models.DateTimeField(auto_now=True)

    objects = TenantManager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "key"],
                                               name="failurecluster_tenant_key")]


class Proposal(models.Model):
    """The governed update proposed for a failure cluster (trainer.evolution.propose_kind),
    with its evidence. Accepting one creates a Candidate (through the gates like any other)."""

    class Status(models.TextChoices):
        OPEN = "open", "Open"
        ACCEPTED = "accepted", "Accepted"
        DISMISSED = "dismissed", "Dismissed"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    cluster = models.ForeignKey(FailureCluster, on_delete=models.CASCADE,
                                related_name="proposals")
    kind = models.CharField(max_length=16, choices=UpdateKind.choices)
    rationale = models.TextField()
    evidence = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OPEN,
                              db_index=True)
    candidate = models.ForeignKey(Candidate, null=True, blank=True, on_delete=models.SET_NULL,
                                  related_name="proposals")
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cluster"], condition=models.Q(
            status="open"), name="proposal_one_open_per_cluster")]
