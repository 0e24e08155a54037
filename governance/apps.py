from django.apps import AppConfig


class GovernanceConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "governance"
    verbose_name = "Steward governance"

    def ready(self) -> None:
        # Celery's autodiscovery imports only `tasks` modules: register the erasure tasks;
        # login_throttle connects the audit of console login lockouts (django-axes' signal).
        from governance import erasure, login_throttle  # noqa: F401

