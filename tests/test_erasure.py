"""GDPR Art. 17 erasure (governance/erasure.py): the REST contract, the job on real data built
by the real shipper and step builder (sanitizer included), resumption after a crash, tenant
scope, the suppression list, and end to end through the real proxy with the official openai
client and a real Celery worker on Redis, after which neither a pg_dump of the database nor the
var/ and spool directories contain the subject's email in clear."""

from __future__ import annotations

import base64
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from governance import services as gov
from governance.erasure import (
    SUPPRESSED_REASON,
    erase_subject,
    lookup_hashes,
    post_condition,
    request_erasure,
)
from governance.keyring import subject_hash
from governance.models import (
    AuditEvent,
    DataKey,
    DatasetVersion,
    ErasureRequest,
    Finding,
    Interaction,
    Reward,
    Step,
    SubjectIndex,
    SuppressedSubject,
    Trajectory,
)
from tests.govdata import make_trajectory
from tests.live import celery_worker
from tests.pipeline import chat_response, make_record, packed_values_text, ship_and_build

ROOT = Path(__file__).resolve().parent.parent
EMAIL = "jane.roe@example.com"
OTHER = "bob.stone@example.org"


@pytest.fixture
def agent(tenant):
    return gov.ensure_agent("system:test", tenant, "support-bot")


@pytest.fixture
def erasure_dirs(settings, tmp_path):
    settings.STEWARD_SPOOL_DIR = tmp_path / "spool"
    settings.VAR_DIR = tmp_path / "var"
    settings.STEWARD_ERASURE_SPOOL_WAIT_S = 2
    return settings


def _chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def _approved_version(people, tenant, name: str = "all"):
    users, _ = people
    ds = gov.create_dataset(users["steward"], tenant, name=name)
    version = gov.freeze_dataset_version(users["steward"], ds)
    gov.request_approval(users["steward"], version)
    gov.approve_version(users["compliance"], version, "reviewed")
    version.refresh_from_db()
    return ds, version


def _checkpoint(tenant, version, tmp_path):
    from trainer.models import Checkpoint, TrainingJob

    job = TrainingJob.objects.create(tenant=tenant, dataset_version=version, reward_fn="exact",
                                     base_model="tiny", base_model_path=str(tmp_path),
                                     status="completed")
    return Checkpoint.objects.create(tenant=tenant, job=job, step=1, path=str(tmp_path),
                                     weight_version="w1", manifest={}, manifest_sha256="0" * 64)


def _no_clear_subject_in_rows(*values: str) -> None:
    for payload in AuditEvent.objects.values_list("payload", flat=True):
        for v in values:
            assert v.lower() not in str(payload).lower()
    for row in ErasureRequest.objects.values():
        for v in values:
            assert v.lower() not in str(row).lower()


# --- REST contract ------------------------------------------------------------------------------


def test_rest_contract_roles_validation_and_idempotency(tenant, people, erasure_dirs):
    _, clients = people
    url = "/api/v1/erasure-requests/"
    r = clients["compliance"].post(url, {"subject": f"  {EMAIL.upper()} "}, format="json")
    assert r.status_code == 202, r.content
    body = r.json()
    assert body["status"] == "pending" and isinstance(body["id"], int)
    req = ErasureRequest.objects.get(pk=body["id"])
    assert req.subject_hash == subject_hash(tenant.pk, EMAIL)
    assert req.lookup_hashes == lookup_hashes(tenant.pk, EMAIL)
    assert "subject" not in body
    # Idempotent while pending; the admin may file too.
    r2 = clients["admin"].post(url, {"subject": EMAIL}, format="json")
    assert r2.status_code == 202 and r2.json()["id"] == body["id"]
    assert ErasureRequest.objects.count() == 1
    # Validation errors in DRF's shape.
    for bad in ({"subject": ""}, {"subject": "   "}, {"subject": "x" * 513}, {}):
        r = clients["compliance"].post(url, bad, format="json")
        assert r.status_code == 400 and "subject" in r.json(), (bad, r.content)
    # Roles without `erase`.
    for role in ("steward", "auditor"):
        assert clients[role].post(url, {"subject": EMAIL}, format="json").status_code == 403
        assert clients[role].get(url).status_code == 403
        assert clients[role].get(f"{url}{body['id']}/").status_code == 403
    # Another tenant's admin: not found, and not listed.
    assert clients["outsider"].get(f"{url}{body['id']}/").status_code == 404
    assert clients["outsider"].get(url).json()["results"] == []
    detail = clients["compliance"].get(f"{url}{body['id']}/").json()
    assert detail["status"] == "pending" and detail["certificate"] is None
    assert [x["id"] for x in clients["admin"].get(url).json()["results"]] == [body["id"]]
    _no_clear_subject_in_rows(EMAIL)
    assert AuditEvent.objects.filter(action="erasure.requested").count() == 1


