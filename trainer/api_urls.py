"""/api/v1/ routes of training (included by governance/api_urls.py)."""

from django.urls import include, path
from rest_framework.routers import SimpleRouter

from trainer.api import CheckpointViewSet, DatasetVersionExportView, TrainingJobViewSet

router = SimpleRouter()
router.register("training-jobs", TrainingJobViewSet, basename="training-job")
router.register("checkpoints", CheckpointViewSet, basename="checkpoint")

urlpatterns = [
    path("dataset-versions/<int:pk>/export/", DatasetVersionExportView.as_view(),
         name="dataset-version-export"),
    path("", include(router.urls)),
]
