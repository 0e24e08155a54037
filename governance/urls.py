"""Console URLs. Each area of the console lives in its own module under governance/views/
(and trainer/views.py) and is listed here; DESIGN.md fixes the top-level paths."""

from django.contrib.auth import views as auth_views
from django.urls import path

from governance.login_throttle import LoginForm
from governance.views import (
    approvals,
    audit,
    datasets,
    erasure,
    keys,
    overview,
    rewards,
    tenant_settings,
    trajectories,
)

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="console/login.html",
                                               authentication_form=LoginForm,
                                               redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("tenant/switch/", overview.switch_tenant, name="switch-tenant"),
    path("", overview.overview, name="overview"),
    path("trajectories/", trajectories.trajectory_list, name="trajectories"),
    path("trajectories/<uuid:trajectory_id>/", trajectories.trajectory_detail, name="trajectory"),
    path("trajectories/<uuid:trajectory_id>/steps/<uuid:step_id>/raw/",
         trajectories.trajectory_raw, name="trajectory-raw"),
    path("rewards/unmatched/", rewards.unmatched_reward_list, name="unmatched-rewards"),
    path("datasets/", datasets.dataset_list, name="datasets"),
    path("datasets/preview/", datasets.dataset_preview, name="dataset-preview"),
    path("datasets/<int:dataset_id>/", datasets.dataset_detail, name="dataset"),
    path("datasets/<int:dataset_id>/count/", datasets.dataset_count, name="dataset-count"),
    path("datasets/<int:dataset_id>/freeze/", datasets.dataset_freeze, name="dataset-freeze"),
    path("datasets/versions/<int:version_id>/", datasets.version_detail,
         name="dataset-version"),
    path("datasets/versions/<int:version_id>/request-approval/",
         datasets.version_request_approval, name="dataset-version-request-approval"),
    path("approvals/", approvals.approval_list, name="approvals"),
    path("approvals/<int:version_id>/", approvals.approval_detail, name="approval"),
    path("approvals/<int:version_id>/decide/", approvals.approval_decide,
         name="approval-decide"),
    path("erasure/", erasure.erasure_list, name="erasure"),
    path("erasure/<int:request_id>/", erasure.erasure_detail, name="erasure-request"),
    path("erasure/<int:request_id>/certificate.json", erasure.erasure_certificate,
         name="erasure-certificate"),
    path("audit/", audit.audit_log, name="audit"),
    path("audit/verify/", audit.audit_verify, name="audit-verify-chain"),
    path("keys/", keys.key_list, name="keys"),
    path("keys/<int:key_id>/revoke/", keys.key_revoke, name="key-revoke"),
    path("keys/api-tokens/", keys.token_create, name="api-token-create"),
    path("keys/api-tokens/<int:token_id>/revoke/", keys.token_revoke, name="api-token-revoke"),
    path("settings/", tenant_settings.settings_page, name="settings"),
    path("settings/retention/", tenant_settings.retention_set, name="settings-retention"),
    path("settings/retention/<int:policy_id>/delete/", tenant_settings.retention_delete,
         name="settings-retention-delete"),
    path("settings/sanitizer/", tenant_settings.sanitizer_set, name="settings-sanitizer"),
    path("settings/sanitizer/changes/<int:change_id>/decide/",
         tenant_settings.sanitizer_change_decide, name="settings-sanitizer-change-decide"),
]
