"""Console URLs of the evolution control plane (included by config/urls.py)."""

from django.urls import path

from evolution import views

urlpatterns = [
    path("evolution/", views.evolution, name="evolution"),
    path("evolution/propose/", views.evolution_propose, name="evolution-propose"),
    path("evolution/failures/", views.evolution_find_failures,
         name="evolution-find-failures"),
    path("evolution/candidates/<int:candidate_id>/", views.candidate,
         name="candidate"),
    path("evolution/candidates/<int:candidate_id>/promote/", views.candidate_promote,
         name="candidate-promote"),
    path("evolution/candidates/<int:candidate_id>/rollback/",
         views.candidate_rollback, name="candidate-rollback"),
    path("evolution/proposals/<int:proposal_id>/accept/", views.proposal_accept,
         name="proposal-accept"),
    path("evolution/proposals/<int:proposal_id>/dismiss/", views.proposal_dismiss,
         name="proposal-dismiss"),
]
