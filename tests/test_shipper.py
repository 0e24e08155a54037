"""The spool shipper (governance/capture/shipper.py) and the step builder (governance/tasks.py)
on the real
PostgreSQL: idempotent shipping, encryption at rest, dead letters and quarantine, a database
outage through a TCP relay, and a real Celery worker on Redis."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from governance.capture.rawstore import (
    data_key_aad,
    decode_body,
    open_dead_letter,
    open_raw,
    raw_plaintext,
)
from governance.capture.shipper import DEAD_LETTER_NAME, Shipper, ship_once
from governance.keyring import master_key, subject_hash
from governance.models import AuditEvent, DataKey, DeadLetter, Interaction, Step, Trajectory
from governance.sanitizer import SANITIZER_VERSION
from governance.tasks import build_pending_steps, build_steps
from proxy.spool import SpoolWriter
from tests.pipeline import chat_response, make_record, write_records
from tests.relay import TcpRelay
from wire.spool import MAGIC, encode_frame, encode_line, segments, spool_key

ROOT = Path(__file__).resolve().parent.parent
# The Redis-broker test runs only where a Redis is named (.ci/run sets it); everything else uses
# the configured broker (on a fresh machine kombu's SQLAlchemy transport, config/test_settings).
REDIS_URL = os.environ.get("STEWARD_TEST_REDIS_URL", "")


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "support-bot")


def _offsets(spool: Path) -> list[Path]:
    return list(spool.glob("*.offset"))


def test_ship_once_inserts_encrypts_and_enqueues(tenant, agent, tmp_path,
                                                 django_capture_on_commit_callbacks):
    traj = str(uuid.uuid4())
    t0 = time.time() - 10
    records = [
        make_record(tenant.pk, agent.pk, trajectory_id=traj, session="s-1", source="session",
                    subject="Alice@Example.com", response=chat_response("one"), t=t0),
        make_record(tenant.pk, agent.pk, trajectory_id=traj, session="s-1", source="session",
                    subject=" alice@example.com", response=chat_response("two"), t=t0 + 1),
        make_record(tenant.pk, agent.pk, consent="no-train", response=chat_response("x"),
                    request=b"\x00binary request", t=t0 + 2),
    ]
    write_records(tmp_path, records)
    enqueued: list[list[int]] = []
    with django_capture_on_commit_callbacks(execute=True):
        counts = ship_once(tmp_path, enqueue=enqueued.append)
    assert counts["inserted"] == 3 and counts["duplicates"] == 0
    assert counts["segments_finished"] == 1 and segments(tmp_path) == []

    rows = {ia.flow_id: ia for ia in Interaction.objects.for_tenant(tenant)}
    assert set(rows) == {r["flow_id"] for r in records}
    assert sorted(enqueued[0]) == sorted(ia.pk for ia in rows.values())

    # One data key per subject (normalised), one per tenant for the call without a subject.
    h = subject_hash(tenant.pk, "alice@example.com")
    keys = {k.subject_hash: k for k in DataKey.objects.for_tenant(tenant)}
    assert set(keys) == {h, ""}
    assert rows[records[0]["flow_id"]].data_key_id == keys[h].pk
    assert rows[records[2]["flow_id"]].data_key_id == keys[""].pk
    assert rows[records[0]["flow_id"]].subject_hash == h

    # The raw exchange decrypts back to the exact bytes; the ciphertext does not contain them.
    for rec in records:
        ia = rows[rec["flow_id"]]
        raw = open_raw(ia)
        assert decode_body(raw["request_body"]) == base64.b64decode(rec["request_body"])
        assert decode_body(raw["response_body"]) == base64.b64decode(rec["response_body"])
        assert raw["request_headers"] == rec["request_headers"]
        assert base64.b64decode(rec["request_body"]) not in bytes(ia.raw_ciphertext)
        expected = timezone.now() + timedelta(days=7)
        assert abs((ia.raw_expires_at - expected).total_seconds()) < 60
    # AAD binds the wrapped key to its tenant and subject: moved to another row, it won't open.
    from cryptography.exceptions import InvalidTag

    from governance.keyring import unwrap_data_key
    with pytest.raises(InvalidTag):
        unwrap_data_key(bytes(keys[h].wrapped_key), data_key_aad(tenant.pk, ""))

    t = Trajectory.objects.get(pk=traj)
    assert (t.step_count, t.session_id, t.source, t.subject_hash) == (2, "s-1", "session", h)
    assert t.started_at.timestamp() == pytest.approx(t0, abs=1e-3)
    assert t.last_step_at.timestamp() == pytest.approx(t0 + 1, abs=1e-3)
    other = Trajectory.objects.get(pk=records[2]["trajectory_id"])
    assert other.consent == "no-train" and rows[records[2]["flow_id"]].consent == "no-train"
    assert AuditEvent.objects.filter(action="capture.shipped", tenant=tenant).count() == 1


def test_shipping_twice_duplicates_nothing(tenant, agent, tmp_path):
    traj = str(uuid.uuid4())
    writer = SpoolWriter(tmp_path, master_key(), batch_ms=5)
    records = [make_record(tenant.pk, agent.pk, trajectory_id=traj,
                           response=chat_response(str(i))) for i in range(5)]
    for r in records:
        writer.append(r)
    deadline = time.time() + 5
    while writer.records_written < 5 and time.time() < deadline:
        time.sleep(0.01)
    try:
        first = ship_once(tmp_path, enqueue=None)
        assert first["inserted"] == 5
        # Forget the offsets: the whole open segment is read and shipped again.
        for p in _offsets(tmp_path):
            p.unlink()
        again: list[list[int]] = []
        second = ship_once(tmp_path, enqueue=again.append)
        assert second["records"] == 5 and second["inserted"] == 0
        assert second["duplicates"] == 5 and again == []
        assert Interaction.objects.filter(trajectory_id=traj).count() == 5
        assert Trajectory.objects.get(pk=traj).step_count == 5
    finally:
        writer.close()


def test_bad_lines_and_invalid_records_are_dead_lettered_or_quarantined(tenant, agent,
                                                                        other_tenant, tmp_path):
    good = make_record(tenant.pk, agent.pk, response=chat_response())
    no_tenant = make_record(tenant.pk, agent.pk)
    del no_tenant["tenant_id"]
    wrong_tenant = make_record(other_tenant.pk, agent.pk)  # agent is not in that tenant
    bad_ids = make_record(tenant.pk, agent.pk, response=chat_response())
    bad_ids["trajectory_id"] = "not-a-uuid"
    bad_ids["request_body"] = "%%% not base64"
    write_records(tmp_path, [good, no_tenant, wrong_tenant, bad_ids])
    seg = segments(tmp_path)[0]
    with open(seg, "ab") as f:  # a line nobody can decrypt (e.g. a foreign key)
        f.write(base64.b64encode(b"garbage-that-is-not-a-sealed-record") + b"\n")

    shipper = Shipper(tmp_path, enqueue=None)
    counts = shipper.ship_once().as_dict()
    assert counts["bad_lines"] == 1
    assert counts["dead_lettered"] == 3
    assert counts["inserted"] == 2 and counts["quarantined"] == 1
    assert not seg.exists()  # shipped, dead letters kept elsewhere

    dead = shipper.read_dead_letters()
    reasons = sorted(d["reason"] for d in dead)
    assert reasons == [f"agent {agent.pk} does not exist in tenant {other_tenant.pk}",
                       "missing or invalid tenant_id", "undecodable spool line"]
    flows = {d["record"]["flow_id"] for d in dead if "record" in d}
    assert flows == {no_tenant["flow_id"], wrong_tenant["flow_id"]}
    line = next(d for d in dead if "line_b64" in d)
    assert base64.b64decode(line["line_b64"]) == base64.b64encode(
        b"garbage-that-is-not-a-sealed-record") + b"\n"
    # The dead-letter file is encrypted like the spool.
    assert b"missing or invalid" not in (tmp_path / DEAD_LETTER_NAME).read_bytes()

    q = Interaction.objects.get(flow_id=bad_ids["flow_id"])
    assert q.state == "quarantined"
    assert "invalid trajectory_id" in q.state_reason and "request_body" in q.state_reason
    assert Interaction.objects.get(flow_id=good["flow_id"]).state == "captured"


def test_step_id_collision_is_dead_lettered_not_lost(tenant, agent, tmp_path):
    first = make_record(tenant.pk, agent.pk, response=chat_response())
    clash = make_record(tenant.pk, agent.pk, response=chat_response())
    clash["step_id"] = first["step_id"]
    write_records(tmp_path, [first, clash])
    shipper = Shipper(tmp_path, enqueue=None)
    counts = shipper.ship_once().as_dict()
    assert (counts["inserted"], counts["dead_lettered"]) == (1, 1)
    # The tenant's dead-letter table (visible on its console), not the operators' file.
    assert shipper.read_dead_letters() == []
    dead = DeadLetter.objects.get(tenant=tenant)
    assert dead.flow_id == clash["flow_id"] and "already used by another flow" in dead.reason
    assert open_dead_letter(dead) == clash


def _framed(rec: dict) -> dict:
    """The record as this proxy spools it (bodies bytes) from make_record's format-1 shape."""
    return {**rec, **{k: base64.b64decode(rec[k]) for k in ("request_body", "response_body")
                      if rec[k] is not None}}


