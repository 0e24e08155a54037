from django.apps import AppConfig


class EvolutionConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "evolution"
    verbose_name = "Steward evolution control plane"

    def ready(self) -> None:
        # The services enqueue their Celery tasks through this table instead of importing
        # evolution.tasks, which imports the services (no module cycle).
        from evolution import services, tasks

        services.ENQUEUE.update(run_gates=tasks.run_gates.delay,
                                push_candidate_weights=tasks.push_candidate_weights.delay)