# --- the job on real pipeline data --------------------------------------------------------------


def test_erasure_job_on_pipeline_data(tenant, other_tenant, agent, people, erasure_dirs,
                                      tmp_path):
    users, clients = people
    header = make_record(tenant.pk, agent.pk, subject="Jane.Roe@Example.com ",
                         session="s-jane", request=_chat("Hello, I need help with my loan."),
                         response=chat_response("Sure.", rid="chatcmpl-jane1"))
    text_only = make_record(tenant.pk, agent.pk,
                            request=_chat(f"Please write to {EMAIL} about the refund."),
                            response=chat_response("Noted.", rid="chatcmpl-jane2"))
    other = make_record(tenant.pk, agent.pk, subject=OTHER,
                        request=_chat(f"This is {OTHER}, any news?"),
                        response=chat_response("Not yet.", rid="chatcmpl-bob"))
    ship_and_build(tmp_path / "ship", [header, text_only, other])
    assert Step.objects.filter(tenant=tenant).count() == 3
    jane_ids = {header["trajectory_id"], text_only["trajectory_id"]}
    # The subject index knows the text-only trajectory by the email the sanitizer found.
    lookups = lookup_hashes(tenant.pk, EMAIL)
    assert SubjectIndex.objects.filter(trajectory_id=text_only["trajectory_id"],
                                       hashes__overlap=SubjectIndex.keys(lookups)).exists()
    # Same subject in another tenant: out of scope.
    foreign_agent = gov.ensure_agent("system:test", other_tenant, "bot")
    foreign = make_trajectory(other_tenant, foreign_agent,
                              subject_hash=subject_hash(other_tenant.pk, EMAIL))

    gov.record_reward("system:test", tenant, value=1.0, trajectory_id=header["trajectory_id"])
    gov.record_reward("system:test", tenant, value=0.5, response_id="chatcmpl-jane2")
    gov.record_reward("system:test", tenant, value=0.2, response_id="chatcmpl-bob")
    ds, approved = _approved_version(people, tenant)
    assert approved.size == 3
    draft = gov.freeze_dataset_version(users["steward"], ds)
    old_hash = draft.content_hash
    ckpt = _checkpoint(tenant, approved, tmp_path)
    from trainer.services import export_dataset_version

    export = erasure_dirs.VAR_DIR / "exports" / "v.jsonl"
    export_dataset_version(users["steward"], approved, "atdp-jsonl", export)
    assert export.exists()

    # Findings are packed per place (decision 37): the certificate counts findings, not rows.
    found = sum(f.total for f in Finding.objects.filter(step__trajectory_id__in=jane_ids))
    req, created = request_erasure(
        users["compliance"], tenant, EMAIL)
    assert created
    assert erase_subject(req.pk, tenant.pk) == {"status": "completed", "stage": "done"}
    req.refresh_from_db()
    assert req.status == "completed", req.error
    cert = req.certificate
    counts = cert["counts"]
    assert counts["trajectories"] == 2 and counts["steps"] == 2
    assert counts["interactions"] == 2 and counts["raw_payloads"] == 2
    assert counts["rewards"] == 2 and counts["findings"] == found >= 1
    assert counts["subject_index"] == 2  # the header row + the email found in the text
    assert counts["data_keys_destroyed"] == 1 and counts["exports_removed"] == 1
    assert counts["suppressed_hashes"] == len(lookups)
    assert cert["post_condition"] == {"clean": True, "remaining": {
        "trajectories": 0, "interactions": 0, "subject_index": 0, "live_data_keys": 0,
        "dead_letters": 0}}
    assert cert["dataset_versions_invalidated"] == [approved.pk]
    assert cert["dataset_versions_changed"] == [draft.pk]
    assert cert["checkpoints_tainted"] == [ckpt.pk]
    assert cert["subject_hash"] == subject_hash(tenant.pk, EMAIL)
    assert cert["sanitizer_version"] and cert["finished_at"] and cert["requested_at"]
    assert EMAIL not in str(cert).lower()

    assert not Trajectory.objects.filter(pk__in=jane_ids).exists()
    assert not Interaction.objects.filter(trajectory_id__in=jane_ids).exists()
    assert not Finding.objects.filter(tenant=tenant, step__trajectory_id__in=jane_ids).exists()
    assert list(Reward.objects.filter(tenant=tenant).values_list("response_id", flat=True)) \
        == ["chatcmpl-bob"]
    assert Trajectory.objects.filter(pk=other["trajectory_id"]).exists()
    assert Trajectory.objects.filter(pk=foreign.pk).exists()  # the other tenant is untouched
    approved.refresh_from_db()
    draft.refresh_from_db()
    assert approved.status == "invalidated"
    assert draft.status == "draft" and draft.size == 1 and draft.content_hash != old_hash
    assert draft.sample_ids == [other["trajectory_id"]]
    ckpt.refresh_from_db()
    assert ckpt.status == "tainted"
    assert not export.exists()
    key = DataKey.objects.get(tenant=tenant, subject_hash=subject_hash(tenant.pk, EMAIL))
    assert key.wrapped_key is None and key.destroyed_at is not None
    assert DataKey.objects.get(tenant=tenant, subject_hash=subject_hash(tenant.pk, OTHER)) \
        .wrapped_key is not None
    stages = set(AuditEvent.objects.filter(object_type="erasure_request")
                 .values_list("action", flat=True))
    assert {"erasure.requested", "erasure.started", "erasure.suppressed",
            "erasure.spool_checked", "erasure.batch_deleted", "erasure.exports_removed",
            "erasure.completed"} <= stages
    _no_clear_subject_in_rows(EMAIL)
    r = clients["compliance"].get(f"/api/v1/erasure-requests/{req.pk}/")
    assert r.json()["status"] == "completed" and r.json()["certificate"]["counts"] == counts

    # Later captures about the subject: metadata only (header or identifier in the text).
    again = [make_record(tenant.pk, agent.pk, subject=EMAIL, request=_chat("hi again"),
                         response=chat_response("hello")),
             make_record(tenant.pk, agent.pk, request=_chat(f"mail {EMAIL} please"),
                         response=chat_response("ok"))]
    ship_and_build(tmp_path / "ship2", again)
    for rec in again:
        ia = Interaction.objects.get(flow_id=rec["flow_id"])
        assert ia.state == "quarantined" and SUPPRESSED_REASON in ia.state_reason
        assert ia.raw_ciphertext is None and ia.data_key_id is None
        assert not Step.objects.filter(pk=rec["step_id"]).exists()
    assert not DataKey.objects.filter(tenant=tenant, wrapped_key__isnull=False,
                                      subject_hash__in=lookups).exists()

    # A second erasure of the same subject removes those leftovers, then finds nothing.
    req2, created = request_erasure(
        users["compliance"], tenant, EMAIL)
    assert created and req2.pk != req.pk
    erase_subject(req2.pk, tenant.pk)
    req2.refresh_from_db()
    assert req2.status == "completed"
    # The header one (its subject hash is kept as metadata); the text-only one carries no
    # link to the subject at all (no index row, no raw payload, no step).
    assert req2.certificate["counts"]["interactions"] == 1
    assert req2.certificate["counts"]["raw_payloads"] == 0
    req3, _ = request_erasure(
        users["compliance"], tenant, EMAIL)
    erase_subject(req3.pk, tenant.pk)
    req3.refresh_from_db()
    assert req3.status == "completed"
    assert not any(req3.certificate["counts"].values())
    assert req3.certificate["post_condition"]["clean"]
    # A finished request is not run again.
    assert erase_subject(req.pk, tenant.pk)["status"] == "completed"