def test_an_older_proxys_spool_ships_after_the_upgrade_with_the_same_raw_payload(
        tenant, agent, tmp_path):
    """A segment of format-1 lines (an older proxy's) and one of binary frames holding the
    same exchange: both ship, and their sealed raw payloads are the same plaintext."""
    old = make_record(tenant.pk, agent.pk, response=chat_response("same"),
                      request=b"\x00\xffbinary request", t=time.time() - 5)
    new = _framed({**make_record(tenant.pk, agent.pk), **{
        k: v for k, v in old.items() if k not in ("flow_id", "step_id", "trajectory_id")}})
    assert isinstance(new["request_body"], bytes)
    (tmp_path / f"seg-1-{os.getpid()}-1.log").write_bytes(
        encode_line(spool_key(master_key()), old))
    write_records(tmp_path, [new])
    assert segments(tmp_path)[1].read_bytes().startswith(MAGIC)
    counts = ship_once(tmp_path, enqueue=None)
    assert (counts["inserted"], counts["segments_finished"]) == (2, 2)
    raw_old = open_raw(Interaction.objects.get(flow_id=old["flow_id"]))
    raw_new = open_raw(Interaction.objects.get(flow_id=new["flow_id"]))
    assert raw_new == raw_old and raw_new["request_body"] == old["request_body"]
    assert raw_plaintext(new) == raw_plaintext(old)
    build_steps(list(Interaction.objects.values_list("pk", flat=True)))
    steps = {s.interaction.flow_id: s for s in Step.objects.select_related("interaction")}
    assert steps[new["flow_id"]].action == steps[old["flow_id"]].action != {}


