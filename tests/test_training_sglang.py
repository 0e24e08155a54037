"""A training job whose config selects the SGLang rollout backend: the Celery task's code path
samples from the (fake) SGLang server and pushes every step's weights to it with a version."""

from __future__ import annotations

import pytest

from governance.services import ServiceError
from tests.test_rollout import fake_sglang, tiny  # noqa: F401 - fixtures
from tests.test_training_jobs import TINY, make_version, var_dir  # noqa: F401 - fixture
from trainer import services
from trainer.models import TrainingJob
from trainer.tasks import run_training_job


def test_a_job_rolls_out_on_sglang_when_its_config_says_so(tenant, people, var_dir,  # noqa: F811
                                                           fake_sglang):  # noqa: F811
    users, _ = people
    fake, url = fake_sglang()
    version, _ = make_version(tenant, people)
    job = services.launch_training_job(
        users["steward"], tenant, version,
        config={**TINY, "rollout_backend": "sglang", "rollout_url": url})
    assert run_training_job(job.pk) == "completed"
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.COMPLETED and job.step == TINY["total_steps"]
    generates = [body for path, body in fake.calls if path == "/generate"]
    assert len(generates) == TINY["total_steps"]
    assert all(body["return_logprob"] for body in generates)
    pushed = [body["weight_version"] for path, body in fake.calls
              if path == "/update_weights_from_disk"]
    assert pushed == ["0", "1", "2", "3"]  # the start weights, then one push per step
    assert job.config["rollout_backend"] == "sglang"
    assert job.checkpoints.get(step=TINY["total_steps"]).manifest["config"][
        "rollout_backend"] == "sglang"


def test_sglang_without_a_server_is_refused_at_launch(tenant, people, var_dir,  # noqa: F811
                                                      settings):
    users, _ = people
    settings.STEWARD_SGLANG_URL = ""
    version, _ = make_version(tenant, people)
    with pytest.raises(ServiceError, match="STEWARD_SGLANG_URL"):
        services.launch_training_job(users["steward"], tenant, version,
                                     config={**TINY, "rollout_backend": "sglang"})
    with pytest.raises(ServiceError, match="rollout_backend must be one of"):
        services.launch_training_job(users["steward"], tenant, version,
                                     config={**TINY, "rollout_backend": "vllm"})
