"""REST API under /api/v1/ (token-authenticated; see governance/auth.py).

Tenant scoping lives in ONE place: `TenantScopedViewSet.get_queryset`, which every viewset
inherits and none may override (enforced when the class is created). Subclasses declare `model`
and may narrow the scoped queryset in `scope_queryset`. So another tenant's object is simply not
in the queryset: its id answers 404 and lists never show it. Writes take the tenant from the
authenticated token, never from the body.

Roles: every action needs one permission of the table in governance/permissions.py
(`required_permission` on the class, `action_permissions` per standard action, or
`@action(required_permission=...)`); `HasTenantPermission` refuses an action without one.
Rules that must hold whatever the caller (four eyes) live in the services: a ServiceForbidden
answers 403, a ServiceConflict 409, any other ServiceError 400 — always with its message.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, ClassVar

from django.db.models import Model, QuerySet
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, PermissionDenied, ValidationError
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from governance.audit import verify_full_chain, verify_new_events
from governance.capture.atdp import (
    atdp_schema,
    trajectory_document,
    trajectory_rewards,
    with_capture_status,
)
from governance.models import (
    AuditEvent,
    Dataset,
    DatasetVersion,
    ErasureRequest,
    RetentionPolicy,
    Reward,
    Step,
    Trajectory,
)
from governance.permissions import HasTenantPermission
from governance.serializers import (
    AuditEventSerializer,
    AuditFilterSerializer,
    AuditVerifyQuerySerializer,
    AuditVerifySerializer,
    DatasetPreviewSerializer,
    DatasetSerializer,
    DatasetVersionDetailSerializer,
    DatasetVersionFilterSerializer,
    DatasetVersionSerializer,
    DecisionSerializer,
    EffectiveRetentionSerializer,
    RetentionPolicySerializer,
    RewardFilterSerializer,
    RewardSerializer,
    TrajectoryFilterSerializer,
    TrajectorySummarySerializer,
)
from governance.services import (
    ServiceConflict,
    ServiceError,
    ServiceForbidden,
    ServiceGone,
    approve_version,
    create_dataset,
    delete_retention_policy,
    freeze_dataset_version,
    preview_dataset_count,
    read_raw_payload,
    record_reward,
    reject_version,
    request_approval,
    set_retention_policy,
)


class ApiTokenScheme(OpenApiAuthenticationExtension):
    """OpenAPI security scheme of governance.auth.ApiTokenAuthentication."""

    target_class = "governance.auth.ApiTokenAuthentication"
    name = "ApiToken"

    def get_security_definition(self, auto_schema: Any) -> dict:
        return {"type": "http", "scheme": "bearer", "bearerFormat": "stwt_...",
                "description": "A REST token from `manage.py create_api_token`."}


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The object is not in a state that allows this."
    default_code = "conflict"


class Gone(APIException):
    status_code = status.HTTP_410_GONE
    default_detail = "The data is destroyed for good."
    default_code = "gone"


def call_service(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a service function, turning its refusals into DRF errors carrying the message."""
    try:
        return fn(*args, **kwargs)
    except ServiceForbidden as exc:
        raise PermissionDenied(str(exc)) from exc
    except ServiceConflict as exc:
        raise Conflict(str(exc)) from exc
    except ServiceGone as exc:
        raise Gone(str(exc)) from exc
    except ServiceError as exc:
        raise ValidationError({"non_field_errors": [str(exc)]}) from exc


