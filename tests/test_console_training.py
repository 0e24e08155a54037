"""Console pages of training (trainer/views.py): the jobs with live progress and the launch
form, one job (live curves from TrainingMetric rows, cancel, resume), the checkpoints and one
checkpoint's lineage (export, refused when tainted). Every role of the tenant, an outsider
(another tenant's objects are 404), and the audit rows each action writes.

No real training runs here: jobs, metrics and checkpoints are written into the tables as the
trainer leaves them; a launch through the form is queued, and its Celery message is sent only
when the request's transaction commits — which a test transaction never does (the on-commit
callback is captured, not run)."""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from io import BytesIO

import pytest

from governance import services as gov
from governance.models import AuditEvent
from governance.tenancy import tenant_context
from tests.govdata import make_trajectory
from trainer.models import Checkpoint, TrainingJob, TrainingMetric
from trainer.views import training_summary

ROLES = ["admin", "steward", "compliance", "auditor"]
LAUNCHERS = {"admin", "steward"}
FORM = {"reward_fn": "exact_match", "reference_reward": "reference", "base_model": "tiny-qwen2",
        "total_steps": "7", "save_every": "3", "train_batch_size": "2", "group_size": "2",
        "lr": "2e-06", "seed": "5"}


@pytest.fixture
def var_dir(settings, tmp_path):
    settings.VAR_DIR = tmp_path / "var"
    return settings.VAR_DIR


def make_version(tenant, people, *, name: str = "sums", decide: str = "approve"):
    """A frozen version of two trajectories, taken to `decide`: draft | approve."""
    users, _ = people
    agent = gov.ensure_agent("system:test", tenant, f"bot-{name}")
    for _ in range(2):
        make_trajectory(tenant, agent, steps=1)
    ds = gov.create_dataset(users["steward"], tenant, name=name, agent_ids=[agent.pk])
    version = gov.freeze_dataset_version(users["steward"], ds)
    if decide == "approve":
        gov.request_approval(users["steward"], version)
        gov.approve_version(users["compliance"], version, "reviewed the sample")
    version.refresh_from_db()
    return version


def make_job(tenant, version, user, *, status: str = "running", step: int = 3,
             total: int = 5) -> TrainingJob:
    return TrainingJob.objects.create(
        tenant=tenant, dataset_version=version, requested_by=user, reward_fn="exact_match",
        base_model="tiny-qwen2", base_model_path="/nowhere/tiny", status=status, step=step,
        total_steps=total, config={"seed": 11, "total_steps": total, "save_every": 2},
        last_metrics={"step": step, "reward_mean": 0.625, "reward_std": 0.25, "loss": 0.0425},
        data_summary={"members": 2, "examples": 2, "tasks": 1,
                      "skipped": {"no reference": 1}})


# Distinct figures per step, so the payload check cannot pass by accident.
METRICS = [(1, 0.125, 0.5, 0.75, 0.001, 101.5), (2, 0.375, 0.25, 0.5, 0.002, 202.5),
           (3, 0.625, 0.125, 0.25, 0.004, 303.5)]


def add_metrics(job: TrainingJob) -> None:
    for step, mean, std, loss, kl, tps in METRICS:
        TrainingMetric.objects.create(tenant=job.tenant, job=job, step=step, reward_mean=mean,
                                      reward_std=std, loss=loss, kl=kl, tokens_per_s=tps)


