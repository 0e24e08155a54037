"""DRF serializers of the training API (trainer/api.py). The tenant never comes from a body."""

from __future__ import annotations

from rest_framework import serializers

from trainer.exports import FORMATS
from trainer.models import Checkpoint, TrainingJob, TrainingMetric


class TrainingMetricSerializer(serializers.ModelSerializer):
    class Meta:
        model = TrainingMetric
        fields = ["step", "reward_mean", "reward_std", "loss", "kl", "entropy", "clip_frac",
                  "grad_norm", "response_length_mean", "tokens_per_s", "step_s", "groups_kept",
                  "groups", "created_at"]
        read_only_fields = fields


class TrainingJobSerializer(serializers.ModelSerializer):
    progress = serializers.FloatField(read_only=True)

    class Meta:
        model = TrainingJob
        fields = ["id", "dataset_version", "status", "step", "total_steps", "progress",
                  "reward_fn", "reward_params", "reference_reward", "base_model", "config",
                  "last_metrics", "data_summary", "error", "attempts", "requested_by",
                  "created_at", "started_at", "heartbeat_at", "finished_at"]
        read_only_fields = fields


class TrainingJobDetailSerializer(TrainingJobSerializer):
    """A job with its per-step metrics (the console's curves) and its checkpoints."""

    metrics = serializers.SerializerMethodField()
    checkpoints = serializers.SerializerMethodField()

    class Meta(TrainingJobSerializer.Meta):
        fields = [*TrainingJobSerializer.Meta.fields, "metrics", "checkpoints"]
        read_only_fields = fields

    def get_metrics(self, obj: TrainingJob) -> list[dict]:
        rows = TrainingMetric.objects.for_tenant(obj.tenant_id).filter(job=obj).order_by("step")
        return TrainingMetricSerializer(rows, many=True).data

    def get_checkpoints(self, obj: TrainingJob) -> list[dict]:
        rows = Checkpoint.objects.for_tenant(obj.tenant_id).filter(job=obj).order_by("step")
        return CheckpointSerializer(rows, many=True).data


class TrainingJobCreateSerializer(serializers.Serializer):
    dataset_version = serializers.IntegerField(min_value=1)
    config = serializers.DictField(required=False, default=dict,
                                   help_text="GRPOConfig overrides (verl parameter names), e.g. "
                                             "{\"total_steps\": 50, \"lr\": 1e-6}")
    reward_fn = serializers.CharField(required=False, default="reference_answer", max_length=64)
    reward_params = serializers.DictField(required=False, default=dict)
    reference_reward = serializers.CharField(required=False, default="reference", max_length=64)
    base_model = serializers.CharField(required=False, default="tiny-qwen2", max_length=128,
                                       help_text="a model directory name under "
                                                 "STEWARD_VAR_DIR/models")


class ResumeSerializer(serializers.Serializer):
    total_steps = serializers.IntegerField(required=False, min_value=1, allow_null=True,
                                           default=None)


class CheckpointSerializer(serializers.ModelSerializer):
    class Meta:
        model = Checkpoint
        fields = ["id", "job", "step", "weight_version", "parent", "status", "tainted_reason",
                  "tainted_at", "manifest_sha256", "created_at"]
        read_only_fields = fields


class CheckpointDetailSerializer(CheckpointSerializer):
    class Meta(CheckpointSerializer.Meta):
        fields = [*CheckpointSerializer.Meta.fields, "path", "manifest"]
        read_only_fields = fields


class ExportQuerySerializer(serializers.Serializer):
    format = serializers.ChoiceField(choices=FORMATS)
    reference_reward = serializers.CharField(required=False, default="reference", max_length=64)
