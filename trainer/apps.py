from django.apps import AppConfig


class TrainerConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "trainer"
    verbose_name = "Steward trainer"

    def ready(self) -> None:
        # Erasure reaches the checkpoints trained on erased data through the participant
        # registry (governance imports nothing of the trainer).
        from governance.erasure import register_erasure_participant
        from trainer.services import mark_checkpoints_tainted

        register_erasure_participant("checkpoints_tainted", mark_checkpoints_tainted)