def test_a_bad_record_is_dead_lettered_without_decrypting_its_batch_again(
        tenant, agent, tmp_path, monkeypatch):
    import wire.spool

    records = [_framed(make_record(tenant.pk, agent.pk, response=chat_response(str(i))))
               for i in range(5)]
    clash = _framed(make_record(tenant.pk, agent.pk, response=chat_response("clash")))
    clash["step_id"] = records[0]["step_id"]
    write_records(tmp_path, [*records, clash])
    tampered = bytearray(encode_frame(spool_key(master_key()), records[1]))
    tampered[20] ^= 1
    with open(segments(tmp_path)[0], "ab") as f:
        f.write(bytes(tampered))
    opened = []
    real = wire.spool.open_sealed
    monkeypatch.setattr(wire.spool, "open_sealed",
                        lambda *a: opened.append(1) or real(*a))
    shipper = Shipper(tmp_path, enqueue=None)
    counts = shipper.ship_once().as_dict()
    assert (counts["inserted"], counts["bad_lines"], counts["dead_lettered"]) == (5, 1, 2)
    assert len(opened) == 7  # six records and the bad one, each once
    (line,) = shipper.read_dead_letters()
    assert base64.b64decode(line["line_b64"]) == bytes(tampered)
    # A framed record dead-lettered to its tenant's table keeps the JSON form (bodies base64).
    dead = DeadLetter.objects.get(tenant=tenant)
    assert open_dead_letter(dead) == {
        **clash, **{k: base64.b64encode(clash[k]).decode()
                    for k in ("request_body", "response_body")}}


