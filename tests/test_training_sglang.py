"""A training job whose config selects the SGLang rollout backend: the Celery task's code path
samples from the (fake) SGLang server and pushes every step's weights to it with a version.
Its rollout_url names one of the operator's rollout engines, never a free URL and never an
engine that serves agents (issue 12, item 3)."""

from __future__ import annotations

import pytest

from governance.services import ServiceError
from tests.test_rollout import fake_sglang, tiny  # noqa: F401 - fixtures
from tests.test_training_jobs import TINY, make_version, var_dir  # noqa: F401 - fixture
from trainer import services
from trainer.models import TrainingJob
from trainer.tasks import run_training_job


def test_a_job_rolls_out_on_sglang_when_its_config_says_so(tenant, people, var_dir,  # noqa: F811
                                                           fake_sglang, settings):  # noqa: F811
    users, _ = people
    fake, url = fake_sglang()
    settings.STEWARD_ROLLOUT_ENGINES = f"train={url}"  # the operator's rollout engine
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
    settings.STEWARD_ROLLOUT_ENGINES = ""
    version, _ = make_version(tenant, people)
    with pytest.raises(ServiceError, match="STEWARD_ROLLOUT_ENGINES"):
        services.launch_training_job(users["steward"], tenant, version,
                                     config={**TINY, "rollout_backend": "sglang"})
    with pytest.raises(ServiceError, match="rollout_backend must be one of"):
        services.launch_training_job(users["steward"], tenant, version,
                                     config={**TINY, "rollout_backend": "vllm"})


# --- rollout_url is the operator's, never a free URL (issue 12, item 3) ---------------------


@pytest.fixture
def engines(settings, fake_sglang):  # noqa: F811
    """A rollout engine `train` and the production engine `prod` (STEWARD_SGLANG_URL), both
    fake SGLang servers recording every call."""
    train, train_url = fake_sglang()
    prod, prod_url = fake_sglang()
    settings.STEWARD_ROLLOUT_ENGINES = f"train={train_url}"
    settings.STEWARD_SGLANG_URL = prod_url
    return {"train": (train, train_url), "prod": (prod, prod_url)}


@pytest.mark.parametrize("rollout_url", [
    "http://attacker.example:30000", "http://169.254.169.254/latest/meta-data",
    "file:///etc/passwd", "gopher://127.0.0.1:6379/_x", "prod"])
def test_rest_refuses_a_rollout_url_that_is_not_a_rollout_engine(
        tenant, people, var_dir, engines, rollout_url):  # noqa: F811
    users, clients = people
    version, _ = make_version(tenant, people)
    url = engines["prod"][1] if rollout_url == "prod" else rollout_url
    body = {"dataset_version": version.pk,
            "config": {**TINY, "rollout_backend": "sglang", "rollout_url": url}}
    r = clients["steward"].post("/api/v1/training-jobs/", body, format="json")
    assert r.status_code == 400 and "rollout" in r.content.decode(), r.content
    assert not TrainingJob.objects.exists()
    # The hf backend does not take a rollout_url either.
    r = clients["steward"].post("/api/v1/training-jobs/", {
        **body, "config": {**TINY, "rollout_url": engines["train"][1]}}, format="json")
    assert r.status_code == 400 and not TrainingJob.objects.exists()
    # Members without launch_training and outsiders get nothing further.
    assert clients["auditor"].post("/api/v1/training-jobs/", body,
                                   format="json").status_code == 403
    assert clients["outsider"].post("/api/v1/training-jobs/", body,
                                    format="json").status_code == 400
    # The listed rollout engine, by name: stored as its URL.
    r = clients["steward"].post("/api/v1/training-jobs/", {
        **body, "config": {**TINY, "rollout_backend": "sglang", "rollout_url": "train"}},
        format="json")
    assert r.status_code == 201, r.content
    assert TrainingJob.objects.get().config["rollout_url"] == engines["train"][1]


def test_the_production_engine_cannot_be_a_rollout_engine(tenant, people, engines, settings,
                                                          var_dir):  # noqa: F811
    users, _ = people
    prod_url = engines["prod"][1]
    settings.STEWARD_ROLLOUT_ENGINES = f"prod={prod_url}"  # an operator's mistake
    version, _ = make_version(tenant, people)
    with pytest.raises(ServiceError, match="also serves agents"):
        services.launch_training_job(users["steward"], tenant, version,
                                     config={**TINY, "rollout_backend": "sglang"})
    assert not TrainingJob.objects.exists()


def test_a_stored_job_pointing_elsewhere_is_refused_before_any_request(
        tenant, people, var_dir, engines):  # noqa: F811
    """A job stored before the rule (or whose engine the operator removed or made a serving
    engine): the task refuses it without one request — no key sent, no weights pushed."""
    users, _ = people
    version, _ = make_version(tenant, people)
    (prod, prod_url), (train, _) = engines["prod"], engines["train"]
    for target in (prod_url, "http://127.0.0.1:9/internal"):
        job = services.launch_training_job(users["steward"], tenant, version,
                                           config={**TINY, "rollout_backend": "sglang"})
        TrainingJob.objects.filter(pk=job.pk).update(
            config={**job.config, "rollout_url": target})
        assert run_training_job(job.pk) == TrainingJob.Status.REFUSED
        job.refresh_from_db()
        assert job.error.startswith("refused: ") and "rollout" in job.error
    assert prod.calls == [] and train.calls == []


def test_a_rollout_error_does_not_store_what_the_server_answered(tenant, people, settings,
                                                                 var_dir):  # noqa: F811
    """The job's error (read by auditors, written into the audit chain) names the status,
    never the answer body."""
    from aiohttp import web

    from governance.models import AuditEvent
    from tests.live import serve_app

    async def internal(request: web.Request) -> web.Response:
        return web.Response(status=403, text="INTERNAL-ADMIN-PAGE secret=hunter2",
                            reason="Forbidden secret=hunter2")

    app = web.Application()
    app.router.add_post("/{tail:.*}", internal)
    url, stop = serve_app(app)
    try:
        settings.STEWARD_ROLLOUT_ENGINES = f"train={url}"
        users, _ = people
        version, _ = make_version(tenant, people)
        job = services.launch_training_job(users["steward"], tenant, version,
                                           config={**TINY, "rollout_backend": "sglang"})
        assert run_training_job(job.pk) == TrainingJob.Status.FAILED
    finally:
        stop()
    job.refresh_from_db()
    assert "HTTP 403" in job.error and "hunter2" not in job.error
    assert "INTERNAL-ADMIN-PAGE" not in job.error
    assert not any("hunter2" in str(e.payload) for e in AuditEvent.objects.all())
