"""Console URLs of training (included by config/urls.py before governance's)."""

from django.urls import path

from trainer import evolution_views, views

urlpatterns = [
    path("training/", views.training, name="training"),
    path("training/<int:job_id>/", views.training_job, name="training-job"),
    path("training/<int:job_id>/cancel/", views.training_job_cancel, name="training-job-cancel"),
    path("training/<int:job_id>/resume/", views.training_job_resume, name="training-job-resume"),
    path("checkpoints/", views.checkpoints, name="checkpoints"),
    path("checkpoints/<int:checkpoint_id>/", views.checkpoint, name="checkpoint"),
    path("checkpoints/<int:checkpoint_id>/export/", views.checkpoint_export,
         name="checkpoint-export"),
    # The evolution control plane (issue 7; trainer/evolution_views.py).
    path("evolution/", evolution_views.evolution, name="evolution"),
    path("evolution/propose/", evolution_views.evolution_propose, name="evolution-propose"),
    path("evolution/failures/", evolution_views.evolution_find_failures,
         name="evolution-find-failures"),
    path("evolution/candidates/<int:candidate_id>/", evolution_views.candidate,
         name="candidate"),
    path("evolution/candidates/<int:candidate_id>/promote/", evolution_views.candidate_promote,
         name="candidate-promote"),
    path("evolution/candidates/<int:candidate_id>/rollback/",
         evolution_views.candidate_rollback, name="candidate-rollback"),
    path("evolution/proposals/<int:proposal_id>/accept/", evolution_views.proposal_accept,
         name="proposal-accept"),
    path("evolution/proposals/<int:proposal_id>/dismiss/", evolution_views.proposal_dismiss,
         name="proposal-dismiss"),
]
