"""The evolution control plane's data (issue 7): context updates and canary routes (the
proxy reads them; evolution/canary.py changes them), candidates on their way through the five
gates with each gate's stored verdict, the tenant's gate thresholds, failure clusters and the
proposals made for them (evolution/gates.py decides, evolution/services.py records).

The models came from governance/models.py and trainer/models.py: each keeps its table
(`db_table`), since the row-level security policies, the NOTIFY triggers the proxy listens to
and the SECURITY DEFINER functions name the tables (migration 0001 moved them in Django's
state only).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from governance.models import Agent, DatasetVersion, Tenant, TenantManager
from trainer.models import Checkpoint


class ContextUpdate(models.Model):
    """A versioned change the proxy makes to one agent's requests (issue 7): a snippet added to
    the system prompt (`{"snippet": "..."}`) or tool definitions replaced by name
    (`{"tools": {"<function name>": {<description/parameters>}}}`). A draft does nothing; in
    `canary` it applies to the candidate arm of its PolicyRoute only; `active` applies to all
    of the agent's traffic (one active update per kind). Changed only through
    evolution/canary.py; the proxy reads canary/active ones through a SECURITY DEFINER
    function (migration 0007) and records id/version/hash in each step's `versions`."""

    class Kind(models.TextChoices):
        SYSTEM_PROMPT = "system_prompt", "System prompt snippet"
        TOOL_SCHEMA = "tool_schema", "Tool schema rewrite"

    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        CANARY = "canary", "Canary"
        ACTIVE = "active", "Active"
        ROLLED_BACK = "rolled_back", "Rolled back"
        REJECTED = "rejected", "Rejected"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="context_updates")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="context_updates")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    content = models.JSONField(default=dict)
    version = models.PositiveIntegerField()  # increasing per tenant + agent
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.DRAFT,
                              db_index=True)
    content_hash = models.CharField(max_length=64)
    reason = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    activated_at = models.DateTimeField(null=True, blank=True)
    rolled_back_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantManager()

    class Meta:
        db_table = "governance_contextupdate"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "agent", "version"],
                                    name="contextupdate_agent_version"),
            # One active update per kind and agent: activating one supersedes the other.
            models.UniqueConstraint(fields=["tenant", "agent", "kind"],
                                    condition=models.Q(status="active"),
                                    name="contextupdate_one_active_per_kind"),
        ]


class PolicyRoute(models.Model):
    """A canary (issue 7): the proxy sends `share` of an agent's NEW sessions to the candidate
    (another upstream and/or model name, and/or a context update), sticky per session, and tags
    those trajectories (Trajectory.route / route_arm). evolution/canary.py compares the arms'
    late-bound rewards and promotes (all new sessions take the candidate) or rolls back (the
    proxy stops routing to it on the next request)."""

    class Status(models.TextChoices):
        CANARY = "canary", "Canary"
        PROMOTED = "promoted", "Promoted"
        ROLLED_BACK = "rolled_back", "Rolled back"
        STOPPED = "stopped", "Stopped"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="policy_routes")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="policy_routes")
    candidate_ref = models.CharField(max_length=200, blank=True, default="")
    candidate_upstream_url = models.CharField(max_length=500, blank=True, default="")
    candidate_model = models.CharField(max_length=256, blank=True, default="")
    context_update = models.ForeignKey(ContextUpdate, null=True, blank=True,
                                       on_delete=models.PROTECT, related_name="routes")
    share = models.FloatField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.CANARY,
                              db_index=True)
    min_sessions_per_arm = models.PositiveIntegerField(default=30)
    max_error_rate_increase = models.FloatField(default=0.05)
    decision_reason = models.TextField(blank=True, default="")
    decided_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantManager()

    class Meta:
        db_table = "governance_policyroute"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "agent"],
                                    condition=models.Q(status__in=["canary", "promoted"]),
                                    name="policyroute_one_live_per_agent"),
            models.CheckConstraint(condition=models.Q(share__gte=0) & models.Q(share__lte=1),
                                   name="policyroute_share_range"),
        ]


class EvolutionPolicy(models.Model):
    """A tenant's gate thresholds. Absent (or a field left empty): evolution.gates.Thresholds'
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

    class Meta:
        db_table = "trainer_evolutionpolicy"


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
        # transaction (evolution.tasks.push_candidate_weights), which then records
        # the outcome: promoting -> promoted | push_failed; rolling_back -> rolled_back, or
        # back to promoted when the previous weights could not be restored.
        PROMOTING = "promoting", "Promoting (pushing weights)"
        ROLLING_BACK = "rolling_back", "Rolling back (pushing weights)"
        PUSH_FAILED = "push_failed", "Promote failed (weights not pushed)"

    CONTEXT_KINDS = (Kind.MEMORY, Kind.SKILL, Kind.HARNESS, Kind.TOOL_SCHEMA)
    PUSHING = (Status.PROMOTING, Status.ROLLING_BACK)
    LIVE = (Status.PENDING, Status.RUNNING, Status.PASSED, *PUSHING)

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="candidates")
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT,
                              related_name="candidates")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    checkpoint = models.ForeignKey(Checkpoint, null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="candidates")
    context_update = models.ForeignKey(ContextUpdate, null=True, blank=True,
                                       on_delete=models.PROTECT, related_name="candidates")
    route = models.ForeignKey(PolicyRoute, null=True, blank=True,
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
    # evolution.gates.Thresholds as used (snapshotted when the gates start).
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
        db_table = "trainer_candidate"
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
        db_table = "trainer_gateresult"
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
    agent = models.ForeignKey(Agent, null=True, blank=True,
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
        db_table = "trainer_failurecluster"
        constraints = [models.UniqueConstraint(fields=["tenant", "key"],
                                               name="failurecluster_tenant_key")]


class Proposal(models.Model):
    """The governed update proposed for a failure cluster (evolution.gates.propose_kind),
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
        db_table = "trainer_proposal"
        constraints = [models.UniqueConstraint(fields=["cluster"], condition=models.Q(
            status="open"), name="proposal_one_open_per_cluster")]
