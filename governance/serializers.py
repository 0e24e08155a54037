"""DRF serializers of the REST API (governance/api.py). Tenant never comes from a body: views
pass `request.tenant` to the services."""

from __future__ import annotations

import math
from typing import Literal

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from governance.capture.atdp import capture_status, with_capture_status
from governance.models import (
    Approval,
    AuditEvent,
    Classification,
    Dataset,
    DatasetVersion,
    RetentionPolicy,
    Reward,
    Trajectory,
)


class TrajectorySummarySerializer(serializers.ModelSerializer):
    agent = serializers.SerializerMethodField()
    status = serializers.SerializerMethodField(
        help_text="processing (a captured call is still waiting for its step), quarantined, "
        "or complete; step_count counts the calls captured, built or not")

    class Meta:
        model = Trajectory
        fields = ["id", "agent", "session_id", "source", "started_at", "last_step_at",
                  "step_count", "status", "consent"]
        read_only_fields = fields

    def get_agent(self, obj: Trajectory) -> dict:
        return {"id": obj.agent_id, "name": obj.agent.name}

    def get_status(self, obj: Trajectory) -> Literal["processing", "quarantined", "complete"]:
        # Annotated by the viewset (governance.capture.atdp.with_capture_status).
        return capture_status(obj.pending_calls, obj.quarantined_calls)


class TrajectoryFilterSerializer(serializers.Serializer):
    """Query parameters of `GET trajectories/`."""

    agent = serializers.CharField(required=False, max_length=128,
                                  help_text="agent name, or its numeric id")
    session = serializers.CharField(required=False, max_length=256,
                                    help_text="X-Steward-Session value")
    since = serializers.DateTimeField(required=False,
                                      help_text="started at or after (ISO 8601)")
    until = serializers.DateTimeField(required=False, help_text="started before (ISO 8601)")

    def validate(self, attrs: dict) -> dict:
        if "since" in attrs and "until" in attrs and attrs["since"] > attrs["until"]:
            raise serializers.ValidationError({"until": ["must not be before since"]})
        return attrs


class RewardSerializer(serializers.ModelSerializer):
    trajectory_id = serializers.UUIDField(required=False, allow_null=True, default=None)
    # Read back as null when the reward names a trajectory (to_representation); null is
    # accepted on input as "none" too, so the OpenAPI schema documents it as nullable.
    response_id = serializers.CharField(required=False, allow_blank=True, allow_null=True,
                                        max_length=256, default="")
    value = serializers.FloatField(help_text="a finite number")
    name = serializers.CharField(required=False, max_length=64, default="reward")
    final = serializers.BooleanField(required=False, default=True)
    comment = serializers.CharField(required=False, allow_blank=True, max_length=10_000,
                                    default="")

    class Meta:
        model = Reward
        fields = ["id", "trajectory_id", "response_id", "name", "value", "final", "comment",
                  "source", "created_at"]
        read_only_fields = ["id", "source", "created_at"]

    def validate_value(self, value: float) -> float:
        if not math.isfinite(value):
            raise serializers.ValidationError("must be a finite number (not NaN or infinity)")
        return value

    def validate(self, attrs: dict) -> dict:
        has_response = bool(attrs.get("response_id"))
        has_trajectory = attrs.get("trajectory_id") is not None
        if has_response and has_trajectory:
            msg = "give exactly one of response_id or trajectory_id, not both"
            raise serializers.ValidationError({"response_id": [msg], "trajectory_id": [msg]})
        if not has_response and not has_trajectory:
            msg = "one of response_id or trajectory_id is required"
            raise serializers.ValidationError({"response_id": [msg], "trajectory_id": [msg]})
        return attrs

    def to_representation(self, instance: Reward) -> dict:
        data = super().to_representation(instance)
        data["response_id"] = data["response_id"] or None
        return data


class RewardFilterSerializer(serializers.Serializer):
    """Query parameters of `GET rewards/`."""

    trajectory_id = serializers.UUIDField(required=False)
    response_id = serializers.CharField(required=False, max_length=256)


# --- datasets and approvals ----------------------------------------------------------------