class TenantScopedViewSet(viewsets.GenericViewSet):
    """Base of every tenant-data viewset. Declare `model` and the permission(s) its actions
    need; optionally override `scope_queryset(qs)` to filter, annotate or select_related.
    `get_queryset` is final."""

    model: ClassVar[type[Model]]
    permission_classes = [permissions.IsAuthenticated, HasTenantPermission]
    # See governance/permissions.py; None: refused (fail closed).
    required_permission: ClassVar[str | None] = None
    action_permissions: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "get_queryset" in cls.__dict__ or "queryset" in cls.__dict__:
            raise TypeError(f"{cls.__name__}: tenant scoping is done by TenantScopedViewSet."
                            "get_queryset; override scope_queryset() instead")

    def get_queryset(self) -> QuerySet:
        tenant = getattr(self.request, "tenant", None)
        if tenant is None:  # schema generation, or an unauthenticated request being rejected
            # Outside any tenant scope the scoped manager refuses to build a queryset; an empty
            # one from the plain manager reads nothing and tells drf-spectacular the model.
            return self.model._base_manager.none()
        return self.scope_queryset(self.model.objects.for_tenant(tenant))

    def scope_queryset(self, qs: QuerySet) -> QuerySet:
        return qs

    def perform_create(self, serializer: Any) -> None:
        serializer.save(tenant=self.request.tenant)


class StartedAtCursorPagination(CursorPagination):
    ordering = ("-started_at", "-id")
    page_size_query_param = "page_size"
    max_page_size = 500


class CreatedAtCursorPagination(CursorPagination):
    ordering = ("-created_at", "-id")
    page_size_query_param = "page_size"
    max_page_size = 500


TRAJECTORY_FILTERS = [
    OpenApiParameter("agent", str, description="agent name, or its numeric id"),
    OpenApiParameter("session", str, description="X-Steward-Session value"),
    OpenApiParameter("since", OpenApiTypes.DATETIME, description="started at or after"),
    OpenApiParameter("until", OpenApiTypes.DATETIME, description="started before"),
]


@extend_schema(tags=["trajectories"])
class TrajectoryViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantScopedViewSet):
    """Captured trajectories. The list gives summaries (newest first, cursor-paginated); the
    detail is the full ATDP v1 document."""

    model = Trajectory
    serializer_class = TrajectorySummarySerializer
    pagination_class = StartedAtCursorPagination
    required_permission = "read_trajectories"
    lookup_value_regex = "[0-9a-fA-F-]{32,36}"

    def scope_queryset(self, qs: QuerySet) -> QuerySet:
        qs = qs.select_related("agent", "tenant")
        if self.action != "list":
            return qs
        qs = with_capture_status(qs, self.request.tenant)
        params = TrajectoryFilterSerializer(data=self.request.query_params)
        params.is_valid(raise_exception=True)
        f = params.validated_data
        if "agent" in f:
            qs = qs.filter(agent_id=int(f["agent"])) if f["agent"].isdigit() \
                else qs.filter(agent__name=f["agent"])
        if "session" in f:
            qs = qs.filter(session_id=f["session"])
        if "since" in f:
            qs = qs.filter(started_at__gte=f["since"])
        if "until" in f:
            qs = qs.filter(started_at__lt=f["until"])
        return qs

    @extend_schema(parameters=TRAJECTORY_FILTERS)
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    @extend_schema(parameters=[OpenApiParameter(
        "form", str, enum=["full", "compact"], required=False,
        description="`compact`: each step's history as `history` {parent_step, kept, appended} "
                    "instead of in its observation (the schema's optional compact form); "
                    "default `full`.")],
        responses={200: OpenApiResponse(
            response=OpenApiTypes.OBJECT,
            description="The ATDP v1 trajectory document (JSON Schema: /api/v1/atdp/schema/).")})
    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        form = request.query_params.get("form", "full")
        if form not in ("full", "compact"):
            raise ValidationError({"form": [f"unknown form {form!r}; use full or compact"]})
        return Response(trajectory_document(self.get_object(), compact=form == "compact"))

    @extend_schema(responses={200: OpenApiResponse(
        response={"type": "array", "items": {"type": "object", "additionalProperties": {}}},
        description="The rewards joined onto this trajectory "
        "(by trajectory id or by the response id of any of its steps), oldest first.")})
    @action(detail=True, methods=["get"], pagination_class=None)
    def rewards(self, request: Request, pk: Any = None) -> Response:
        return Response(trajectory_rewards(self.get_object()))

    @extend_schema(
        parameters=[OpenApiParameter("reason", str, required=True,
                                     description="Why the raw payload is read (audited as a "
                                     "hash: the audit chain stays pseudonymous).")],
        responses={
            200: OpenApiResponse(response=OpenApiTypes.OBJECT, description=(
                "The raw, unsanitized exchange behind a step: request and response headers "
                "and exact bodies (base64, and as text when UTF-8). Compliance only; every "
                "read writes the audit event `raw.read`.")),
            400: OpenApiResponse(description="No reason given."),
            410: OpenApiResponse(description="Destroyed for good: the raw retention ended "
                                 "(ciphertext destroyed) or the subject was erased (data key "
                                 "destroyed). The sanitized step remains."),
        })
    @action(detail=True, methods=["get"], pagination_class=None,
            url_path=r"steps/(?P<step_id>[0-9a-fA-F-]{32,36})/raw",
            required_permission="read_raw_payloads")
    def raw(self, request: Request, pk: Any = None, step_id: str = "") -> Response:
        reason = (request.query_params.get("reason") or "").strip()
        if not reason:
            raise ValidationError({"reason": ["Required: say why the raw payload is read "
                                              "(the read is audited)."]})
        if len(reason) > 2000:
            raise ValidationError({"reason": ["At most 2000 characters."]})
        trajectory = self.get_object()
        try:
            step_uuid = uuid.UUID(step_id)
        except ValueError:
            raise NotFound("No such step in this trajectory.") from None
        step = (Step.objects.for_tenant(request.tenant)
                .filter(trajectory=trajectory, pk=step_uuid).first())
        if step is None:
            raise NotFound("No such step in this trajectory.")
        raw = call_service(read_raw_payload, request.user, step, reason)
        response = Response(raw_payload_document(raw))
        response["Cache-Control"] = "no-store"  # unsanitized: never kept by a cache
        return response