def test_large_batches_are_inserted_in_chunks(tenant, agent, tmp_path, monkeypatch):
    import governance.capture.rawstore

    # A smaller chunk than production's 1000 rows exercises the multi-statement path quickly.
    monkeypatch.setattr(governance.capture.rawstore, "INSERT_CHUNK", 40)
    records = [make_record(tenant.pk, agent.pk, response=chat_response()) for _ in range(250)]
    records.append(records[3])  # a duplicate inside the batch
    write_records(tmp_path, records)
    counts = Shipper(tmp_path, enqueue=None, max_records=500).ship_once().as_dict()
    assert (counts["inserted"], counts["duplicates"], counts["batches"]) == (250, 1, 1)
    assert Interaction.objects.for_tenant(tenant).count() == 250


def test_build_steps_builds_quarantines_and_is_idempotent(tenant, agent, tmp_path):
    ok = make_record(tenant.pk, agent.pk, response=chat_response("fine", rid="chatcmpl-ok"),
                     consent="no-train")
    broken = make_record(tenant.pk, agent.pk, response=b"<html>not json</html>", status=200)
    failed = make_record(tenant.pk, agent.pk, response={"error": {"message": "boom"}},
                         status=500)
    erased = make_record(tenant.pk, agent.pk, subject="bob", response=chat_response())
    write_records(tmp_path, [ok, broken, failed, erased])
    ship_once(tmp_path, enqueue=None)
    ids = {r["flow_id"]: Interaction.objects.get(flow_id=r["flow_id"]).pk
           for r in (ok, broken, failed, erased)}
    # Crypto-shred bob's key before the step is built: the payload can no longer be read.
    DataKey.objects.filter(subject_hash=subject_hash(tenant.pk, "bob")).update(
        wrapped_key=None, destroyed_at=timezone.now())

    result = build_steps(list(ids.values()))
    assert result == {"built": 2, "quarantined": 2, "skipped": 0}
    step = Step.objects.get(interaction_id=ids[ok["flow_id"]])
    assert str(step.id) == ok["step_id"]
    assert step.response_id == "chatcmpl-ok" and step.action["messages"][0]["content"] == "fine"
    # Sanitized when built; no-train consent: never eligible.
    assert (step.consent, step.training_eligible, step.sanitizer_version) == (
        "no-train", False, SANITIZER_VERSION)
    assert step.classification == "internal" and step.retention_until is None
    assert step.versions["harness_version"] == "steward-proxy/0.1"
    assert Step.objects.get(interaction_id=ids[failed["flow_id"]]).error["kind"] == "http_error"
    b = Interaction.objects.get(pk=ids[broken["flow_id"]])
    assert b.state == "quarantined" and "not a JSON object" in b.state_reason
    e = Interaction.objects.get(pk=ids[erased["flow_id"]])
    assert e.state == "quarantined" and "destroyed" in e.state_reason
    assert AuditEvent.objects.filter(action="capture.steps_built").count() == 1

    # A redelivered message builds nothing twice.
    assert build_steps(list(ids.values())) == {"built": 0, "quarantined": 0, "skipped": 4}
    assert Step.objects.filter(tenant=tenant).count() == 2


def test_build_pending_steps_picks_up_lost_messages(tenant, agent, tmp_path):
    from config.celery import app

    rec = make_record(tenant.pk, agent.pk, response=chat_response())
    write_records(tmp_path, [rec])
    ship_once(tmp_path, enqueue=None)  # the message was "lost"
    assert build_pending_steps() == 0  # too fresh: its message may still be on its way
    Interaction.objects.update(shipped_at=timezone.now() - timedelta(minutes=2))
    app.conf.task_always_eager = True
    try:
        assert build_pending_steps() == 1
    finally:
        app.conf.task_always_eager = False
    assert Interaction.objects.get(flow_id=rec["flow_id"]).state == "processed"


