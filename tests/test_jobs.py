"""The one claim rule of long tasks (governance/jobs.py), on the three tasks that use it: a
redelivered message of a live run claims nothing and runs nothing; a retry of the same task id
or a stale heartbeat (the worker died) takes over; a finished row is never claimed again."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from governance import jobs
from governance.erasure import erase_subject, request_erasure
from governance.models import AuditEvent, ErasureRequest
from tests.test_training_jobs import TINY, make_version, var_dir  # noqa: F401 (fixture)
from trainer import services
from trainer.models import TrainingJob
from trainer.tasks import claim as claim_training_job

STALE = timedelta(seconds=120)


def _claim(req, task_id, *, is_retry=False):
    return jobs.claim(ErasureRequest, req.pk, req.tenant_id, task_id, waiting="pending",
                      is_retry=is_retry, stale_after=STALE)


def test_the_claim_rule(tenant, people):
    users, _ = people
    req, _ = request_erasure(users["compliance"], tenant, "jane.roe@example.com")
    assert _claim(req, "t1")
    # The same message delivered again while the run is alive (fresh heartbeat): nothing.
    assert not _claim(req, "t1")
    assert not _claim(req, "t2")
    # A Celery retry of the same task id (the attempt before raised Retry) resumes it; another
    # task id's retry does not.
    assert _claim(req, "t1", is_retry=True)
    assert not _claim(req, "t2", is_retry=True)
    # The heartbeat keeps it alive; once stale (the worker died), a redelivery takes over.
    ErasureRequest.objects.filter(pk=req.pk).update(heartbeat_at=timezone.now() - 2 * STALE)
    jobs.heartbeat(ErasureRequest, req.pk, tenant.pk)
    assert not _claim(req, "t3")
    ErasureRequest.objects.filter(pk=req.pk).update(heartbeat_at=timezone.now() - 2 * STALE)
    assert _claim(req, "t3")
    assert ErasureRequest.objects.get(pk=req.pk).task_id == "t3"
    ErasureRequest.objects.filter(pk=req.pk).update(status="completed",
                                                    heartbeat_at=timezone.now() - 2 * STALE)
    assert not _claim(req, "t4") and not _claim(req, "t3", is_retry=True)


def test_a_redelivered_erasure_message_does_not_start_a_second_run(tenant, people):
    users, _ = people
    req, _ = request_erasure(users["compliance"], tenant, "jane.roe@example.com")
    # A worker claimed it under the task id "" (eager call) and is running it now.
    assert _claim(req, "")
    started = AuditEvent.objects.filter(action__in=["erasure.started", "erasure.resumed"]).count()
    # acks_late delivers the same message again (same task id, not a retry): it runs nothing.
    assert erase_subject(req.pk, tenant.pk) == {"status": "running", "stage": req.stage}
    assert AuditEvent.objects.filter(
        action__in=["erasure.started", "erasure.resumed"]).count() == started


@pytest.mark.usefixtures("var_dir")
def test_a_redelivered_training_message_does_not_start_a_second_run(tenant, people):
    users, _ = people
    version, _ = make_version(tenant, people)
    job = services.launch_training_job(users["steward"], tenant, version, config=TINY)
    assert claim_training_job(job.pk, tenant.pk, "task-1", is_retry=False)
    assert not claim_training_job(job.pk, tenant.pk, "task-1", is_retry=False)
    assert TrainingJob.objects.get(pk=job.pk).attempts == 1
    assert claim_training_job(job.pk, tenant.pk, "task-1", is_retry=True)
    TrainingJob.objects.filter(pk=job.pk).update(
        heartbeat_at=timezone.now() - services.stale_after() - timedelta(seconds=5))
    assert claim_training_job(job.pk, tenant.pk, "task-2", is_retry=False)
    assert TrainingJob.objects.get(pk=job.pk).attempts == 3