def _body_parts(value: Any) -> dict[str, Any]:
    if not isinstance(value, str):
        return {"body_base64": None, "body_text": None}
    data = base64.b64decode(value)
    try:
        text: str | None = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return {"body_base64": value, "body_text": text}


def raw_payload_document(raw: Any) -> dict[str, Any]:
    ex, ia = raw.exchange, raw.interaction
    return {
        "step_id": str(raw.step.pk),
        "trajectory_id": str(raw.step.trajectory_id),
        "interaction_id": ia.pk,
        "endpoint": ia.endpoint,
        "method": ex.get("method"),
        "path": ex.get("path"),
        "captured_at": ia.started_at.isoformat(),
        "raw_expires_at": ia.raw_expires_at.isoformat() if ia.raw_expires_at else None,
        "request": {"headers": ex.get("request_headers") or [],
                    "is_json": bool(ex.get("request_is_json")),
                    **_body_parts(ex.get("request_body"))},
        "response": {"status": ex.get("response_status"),
                     "headers": ex.get("response_headers"),
                     "is_stream": bool(ex.get("is_stream")),
                     **_body_parts(ex.get("response_body"))},
        "error": ex.get("error"),
    }


REWARD_FILTERS = [
    OpenApiParameter("trajectory_id", OpenApiTypes.UUID),
    OpenApiParameter("response_id", str),
]


@extend_schema(tags=["rewards"])
class RewardViewSet(mixins.ListModelMixin, mixins.CreateModelMixin, mixins.RetrieveModelMixin,
                    TenantScopedViewSet):
    """Late-bound rewards (append-only). POST names exactly one of `response_id` (the
    upstream's response id, e.g. `chatcmpl-...`) or `trajectory_id`; it is accepted even when
    that capture has not arrived yet."""

    model = Reward
    serializer_class = RewardSerializer
    pagination_class = CreatedAtCursorPagination
    required_permission = "read_trajectories"
    action_permissions = {"create": "record_rewards"}

    def scope_queryset(self, qs: QuerySet) -> QuerySet:
        if self.action != "list":
            return qs
        params = RewardFilterSerializer(data=self.request.query_params)
        params.is_valid(raise_exception=True)
        f = params.validated_data
        if "trajectory_id" in f:
            qs = qs.filter(trajectory_id=f["trajectory_id"])
        if "response_id" in f:
            qs = qs.filter(response_id=f["response_id"])
        return qs

    @extend_schema(parameters=REWARD_FILTERS)
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    def perform_create(self, serializer: RewardSerializer) -> None:
        data = serializer.validated_data
        serializer.instance = call_service(
            record_reward, self.request.user, self.request.tenant, value=data["value"],
            response_id=data.get("response_id") or "",
            trajectory_id=data.get("trajectory_id"), name=data.get("name") or "reward",
            final=data.get("final", True), comment=data.get("comment") or "", source="api")