def make_checkpoint(job: TrainingJob, step: int, *, parent=None, root=None, files=None,
                    status: str = "ok", reason: str = "") -> Checkpoint:
    version = job.dataset_version
    manifest = {
        "manifest_version": 1, "job": job.pk, "tenant": job.tenant_id,
        "dataset_version": {"id": version.pk, "dataset": version.dataset_id,
                            "number": version.number, "content_hash": version.content_hash,
                            "size": version.size},
        "trajectories_merkle_root": "ab" * 32, "approvals": [version.approval.pk],
        "sanitizer_versions": ["test-1"], "base_model": {"name": "tiny-qwen2", "path": "/x"},
        "reward": {"fn": "exact_match", "params": {}, "reference_reward": "reference"},
        "config": {"seed": 11, "total_steps": 5, "lr": 1e-6}, "seed": 11,
        "code_version": {"git": "v1.2-3-gdeadbee", "package": "0.1.0",
                         "trainer_sources_sha256": "cd" * 32},
        "step": step, "weight_version": str(step),
        "parent_checkpoint": ({"id": parent.pk, "step": parent.step,
                               "manifest_sha256": parent.manifest_sha256} if parent else None),
        "files": files or {"model/model.safetensors": "ef" * 32},
        "trainer_state_sha256": "12" * 32,
    }
    return Checkpoint.objects.create(
        tenant=job.tenant, job=job, step=step, path=str(root or f"/nowhere/step-{step}"),
        weight_version=str(step), parent=parent, manifest=manifest,
        manifest_sha256=hashlib.sha256(json.dumps(manifest).encode()).hexdigest(),
        status=status, tainted_reason=reason)


@pytest.fixture
def world(tenant, people, var_dir):
    """An approved version, a running job with metrics and two checkpoints (one tainted by an
    erasure request), a completed job."""
    users, _ = people
    version = make_version(tenant, people)
    job = make_job(tenant, version, users["steward"])
    add_metrics(job)
    first = make_checkpoint(job, 2)
    tainted = make_checkpoint(job, 3, parent=first, status="tainted",
                              reason="erasure request 7")
    done = make_job(tenant, version, users["admin"], status="completed", step=5)
    return {"version": version, "job": job, "done": done, "first": first, "tainted": tainted}


def login(client, people, who: str):
    users, _ = people
    client.force_login(users[who])
    return users[who]


def events(action: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=action).order_by("seq"))


def chart_payload(body: str, chart_id: str) -> dict:
    match = re.search(rf'<script id="{chart_id}" type="application/json">(.*?)</script>', body,
                      re.S)
    assert match, f"no json_script {chart_id}"
    return json.loads(match.group(1))


# --- access ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page", ["/training/", "/training/1/", "/checkpoints/",
                                  "/checkpoints/1/"])
def test_anonymous_is_sent_to_login(client, db, page):
    response = client.get(page)
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.parametrize("role", ROLES)
def test_every_role_sees_jobs_curves_and_lineage(client, people, world, role):
    login(client, people, role)
    job, version = world["job"], world["version"]

    body = client.get("/training/").content.decode()
    assert f'href="/training/{job.pk}/"' in body and f'href="/training/{world["done"].pk}/"' in body
    assert 'value="3"' in body and "3 / 5 steps" in body  # the progress bar
    assert "0.625" in body  # last reward mean
    launch_form = 'name="dataset_version"' in body
    assert launch_form == (role in LAUNCHERS)
    if role in LAUNCHERS:
        assert f'<option value="{version.pk}"' in body
    else:
        assert "may see training but not launch" in body and "Tenant admin" in body

    body = client.get(f"/training/{job.pk}/").content.decode()
    assert "chart-reward" in body and "no reference" in body
    assert (f'action="/training/{job.pk}/cancel/"' in body) == (role in LAUNCHERS)
    assert f'href="/checkpoints/{world["first"].pk}/"' in body

    body = client.get("/checkpoints/").content.decode()
    assert f'href="/checkpoints/{world["tainted"].pk}/"' in body and "Tainted" in body

    body = client.get(f"/checkpoints/{world['first'].pk}/").content.decode()
    assert "ab" * 32 in body  # the Merkle root
    assert (f'action="/checkpoints/{world["first"].pk}/export/"' in body) == \
        (role in LAUNCHERS)


