"""DRF serializers of the REST API (governance/api.py). Tenant never comes from a body: views
pass `request.tenant` to the services."""

from __future__ import annotations

import math

from rest_framework import serializers

from governance.models import Reward, Trajectory


class TrajectorySummarySerializer(serializers.ModelSerializer):
    agent = serializers.SerializerMethodField()

    class Meta:
        model = Trajectory
        fields = ["id", "agent", "session_id", "source", "started_at", "last_step_at",
                  "step_count", "consent"]
        read_only_fields = fields

    def get_agent(self, obj: Trajectory) -> dict:
        return {"id": obj.agent_id, "name": obj.agent.name}


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
    response_id = serializers.CharField(required=False, allow_blank=True, max_length=256,
                                        default="")
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