def test_crash_mid_job_resumes_without_double_counting(tenant, agent, people, erasure_dirs,
                                                      monkeypatch):
    from governance import erasure

    users, _ = people
    h = subject_hash(tenant.pk, EMAIL)
    trajs = [make_trajectory(tenant, agent, steps=2, subject_hash=h) for _ in range(3)]
    keep = make_trajectory(tenant, agent, steps=1)
    monkeypatch.setattr(erasure, "BATCH_TRAJECTORIES", 1)
    real = erasure.PARTICIPANTS["checkpoints_tainted"]
    calls = {"n": 0}

    def crash_on_second_batch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OperationalError("simulated: the database went away")
        return real(*args, **kwargs)

    monkeypatch.setitem(erasure.PARTICIPANTS, "checkpoints_tainted", crash_on_second_batch)
    req, _ = erasure.request_erasure(users["compliance"], tenant, EMAIL)
    with pytest.raises(OperationalError):
        erase_subject(req.pk, tenant.pk)
    req.refresh_from_db()
    assert req.status == "running" and req.stage == "delete"
    assert req.progress["counts"]["trajectories"] == 1  # the first batch committed
    assert Trajectory.objects.filter(pk__in=[t.pk for t in trajs]).count() == 2
    # The worker died: once its heartbeat is stale, the redelivered message resumes at the batch
    # that failed (while it is fresh, a duplicate claims nothing: tests/test_jobs.py).
    ErasureRequest.objects.filter(pk=req.pk).update(
        heartbeat_at=timezone.now() - timedelta(seconds=erasure.HEARTBEAT_STALE_S + 1))
    assert erase_subject(req.pk, tenant.pk)["status"] == "completed"
    req.refresh_from_db()
    assert req.status == "completed" and req.attempts == 2
    assert req.certificate["counts"]["trajectories"] == 3
    assert req.certificate["counts"]["steps"] == 6
    assert req.certificate["counts"]["interactions"] == 6
    assert Trajectory.objects.filter(pk=keep.pk).exists()
    assert post_condition(tenant.pk, req.lookup_hashes) == {
        "trajectories": 0, "interactions": 0, "subject_index": 0, "live_data_keys": 0,
        "dead_letters": 0}
    assert AuditEvent.objects.filter(action="erasure.resumed", object_id=str(req.pk)).exists()
    assert SuppressedSubject.objects.filter(tenant=tenant).count() == len(req.lookup_hashes)