class DatasetSerializer(serializers.ModelSerializer):
    """A dataset definition (a filter). Validation of the filter against the tenant (agents
    exist, bounds consistent) is done by services.create_dataset."""

    agent_ids = serializers.ListField(child=serializers.IntegerField(min_value=1),
                                      required=False, default=list, max_length=1000,
                                      help_text="agent ids of this tenant; empty: every agent")
    description = serializers.CharField(required=False, allow_blank=True, max_length=10_000,
                                        default="")
    reward_name = serializers.CharField(required=False, allow_blank=True, max_length=64,
                                        default="")
    reward_min = serializers.FloatField(required=False, allow_null=True, default=None)
    reward_max = serializers.FloatField(required=False, allow_null=True, default=None)
    since = serializers.DateTimeField(required=False, allow_null=True, default=None)
    until = serializers.DateTimeField(required=False, allow_null=True, default=None)

    class Meta:
        model = Dataset
        fields = ["id", "name", "description", "agent_ids", "since", "until", "reward_name",
                  "reward_min", "reward_max", "classification", "created_by", "created_at"]
        read_only_fields = ["id", "created_by", "created_at"]

    def validate_reward_min(self, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise serializers.ValidationError("must be a finite number")
        return value

    validate_reward_max = validate_reward_min


class DatasetPreviewSerializer(serializers.Serializer):
    count = serializers.IntegerField(help_text="trajectories a freeze would take now")


class ApprovalSerializer(serializers.ModelSerializer):
    class Meta:
        model = Approval
        fields = ["id", "decision", "decided_by", "reason", "decided_at"]
        read_only_fields = fields


class DatasetVersionSerializer(serializers.ModelSerializer):
    approval = serializers.SerializerMethodField()

    class Meta:
        model = DatasetVersion
        fields = ["id", "dataset", "number", "status", "filter", "content_hash", "size",
                  "step_count", "sample_ids", "created_by", "created_at", "requested_by",
                  "requested_at", "invalidated_at", "invalidated_reason", "approval"]
        read_only_fields = fields

    @extend_schema_field(ApprovalSerializer(allow_null=True))
    def get_approval(self, obj: DatasetVersion) -> dict | None:
        try:
            approval = obj.approval
        except Approval.DoesNotExist:
            return None
        return ApprovalSerializer(approval).data


class DatasetVersionDetailSerializer(DatasetVersionSerializer):
    """A version with its review sample: summaries of the sampled trajectories."""

    sample = serializers.SerializerMethodField()

    class Meta(DatasetVersionSerializer.Meta):
        fields = [*DatasetVersionSerializer.Meta.fields, "sample"]
        read_only_fields = fields

    @extend_schema_field(TrajectorySummarySerializer(many=True))
    def get_sample(self, obj: DatasetVersion) -> list:
        trajs = (Trajectory.objects.for_tenant(obj.tenant_id)
                 .filter(pk__in=obj.sample_ids).select_related("agent").order_by("pk"))
        return TrajectorySummarySerializer(with_capture_status(trajs, obj.tenant_id),
                                           many=True).data


class DatasetVersionFilterSerializer(serializers.Serializer):
    """Query parameters of `GET dataset-versions/`."""

    dataset = serializers.IntegerField(required=False, min_value=1)
    status = serializers.ChoiceField(required=False, choices=DatasetVersion.Status.choices)


class DecisionSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=5000, trim_whitespace=True,
                                   help_text="why (kept with the approval; the audit log "
                                   "holds its SHA-256)")


# --- retention -----------------------------------------------------------------------------


class RetentionPolicySerializer(serializers.ModelSerializer):
    classification = serializers.ChoiceField(
        choices=[RetentionPolicy.ANY, *Classification.values],
        help_text="'*' applies to every classification without a policy of its own")

    class Meta:
        model = RetentionPolicy
        fields = ["id", "classification", "steps_days", "raw_days", "findings_days",
                  "audit_days", "updated_by", "updated_at"]
        read_only_fields = ["id", "updated_by", "updated_at"]

    def validate_classification(self, value: str) -> str:
        if self.instance is not None and value != self.instance.classification:
            raise serializers.ValidationError("cannot change; create a policy for the other "
                                              "classification instead")
        return value


class EffectiveRetentionSerializer(serializers.Serializer):
    classification = serializers.CharField()
    steps_days = serializers.IntegerField()
    raw_days = serializers.IntegerField()
    findings_days = serializers.IntegerField()
    audit_days = serializers.IntegerField()
    source = serializers.CharField(help_text='"policy:<id>" or "default"')


# --- audit ---------------------------------------------------------------------------------


class AuditEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditEvent
        fields = ["seq", "actor", "action", "object_type", "object_id", "payload",
                  "created_at", "prev_hash", "hash"]
        read_only_fields = fields


class AuditFilterSerializer(serializers.Serializer):
    """Query parameters of `GET audit/`."""

    action = serializers.CharField(required=False, max_length=64,
                                   help_text="exact action, or a prefix ending in '.' "
                                   "(e.g. 'dataset_version.')")
    actor = serializers.CharField(required=False, max_length=150,
                                  help_text="e.g. user:12, system:retention")
    object_type = serializers.CharField(required=False, max_length=64)
    object_id = serializers.CharField(required=False, max_length=128)
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)


class AuditVerifyQuerySerializer(serializers.Serializer):
    full = serializers.BooleanField(required=False, default=False)


class AuditVerifySerializer(serializers.Serializer):
    ok = serializers.BooleanField()
    events = serializers.IntegerField(help_text="this tenant's events (the chain itself spans "
                                      "every tenant)")
    first_bad_seq = serializers.IntegerField(allow_null=True)
    reason = serializers.CharField()
    checked = serializers.IntegerField(help_text="events walked by this verification")
    from_seq = serializers.IntegerField(help_text="the first sequence number walked")
    full = serializers.BooleanField(help_text="walked from the first event (else from the "
                                    "last verified checkpoint)")
