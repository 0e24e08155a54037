"""Console URLs. Each area of the console lives in its own module under governance/views/
(and trainer/views.py) and is listed here; DESIGN.md fixes the top-level paths."""

from django.contrib.auth import views as auth_views
from django.urls import path

from governance.views import overview, trajectories

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="console/login.html",
                                               redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("tenant/switch/", overview.switch_tenant, name="switch-tenant"),
    path("", overview.overview, name="overview"),
    path("trajectories/", trajectories.trajectory_list, name="trajectories"),
    path("trajectories/<uuid:trajectory_id>/", trajectories.trajectory_detail, name="trajectory"),
]