def test_lookup_hashes_cover_identifier_normalisations(tenant):
    from governance.sanitizer import normalize_identifier

    phone = "+1 (415) 555-0100"
    hashes = lookup_hashes(tenant.pk, phone)
    assert subject_hash(tenant.pk, normalize_identifier("PHONE_NUMBER", phone)) in hashes
    assert subject_hash(tenant.pk, phone) in hashes
    name = "  Jane   Roe "
    assert subject_hash(tenant.pk, normalize_identifier("PERSON", name)) in \
        lookup_hashes(tenant.pk, name)
    # A name is not hashed as a phone number; hashes are per tenant.
    assert lookup_hashes(tenant.pk, EMAIL) != lookup_hashes(tenant.pk + 1, EMAIL)


# --- end to end: proxy, openai client, REST, Celery worker on Redis ----------------------------


def _wait(pred, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; worker log:\n"
                         + (log.read_text()[-4000:] if log.exists() else ""))


def _pg_dump() -> str:
    """pgserver's pg_dump (PostgreSQL 16): it dumps the embedded test server and any older
    server, where a distribution's pg_dump refuses a newer server and may not be installed."""
    from pgserver._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / "pg_dump")


def _files_containing(root: Path, needle: bytes) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and needle in path.read_bytes().lower():
            hits.append(str(path))
    return hits


