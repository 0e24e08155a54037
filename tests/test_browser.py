"""The console in real headless Chromium (tests/browser.py), against the live server, with data
captured through the real proxy by the official openai client."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def capture_through_proxy_once(steward_proxy, proxy_key, text: str, **headers: str) -> list[str]:
    """One call through the proxy with the official openai client; returns its trajectory id."""
    import openai

    client = openai.OpenAI(base_url=steward_proxy.base_url, api_key=proxy_key.secret,
                           max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": text}],
        extra_headers=headers or None)
    return [raw.headers["x-steward-trajectory"]]


def ship_and_build(steward_proxy, count: int) -> None:
    """Ship the spool and build the steps the way the shipper and the Celery task do."""
    from governance.capture.shipper import ship_once
    from governance.tasks import build_steps
    from tests.live import master_key

    steward_proxy.wait_for_records(count)
    steward_proxy.stop()  # closes the segment so shipping takes it
    shipped: list[int] = []
    ship_once(steward_proxy.spool_dir, master_key=master_key(), enqueue=shipped.extend)
    assert len(shipped) == count
    build_steps(shipped)


def capture_through_proxy(steward_proxy, proxy_key, messages: list[str], **headers: str
                          ) -> list[str]:
    """Each message as one call through the proxy, then shipped and built. Trajectory ids."""
    ids = [tid for text in messages
           for tid in capture_through_proxy_once(steward_proxy, proxy_key, text, **headers)]
    ship_and_build(steward_proxy, len(messages))
    return ids


def test_login_and_read_a_trajectory_captured_through_the_proxy(
        console, steward_proxy, proxy_key, make_member):
    steward = make_member("steward", "sam-steward")
    [trajectory_id] = capture_through_proxy(
        steward_proxy, proxy_key, ["My email is jane.doe@example.com; where is my parcel?"])

    cp = console(steward)
    page = cp.page
    assert page.get_by_role("navigation", name="Main").get_by_role(
        "link", name="Trajectories").is_visible()
    cp.shot("overview")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Trajectories").click()
    page.wait_for_url("**/trajectories/**")
    row_link = page.locator(f"a[href='/trajectories/{trajectory_id}/']")
    assert row_link.count() == 1
    cp.shot("trajectories")
    row_link.click()
    page.wait_for_url(f"**/trajectories/{trajectory_id}/")
    body = page.locator("main").inner_text()
    assert "where is my parcel?" in body
    assert "jane.doe@example.com" not in body  # the steward reads the sanitized step only
    cp.shot("trajectory")
    cp.assert_clean()


# --- the whole journey, with a real Celery worker ---------------------------------------------

SUBJECT = "jane.roe@example.com"
SUMS = [(2, 3), (4, 1), (3, 3), (1, 6), (5, 2), (2, 2)]
STEPS = 150  # 0.06-0.4 s each here: long enough for the 2 s poll to show steps in between


@pytest.fixture
def worker_log(tmp_path, live_server):
    """A real Celery worker (queues capture + gpu) on the broker, against the test database
    under the app role (tests/live.py celery_worker). Yields its log path."""
    from tests.live import celery_worker

    log = tmp_path / "worker.log"
    with celery_worker("capture,gpu", log, "browser-test",
                       STEWARD_VAR_DIR=str(tmp_path / "var"),
                       STEWARD_SPOOL_DIR=str(tmp_path / "spool"),
                       STEWARD_ERASURE_SPOOL_WAIT_S="1"):
        yield log


def test_the_journey_capture_approve_train_erase(console, steward_proxy, proxy_key, make_member,
                                                 settings, tmp_path, worker_log):
    """Calls captured through the proxy -> the steward defines, freezes and submits a dataset
    and cannot decide it -> an officer approves -> the steward launches a GRPO job that a real
    worker runs while the progress bar moves -> the officer erases a data subject; the request
    completes, its certificate is readable, the checkpoint trained on that subject is tainted.
    Screenshots of every main page; no browser console error anywhere."""
    from governance import services as gov
    from governance.models import DatasetVersion, ErasureRequest
    from trainer.models import Checkpoint, TrainingJob

    settings.VAR_DIR = tmp_path / "var"  # the web process resolves models/outputs like the worker
    tenant = proxy_key.tenant
    steward = make_member("steward", "sam-steward")
    officer = make_member("compliance", "olivia-officer")
    admin = make_member("admin", "ada-admin")
    ids = []
    for i, (a, b) in enumerate(SUMS):
        headers = {"X-Steward-Session": f"sum-{i}"}
        if i == 0:
            headers["X-Steward-Subject"] = SUBJECT
        ids += capture_through_proxy_once(steward_proxy, proxy_key, f"What is {a}+{b}?",
                                          **headers)
    ship_and_build(steward_proxy, len(SUMS))
    for tid, (a, b) in zip(ids, SUMS, strict=True):  # late-bound ground truth, as over REST
        gov.record_reward("system:test", tenant, value=1.0, trajectory_id=tid,
                          name="reference", comment=str(a + b))

    # The steward: define, freeze, submit; the decision is not theirs.
    sam = console(steward)
    page = sam.page
    sam.go("/trajectories/")
    assert page.locator("a[href^='/trajectories/']").count() >= len(SUMS)
    sam.shot("journey-trajectories")
    sam.go("/datasets/")
    page.get_by_label("Name", exact=True).fill("sums")
    page.get_by_role("button", name="Define dataset").click()
    page.wait_for_url("**/datasets/*/")
    page.get_by_role("button", name="Freeze a new version").click()
    page.wait_for_url("**/datasets/versions/*/")
    page.get_by_role("button", name="Request approval").click()
    page.wait_for_url("**/datasets/versions/*/")
    version = DatasetVersion.objects.get(dataset__name="sums")
    assert version.size == len(SUMS)
    sam.go(f"/approvals/{version.pk}/")
    assert page.get_by_role("button", name="Approve").count() == 0
    assert "Read-only for your role" in page.locator("#decision").inner_text()
    assert "olivia-officer" in page.locator("#decision").inner_text()
    sam.shot("journey-approval-steward")

    # The officer approves with a reason.
    olivia = console(officer)
    olivia.go("/approvals/")
    olivia.shot("approvals")
    olivia.page.locator(f"a[href='/approvals/{version.pk}/']").first.click()
    olivia.page.wait_for_url(f"**/approvals/{version.pk}/")
    olivia.page.get_by_label("Reason").fill("sample read: sums only, no identifiers")
    olivia.shot("approval-review")
    olivia.page.get_by_role("button", name="Approve").click()
    olivia.page.wait_for_url(f"**/approvals/{version.pk}/")
    version.refresh_from_db()
    assert version.status == DatasetVersion.Status.APPROVED

    # The steward launches a job; the worker trains; the progress bar moves to the end.
    sam.go("/training/")
    page.get_by_label("Approved dataset version").select_option(str(version.pk))
    page.get_by_label("Total steps").fill(str(STEPS))
    page.get_by_label("Save every (steps)").fill(str(STEPS // 2))
    page.get_by_role("button", name="Launch job").click()
    page.wait_for_url("**/training/*/")
    job = TrainingJob.objects.get(dataset_version=version)
    bar = page.locator(f"#progress-{job.pk}")
    seen = {int(bar.get_attribute("value") or 0)}
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        page.wait_for_timeout(1000)
        seen.add(int(float(bar.get_attribute("value") or 0)))
        job.refresh_from_db()
        if job.status in TrainingJob.TERMINAL:
            break
    page.wait_for_timeout(2500)  # one more poll renders the final state
    assert job.status == TrainingJob.Status.COMPLETED, (job.status, job.error,
                                                        worker_log.read_text()[-3000:])
    assert int(float(bar.get_attribute("value"))) == STEPS
    # It moved while we watched: the live fragment showed steps between the first and the last.
    assert any(0 < v < STEPS for v in seen), seen
    sam.shot("training-job")
    checkpoint = Checkpoint.objects.get(job=job, step=STEPS)

    # The officer erases the subject; the worker completes it; the checkpoint is tainted.
    olivia.go("/erasure/")
    olivia.page.get_by_label("Data subject").fill(SUBJECT)
    olivia.page.locator("#erasure-confirm").check()
    olivia.page.get_by_role("button", name="File erasure request").click()
    olivia.page.wait_for_url("**/erasure/**")
    request = ErasureRequest.objects.latest("id")
    olivia.page.locator(f"a[href='/erasure/{request.pk}/']").first.click()
    olivia.page.locator(".certificate").wait_for(timeout=120_000)  # htmx polls until done
    text = olivia.page.locator("main").inner_text()
    assert SUBJECT not in olivia.page.content()
    olivia.shot("erasure-certificate")
    checkpoint.refresh_from_db()
    assert checkpoint.status == Checkpoint.Status.TAINTED, text
    version.refresh_from_db()
    assert version.status == DatasetVersion.Status.INVALIDATED
    olivia.go("/erasure/")
    olivia.shot("erasure")
    olivia.go("/audit/")
    olivia.shot("audit")

    sam.go(f"/checkpoints/{checkpoint.pk}/")
    assert "Tainted" in page.locator("main").inner_text()
    sam.shot("checkpoint-tainted")
    sam.go("/checkpoints/")
    sam.shot("checkpoints")
    sam.go("/")
    sam.shot("overview-journey")

    ada = console(admin)
    for path, name in (("/keys/", "keys"), ("/settings/", "settings"), ("/datasets/", "datasets"),
                       ("/training/", "training")):
        ada.go(path)
        ada.shot(name)
    for cp in (sam, olivia, ada):
        cp.assert_clean()


def test_error_pages_have_the_console_layout_and_say_why(console, make_member, tenant):
    """Issue 13.8: a 403 names the role and the permission it lacks, a 404 what was not
    found, both inside the console's layout (navigation, styles), not a bare error page."""
    import uuid

    auditor = make_member("auditor", "aud-errors")
    cp = console(auditor)
    page = cp.page
    response = page.goto(cp.base_url + "/keys/")
    assert response.status == 403
    nav = page.get_by_role("navigation", name="Main")
    assert nav.get_by_role("link", name="Audit").is_visible()
    reason = page.get_by_role("alert").inner_text()
    assert f"Your role in {tenant.name}, Auditor, may not do this" in reason
    assert "manage_keys" in reason
    # The stylesheet applies (a laid-out card, not the browser's default page).
    assert page.evaluate("() => getComputedStyle(document.querySelector('.card')).borderStyle"
                         ) == "solid"
    cp.shot("error-403")
    response = page.goto(cp.base_url + f"/trajectories/{uuid.uuid4()}/")
    assert response.status == 404
    assert "No such trajectory" in page.get_by_role("alert").inner_text()
    assert page.get_by_role("navigation", name="Main").is_visible()
    cp.shot("error-404")
    # Chromium logs the two error documents themselves as failed loads; nothing else may fail.
    expected = {"console: Failed to load resource: the server responded with a status of 403 "
                "(Forbidden)", "console: Failed to load resource: the server responded with a "
                "status of 404 (Not Found)"}
    assert set(cp.problems) == expected
    cp.problems = []
    cp.assert_clean()