def test_outsider_sees_nothing_of_the_tenant(client, people, world, other_tenant):
    login(client, people, "outsider")
    job, ckpt, version = world["job"], world["first"], world["version"]
    body = client.get("/training/").content.decode()
    assert f"/training/{job.pk}/" not in body and f'value="{version.pk}"' not in body
    assert "Nothing to train on yet" in body  # their own tenant has nothing
    assert f"/checkpoints/{ckpt.pk}/" not in client.get("/checkpoints/").content.decode()
    for url in (f"/training/{job.pk}/", f"/checkpoints/{ckpt.pk}/"):
        assert client.get(url).status_code == 404, url
    for url in (f"/training/{job.pk}/cancel/", f"/training/{job.pk}/resume/",
                f"/checkpoints/{ckpt.pk}/export/"):
        assert client.post(url).status_code == 404, url
    # A forged launch on the other tenant's approved version: unknown here.
    response = client.post("/training/", {**FORM, "dataset_version": version.pk})
    assert response.status_code == 400 and "unknown dataset version" in response.content.decode()
    assert TrainingJob.objects.count() == 2 and not events("training_job.launched")
    assert not events("training_job.cancel_requested") and not events("checkpoint.exported")
    job.refresh_from_db()
    assert job.status == "running"


def test_empty_state_explains_the_path_to_an_approved_version(client, people):
    login(client, people, "steward")
    response = client.get("/training/")
    body = response.content.decode()
    assert response.status_code == 200 and "Nothing to train on yet" in body
    for step in ("Define a dataset", "Freeze", "Request approval", "compliance officer"):
        assert step in body, step
    assert 'href="/datasets/"' in body and 'href="/approvals/"' in body
    assert 'name="dataset_version"' not in body and "No approved dataset version" in body
    body = client.get("/checkpoints/").content.decode()
    assert "No checkpoints yet" in body and 'href="/training/"' in body


# --- launching ------------------------------------------------------------------------------


def test_launch_through_the_form_queues_a_job(client, people, tenant, var_dir,
                                              django_capture_on_commit_callbacks):
    steward = login(client, people, "steward")
    version = make_version(tenant, people)
    make_version(tenant, people, name="drafty", decide="draft")
    body = client.get("/training/").content.decode()
    # Only the approved version is offered.
    assert re.findall(r'<option value="(\d+)"[^>]*>[^<]*trajectories', body) == [str(version.pk)]
    assert "exact_match" in body and "tiny-qwen2" in body  # registry + base models
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client.post("/training/", {**FORM, "dataset_version": version.pk})
    job = TrainingJob.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/training/{job.pk}/"
    assert len(callbacks) == 1  # the enqueue, sent when the request's transaction commits
    assert (job.status, job.total_steps, job.dataset_version_id, job.requested_by_id) == \
        ("queued", 7, version.pk, steward.pk)
    assert job.tenant_id == tenant.pk and job.reward_fn == "exact_match"
    assert {k: job.config[k] for k in ("total_steps", "save_every", "train_batch_size",
                                       "group_size", "lr", "seed")} == \
        {"total_steps": 7, "save_every": 3, "train_batch_size": 2, "group_size": 2,
         "lr": 2e-06, "seed": 5}
    (event,) = events("training_job.launched")
    assert event.object_id == str(job.pk) and event.payload["dataset_version"] == version.pk
    assert event.actor == f"user:{steward.pk}"
    page = client.get(response["Location"]).content.decode()
    assert f"Training job {job.pk} queued" in page and 'hx-trigger="every 2s"' in page


def test_a_forged_launch_on_an_unapproved_version_is_refused(client, people, tenant, var_dir):
    login(client, people, "steward")
    make_version(tenant, people)
    draft = make_version(tenant, people, name="drafty", decide="draft")
    response = client.post("/training/", {**FORM, "dataset_version": draft.pk})
    body = response.content.decode()
    assert response.status_code == 400
    assert "Not launched: refused" in body and "draft" in body
    assert 'value="7"' in body and 'value="2e-06"' in body  # the input is kept
    assert TrainingJob.objects.count() == 0 and not events("training_job.launched")
    # A field error is a message too, never a 500.
    response = client.post("/training/", {**FORM, "dataset_version": draft.pk,
                                          "total_steps": "0"})
    assert response.status_code == 400 and "Not launched" in response.content.decode()


@pytest.mark.parametrize("role", ["compliance", "auditor"])
def test_readers_cannot_launch(client, people, tenant, var_dir, role):
    login(client, people, role)
    version = make_version(tenant, people)
    response = client.post("/training/", {**FORM, "dataset_version": version.pk}, follow=True)
    assert "may not launch" in response.content.decode()
    assert TrainingJob.objects.count() == 0 and not events("training_job.launched")


