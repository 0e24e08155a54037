"""REST API under /api/v1/ (token-authenticated; see governance/auth.py).

Tenant scoping lives in ONE place: `TenantScopedViewSet.get_queryset`, which every viewset
inherits and none may override (enforced when the class is created). Subclasses declare `model`
and may narrow the scoped queryset in `scope_queryset`. So another tenant's object is simply not
in the queryset: its id answers 404 and lists never show it. Writes take the tenant from the
authenticated token, never from the body.

Roles: every member may read; rewards may be written by tenant admins and data stewards (an
auditor or compliance officer only reads).
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db.models import Model, QuerySet
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, permissions, status, viewsets
from rest_framework.decorators import action
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from governance.atdp import atdp_schema, trajectory_document, trajectory_rewards
from governance.models import Reward, Role, Trajectory
from governance.serializers import (
    RewardFilterSerializer,
    RewardSerializer,
    TrajectoryFilterSerializer,
    TrajectorySummarySerializer,
)
from governance.services import ServiceError, record_reward


class ApiTokenScheme(OpenApiAuthenticationExtension):
    """OpenAPI security scheme of governance.auth.ApiTokenAuthentication."""

    target_class = "governance.auth.ApiTokenAuthentication"
    name = "ApiToken"

    def get_security_definition(self, auto_schema: Any) -> dict:
        return {"type": "http", "scheme": "bearer", "bearerFormat": "stwt_...",
                "description": "A REST token from `manage.py create_api_token`."}


class IsTenantMember(permissions.BasePermission):
    """Authenticated through an API token, so `request.tenant` and `request.membership` are
    set; writes need one of the viewset's `write_roles`."""

    message = "Your role in this tenant may not do this."

    def has_permission(self, request: Request, view: Any) -> bool:
        if getattr(request, "tenant", None) is None or getattr(request, "membership", None) is None:
            return False
        if request.method in permissions.SAFE_METHODS:
            return True
        return request.membership.role in getattr(view, "write_roles", ())


class TenantScopedViewSet(viewsets.GenericViewSet):
    """Base of every tenant-data viewset. Declare `model`; optionally override
    `scope_queryset(qs)` to filter, annotate or select_related. `get_queryset` is final."""

    model: ClassVar[type[Model]]
    permission_classes = [permissions.IsAuthenticated, IsTenantMember]
    write_roles: ClassVar[tuple[str, ...]] = (Role.ADMIN,)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "get_queryset" in cls.__dict__ or "queryset" in cls.__dict__:
            raise TypeError(f"{cls.__name__}: tenant scoping is done by TenantScopedViewSet."
                            "get_queryset; override scope_queryset() instead")

    def get_queryset(self) -> QuerySet:
        tenant = getattr(self.request, "tenant", None)
        if tenant is None:  # schema generation, or an unauthenticated request being rejected
            return self.model.objects.none()
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
    lookup_value_regex = "[0-9a-fA-F-]{32,36}"

    def scope_queryset(self, qs: QuerySet) -> QuerySet:
        qs = qs.select_related("agent", "tenant")
        if self.action != "list":
            return qs
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

    @extend_schema(responses={200: OpenApiResponse(
        response=OpenApiTypes.OBJECT,
        description="The ATDP v1 trajectory document (JSON Schema: /api/v1/atdp/schema/).")})
    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response(trajectory_document(self.get_object()))

    @extend_schema(responses={200: OpenApiResponse(
        response=OpenApiTypes.OBJECT, description="The rewards joined onto this trajectory "
        "(by trajectory id or by the response id of any of its steps), oldest first.")})
    @action(detail=True, methods=["get"], pagination_class=None)
    def rewards(self, request: Request, pk: Any = None) -> Response:
        return Response(trajectory_rewards(self.get_object()))


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
    write_roles = (Role.ADMIN, Role.STEWARD)

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
        try:
            serializer.instance = record_reward(
                self.request.user, self.request.tenant, value=data["value"],
                response_id=data.get("response_id") or "",
                trajectory_id=data.get("trajectory_id"), name=data.get("name") or "reward",
                final=data.get("final", True), comment=data.get("comment") or "", source="api")
        except ServiceError as exc:
            from rest_framework.exceptions import ValidationError

            raise ValidationError({"non_field_errors": [str(exc)]}) from exc


class AtdpSchemaView(APIView):
    """The ATDP v1 JSON Schema. Public: it describes the format, holds no tenant data."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(tags=["atdp"], responses={200: OpenApiResponse(
        response=OpenApiTypes.OBJECT, description="JSON Schema (draft 2020-12) of ATDP v1")})
    def get(self, request: Request) -> Response:
        return Response(atdp_schema(), status=status.HTTP_200_OK)
