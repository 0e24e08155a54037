from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import DefaultRouter

from governance.api import (
    AtdpSchemaView,
    AuditEventViewSet,
    DatasetVersionViewSet,
    DatasetViewSet,
    ErasureRequestViewSet,
    RetentionPolicyViewSet,
    RewardViewSet,
    TrajectoryViewSet,
)

# /api/v1/... — other parts of the API register their viewsets on this router.
router = DefaultRouter()
router.register("trajectories", TrajectoryViewSet, basename="trajectory")
router.register("rewards", RewardViewSet, basename="reward")
router.register("datasets", DatasetViewSet, basename="dataset")
router.register("dataset-versions", DatasetVersionViewSet, basename="dataset-version")
router.register("retention-policies", RetentionPolicyViewSet, basename="retention-policy")
router.register("audit", AuditEventViewSet, basename="audit")
router.register("erasure-requests", ErasureRequestViewSet, basename="erasure-request")

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("v1/atdp/schema/", AtdpSchemaView.as_view(), name="atdp-schema"),
    path("v1/", include(router.urls)),
    path("v1/", include("trainer.api_urls")),  # training-jobs, checkpoints, exports
]