@pytest.mark.timeout(300)
def test_end_to_end_erasure_through_the_proxy(steward_proxy, proxy_key, make_member,
                                              api_client_for, other_tenant,
                                              settings, tmp_path):
    import openai

    from governance.capture.shipper import ship_once
    from governance.tasks import build_steps
    from tests.live import master_key as spool_master_key

    tenant = proxy_key.tenant
    users = {role: make_member(role, f"e2e-{role}", on=tenant)
             for role in ("steward", "compliance", "auditor")}
    clients = {role: api_client_for(u, tenant) for role, u in users.items()}
    outsider = api_client_for(make_member("admin", "e2e-outsider", on=other_tenant),
                              other_tenant)
    client = openai.OpenAI(base_url=steward_proxy.base_url, api_key=proxy_key.secret,
                           max_retries=0)
    r1 = client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": f"I am {EMAIL}; my card was "
                                                             "declined, help?"}],
        extra_headers={"X-Steward-Subject": EMAIL, "X-Steward-Session": "e2e-jane"})
    r2 = client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": f"Forward this to {EMAIL} now."}])
    r3 = client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": "What are your opening hours?"}],
        extra_headers={"X-Steward-Subject": OTHER})
    jane = {r1.headers["x-steward-trajectory"], r2.headers["x-steward-trajectory"]}
    keep = r3.headers["x-steward-trajectory"]
    steward_proxy.wait_for_records(3)
    steward_proxy.stop()  # closes the segment, so shipping it deletes it
    collected: list[int] = []
    ship_once(steward_proxy.spool_dir, master_key=spool_master_key(), enqueue=collected.extend)
    assert len(collected) == 3
    build_steps(collected)
    assert Step.objects.filter(trajectory_id__in=jane | {keep}).count() == 3
    assert SubjectIndex.objects.filter(trajectory_id__in=jane).exists()
    # Control: before erasure the subject's email is recoverable (raw payloads decrypt).
    from governance.capture.rawstore import open_raw

    raws = [open_raw(ia) for ia in Interaction.objects.select_related("data_key")
            .filter(trajectory_id__in=jane)]
    assert len(raws) == 2 and all(EMAIL in base64.b64decode(r["request_body"]).decode()
                                  for r in raws)

    ds = gov.create_dataset(users["steward"], tenant, name="e2e")
    version = gov.freeze_dataset_version(users["steward"], ds)
    gov.request_approval(users["steward"], version)
    gov.approve_version(users["compliance"], version, "ok")
    assert version.members.count() == 3

    var_dir = tmp_path / "var"
    var_dir.mkdir()
    s = connection.settings_dict
    log = tmp_path / "worker.log"
    with celery_worker("capture", log, "erasure-test", STEWARD_VAR_DIR=str(var_dir),
                       STEWARD_SPOOL_DIR=str(steward_proxy.spool_dir),
                       STEWARD_ERASURE_SPOOL_WAIT_S="5"):
        url = "/api/v1/erasure-requests/"
        for role in ("steward", "auditor"):
            assert clients[role].post(url, {"subject": EMAIL}, format="json").status_code == 403
        r = clients["compliance"].post(url, {"subject": EMAIL}, format="json")
        assert r.status_code == 202, r.content
        rid = r.json()["id"]
        assert outsider.get(f"{url}{rid}/").status_code == 404
        assert clients["auditor"].get(f"{url}{rid}/").status_code == 403
        done = _wait(lambda: (lambda b: b if b["status"] in ("completed", "failed") else None)(
            clients["compliance"].get(f"{url}{rid}/").json()), 120, "the erasure", log)
        assert done["status"] == "completed", done
        cert = done["certificate"]
        assert cert["counts"]["trajectories"] == 2
        assert cert["counts"]["steps"] == 2 and cert["counts"]["interactions"] == 2
        assert cert["counts"]["raw_payloads"] == 2
        assert cert["counts"]["data_keys_destroyed"] == 1
        assert cert["counts"]["subject_index"] >= 3 and cert["counts"]["findings"] >= 2
        assert cert["dataset_versions_invalidated"] == [version.pk]
        assert cert["post_condition"]["clean"] is True
        assert cert["spool"]["drained"] is True
        version.refresh_from_db()
        assert version.status == DatasetVersion.Status.INVALIDATED
        assert Trajectory.objects.filter(pk=keep).exists()
        assert not Trajectory.objects.filter(pk__in=jane).exists()
        assert "governance.erasure.erase_subject" in log.read_text()

        # Nothing in clear: a dump of the whole database, var/ and the spool directory.
        dump = subprocess.run(
            [_pg_dump(), "-h", s["HOST"] or "127.0.0.1", "-p", str(s["PORT"] or 5432),
             "-U", s["USER"], "--no-owner", s["NAME"]],
            capture_output=True, check=True).stdout
        assert len(dump) > 10_000 and b"governance_erasurerequest" in dump
        assert EMAIL.encode() not in dump.lower()
        # Items' content and a step's small JSON values are compressed in the dump (decisions
        # 40 and 60): read them decoded.
        assert EMAIL not in packed_values_text().lower()
        for root in (var_dir, steward_proxy.spool_dir):
            assert _files_containing(root, EMAIL.encode()) == []

        # A second erasure of the same subject finds nothing and completes.
        r = clients["compliance"].post(url, {"subject": EMAIL}, format="json")
        assert r.status_code == 202 and r.json()["id"] != rid
        again = _wait(lambda: (lambda b: b if b["status"] in ("completed", "failed") else None)(
            clients["compliance"].get(f"{url}{r.json()['id']}/").json()), 120,
            "the second erasure", log)
        assert again["status"] == "completed"
        assert not any(again["certificate"]["counts"].values())


def test_an_erasure_with_nothing_to_scan_never_builds_the_sanitizer(tenant, agent, people,
                                                                    erasure_dirs, monkeypatch):
    """Building the sanitizer loads spaCy and its model (seconds in a process that has not):
    the scan builds it only for a never-indexed payload, and here every call is indexed."""
    from governance import sanitizing

    users, _ = people
    make_trajectory(tenant, agent, steps=2, subject_hash=subject_hash(tenant.pk, EMAIL))

    def refuse(*args, **kwargs):
        raise AssertionError("the sanitizer was built for an erasure with nothing to scan")

    monkeypatch.setattr(sanitizing, "sanitizer_for_tenant", refuse)
    req, _ = request_erasure(users["compliance"], tenant, EMAIL)
    assert erase_subject(req.pk, tenant.pk)["status"] == "completed"
    req.refresh_from_db()
    assert req.certificate["counts"]["trajectories"] == 1