# --- one job --------------------------------------------------------------------------------


def test_job_page_draws_the_curves_from_the_metric_rows(client, people, world):
    login(client, people, "auditor")
    job = world["job"]
    body = client.get(f"/training/{job.pk}/").content.decode()
    reward = chart_payload(body, "chart-reward")
    assert reward["labels"] == [1, 2, 3]
    assert reward["datasets"][0]["data"] == [m[1] for m in METRICS]
    assert reward["std"] == [m[2] for m in METRICS]
    assert reward["datasets"][1]["data"] == [m[1] + m[2] for m in METRICS]
    assert chart_payload(body, "chart-loss")["datasets"][0]["data"] == [m[3] for m in METRICS]
    assert chart_payload(body, "chart-kl")["datasets"][0]["data"] == [m[4] for m in METRICS]
    assert chart_payload(body, "chart-tokens")["datasets"][0]["data"] == [m[5] for m in METRICS]
    assert 'data-chart="chart-reward"' in body and 'class="chart"' in body
    # A diverged step is a gap in the curve, never a NaN that breaks JSON.parse.
    TrainingMetric.objects.create(tenant=job.tenant, job=job, step=4, reward_mean=0.5,
                                  reward_std=0.0, loss=float("nan"), kl=float("inf"))
    body = client.get(f"/training/{job.pk}/").content.decode()
    assert "NaN" not in body and "Infinity" not in body
    assert chart_payload(body, "chart-loss")["datasets"][0]["data"][3] is None
    assert chart_payload(body, "chart-kl")["datasets"][0]["data"][3] is None
    TrainingMetric.objects.filter(job=job, step=4).delete()

    # htmx polls the live fragment while the job runs: chart JSON included, no page chrome.
    live = client.get(f"/training/{job.pk}/", HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in live and live.lstrip().startswith('<div id="job-live"')
    assert 'hx-trigger="every 2s"' in live
    assert chart_payload(live, "chart-loss")["datasets"][0]["data"] == [m[3] for m in METRICS]
    # Finished: the fragment stops polling.
    TrainingJob.objects.filter(pk=job.pk).update(status="failed", error="RuntimeError: boom")
    live = client.get(f"/training/{job.pk}/", HTTP_HX_REQUEST="true").content.decode()
    assert "hx-trigger" not in live and "RuntimeError: boom" in live


def test_the_list_polls_only_while_a_job_is_active(client, people, world):
    login(client, people, "compliance")
    live = client.get("/training/", HTTP_HX_REQUEST="true").content.decode()
    assert live.lstrip().startswith('<section id="training-jobs"')
    assert 'hx-trigger="every 2s"' in live and "3 / 5 steps" in live
    TrainingJob.objects.filter(pk=world["job"].pk).update(status="completed", step=5)
    live = client.get("/training/", HTTP_HX_REQUEST="true").content.decode()
    assert "hx-trigger" not in live and "5 / 5 steps" in live


def test_cancel_and_resume_write_audit_rows(client, people, tenant, var_dir):
    users, _ = people
    version = make_version(tenant, people)
    from trainer.services import launch_training_job

    job = launch_training_job(users["steward"], tenant, version, config={"total_steps": 4})
    # Readers may not act.
    login(client, people, "compliance")
    assert client.post(f"/training/{job.pk}/cancel/").status_code == 403
    assert not events("training_job.cancel_requested")

    admin = login(client, people, "admin")
    response = client.post(f"/training/{job.pk}/cancel/", follow=True)
    assert f"Training job {job.pk} cancelled" in response.content.decode()
    job.refresh_from_db()
    assert job.status == "cancelled" and job.cancel_requested_by_id == admin.pk
    (event,) = events("training_job.cancel_requested")
    assert event.object_id == str(job.pk) and event.payload["now"] == "cancelled"
    assert event.actor == f"user:{admin.pk}"
    # Cancelling again is refused with the service's reason, not a 500.
    body = client.post(f"/training/{job.pk}/cancel/", follow=True).content.decode()
    assert "Not cancelled: job is cancelled" in body and len(events(
        "training_job.cancel_requested")) == 1

    body = client.post(f"/training/{job.pk}/resume/", {"total_steps": "12"},
                       follow=True).content.decode()
    assert f"Training job {job.pk} queued again" in body
    job.refresh_from_db()
    assert (job.status, job.total_steps) == ("queued", 12)
    (event,) = events("training_job.resumed")
    assert event.payload == {"was": "cancelled", "step": 0, "total_steps": 12}
    body = client.post(f"/training/{job.pk}/resume/", follow=True).content.decode()
    assert "Not resumed: job is queued" in body and len(events("training_job.resumed")) == 1
    assert client.get(f"/training/{job.pk}/resume/").status_code == 405


# --- checkpoints ------------------------------------------------------------------------------


def test_checkpoint_page_shows_the_lineage_with_links(client, people, world):
    login(client, people, "compliance")
    ckpt, first, version = world["tainted"], world["first"], world["version"]
    body = client.get(f"/checkpoints/{ckpt.pk}/").content.decode()
    assert f'href="/datasets/versions/{version.pk}/"' in body
    assert f'href="/approvals/{version.pk}/"' in body and f"approval {version.approval.pk}" in body
    assert f'href="/checkpoints/{first.pk}/"' in body  # the parent
    assert f'href="/training/{ckpt.job_id}/"' in body
    for text in ("ab" * 32, "ef" * 32, "model/model.safetensors", "test-1", "v1.2-3-gdeadbee",
                 "cd" * 32, version.content_hash, ckpt.manifest_sha256):
        assert text in body, text
    assert "none: trained from the base model" in client.get(
        f"/checkpoints/{first.pk}/").content.decode()


def test_a_tainted_checkpoint_is_marked_and_never_exported(client, people, world):
    login(client, people, "steward")
    ckpt = world["tainted"]
    body = client.get("/checkpoints/").content.decode()
    row = body[body.index(f'href="/checkpoints/{ckpt.pk}/"'):]
    row = row[:row.index("</tr>")]
    assert "Tainted" in row and "erasure request 7" in row
    assert "Tainted" not in body[body.index(f'href="/checkpoints/{world["first"].pk}/"'):][:400]
    filtered = client.get("/checkpoints/?status=tainted").content.decode()
    assert f"/checkpoints/{ckpt.pk}/" in filtered
    assert f'href="/checkpoints/{world["first"].pk}/"' not in filtered

    body = client.get(f"/checkpoints/{ckpt.pk}/").content.decode()
    assert "never exported, never promoted" in body and "erasure request 7" in body
    assert f'action="/checkpoints/{ckpt.pk}/export/"' not in body
    # A forged export request: refused by the service, shown as a message.
    response = client.post(f"/checkpoints/{ckpt.pk}/export/", follow=True)
    assert response.status_code == 200
    assert "Not exported" in response.content.decode() and "tainted" in response.content.decode()
    assert not events("checkpoint.exported")


def test_a_clean_checkpoint_exports_as_an_audited_tar(client, people, world, var_dir):
    job = world["job"]
    root = var_dir / "train" / f"tenant-{job.tenant_id}" / f"job-{job.pk}" / "step-4"
    (root / "model").mkdir(parents=True)
    weights = b"weights" * 100
    (root / "model" / "model.safetensors").write_bytes(weights)
    (root / "trainer_state.json").write_text("{}")
    (root / "manifest.json").write_text("{}")
    ckpt = make_checkpoint(job, 4, parent=world["first"], root=root,
                           files={"model/model.safetensors": hashlib.sha256(weights).hexdigest()})
    login(client, people, "auditor")
    assert client.post(f"/checkpoints/{ckpt.pk}/export/").status_code == 403
    steward = login(client, people, "steward")
    response = client.post(f"/checkpoints/{ckpt.pk}/export/")
    assert response.status_code == 200 and response["Content-Type"] == "application/x-tar"
    data = b"".join(response.streaming_content)
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == sorted(
            f"checkpoint-{ckpt.pk}/{n}" for n in ("model/model.safetensors",
                                                  "trainer_state.json", "manifest.json"))
    (event,) = events("checkpoint.exported")
    assert event.object_id == str(ckpt.pk)
    assert event.payload["sha256"] == hashlib.sha256(data).hexdigest()
    assert event.actor == f"user:{steward.pk}"
    # Files that no longer match the manifest: refused with the reason.
    (root / "model" / "model.safetensors").write_bytes(b"tampered")
    body = client.post(f"/checkpoints/{ckpt.pk}/export/", follow=True).content.decode()
    assert "does not match its manifest" in body and len(events("checkpoint.exported")) == 1


# --- performance and the overview's summary ---------------------------------------------------


def test_lists_run_a_fixed_number_of_queries(client, people, world):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    login(client, people, "admin")

    def queries(url: str) -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert client.get(url).status_code == 200
        return len(ctx.captured_queries)

    before = (queries("/training/"), queries("/checkpoints/"))
    users, _ = people
    for i in range(6):
        job = make_job(world["job"].tenant, world["version"], users["admin"], status="completed")
        make_checkpoint(job, 1, status="tainted" if i % 2 else "ok", reason="erasure request 9")
    assert (queries("/training/"), queries("/checkpoints/")) == before


def test_training_summary_for_the_overview(tenant, other_tenant, people, world):
    with tenant_context(tenant):
        summary = training_summary(tenant)
    assert summary["running"] == 1 and summary["queued"] == 0
    assert summary["latest"].pk == world["done"].pk
    with tenant_context(other_tenant):
        assert training_summary(other_tenant) == {"running": 0, "queued": 0, "latest": None}


def test_lists_are_paginated_by_fifty(client, people, world):
    users, _ = people
    TrainingJob.objects.bulk_create([
        TrainingJob(tenant=world["job"].tenant, dataset_version=world["version"],
                    reward_fn="exact_match", base_model="tiny-qwen2", base_model_path="/x",
                    status="completed", total_steps=1, step=1) for _ in range(50)])
    login(client, people, "auditor")
    first = client.get("/training/").content.decode()
    assert "Page 1 of 2 · 52 jobs" in first and 'href="?page=2"' in first
    second = client.get("/training/?page=2").content.decode()
    assert f'href="/training/{world["job"].pk}/"' in second  # the oldest two are on page 2
    assert f'href="/training/{world["job"].pk}/"' not in first


# --- in a real browser --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_browser_draws_the_curves_and_redraws_them_live(console, people, world):
    """Chart.js draws the four curves; htmx polls the live fragment every 2 s and charts.js
    redraws after each swap; a finished job stops polling."""
    users, _ = people
    job = world["job"]
    cp = console(users["auditor"])
    page = cp.page
    cp.go(f"/training/{job.pk}/")

    def labels(chart: str) -> int:
        return page.evaluate("id => { const c = Chart.getChart(document.querySelector("
                             "`canvas[data-chart=${id}]`)); return c ? c.data.labels.length "
                             ": -1 }", chart)

    page.wait_for_function("() => typeof Chart !== 'undefined' && Chart.getChart("
                           "document.querySelector('canvas[data-chart=chart-reward]'))")
    assert [labels(c) for c in ("chart-reward", "chart-loss", "chart-kl", "chart-tokens")] \
        == [3, 3, 3, 3]
    cp.shot("training-job")
    TrainingMetric.objects.create(tenant=job.tenant, job=job, step=4, reward_mean=0.75,
                                  reward_std=0.1, loss=0.2, kl=0.005, tokens_per_s=404.0)
    TrainingJob.objects.filter(pk=job.pk).update(step=4)
    page.wait_for_function("() => { const c = Chart.getChart(document.querySelector("
                           "'canvas[data-chart=chart-loss]')); return c && "
                           "c.data.labels.length === 4 }", timeout=10_000)
    assert "4 / 5 steps" in page.locator("#job-live").inner_text()
    TrainingJob.objects.filter(pk=job.pk).update(status="completed", step=5)
    page.wait_for_function("() => !document.querySelector('#job-live[hx-trigger]')",
                           timeout=10_000)
    # The charts of the final fragment are drawn when htmx settles it, just after the swap.
    page.wait_for_function("() => { const c = Chart.getChart(document.querySelector("
                           "'canvas[data-chart=chart-tokens]')); return c && "
                           "c.data.labels.length === 4 }", timeout=10_000)
    assert labels("chart-tokens") == 4
    cp.go("/training/")
    cp.shot("training")
    cp.go(f"/checkpoints/{world['tainted'].pk}/")
    cp.shot("checkpoint-tainted")
    cp.assert_clean()


# --- is anything listening on the gpu queue? (issue 13.2) -------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_page_says_when_no_worker_listens_on_the_gpu_queue(client, people, transactional_db,
                                                                tmp_path):
    """A real Celery worker on the gpu queue reports itself (governance/workers.py); the page
    warns before it starts, not while it runs, and again once it stopped. A worker on the
    capture queue only does not count."""
    import time

    from governance.models import WorkerHeartbeat
    from tests.live import celery_worker

    login(client, people, "steward")

    def warned() -> bool:
        response = client.get("/training/")
        assert response.status_code == 200
        return 'id="no-gpu-worker"' in response.content.decode()

    def wait_for(predicate, what: str, log) -> None:
        deadline = time.monotonic() + 120
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; worker log:\n"
                                     + log.read_text()[-3000:])
            time.sleep(0.3)

    assert warned()
    body = client.get("/training/").content.decode()
    assert "No worker listens on the gpu queue" in body and "stays" in body
    capture_log = tmp_path / "capture.log"
    with celery_worker("capture", capture_log, "capture-only"):
        wait_for(lambda: WorkerHeartbeat.objects.exists(), "the capture worker", capture_log)
        assert warned()  # it does not consume gpu
    log = tmp_path / "gpu.log"
    with celery_worker("gpu", log, "gpu-test"):
        wait_for(lambda: not warned(), "the gpu worker's heartbeat", log)
        row = WorkerHeartbeat.objects.get(queues__contains=["gpu"])
        assert row.hostname.startswith("gpu-test-")
    # A clean stop removes its row at once: warned again, no 30 s wait.
    assert not WorkerHeartbeat.objects.filter(queues__contains=["gpu"]).exists()
    assert warned()


