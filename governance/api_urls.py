from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import DefaultRouter

from governance.api import AtdpSchemaView, RewardViewSet, TrajectoryViewSet

# /api/v1/... — other parts of the API register their viewsets on this router.
router = DefaultRouter()
router.register("trajectories", TrajectoryViewSet, basename="trajectory")
router.register("rewards", RewardViewSet, basename="reward")

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("v1/atdp/schema/", AtdpSchemaView.as_view(), name="atdp-schema"),
    path("v1/", include(router.urls)),
]
