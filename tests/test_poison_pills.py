"""Poison pills (issue 12, items 6 and 7): one record or interaction the database cannot store
must not stop the shipper or a tenant's step building; it is set aside where a person can see
it, and everything around it goes on."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.db import connection

from governance.capture.rawstore import decode_body, open_dead_letter, open_raw
from governance.capture.shipper import Shipper, ship_once, storable_text
from governance.erasure import lookup_hashes
from governance.keyring import subject_hash
from governance.models import (
    ConversationItem,
    DeadLetter,
    Finding,
    Interaction,
    Step,
    SubjectIndex,
    Trajectory,
)
from governance.tasks import build_steps
from tests.pipeline import chat_response, make_record, ship_and_build, write_records
from tests.test_shipper import _child_env
from wire.spool import segments

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "support-bot")


def _chat(content: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


# --- item 7: a step PostgreSQL refuses --------------------------------------------------------

def test_nul_in_message_content_quarantines_that_interaction_and_builds_its_neighbours(
        tenant, agent, tmp_path):
    before = make_record(tenant.pk, agent.pk, request=_chat("first"),
                         response=chat_response("one"), t=1_700_000_000)
    poison = make_record(tenant.pk, agent.pk, request=_chat("a\u0000b"),
                         response=chat_response("two"), t=1_700_000_001)
    after = make_record(tenant.pk, agent.pk, request=_chat("third"),
                        response=chat_response("th\u0000ree"), t=1_700_000_002)
    fine = make_record(tenant.pk, agent.pk, request=_chat("fourth"),
                       response=chat_response("four"), t=1_700_000_003)
    write_records(tmp_path, [before, poison, after, fine])
    ship_once(tmp_path, enqueue=None)
    ids = {r["flow_id"]: Interaction.objects.get(flow_id=r["flow_id"]).pk
           for r in (before, poison, after, fine)}

    # One batch holds all four (as the shipper enqueues them): jsonb refuses "\u0000", and
    # before the fix the whole batch rolled back with a DataError, every time it was retried.
    result = build_steps(list(ids.values()))
    assert result == {"built": 2, "quarantined": 2, "skipped": 0}
    for rec in (before, fine):
        assert Interaction.objects.get(flow_id=rec["flow_id"]).state == "processed"
        assert Step.objects.filter(pk=rec["step_id"]).exists()
    for rec in (poison, after):
        ia = Interaction.objects.get(flow_id=rec["flow_id"])
        assert ia.state == "quarantined"
        assert ia.state_reason.startswith("step not stored: the database refused it (DataError")
        assert "\x00" not in ia.state_reason
        assert not Step.objects.filter(interaction=ia).exists()
        assert ia.raw_ciphertext is not None  # kept: erasure and compliance can still see it

    # The tenant is not stuck: a later call is built, and the quarantined ones stay put.
    later = make_record(tenant.pk, agent.pk, request=_chat("later"),
                        response=chat_response("five"))
    write_records(tmp_path, [later])
    ship_once(tmp_path, enqueue=None)
    pk = Interaction.objects.get(flow_id=later["flow_id"]).pk
    assert build_steps([pk]) == {"built": 1, "quarantined": 0, "skipped": 0}
    assert Interaction.objects.filter(pending__state="captured").count() == 0


def _session_call(tenant, agent, traj: str, messages: list, t: float,
                  reply: str = "Noted.") -> dict:
    return make_record(tenant.pk, agent.pk, trajectory_id=traj,
                       request={"model": "m", "messages": messages},
                       response=chat_response(reply), t=t)


PERSONAL = {"role": "user", "content": "Please update the address of Dana White, "
                                        "dana.white@example.net, phone +1 415 555 0199."}


def _subject_key(tenant) -> int:
    from governance.sanitizer import normalize_identifier

    return SubjectIndex.keys([subject_hash(tenant.pk, normalize_identifier(
        "EMAIL_ADDRESS", "dana.white@example.net"))])[0]


def _item_rows(traj: str) -> tuple[list, list, list]:
    items = list(ConversationItem.objects.filter(trajectory_id=traj).values_list("pk", flat=True))
    findings = list(Finding.objects.filter(item_id__in=items).values_list("item_id", "step_id"))
    keys = list(SubjectIndex.objects.filter(trajectory_id=traj).values_list("item_id", "hashes"))
    return items, findings, keys


@pytest.mark.parametrize("refused_by", ["reply", "another item"])
def test_a_refused_first_carrier_hands_its_items_rows_to_the_next_step(tenant, agent, tmp_path,
                                                                       refused_by):
    """The personal data of a message is indexed (and its findings kept) with the first step
    that carries it. When the database refuses that step (a NUL in its reply) or another of
    its messages, the item is stored all the same and the next call of the session carries it:
    its subject-index row and findings go with that call's step, so an erasure still finds the
    trajectory by the subject (decision 46)."""
    traj = str(uuid.uuid4())
    t0 = 1_700_000_100
    if refused_by == "reply":
        first = _session_call(tenant, agent, traj, [PERSONAL], t0, reply="do\u0000ne")
    else:
        first = _session_call(tenant, agent, traj,
                              [PERSONAL, {"role": "user", "content": "a\u0000b"}], t0)
    second = _session_call(tenant, agent, traj, [
        PERSONAL, {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks."}], t0 + 1)
    ship_and_build(tmp_path, [first, second])  # one batch

    assert not Step.objects.filter(pk=first["step_id"]).exists()
    assert Interaction.objects.get(flow_id=first["flow_id"]).state == "quarantined"
    assert Step.objects.filter(pk=second["step_id"]).exists()
    personal = ConversationItem.objects.get(trajectory_id=traj, first_step=first["step_id"],
                                            pk__in=Step.objects.get(pk=second["step_id"]).appended)
    items, findings, keys = _item_rows(traj)
    assert (personal.pk, uuid.UUID(second["step_id"])) in findings
    assert any(item == personal.pk and _subject_key(tenant) in hashes for item, hashes in keys)
    # Erasure's lookup (governance/erasure.py) finds the trajectory by the subject.
    wanted = SubjectIndex.keys(lookup_hashes(tenant.pk, "dana.white@example.net"))
    assert set(SubjectIndex.objects.filter(hashes__keys_overlap=wanted)
               .values_list("trajectory_id", flat=True)) == {uuid.UUID(traj)}


def test_a_refused_first_carrier_alone_leaves_no_item_and_the_next_batch_indexes_it(
        tenant, agent, tmp_path):
    """The same, with the refused call alone in its batch: nothing references the items it
    stored, so they are deleted; the next call stores the message again, with its rows."""
    traj = str(uuid.uuid4())
    t0 = 1_700_000_200
    first = _session_call(tenant, agent, traj, [PERSONAL], t0, reply="do\u0000ne")
    ship_and_build(tmp_path / "a", [first])
    assert not Step.objects.filter(trajectory_id=traj).exists()
    assert _item_rows(traj) == ([], [], [])

    second = _session_call(tenant, agent, traj, [
        PERSONAL, {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks."}], t0 + 1)
    ship_and_build(tmp_path / "b", [second])
    step = Step.objects.get(pk=second["step_id"])
    items, findings, keys = _item_rows(traj)
    assert set(step.appended) == set(items) and len(items) == 3
    assert findings and all(s == step.pk for _, s in findings)
    assert any(_subject_key(tenant) in hashes for _, hashes in keys)


# --- item 6: a record PostgreSQL refuses ------------------------------------------------------

def test_storable_text_escapes_what_postgresql_cannot_hold():
    assert storable_text("a\x00b") == "a\\x00b"
    assert storable_text("caf\udce9") == "caf\\udce9"  # a lone surrogate (surrogateescape)
    assert storable_text("plain", 3) == "pla"
    assert storable_text(42) == "42"


def _refuse_flow(flow_id: str) -> None:
    """A real refusal by PostgreSQL for one row, whatever its content (a trigger, as a check
    an operator added would): the kind of record no escaping can make storable."""
    with connection.cursor() as cursor:
        cursor.execute(f"""
            CREATE OR REPLACE FUNCTION test_refuse_flow() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.flow_id = '{flow_id}' THEN
                    RAISE EXCEPTION 'refused for the test' USING ERRCODE = '22000';
                END IF;
                RETURN NEW;
            END $$;
            DROP TRIGGER IF EXISTS test_refuse_flow ON governance_interaction;
            CREATE TRIGGER test_refuse_flow BEFORE INSERT ON governance_interaction
                FOR EACH ROW EXECUTE FUNCTION test_refuse_flow();""")


def _ship_process(spool: Path) -> subprocess.CompletedProcess:
    """The real shipper process, as the supervisor runs it (one pass)."""
    return subprocess.run(
        [sys.executable, "manage.py", "ship_spool", "--once", "--no-enqueue", "--spool-dir",
         str(spool)], cwd=ROOT, env=_child_env(int(connection.settings_dict["PORT"] or 5432)),
        capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(240)
def test_nul_bytes_are_stored_escaped_and_a_refused_record_is_dead_lettered(
        transactional_db, tenant, agent, tmp_path, client, make_member):
    spool = tmp_path / "spool"
    before = make_record(tenant.pk, agent.pk, response=chat_response("one"))
    nul_session = make_record(tenant.pk, agent.pk, session="sess\x00ion", source="session",
                              response=chat_response("two"))
    nul_query = make_record(tenant.pk, agent.pk, response=chat_response("three"))
    nul_query["path"] = "/v1/chat/completions?q=\x00&x=1"
    nul_fields = make_record(tenant.pk, agent.pk, response=chat_response("four"),
                             error={"kind": "upstream\x00", "message": "reset \x00 by peer"})
    nul_fields["proxy_instance"] = "host\x00:1"
    nul_fields["method"] = "PO\x00ST"
    refused = make_record(tenant.pk, agent.pk, subject="carol@example.com",
                          response=chat_response("five"))
    after = make_record(tenant.pk, agent.pk, response=chat_response("six"))
    records = [before, nul_session, nul_query, nul_fields, refused, after]
    write_records(spool, records)
    _refuse_flow(refused["flow_id"])
    try:
        # Before the fix this process died on the first NUL (DataError), and again on every
        # restart, on the same record: nothing behind it was ever shipped.
        result = _ship_process(spool)
        assert result.returncode == 0, result.stderr[-3000:]
        counts = json.loads(result.stdout.strip().splitlines()[-1])
        assert (counts["inserted"], counts["dead_lettered"]) == (5, 1)
        assert segments(spool) == []  # shipped past the poison pill
        again = _ship_process(spool)
        assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1])[
            "records"] == 0
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS test_refuse_flow ON governance_interaction")

    rows = {ia.flow_id: ia for ia in Interaction.objects.filter(
        flow_id__in=[r["flow_id"] for r in records])}
    assert set(rows) == {r["flow_id"] for r in records} - {refused["flow_id"]}
    assert all(ia.state == "captured" for ia in rows.values())
    # Escaped in the metadata columns; exact in the sealed raw payload.
    assert Trajectory.objects.get(pk=nul_session["trajectory_id"]).session_id == "sess\\x00ion"
    q = rows[nul_query["flow_id"]]
    assert q.path == "/v1/chat/completions?q=\\x00&x=1"
    assert open_raw(q)["path"] == "/v1/chat/completions?q=\x00&x=1"
    f = rows[nul_fields["flow_id"]]
    assert (f.method, f.error_kind, f.error_message, f.proxy_instance) == (
        "PO\\x00ST", "upstream\\x00", "reset \\x00 by peer", "host\\x00:1")
    assert decode_body(open_raw(f)["response_body"]) == base64.b64decode(
        nul_fields["response_body"])

    # The refused record: a dead letter of its tenant, sealed under its subject's key.
    dead = DeadLetter.objects.get(tenant=tenant)
    assert dead.flow_id == refused["flow_id"]
    assert dead.reason == "the database refused the record (DataError 22000)"
    assert dead.subject_hash == subject_hash(tenant.pk, "carol@example.com")
    assert dead.data_key.subject_hash == dead.subject_hash
    assert b"carol" not in bytes(dead.record_ciphertext)
    assert open_dead_letter(dead) == refused

    # Visible on the console's overview: count, id, flow and reason.
    client.force_login(make_member("steward"))
    page = client.get("/").content.decode()
    assert "records the shipper could not store" in page
    assert 'id="dead-letters"' in page and refused["flow_id"] in page
    assert "the database refused the record (DataError 22000)" in page


def test_step_id_collision_and_unattributable_records_keep_their_places(tenant, agent,
                                                                        other_tenant, tmp_path):
    """The table holds only what the tenant can be shown; the rest stays in the operators'
    encrypted file, as before."""
    first = make_record(tenant.pk, agent.pk, response=chat_response())
    clash = make_record(tenant.pk, agent.pk, response=chat_response())
    clash["step_id"] = first["step_id"]
    foreign = make_record(other_tenant.pk, agent.pk)  # the agent is not in that tenant
    write_records(tmp_path, [first, clash, foreign])
    shipper = Shipper(tmp_path, enqueue=None)
    assert shipper.ship_once().dead_lettered == 2
    assert list(DeadLetter.objects.values_list("tenant_id", "flow_id")) == [
        (tenant.pk, clash["flow_id"])]
    assert [d["record"]["flow_id"] for d in shipper.read_dead_letters()] == [foreign["flow_id"]]
    assert all("_tenant_table" not in d for d in shipper.read_dead_letters())


def test_dead_letters_expire_like_raw_payloads(tenant, agent, tmp_path, settings):
    from datetime import timedelta

    from django.utils import timezone

    from governance.retention import purge_expired

    first = make_record(tenant.pk, agent.pk, response=chat_response())
    clashes = []
    for _ in range(2):
        clash = make_record(tenant.pk, agent.pk, response=chat_response())
        clash["step_id"] = first["step_id"]
        clashes.append(clash)
    write_records(tmp_path, [first, *clashes])
    Shipper(tmp_path, enqueue=None).ship_once()
    now = timezone.now()
    recent, old = (DeadLetter.objects.get(flow_id=c["flow_id"]) for c in clashes)
    assert recent.expires_at > now + timedelta(days=6)  # STEWARD_RAW_RETENTION_DAYS
    DeadLetter.objects.filter(pk=recent.pk).update(expires_at=now - timedelta(seconds=1))
    DeadLetter.objects.filter(pk=old.pk).update(created_at=now - timedelta(days=400))
    result = purge_expired(tenant.pk, now=now)[tenant.pk]
    assert result["dead_letters"] == 1
    recent.refresh_from_db()
    assert recent.record_ciphertext is None  # the record is gone, the row says what happened
    assert not DeadLetter.objects.filter(pk=old.pk).exists()


@pytest.mark.timeout(180)
def test_nul_bytes_through_the_real_proxy_are_shipped(steward_proxy, proxy_key, tmp_path):
    """The exchange the adversarial review sent, on the wire through the running proxy, then
    the real shipper: a NUL byte in X-Steward-Session is refused at the headers (400 in
    OpenAI's shape, nothing forwarded or spooled, tests/test_hostile_proxy.py); a NUL in the
    query string is recorded percent-encoded, and that record ships."""
    import socket

    def send(path: bytes, session: bytes) -> bytes:
        body = json.dumps(_chat("hello")).encode()
        head = (b"POST " + path + b" HTTP/1.1\r\n"
                b"Host: 127.0.0.1\r\n"
                b"Authorization: Bearer " + proxy_key.secret.encode() + b"\r\n"
                b"Content-Type: application/json\r\n"
                b"X-Steward-Session: " + session + b"\r\n"
                b"Connection: close\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        with socket.create_connection(("127.0.0.1", steward_proxy.port), timeout=30) as sock:
            sock.sendall(head + body)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        return answer

    refused = send(b"/v1/chat/completions", b"sess\x00ion")
    assert refused.split(b"\r\n", 1)[0].split()[1] == b"400", refused[:500]
    assert b"invalid_steward_header" in refused and b"x-steward-step" not in refused.lower()

    answer = send(b"/v1/chat/completions?debug=a\x00b", b"session-with-nul-query")
    # The demo upstream (aiohttp) may answer 400 to the odd query; the proxy forwards that and
    # captures the exchange like any failed call.
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] in (b"200", b"400"), answer[:500]
    step_id = next(line.split(b":", 1)[1].strip().decode()
                   for line in rest.split(b"\r\n") if line.lower().startswith(b"x-steward-step:"))
    rec = steward_proxy.wait_for_record(step_id)
    assert "\x00" not in rec["path"] and "%00" in rec["path"]

    from tests.live import master_key as spool_master_key

    counts = Shipper(steward_proxy.spool_dir, master_key=spool_master_key(),
                     enqueue=None).ship_once()
    assert counts.inserted >= 1 and counts.dead_lettered == 0
    ia = Interaction.objects.get(step_id=step_id)
    assert ia.path == rec["path"] and ia.trajectory.session_id == "session-with-nul-query"
    assert open_raw(ia)["path"] == rec["path"]