# --- real processes ----------------------------------------------------------------------------

def _child_env(db_port: int, **extra: str) -> dict[str, str]:
    s = connection.settings_dict
    env = dict(os.environ)
    env.update({
        "DATABASE_URL": f"postgresql://{s['USER']}@{s['HOST'] or '127.0.0.1'}:{db_port}/"
                        f"{s['NAME']}",
        "STEWARD_MASTER_KEY": base64.b64encode(master_key()).decode(),
        "PYTHONUNBUFFERED": "1",
        "CELERY_BROKER_URL": REDIS_URL or settings.CELERY_BROKER_URL,
    })
    env.update(extra)
    return env


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _shipped(flows: list[str]) -> int:
    return Interaction.objects.filter(flow_id__in=flows).count()


@pytest.mark.timeout(120)
def test_database_outage_loses_and_duplicates_nothing(transactional_db, tenant, agent,
                                                      tmp_path):
    relay = TcpRelay(int(connection.settings_dict["PORT"] or 5432))
    relay.start()
    log_path = tmp_path / "shipper.log"
    spool = tmp_path / "spool"
    spool.mkdir()

    def start_shipper() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "manage.py", "ship_spool", "--interval", "0.05", "--spool-dir",
             str(spool), "--no-enqueue"],
            cwd=ROOT, env=_child_env(relay.port), stdout=subprocess.DEVNULL,
            stderr=open(log_path, "ab"))

    shipper = start_shipper()
    writer = SpoolWriter(spool, master_key(), batch_ms=5, segment_seconds=0.5)
    traj = str(uuid.uuid4())
    flows: list[str] = []

    def produce(n: int) -> None:
        for _ in range(n):
            rec = make_record(tenant.pk, agent.pk, trajectory_id=traj, source="session",
                              session="outage", response=chat_response())
            flows.append(rec["flow_id"])
            writer.append(rec)
            time.sleep(0.01)

    try:
        produce(20)
        _wait(lambda: _shipped(flows) == 20, 60, "the first 20 records")

        relay.stop()  # the database "goes down" for the shipper
        produce(30)  # the proxy keeps capturing meanwhile
        time.sleep(1.5)
        assert _shipped(flows) == 20
        assert shipper.poll() is None, "the shipper must survive the outage"
        assert any(spool.glob("seg-*"))  # the spool holds what could not be shipped

        relay.start()  # back on the same port
        _wait(lambda: _shipped(flows) == 50, 60, "the records written during the outage")
        produce(10)
        _wait(lambda: _shipped(flows) == 60, 30, "records after recovery")

        # A restart that forgets every offset re-reads the spool and inserts nothing twice.
        shipper.terminate()
        shipper.wait(10)
        for p in spool.glob("*.offset"):
            p.unlink()
        shipper = start_shipper()
        time.sleep(3)
        assert Interaction.objects.filter(flow_id__in=flows).count() == 60
        assert Trajectory.objects.get(pk=traj).step_count == 60
        log_text = log_path.read_text()
        assert "database unavailable" in log_text and "retrying" in log_text
    finally:
        writer.close()
        shipper.terminate()
        try:
            shipper.wait(10)
        except subprocess.TimeoutExpired:
            shipper.kill()
        relay.close()


@pytest.mark.timeout(180)
@pytest.mark.skipif(not REDIS_URL, reason="STEWARD_TEST_REDIS_URL is not set (no Redis to test "
                    "the Redis broker on; .ci/run sets it)")
