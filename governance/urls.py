from django.contrib.auth import views as auth_views
from django.urls import path

from governance import views

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="console/login.html",
                                               redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("tenant/switch/", views.switch_tenant, name="switch-tenant"),
    path("", views.overview, name="overview"),
    path("trajectories/", views.trajectory_list, name="trajectories"),
    path("trajectories/<uuid:trajectory_id>/", views.trajectory_detail, name="trajectory"),
]
