"""False erasure certificates (issue 12, item 8): what the sanitizer never indexed is still
found and erased, long texts are sanitized (and indexed) in chunks, and a certificate says
`clean` only once every spool has shipped what it held."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from django.utils import timezone

from governance import services as gov
from governance.capture.shipper import Shipper
from governance.capture.steps import UNSCANNED_KEY
from governance.erasure import erase_subject, lookup_hashes, request_erasure
from governance.models import (
    DeadLetter,
    ErasureRequest,
    Interaction,
    SpoolState,
    Step,
    SubjectIndex,
    Trajectory,
)
from governance.sanitizer import load_nlp
from governance.sanitizing import LongTextNlp, chunk_bounds, clear_cache
from tests.pipeline import chat_response, make_record, ship_and_build, write_records

EMAIL = "jane.roe@example.com"


@pytest.fixture
def agent(tenant):
    return gov.ensure_agent("system:test", tenant, "support-bot")


@pytest.fixture
def erasure_dirs(settings, tmp_path):
    settings.STEWARD_SPOOL_DIR = tmp_path / "spool"
    settings.VAR_DIR = tmp_path / "var"
    settings.STEWARD_ERASURE_SPOOL_WAIT_S = 1
    return settings


def _chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def _erase(people, tenant, subject: str = EMAIL) -> ErasureRequest:
    users, _ = people
    req, _ = request_erasure(users["compliance"], tenant, subject)
    erase_subject(req.pk, tenant.pk)
    req.refresh_from_db()
    return req


# --- long texts ----------------------------------------------------------------------------------

def test_chunk_bounds_cover_the_text_and_cut_at_breaks():
    text = ("word " * 50 + "\n") * 40
    bounds = chunk_bounds(text, 700)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(text)
    assert all(a == b for (_, a), (b, _) in zip(bounds, bounds[1:], strict=False))
    assert all(0 < end - start <= 700 for start, end in bounds)
    assert all(text[end - 1] == "\n" for _, end in bounds[:-1])  # a line break, not a word
    assert chunk_bounds("short", 700) == [(0, 5)]


def test_long_text_is_sanitized_in_chunks_and_indexed(tenant, agent, tmp_path, monkeypatch):
    # The real limit is 1,000,000 characters; a small one exercises the same path quickly.
    nlp = load_nlp(True)
    monkeypatch.setattr(nlp, "max_length", 4000)
    clear_cache()
    filler = "The quarterly report covers revenue, costs and the outlook for next year. " * 60
    text = filler + f"Please send the statement to {EMAIL} today. " + filler
    assert len(text) > 2 * nlp.max_length
    rec = make_record(tenant.pk, agent.pk, request=_chat(text), response=chat_response("ok"))
    ship_and_build(tmp_path / "ship", [rec])
    ia = Interaction.objects.get(flow_id=rec["flow_id"])
    # Before: spaCy's E088 (text too long), the interaction quarantined, nothing indexed.
    assert ia.state == "processed", ia.state_reason
    content = Step.objects.get(pk=rec["step_id"]).observation["messages"][0]["content"]
    assert EMAIL not in content and "<EMAIL_ADDRESS_1>" in content
    assert len(content) > 2 * nlp.max_length
    # The email is in a history message: its row belongs to the conversation item.
    assert SubjectIndex.objects.filter(trajectory_id=ia.trajectory_id, item__isnull=False,
                                       hashes__overlap=SubjectIndex.keys(
                                           lookup_hashes(tenant.pk, EMAIL))).exists()


def test_long_text_nlp_puts_entities_back_at_their_offsets(monkeypatch):
    nlp = load_nlp(True)
    monkeypatch.setattr(nlp, "max_length", 3000)
    text = "Nothing to see here at all. " * 150 + "Angela Merkel visited Paris. " + "x " * 10
    doc = next(LongTextNlp(nlp, chunk_chars=1000).pipe([text]))
    assert doc.text == text
    ents = {(e.text, e.label_) for e in doc.ents}
    assert ("Angela Merkel", "PERSON") in ents
    assert all(text[e.start_char:e.end_char] == e.text for e in doc.ents)


# --- payloads never indexed --------------------------------------------------------------------

def test_erasure_scans_what_was_never_indexed(tenant, agent, people, erasure_dirs, tmp_path):
    non_json = make_record(tenant.pk, agent.pk,
                           request=f"plain text from {EMAIL}, not JSON".encode(),
                           response=chat_response("ok"))
    quarantined = make_record(tenant.pk, agent.pk, request=_chat(f"I am {EMAIL}"),
                              response=b"<html>not json</html>", status=200)
    clash_owner = make_record(tenant.pk, agent.pk, request=_chat("hello"),
                              response=chat_response("hi"))
    dead = make_record(tenant.pk, agent.pk, request=_chat(f"write to {EMAIL.upper()}"),
                       response=chat_response("ok"))
    dead["step_id"] = clash_owner["step_id"]  # -> a dead letter of the tenant
    unrelated = make_record(tenant.pk, agent.pk, request=b"plain text about nobody",
                            response=chat_response("ok"))
    ship_and_build(tmp_path / "ship", [non_json, quarantined, clash_owner, dead, unrelated])

    hashes = lookup_hashes(tenant.pk, EMAIL)
    ia = Interaction.objects.get(flow_id=non_json["flow_id"])
    assert ia.state == "processed"
    assert Step.objects.get(interaction=ia).metadata[UNSCANNED_KEY] == ["request_body"]
    assert Interaction.objects.get(flow_id=quarantined["flow_id"]).state == "quarantined"
    assert DeadLetter.objects.filter(flow_id=dead["flow_id"]).exists()
    # None of them is in the subject index: the old erasure found nothing and said "clean".
    assert not SubjectIndex.objects.filter(hashes__overlap=SubjectIndex.keys(hashes)).exists()

    req = _erase(people, tenant)
    assert req.status == "completed", req.error
    cert = req.certificate
    assert cert["post_condition"]["clean"] is True
    assert cert["unindexed_scan"]["matched"] == 3 and cert["unindexed_scan"]["unreadable"] == 0
    assert cert["counts"]["dead_letters"] == 1 and cert["counts"]["interactions"] == 2
    gone = [non_json, quarantined]
    assert not Interaction.objects.filter(flow_id__in=[r["flow_id"] for r in gone]).exists()
    assert not Trajectory.objects.filter(pk__in=[r["trajectory_id"] for r in gone]).exists()
    assert not DeadLetter.objects.filter(flow_id=dead["flow_id"]).exists()
    for keep in (clash_owner, unrelated):
        assert Interaction.objects.filter(flow_id=keep["flow_id"]).exists()
    assert EMAIL not in str(cert).lower()


def test_an_unreadable_never_indexed_payload_refuses_clean(tenant, agent, people,
                                                          erasure_dirs, tmp_path):
    rec = make_record(tenant.pk, agent.pk, request=b"not json", response=chat_response("ok"))
    ship_and_build(tmp_path / "ship", [rec])
    # Damaged at rest (a restored backup, a bit flip): it cannot be scanned for the subject.
    ia = Interaction.objects.get(flow_id=rec["flow_id"])
    Interaction.objects.filter(pk=ia.pk).update(
        raw_ciphertext=bytes(ia.raw_ciphertext)[:-1] + b"\x00")
    req = _erase(people, tenant)
    assert req.status == "failed"
    post = req.certificate["post_condition"]
    assert post["clean"] is False
    assert post["because"] == ["1 never-indexed payload(s) could not be decrypted to be scanned"]


# --- spools --------------------------------------------------------------------------------------

def test_certificate_waits_for_the_local_spool_then_names_it(tenant, agent, people,
                                                           erasure_dirs):
    spool = erasure_dirs.STEWARD_SPOOL_DIR
    # Still in the spool when the erasure starts: a non-JSON call mentioning the subject.
    rec = make_record(tenant.pk, agent.pk, request=f"hello from {EMAIL}".encode(),
                      response=chat_response("ok"))
    write_records(spool, [rec])

    req = _erase(people, tenant)
    assert req.status == "failed"
    cert = req.certificate
    name = f"{socket.gethostname()}:{spool.resolve()}"
    assert cert["spool"]["drained"] is False and cert["spool"]["pending"] == [name]
    assert [s["segments_pending"] for s in cert["spool"]["spools"] if s["name"] == name] == [1]
    assert cert["post_condition"]["because"] == [f"spool not drained: {name}"]
    assert req.error.startswith("not clean: spool not drained")

    # Shipped afterwards (before the fix, with its raw payload kept and a clean certificate
    # already issued): the next request waits for nothing, scans it and erases it.
    Shipper(spool, enqueue=None).ship_once()
    assert Interaction.objects.filter(flow_id=rec["flow_id"]).exists()
    again = _erase(people, tenant)
    assert again.status == "completed", again.error
    assert again.certificate["spool"]["drained"] is True
    assert not Interaction.objects.filter(flow_id=rec["flow_id"]).exists()


def test_certificate_names_another_hosts_spool_until_its_shipper_has_drained_it(
        tenant, people, erasure_dirs):
    now = timezone.now()
    SpoolState.objects.create(name="proxy-2:/var/lib/steward/spool",
                              pending_segments=["seg-1-2-3"], pending_bytes=10,
                              drained_through=now - timedelta(minutes=5),
                              updated_at=now - timedelta(minutes=5))
    req = _erase(people, tenant)
    assert req.status == "failed"
    spool = req.certificate["spool"]
    assert spool["pending"] == ["proxy-2:/var/lib/steward/spool"]
    remote = next(s for s in spool["spools"] if s["name"].startswith("proxy-2:"))
    assert remote == {"name": "proxy-2:/var/lib/steward/spool", "checked": "shipper report",
                      "drained": False, "segments_pending": 1,
                      "last_report": (now - timedelta(minutes=5)).isoformat()}

    # Its shipper completes a pass that began after the erasure did: drained.
    SpoolState.objects.filter(name__startswith="proxy-2:").update(
        drained_through=timezone.now() + timedelta(seconds=5), pending_segments=[],
        updated_at=timezone.now())
    again = _erase(people, tenant)
    assert again.status == "completed", again.error
    assert again.certificate["spool"]["drained"] is True
    assert again.certificate["spool"]["pending"] == []


def test_the_shipper_reports_its_spool(tenant, agent, tmp_path):
    spool = tmp_path / "spool"
    write_records(spool, [make_record(tenant.pk, agent.pk, response=chat_response("ok"))])
    before = timezone.now()
    Shipper(spool, enqueue=None).ship_once()
    state = SpoolState.objects.get(name=f"{socket.gethostname()}:{spool.resolve()}")
    assert state.pending_segments == [] and state.pending_bytes == 0
    assert state.drained_through >= before