def test_celery_worker_builds_steps_from_shipped_interactions(transactional_db, tenant, agent,
                                                              tmp_path):
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.delete("capture")
    spool = tmp_path / "spool"
    port = int(connection.settings_dict["PORT"] or 5432)
    log_path = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "capture", "-c", "1",
         "--pool", "solo", "--without-heartbeat", "--without-gossip", "--without-mingle",
         "-l", "info", "-n", f"capture-test-{os.getpid()}@%h"],
        cwd=ROOT, env=_child_env(port), stdout=subprocess.DEVNULL,
        stderr=open(log_path, "ab"))
    shipper = None
    try:
        records = [
            make_record(tenant.pk, agent.pk, response=chat_response("a", rid="chatcmpl-w1")),
            make_record(tenant.pk, agent.pk, response=b"\x89PNG not json", status=200),
        ]
        write_records(spool, records)
        shipper = subprocess.Popen(
            [sys.executable, "manage.py", "ship_spool", "--interval", "0.1", "--spool-dir",
             str(spool)], cwd=ROOT, env=_child_env(port), stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "shipper.log", "ab"))

        def done() -> bool:
            return Interaction.objects.filter(
                flow_id__in=[r["flow_id"] for r in records]).exclude(
                pending__state="captured").count() == 2

        try:
            _wait(done, 120, "the worker to build the steps")
        except AssertionError:
            raise AssertionError("worker log:\n" + log_path.read_text()[-3000:]) from None
        step = Step.objects.get(pk=records[0]["step_id"])
        assert step.response_id == "chatcmpl-w1"
        assert step.action["messages"][0]["content"] == "a"
        bad = Interaction.objects.get(flow_id=records[1]["flow_id"])
        assert bad.state == "quarantined" and not Step.objects.filter(interaction=bad).exists()
        assert "governance.tasks.build_steps" in log_path.read_text()
    finally:
        for proc in (shipper, worker):
            if proc is not None:
                proc.terminate()
        for proc in (shipper, worker):
            if proc is not None:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        client.delete("capture")


def test_raw_payload_format_3_is_compressed_and_opens_like_format_1(tenant, agent, tmp_path):
    """Raw payloads are sealed compressed (rawstore.pack_raw): the bodies as raw bytes under
    zlib, a fraction of format 1's base64 JSON for agent traffic, opened to the same document;
    a payload sealed in format 1 (stored before) still opens; a body that is not base64 text
    and a delta's middle survive the round trip."""
    import zlib

    import orjson

    from governance.capture.rawstore import (
        RAW3_MAGIC,
        RAW_FIELDS,
        apply_delta,
        pack_raw,
        request_delta,
        seal_raw,
        unpack_raw,
        unwrap,
    )

    messages = [{"role": "user", "content": f"Customer {i}: Jane Roe, jane{i}@example.com, "
                 f"+44 20 7946 09{i:02d}, 221B Baker Street"} for i in range(40)]
    body = orjson.dumps({"model": "m", "messages": messages})
    rec = make_record(tenant.pk, agent.pk, request=body)
    v1 = orjson.dumps({"v": 1, **{k: rec.get(k) for k in RAW_FIELDS}})
    v3 = raw_plaintext(rec)
    assert v3.startswith(RAW3_MAGIC) and len(v3) * 4 < len(v1)
    assert unpack_raw(v3) == orjson.loads(v1) == unpack_raw(v1)
    assert unpack_raw(raw_plaintext({**rec, "request_body": "not base64 !"}))[
        "request_body"] == "not base64 !"
    longer = body[:-2] + b',{"role":"tool","content":"done"}]}'
    delta = {**request_delta(body, longer), "base": rec["flow_id"]}
    doc = unpack_raw(raw_plaintext(rec, delta))
    assert "request_body" not in doc and apply_delta(body, doc["request_delta"]) == longer
    with pytest.raises(ValueError):
        unpack_raw(RAW3_MAGIC + zlib.compress(b"\x00\x00\x00\x02{}extra"))

    # Shipped: sealed in format 3; an interaction sealed in format 1 before still opens.
    write_records(tmp_path, [rec])
    assert ship_once(tmp_path, enqueue=None)["inserted"] == 1
    ia = Interaction.objects.select_related("data_key").get(flow_id=rec["flow_id"])
    assert len(ia.raw_ciphertext) < len(v1) // 3
    assert decode_body(open_raw(ia)["request_body"]) == body
    ia.raw_ciphertext = seal_raw(unwrap(ia.data_key), ia.flow_id, v1)
    ia.save(update_fields=["raw_ciphertext"])
    assert open_raw(ia) == orjson.loads(v1)
    assert pack_raw(orjson.loads(v1)) == v3
