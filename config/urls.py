from django.urls import include, path

urlpatterns = [
    path("api/", include("governance.api_urls")),
    path("", include("trainer.urls")),
    path("", include("evolution.urls")),
    path("", include("governance.urls")),
]