def test_a_stale_heartbeat_is_not_a_listening_worker(db):
    from datetime import timedelta

    from django.utils import timezone

    from governance.models import WorkerHeartbeat
    from governance.workers import STALE_AFTER_SECONDS, workers_listening

    now = timezone.now()
    WorkerHeartbeat.objects.create(hostname="gpu@a", queues=["gpu"], started_at=now,
                                   seen_at=now - timedelta(seconds=STALE_AFTER_SECONDS + 1))
    WorkerHeartbeat.objects.create(hostname="gpu@b", queues=["gpu"], started_at=now,
                                   seen_at=now)
    WorkerHeartbeat.objects.create(hostname="steward@b", queues=["capture", "celery"],
                                   started_at=now, seen_at=now)
    assert workers_listening("gpu") == ["gpu@b"]
    assert workers_listening("capture") == ["steward@b"]


def test_a_queued_job_page_says_when_no_worker_listens(client, people, tenant):
    from django.utils import timezone

    from governance.models import WorkerHeartbeat

    users = login(client, people, "auditor") and people[0]
    version = make_version(tenant, people)
    queued = make_job(tenant, version, users["steward"], status="queued", step=0)
    done = make_job(tenant, version, users["steward"], status="completed")
    page = client.get(f"/training/{queued.pk}/").content.decode()
    assert 'id="no-gpu-worker"' in page and "No worker listens on the gpu queue" in page
    assert 'id="no-gpu-worker"' not in client.get(f"/training/{done.pk}/").content.decode()
    now = timezone.now()
    WorkerHeartbeat.objects.create(hostname="gpu@h", queues=["gpu"], started_at=now, seen_at=now)
    assert 'id="no-gpu-worker"' not in client.get(f"/training/{queued.pk}/").content.decode()
