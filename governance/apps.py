from django.apps import AppConfig


class GovernanceConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "governance"
    verbose_name = "Steward governance"

    def ready(self) -> None:
        # Celery's autodiscovery imports only `tasks` modules: register the erasure tasks.
        from governance import erasure  # noqa: F401

