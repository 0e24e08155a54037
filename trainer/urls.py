"""Console URLs of training (included by config/urls.py before governance's)."""

from django.urls import path

from trainer import views

urlpatterns = [
    path("training/", views.training, name="training"),
    path("training/<int:job_id>/", views.training_job, name="training-job"),
    path("training/<int:job_id>/cancel/", views.training_job_cancel, name="training-job-cancel"),
    path("training/<int:job_id>/resume/", views.training_job_resume, name="training-job-resume"),
    path("checkpoints/", views.checkpoints, name="checkpoints"),
    path("checkpoints/<int:checkpoint_id>/", views.checkpoint, name="checkpoint"),
    path("checkpoints/<int:checkpoint_id>/export/", views.checkpoint_export,
         name="checkpoint-export"),
]
