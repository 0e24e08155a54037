from django.apps import AppConfig


class EvolutionConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "evolution"
    verbose_name = "Steward evolution control plane"