class AtdpSchemaView(APIView):
    """The ATDP v1 JSON Schema. Public: it describes the format, holds no tenant data."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(tags=["atdp"], responses={200: OpenApiResponse(
        response=OpenApiTypes.OBJECT, description="JSON Schema (draft 2020-12) of ATDP v1")})
    def get(self, request: Request) -> Response:
        return Response(atdp_schema(), status=status.HTTP_200_OK)


# --- datasets, versions, four-eyes approval -------------------------------------------------


@extend_schema(tags=["datasets"])
class DatasetViewSet(mixins.ListModelMixin, mixins.CreateModelMixin, mixins.RetrieveModelMixin,
                     TenantScopedViewSet):
    """Dataset definitions (filters over the tenant's trajectories). `preview` counts what a
    freeze would take now; `freeze` makes a new draft version (trajectory ids, content hash,
    review sample)."""

    model = Dataset
    serializer_class = DatasetSerializer
    pagination_class = CreatedAtCursorPagination
    required_permission = "read_datasets"
    action_permissions = {"create": "manage_datasets"}

    def perform_create(self, serializer: DatasetSerializer) -> None:
        serializer.instance = call_service(create_dataset, self.request.user,
                                           self.request.tenant, **serializer.validated_data)

    @extend_schema(request=None, responses={200: DatasetPreviewSerializer})
    @action(detail=True, methods=["get"], pagination_class=None)
    def preview(self, request: Request, pk: Any = None) -> Response:
        return Response({"count": preview_dataset_count(self.get_object())})

    @extend_schema(request=None, responses={201: DatasetVersionSerializer})
    @action(detail=True, methods=["post"], required_permission="manage_datasets")
    def freeze(self, request: Request, pk: Any = None) -> Response:
        version = call_service(freeze_dataset_version, request.user, self.get_object())
        return Response(DatasetVersionSerializer(version).data,
                        status=status.HTTP_201_CREATED)


DATASET_VERSION_FILTERS = [
    OpenApiParameter("dataset", int, description="dataset id"),
    OpenApiParameter("status", str, enum=DatasetVersion.Status.values),
]


@extend_schema(tags=["datasets"])
class DatasetVersionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin,
                            TenantScopedViewSet):
    """Frozen dataset versions. The detail carries the review sample. A steward requests
    approval; a compliance officer who neither froze nor requested it approves or rejects it
    with a reason (four eyes, enforced by the service)."""

    model = DatasetVersion
    serializer_class = DatasetVersionSerializer
    pagination_class = CreatedAtCursorPagination
    required_permission = "read_datasets"

    def get_serializer_class(self) -> type:
        if self.action == "retrieve":
            return DatasetVersionDetailSerializer
        return DatasetVersionSerializer

    def scope_queryset(self, qs: QuerySet) -> QuerySet:
        qs = qs.select_related("approval")
        if self.action != "list":
            return qs
        params = DatasetVersionFilterSerializer(data=self.request.query_params)
        params.is_valid(raise_exception=True)
        f = params.validated_data
        if "dataset" in f:
            qs = qs.filter(dataset_id=f["dataset"])
        if "status" in f:
            qs = qs.filter(status=f["status"])
        return qs

    @extend_schema(parameters=DATASET_VERSION_FILTERS)
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    def _respond(self, version: DatasetVersion) -> Response:
        version.refresh_from_db()
        return Response(DatasetVersionSerializer(version).data)

    @extend_schema(request=None, responses={200: DatasetVersionSerializer})
    @action(detail=True, methods=["post"], url_path="request-approval",
            required_permission="request_approval")
    def request_approval(self, request: Request, pk: Any = None) -> Response:
        return self._respond(call_service(request_approval, request.user, self.get_object()))

    @extend_schema(request=DecisionSerializer, responses={200: DatasetVersionSerializer})
    @action(detail=True, methods=["post"], required_permission="approve")
    def approve(self, request: Request, pk: Any = None) -> Response:
        body = DecisionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        version = self.get_object()
        call_service(approve_version, request.user, version, body.validated_data["reason"])
        return self._respond(version)

    @extend_schema(request=DecisionSerializer, responses={200: DatasetVersionSerializer})
    @action(detail=True, methods=["post"], required_permission="approve")
    def reject(self, request: Request, pk: Any = None) -> Response:
        body = DecisionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        version = self.get_object()
        call_service(reject_version, request.user, version, body.validated_data["reason"])
        return self._respond(version)


# --- retention ------------------------------------------------------------------------------


@extend_schema(tags=["retention"])
class RetentionPolicyViewSet(mixins.ListModelMixin, mixins.CreateModelMixin,
                             mixins.RetrieveModelMixin, mixins.UpdateModelMixin,
                             mixins.DestroyModelMixin, TenantScopedViewSet):
    """Retention per data classification ('*': the rest). `effective` shows what applies to
    each classification, defaults included. Audit retention is reported, never purged."""

    model = RetentionPolicy
    serializer_class = RetentionPolicySerializer
    pagination_class = None
    required_permission = "manage_retention"
    action_permissions = {"list": "read_retention", "retrieve": "read_retention",
                          "effective": "read_retention"}

    def scope_queryset(self, qs: QuerySet) -> QuerySet:
        return qs.order_by("classification")

    def perform_create(self, serializer: RetentionPolicySerializer) -> None:
        data = dict(serializer.validated_data)
        classification = data.pop("classification")
        if RetentionPolicy.objects.for_tenant(self.request.tenant).filter(
                classification=classification).exists():
            raise Conflict(f"a policy for {classification!r} exists; update it instead")
        serializer.instance = call_service(set_retention_policy, self.request.user,
                                           self.request.tenant, classification, **data)

    def perform_update(self, serializer: RetentionPolicySerializer) -> None:
        current = serializer.instance
        data = {f: serializer.validated_data.get(f, getattr(current, f))
                for f in ("steps_days", "raw_days", "findings_days", "audit_days")}
        serializer.instance = call_service(set_retention_policy, self.request.user,
                                           self.request.tenant, current.classification, **data)

    def perform_destroy(self, instance: RetentionPolicy) -> None:
        call_service(delete_retention_policy, self.request.user, instance)

    @extend_schema(responses={200: EffectiveRetentionSerializer(many=True)})
    @action(detail=False, methods=["get"])
    def effective(self, request: Request) -> Response:
        from dataclasses import asdict

        from governance.retention import effective_policies

        rows = [asdict(p) for p in effective_policies(request.tenant).values()]
        return Response(EffectiveRetentionSerializer(rows, many=True).data)


# --- audit ----------------------------------------------------------------------------------


class SeqCursorPagination(CursorPagination):
    ordering = ("-seq",)
    page_size_query_param = "page_size"
    max_page_size = 500


AUDIT_FILTERS = [
    OpenApiParameter("action", str, description="exact action, or a prefix ending in '.'"),
    OpenApiParameter("actor", str, description="e.g. user:12, system:retention"),
    OpenApiParameter("object_type", str),
    OpenApiParameter("object_id", str),
    OpenApiParameter("since", OpenApiTypes.DATETIME),
    OpenApiParameter("until", OpenApiTypes.DATETIME),
]


@extend_schema(tags=["audit"])
class AuditEventViewSet(mixins.ListModelMixin, TenantScopedViewSet):
    """The tenant's audit events, newest first (cursor-paginated). `verify` walks the whole
    hash chain (all tenants: one chain) and reports the first bad sequence number."""

    model = AuditEvent
    serializer_class = AuditEventSerializer
    pagination_class = SeqCursorPagination
    required_permission = "read_audit"

    def scope_queryset(self, qs: QuerySet) -> QuerySet:
        if self.action != "list":
            return qs
        params = AuditFilterSerializer(data=self.request.query_params)
        params.is_valid(raise_exception=True)
        f = params.validated_data
        if "action" in f:
            qs = (qs.filter(action__startswith=f["action"]) if f["action"].endswith(".")
                  else qs.filter(action=f["action"]))
        for field in ("actor", "object_type", "object_id"):
            if field in f:
                qs = qs.filter(**{field: f[field]})
        if "since" in f:
            qs = qs.filter(created_at__gte=f["since"])
        if "until" in f:
            qs = qs.filter(created_at__lt=f["until"])
        return qs

    @extend_schema(parameters=AUDIT_FILTERS)
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    @extend_schema(responses={200: AuditVerifySerializer}, parameters=[OpenApiParameter(
        "full", OpenApiTypes.BOOL, description="walk the whole chain from its first event "
        "(slow on a large log); default: only the events since the last verification")])
    @action(detail=False, methods=["get"], pagination_class=None,
            required_permission="verify_audit")
    def verify(self, request: Request) -> Response:
        params = AuditVerifyQuerySerializer(data=request.query_params)
        params.is_valid(raise_exception=True)
        result = verify_full_chain() if params.validated_data["full"] else verify_new_events()
        # The chain is one over every tenant; the count is the caller's own events.
        return Response({"ok": result.ok,
                         "events": AuditEvent.objects.for_tenant(request.tenant).count(),
                         "first_bad_seq": result.first_bad_seq, "reason": result.reason,
                         "checked": result.checked, "from_seq": result.from_seq,
                         "full": result.full})


# --- GDPR Art. 17 erasure -------------------------------------------------------------------


class ErasureCreateSerializer(serializers.Serializer):
    """The data subject: the X-Steward-Subject value, an email, a phone number, a name or
    another identifier. Stored only as keyed hashes."""

    subject = serializers.CharField(max_length=512, trim_whitespace=True, allow_blank=False,
                                    write_only=True)


class ErasureRequestSerializer(serializers.ModelSerializer):
    """An erasure request; `certificate` is set once it completed (or its post-condition
    failed)."""

    class Meta:
        model = ErasureRequest
        fields = ["id", "status", "stage", "subject_hash", "progress", "created_at",
                  "started_at", "finished_at", "certificate", "error"]
        read_only_fields = fields


@extend_schema(tags=["erasure"])
class ErasureRequestViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin,
                            TenantScopedViewSet):
    """GDPR Art. 17 erasure requests. POST `{"subject": "..."}` answers 202 with the request's
    id; a request for the same subject still pending or running is returned instead of a new
    one. The job (governance/erasure.py) runs on Celery; GET shows its status and, when it is
    completed, its certificate."""

    model = ErasureRequest
    serializer_class = ErasureRequestSerializer
    pagination_class = CreatedAtCursorPagination
    required_permission = "erase"

    @extend_schema(request=ErasureCreateSerializer,
                   responses={202: ErasureRequestSerializer, 400: OpenApiResponse(
                       description="empty or oversized subject")})
    def create(self, request: Request) -> Response:
        from governance.erasure import ErasureError, request_erasure

        body = ErasureCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            req, _ = request_erasure(request.user, request.tenant,
                                     body.validated_data["subject"])
        except ErasureError as exc:
            raise ValidationError({"subject": [str(exc)]}) from exc
        return Response(ErasureRequestSerializer(req).data, status=status.HTTP_202_ACCEPTED)
