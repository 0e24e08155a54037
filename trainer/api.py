"""REST API of training under /api/v1/ (trainer/api_urls.py): training jobs, checkpoints and
dataset exports. Tenant scoping, permissions and error mapping are governance's
(TenantScopedViewSet, HasTenantPermission, call_service); the rules are in trainer/services.py.

Permissions: reading jobs and checkpoints (list, retrieve: progress, curves, lineage
manifests) needs `read_training` — compliance officers and auditors trace what a model learned
from. Acting (create, cancel, resume) and exports (dataset versions and checkpoints) need
`launch_training` — exporting a version is training on it elsewhere, so the same people pass
the same gate.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from django.db.models import QuerySet
from django.http import FileResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, permissions, status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from governance.api import CreatedAtCursorPagination, TenantScopedViewSet, call_service
from governance.models import DatasetVersion
from governance.permissions import HasTenantPermission
from trainer.exports import CONTENT_TYPES, EXTENSIONS, FORMATS
from trainer.models import Checkpoint, TrainingJob
from trainer.serializers import (
    CheckpointDetailSerializer,
    CheckpointSerializer,
    ExportQuerySerializer,
    ResumeSerializer,
    TrainingJobCreateSerializer,
    TrainingJobDetailSerializer,
    TrainingJobSerializer,
)
from trainer.services import (
    cancel_training_job,
    export_checkpoint,
    export_dataset_version,
    launch_training_job,
    resume_training_job,
)


def _file_response(write: Any, filename: str, content_type: str) -> FileResponse:
    """Run `write(path)` into a temp file, then stream it. The file is unlinked while open, so
    nothing is left behind whatever happens to the response; streaming reads only the file,
    never the database (the request's tenant transaction is over by then)."""
    fd, name = tempfile.mkstemp(prefix="steward-export-")
    os.close(fd)
    try:
        write(Path(name))
        handle = open(name, "rb")  # noqa: SIM115 - FileResponse closes it
    finally:
        Path(name).unlink(missing_ok=True)
    return FileResponse(handle, as_attachment=True, filename=filename, content_type=content_type)


class IgnoreFormatParameter(DefaultContentNegotiation):
    """`?format=` names the export format here, not a DRF renderer: errors render as JSON."""

    def select_renderer(self, request: Request, renderers: list, format_suffix: Any = None
                        ) -> tuple:
        return renderers[0], renderers[0].media_type


class DatasetVersionExportView(APIView):
    """`GET /api/v1/dataset-versions/{id}/export/?format=verl-rl|verl-sft|atdp-jsonl` — the
    file itself, for an approved, non-invalidated version only (409 otherwise); audited."""

    permission_classes = [permissions.IsAuthenticated, HasTenantPermission]
    required_permission = "launch_training"
    content_negotiation_class = IgnoreFormatParameter

    @extend_schema(
        tags=["datasets"],
        parameters=[OpenApiParameter("format", str, enum=list(FORMATS), required=True),
                    OpenApiParameter("reference_reward", str,
                                     description="reward name carrying the ground truth "
                                                 "(verl-rl; default 'reference')")],
        responses={200: OpenApiResponse(OpenApiTypes.BINARY, description="the export file"),
                   409: OpenApiResponse(description="the version is not approved, was "
                                                    "invalidated or changed")})
    def get(self, request: Request, pk: int) -> FileResponse:
        params = ExportQuerySerializer(data=request.query_params)
        params.is_valid(raise_exception=True)
        fmt = params.validated_data["format"]
        version = DatasetVersion.objects.for_tenant(request.tenant).filter(pk=pk).first()
        if version is None:
            raise NotFound()
        filename = f"dataset-version-{version.pk}-{fmt}.{EXTENSIONS[fmt]}"
        return _file_response(
            lambda path: call_service(export_dataset_version, request.user, version, fmt, path,
                                      reference_reward=params.validated_data["reference_reward"]),
            filename, CONTENT_TYPES[fmt])


@extend_schema(tags=["training"])
class TrainingJobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantScopedViewSet):
    """GRPO training jobs on approved dataset versions (queue `gpu`). The detail carries the
    progress, every step's metrics and the checkpoints."""

    model = TrainingJob
    serializer_class = TrainingJobSerializer
    pagination_class = CreatedAtCursorPagination
    required_permission = "read_training"
    action_permissions = {"create": "launch_training"}

    def get_serializer_class(self) -> type:
        return TrainingJobDetailSerializer if self.action == "retrieve" else TrainingJobSerializer

    def scope_queryset(self, qs: QuerySet) -> QuerySet:
        version = self.request.query_params.get("dataset_version")
        if self.action == "list" and version:
            if not version.isdigit():
                raise ValidationError({"dataset_version": ["must be an id"]})
            qs = qs.filter(dataset_version_id=int(version))
        return qs

    @extend_schema(request=TrainingJobCreateSerializer, responses={201: TrainingJobSerializer})
    def create(self, request: Request) -> Response:
        body = TrainingJobCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)
        version = (DatasetVersion.objects.for_tenant(request.tenant)
                   .filter(pk=data.pop("dataset_version")).first())
        if version is None:
            raise ValidationError({"dataset_version": ["unknown dataset version"]})
        job = call_service(launch_training_job, request.user, request.tenant, version, **data)
        return Response(TrainingJobSerializer(job).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: TrainingJobSerializer})
    @action(detail=True, methods=["post"], required_permission="launch_training")
    def cancel(self, request: Request, pk: Any = None) -> Response:
        job = call_service(cancel_training_job, request.user, self.get_object())
        return Response(TrainingJobSerializer(job).data)

    @extend_schema(request=ResumeSerializer, responses={200: TrainingJobSerializer})
    @action(detail=True, methods=["post"], required_permission="launch_training")
    def resume(self, request: Request, pk: Any = None) -> Response:
        body = ResumeSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        job = call_service(resume_training_job, request.user, self.get_object(),
                           total_steps=body.validated_data["total_steps"])
        return Response(TrainingJobSerializer(job).data)


@extend_schema(tags=["training"])
class CheckpointViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantScopedViewSet):
    """Checkpoints with their lineage manifests. `export` downloads one (a tar of weights,
    config, trainer state and manifest) — never a tainted one."""

    model = Checkpoint
    serializer_class = CheckpointSerializer
    pagination_class = CreatedAtCursorPagination
    required_permission = "read_training"

    def get_serializer_class(self) -> type:
        return CheckpointDetailSerializer if self.action == "retrieve" else CheckpointSerializer

    def scope_queryset(self, qs: QuerySet) -> QuerySet:
        job = self.request.query_params.get("job")
        if self.action == "list" and job:
            if not job.isdigit():
                raise ValidationError({"job": ["must be an id"]})
            qs = qs.filter(job_id=int(job))
        return qs

    @extend_schema(request=None,
                   responses={200: OpenApiResponse(OpenApiTypes.BINARY, description="a tar"),
                              403: OpenApiResponse(description="the checkpoint is tainted")})
    @action(detail=True, methods=["get"], required_permission="launch_training",
            pagination_class=None)
    def export(self, request: Request, pk: Any = None) -> FileResponse:
        ckpt = self.get_object()
        return _file_response(lambda path: call_service(export_checkpoint, request.user, ckpt,
                                                        path),
                              f"checkpoint-{ckpt.pk}.tar", "application/x-tar")
