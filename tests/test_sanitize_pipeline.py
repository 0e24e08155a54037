"""The sanitizer in the capture pipeline (governance/tasks.py + governance/sanitizing.py):

- steps are built from sanitized exchanges only: no planted value in any stored step, finding
  or subject-index row (the whole row text, as PostgreSQL stores it), placeholders consistent
  across the steps of a trajectory, token ids and logprob token text dropped where a value was
  replaced, images/audio removed, findings without values;
- the subject index finds the trajectory by a found identifier's keyed hash and by the subject
  header's;
- a sanitizer failure quarantines only the interaction it failed on (reason: the exception
  class), which is never eligible and visible in the trajectory document;
- the tenant's policy applies in the pipeline and in `manage.py sanitize --tenant` (as the app
  role, under row-level security);
- raw payloads: compliance only, reason required, audited as a hash, 410 once the retention or
  erasure destroyed them;
- end to end through the real proxy (mitmdump + addon), shipper and step builder.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path

import openai
import pytest
from django.db import connection
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from governance.capture.placeholders import placeholder_state, write_deltas
from governance.capture.steps import fields_from_exchange, parse_exchange
from governance.keyring import subject_hash
from governance.models import (
    AuditEvent,
    DataKey,
    Finding,
    Interaction,
    PlaceholderDelta,
    Step,
    SubjectIndex,
    Trajectory,
)
from governance.sanitizer import (
    SANITIZER_VERSION,
    PlaceholderState,
    Policy,
    Sanitizer,
    normalize_identifier,
)
from governance.sanitizing import BINARY_MARKER, finish_fields, sanitize_exchanges
from governance.tenancy import tenant_context
from tests.live import database_url_from_django
from tests.live import master_key as live_master_key
from tests.pipeline import chat_response, make_record, packed_values_text, ship_and_build

ROOT = Path(__file__).resolve().parent.parent

EMAIL = "maria.garcia@example.com"
PHONE = "+1 415 555 0142"
NAME = "Maria Garcia"
API_KEY = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z_-AbCdEf"
SUBJECT = "customer-4711"
# What must never be stored: each value, and the phone's digits (digit-for-digit leaks).
PLANTED = [EMAIL, PHONE, NAME, "Garcia", API_KEY, "4155550142", "555 0142"]


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "pii-bot")


def stored_text(sql: str, params: list) -> str:
    """Rows as PostgreSQL stores them (row_to_json), read as the superuser outside any scope."""
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return "\n".join(row[0] for row in cur.fetchall())


def all_rows_text(trajectory_ids: list[str]) -> str:
    ids = [str(t) for t in trajectory_ids]
    return "\n".join([
        stored_text("SELECT row_to_json(s)::text FROM governance_step s "
                    "WHERE s.trajectory_id::text = ANY(%s)", [ids]),
        stored_text("SELECT row_to_json(f)::text FROM governance_finding f JOIN governance_step s "
                    "ON s.id = f.step_id WHERE s.trajectory_id::text = ANY(%s)", [ids]),
        stored_text("SELECT row_to_json(x)::text FROM governance_subjectindex x "
                    "WHERE x.trajectory_id::text = ANY(%s)", [ids]),
        stored_text("SELECT row_to_json(t)::text FROM governance_trajectory t "
                    "WHERE t.id::text = ANY(%s)", [ids]),
        # Items' content is zlib'd JSON (decision 40): read as the values it holds.
        stored_text("SELECT row_to_json(c)::text FROM (SELECT id, tenant_id, trajectory_id, "
                    "kind, digest, sanitizer_version, first_step, created_at "
                    "FROM governance_conversationitem) c "
                    "WHERE c.trajectory_id::text = ANY(%s)", [ids]),
        packed_values_text(ids),
    ])


def assert_clean(text: str) -> None:
    lowered = text.casefold()
    leaked = [v for v in PLANTED if v.casefold() in lowered]
    assert not leaked, f"planted values stored: {leaked}"


def sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def pii_conversation(tenant, agent, traj: str, t0: float) -> list[dict]:
    """Three calls of one session: PII in the user text, the system prompt, tool arguments,
    a tool result, a streamed answer with logprobs and token ids, and an image."""
    system = {"role": "system", "content": f"You help {NAME} ({EMAIL})."}
    user = {"role": "user", "content": [
        {"type": "text", "text": f"I am {NAME}, mail {EMAIL}, phone {PHONE}, key {API_KEY}"},
        {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"\x89PNG" * 50).decode()}}]}
    call = {"id": "call_1", "type": "function", "function": {
        "name": "crm_lookup", "arguments": json.dumps({"email": EMAIL, "phone": PHONE})}}
    tools = [{"type": "function", "function": {"name": "crm_lookup",
                                               "parameters": {"type": "object"}}}]
    first = make_record(
        tenant.pk, agent.pk, trajectory_id=traj, session="s1", source="session",
        subject=SUBJECT, t=t0,
        request={"model": "m", "messages": [system, user], "tools": tools},
        response=chat_response(None, rid="chatcmpl-p1", tool_calls=[call]))
    tool_result = {"role": "tool", "tool_call_id": "call_1",
                   "content": json.dumps({"customer": NAME, "phone": PHONE, "tier": "gold"})}
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = f"{NAME} can be reached at {PHONE}."
    pieces = answer.split(" ")
    pieces = [p + (" " if i < len(pieces) - 1 else "") for i, p in enumerate(pieces)]
    chunks = [{"id": "chatcmpl-p2", "model": "m-1", "choices": [{"index": 0, "delta": {
        "role": "assistant", "content": piece}, "logprobs": {"content": [
            {"token": piece, "logprob": -0.1, "bytes": list(piece.encode()),
             "top_logprobs": [{"token": piece, "logprob": -0.1}], "token_id": 100 + i}]}}]}
              for i, piece in enumerate(pieces)]
    chunks.append({"id": "chatcmpl-p2", "model": "m-1", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop"}]})
    second = make_record(
        tenant.pk, agent.pk, trajectory_id=traj, session="s1", source="session",
        subject=SUBJECT, t=t0 + 1, stream=True,
        request={"model": "m", "messages": [system, user, assistant, tool_result],
                 "tools": tools, "stream": True, "logprobs": True},
        response=sse(*chunks))
    third = make_record(
        tenant.pk, agent.pk, trajectory_id=traj, session="s1", source="session",
        subject=SUBJECT, t=t0 + 2,
        request={"model": "m", "messages": [{"role": "user", "content": "Thanks, Garcia here."}]},
        response=chat_response("You are welcome, Garcia.", rid="chatcmpl-p3"))
    return [first, second, third]


# --- in-process pipeline -------------------------------------------------------------------


def test_steps_are_built_from_sanitized_exchanges_only(tenant, agent, tmp_path):
    traj = str(uuid.uuid4())
    ship_and_build(tmp_path / "spool", pii_conversation(tenant, agent, traj, time.time() - 30))
    steps = list(Step.objects.filter(trajectory_id=traj).order_by("started_at"))
    assert len(steps) == 3
    assert_clean(all_rows_text([traj]))

    s1, s2, s3 = steps
    for s in steps:
        assert s.sanitizer_version == SANITIZER_VERSION and s.training_eligible
    # Placeholders: the same person / email / phone in every step of the trajectory.
    user_text = s1.observation["messages"][1]["content"][0]["text"]
    assert user_text == ("I am <PERSON_1>, mail <EMAIL_ADDRESS_1>, phone <PHONE_NUMBER_1>, "
                         "key <OPENAI_API_KEY>")
    assert s1.observation["messages"][0]["content"] == "You help <PERSON_1> (<EMAIL_ADDRESS_1>)."
    args = json.loads(s1.action["messages"][0]["tool_calls"][0]["function"]["arguments"])
    assert args == {"email": "<EMAIL_ADDRESS_1>", "phone": "<PHONE_NUMBER_1>"}
    tool = json.loads(s2.observation["messages"][3]["content"])
    assert tool == {"customer": "<PERSON_1>", "phone": "<PHONE_NUMBER_1>", "tier": "gold"}
    assert s2.action["messages"][0]["content"] == "<PERSON_1> can be reached at <PHONE_NUMBER_1>."
    assert s3.observation["messages"][0]["content"] == "Thanks, <PERSON_1> here."
    # The image is gone from the step, and noted.
    image = s1.observation["messages"][1]["content"][1]["image_url"]["url"]
    assert image == BINARY_MARKER
    assert s1.metadata["steward.sanitizer.binary_removed"] == {"request": 1}
    # Streamed answer with a name and a phone: token ids and token text dropped, logprobs kept.
    assert "token_ids" not in s2.tokens
    assert s2.tokens["logprobs"] and all(set(e) <= {"logprob", "top_logprobs"}
                                         for e in s2.tokens["logprobs"])
    assert s2.metadata["steward.tokens.dropped"] == ["logprob_tokens", "token_ids"]

    # Findings: where and what, never the value.
    rows = list(Finding.objects.filter(step__trajectory_id=traj))
    findings = [{**f, "step_id": row.step_id, "sanitizer_version": row.sanitizer_version}
                for row in rows for f in row.details()]
    kinds = {(f["side"], f["entity_type"]) for f in findings}
    assert {("request", "EMAIL_ADDRESS"), ("request", "PHONE_NUMBER"), ("request", "PERSON"),
            ("request", "OPENAI_API_KEY"), ("response", "PERSON"),
            ("response", "PHONE_NUMBER"), ("response", "EMAIL_ADDRESS")} <= kinds
    args_finding = next(f for f in findings if f["step_id"] == s1.id
                        and f["side"] == "response" and f["entity_type"] == "EMAIL_ADDRESS")
    assert args_finding["path"] == "$.choices[0].message.tool_calls[0].function.arguments"
    assert args_finding["value_path"] == "$.email" and args_finding["operator"] == "placeholder"
    assert all(f["sanitizer_version"] == SANITIZER_VERSION for f in findings)
    # Packed one row per place and side: counts and total agree with the detail.
    for row in rows:
        assert row.total == len(row.details()) > 0
        assert row.counts == dict(sorted(Counter(f["entity_type"]
                                                 for f in row.details()).items()))

    # The trajectory's placeholder state holds keyed hashes only.
    with tenant_context(tenant):
        state = placeholder_state(traj).to_json()
    assert state["counters"]["PERSON"] == 1 and state["labels"]
    assert_clean(json.dumps(state))
    # Stored as what each batch added (decision 34): the base column stays empty.
    assert Trajectory.objects.get(pk=traj).sanitizer_state == {}
    assert PlaceholderDelta.objects.filter(trajectory_id=traj).count() == (
        Trajectory.objects.get(pk=traj).sanitizer_state_seq) >= 1
    assert_clean(json.dumps([d.delta() for d in
                             PlaceholderDelta.objects.filter(trajectory_id=traj)]))

    # Subject index: by a found identifier (any spelling) and by the subject header.
    def found(entity_type: str, value: str) -> set[str]:
        h = subject_hash(tenant.pk, normalize_identifier(entity_type, value))
        return {str(t) for t in SubjectIndex.objects.filter(
                tenant=tenant, hashes__overlap=SubjectIndex.keys([h]))
                .values_list("trajectory_id", flat=True)}

    assert found("EMAIL_ADDRESS", "Maria.Garcia@Example.com") == {traj}
    assert found("PHONE_NUMBER", "(415) 555-0142") == {traj}
    assert found("PERSON", "maria garcia") == {traj}
    header = SubjectIndex.objects.filter(
        tenant=tenant, hashes__contains=SubjectIndex.keys([subject_hash(tenant.pk, SUBJECT)]))
    assert {str(r.trajectory_id) for r in header} == {traj}
    assert {r.source for r in header} == {"header"} and header.count() == 3
    assert all(len(r.hashes) == 1 for r in header)

    event = AuditEvent.objects.filter(action="capture.steps_built").latest("seq")
    assert event.payload["sanitizer_version"] == SANITIZER_VERSION
    assert event.payload["findings"]["EMAIL_ADDRESS"] >= 2


def test_sanitizer_failure_quarantines_only_that_interaction(tenant, agent, tmp_path,
                                                             monkeypatch, make_member,
                                                             api_client_for):
    """The batch call fails; one by one, only the exchange carrying the trigger fails again:
    it is quarantined (reason: the exception class, never the payload), has no step, makes
    its trajectory ineligible and shows in the document; the others are built."""
    real = Sanitizer.sanitize_bodies

    def flaky(self, items, state=None):
        if any("TRIGGER-FAILURE" in json.dumps(body) for _, body in items):
            raise RuntimeError(f"cannot handle {EMAIL}")  # a message quoting the payload
        return real(self, items, state)

    monkeypatch.setattr(Sanitizer, "sanitize_bodies", flaky)
    traj = str(uuid.uuid4())
    t0 = time.time() - 20
    good = make_record(tenant.pk, agent.pk, trajectory_id=traj, t=t0,
                       request={"model": "m", "messages": [
                           {"role": "user", "content": f"mail {EMAIL}"}]},
                       response=chat_response("ok"))
    bad = make_record(tenant.pk, agent.pk, trajectory_id=traj, t=t0 + 1,
                      request={"model": "m", "messages": [
                          {"role": "user", "content": f"TRIGGER-FAILURE {EMAIL}"}]},
                      response=chat_response("fine"))
    other = make_record(tenant.pk, agent.pk, t=t0 + 2, response=chat_response("hello"))
    ship_and_build(tmp_path / "spool", [good, bad, other])

    ia = Interaction.objects.get(flow_id=bad["flow_id"])
    assert ia.state == "quarantined" and ia.state_reason == "sanitizer failed: RuntimeError"
    assert not Step.objects.filter(pk=bad["step_id"]).exists()
    assert Step.objects.filter(pk__in=[good["step_id"], other["step_id"]]).count() == 2
    # The placeholder numbering is not disturbed by the failed attempt.
    good_step = Step.objects.get(pk=good["step_id"])
    assert good_step.observation["messages"][0]["content"] == "mail <EMAIL_ADDRESS_1>"

    client = api_client_for(make_member("steward"), tenant)
    doc = client.get(f"/api/v1/trajectories/{traj}/").json()
    assert doc["governance"]["training_eligible"] is False
    assert doc["governance"]["quarantined"] == [{
        "step_id": bad["step_id"], "state": "quarantined",
        "reason": "sanitizer failed: RuntimeError", "started_at": ia.started_at.isoformat()}]
    assert EMAIL not in json.dumps(doc)


def test_tenant_policy_applies_in_the_pipeline(tenant, agent, tmp_path):
    from governance.services import set_sanitizer_policy

    set_sanitizer_policy("system:test", tenant, {"operators": {"EMAIL_ADDRESS": "hash"},
                                                 "deny_list": ["Project Falcon"]})
    rec = make_record(tenant.pk, agent.pk, request={"model": "m", "messages": [
        {"role": "user", "content": f"{EMAIL} asks about Project Falcon"}]},
        response=chat_response("noted"))
    ship_and_build(tmp_path / "spool", [rec])
    content = Step.objects.get(pk=rec["step_id"]).observation["messages"][0]["content"]
    assert content.startswith("<EMAIL_ADDRESS:") and content.endswith("asks about <DENY_LIST>")
    event = AuditEvent.objects.filter(action="sanitizer_policy.updated").get()
    assert event.payload["deny_list"] == 1 and "Falcon" not in json.dumps(event.payload)

    from governance.services import ServiceError

    with pytest.raises(ServiceError, match="unknown operator"):
        set_sanitizer_policy("system:test", tenant, {"operators": {"PERSON": "reverse"}})


@pytest.mark.django_db(transaction=True)
def test_sanitize_command_uses_the_tenant_policy_as_the_app_role(tenant):
    """`manage.py sanitize --tenant` reads the tenant's policy over a connection that is the
    NOBYPASSRLS app role (as in production)."""
    from governance.services import set_sanitizer_policy

    set_sanitizer_policy("system:test", tenant, {"operators": {"EMAIL_ADDRESS": "redact"}})
    body = json.dumps({"model": "m", "prompt": f"write to {EMAIL}"})
    proc = subprocess.run(
        [sys.executable, "manage.py", "sanitize", "--tenant", tenant.slug],
        input=body + "\n", capture_output=True, text=True, cwd=ROOT, timeout=240,
        env={**os.environ, "DATABASE_URL": database_url_from_django("steward_app")})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["body"]["prompt"] == "write to <EMAIL_ADDRESS>"
    assert out["findings"][0]["operator"] == "redact"


# --- raw payloads ------------------------------------------------------------------------------


@pytest.fixture
def built(tenant, agent, tmp_path):
    rec = make_record(tenant.pk, agent.pk, subject=SUBJECT, request={"model": "m", "messages": [
        {"role": "user", "content": f"I am {NAME}, {EMAIL}"}]}, response=chat_response("hi"))
    ship_and_build(tmp_path / "spool", [rec])
    return rec


def raw_url(rec: dict, reason: str | None = "ticket 42: disputed redaction") -> str:
    url = f"/api/v1/trajectories/{rec['trajectory_id']}/steps/{rec['step_id']}/raw/"
    return url + (f"?reason={reason}" if reason is not None else "")


def test_raw_payload_read_is_a_permission_needs_a_reason_and_is_audited(
        built, tenant, other_tenant, make_member, api_client_for):
    compliance = api_client_for(make_member("compliance"), tenant)
    resp = compliance.get(raw_url(built))
    assert resp.status_code == 200, resp.content
    assert resp["Cache-Control"] == "no-store"
    doc = resp.json()
    assert EMAIL in doc["request"]["body_text"]  # the raw, unsanitized bytes
    assert base64.b64decode(doc["request"]["body_base64"]) == base64.b64decode(
        built["request_body"])
    assert doc["response"]["status"] == 200 and doc["step_id"] == built["step_id"]
    event = AuditEvent.objects.filter(action="raw.read").get()
    assert event.object_id == built["step_id"] and event.actor.startswith("user:")
    assert event.payload["reason_length"] == len("ticket 42: disputed redaction")
    assert len(event.payload["reason_sha256"]) == 64
    assert "ticket" not in json.dumps(event.payload)

    assert compliance.get(raw_url(built, None)).status_code == 400
    assert compliance.get(raw_url(built, "")).status_code == 400
    for role in ("steward", "admin", "auditor"):
        client = api_client_for(make_member(role), tenant)
        assert client.get(raw_url(built)).status_code == 403, role
    outsider = api_client_for(make_member("compliance", "outsider", on=other_tenant),
                              other_tenant)
    assert outsider.get(raw_url(built)).status_code == 404
    wrong_step = {**built, "step_id": str(uuid.uuid4())}
    assert compliance.get(raw_url(wrong_step)).status_code == 404
    assert AuditEvent.objects.filter(action="raw.read").count() == 1


def test_raw_payload_cannot_be_read_after_its_retention_or_its_key_is_gone(
        built, tenant, agent, tmp_path, make_member, api_client_for):
    from governance.retention import purge_expired

    compliance = api_client_for(make_member("compliance"), tenant)
    assert compliance.get(raw_url(built)).status_code == 200
    # The raw retention ends: governance/retention.py destroys the ciphertext.
    Interaction.objects.filter(flow_id=built["flow_id"]).update(
        raw_expires_at=timezone.now() - timedelta(seconds=1))
    assert purge_expired(tenant.pk)[tenant.pk]["raw_payloads"] == 1
    resp = compliance.get(raw_url(built))
    assert resp.status_code == 410
    assert "destroyed by its retention" in resp.json()["detail"]
    # The sanitized step remains readable.
    assert compliance.get(f"/api/v1/trajectories/{built['trajectory_id']}/").status_code == 200

    # Erasure crypto-shreds the subject's data key: the ciphertext is still there, unreadable.
    rec = make_record(tenant.pk, agent.pk, subject="bob@example.com",
                      response=chat_response("hello"))
    ship_and_build(tmp_path / "spool2", [rec])
    assert compliance.get(raw_url(rec)).status_code == 200
    DataKey.objects.filter(subject_hash=subject_hash(tenant.pk, "bob@example.com")).update(
        wrapped_key=None, destroyed_at=timezone.now())
    resp = compliance.get(raw_url(rec))
    assert resp.status_code == 410 and "data key is destroyed" in resp.json()["detail"]
    assert Interaction.objects.get(flow_id=rec["flow_id"]).raw_ciphertext is not None
    assert AuditEvent.objects.filter(action="raw.read").count() == 2  # the two real reads


# --- pipeline-level property: a canary never survives into a step ----------------------------

_LOCAL = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=4, max_size=12)


@pytest.fixture(scope="module")
def plain_sanitizer() -> Sanitizer:
    return Sanitizer(Policy(secret=b"p" * 32))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(local=_LOCAL, digits=st.integers(min_value=2_000_000, max_value=9_999_999),
       where=st.sampled_from(["user", "tool_args", "tool_result", "stream"]))
def test_canaries_never_reach_step_fields(plain_sanitizer, local, digits, where):
    email = f"{local}@canary-{local[:3]}.com"
    phone = f"+1 415 {str(digits)[:3]} {str(digits)[3:]}"
    text = f"contact {email} or {phone} please"
    messages: list[dict] = [{"role": "user", "content": text if where == "user" else "hi"}]
    if where == "tool_result":
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"note": text})}]
    if where == "stream":
        response = sse(*[{"id": "x", "model": "m", "choices": [{"index": 0, "delta": {
            "content": piece}}]} for piece in (text[:9], text[9:20], text[20:])])
    elif where == "tool_args":
        response = json.dumps(chat_response(None, tool_calls=[{
            "id": "c2", "type": "function",
            "function": {"name": "f", "arguments": json.dumps({"q": text})}}])).encode()
    else:
        response = json.dumps(chat_response("done")).encode()
    ex = parse_exchange(endpoint="chat.completions",
                        request_body=json.dumps({"model": "m", "messages": messages}).encode(),
                        response_body=response, response_status=200,
                        is_stream=where == "stream")
    [result] = sanitize_exchanges(plain_sanitizer, [(ex, PlaceholderState())])
    fields = finish_fields(fields_from_exchange(result.exchange), result)
    stored = json.dumps(fields)
    assert email not in stored and str(digits)[3:] not in stored.replace(" ", "")
    assert {"EMAIL_ADDRESS", "PHONE_NUMBER"} <= {f["entity_type"] for f in result.findings}


# --- end to end: real proxy, shipper, step builder ---------------------------------------------


@pytest.mark.timeout(300)
def test_end_to_end_through_the_proxy(steward_proxy, proxy_key, make_member, api_client_for):
    from governance.capture.shipper import Shipper
    from governance.tasks import build_steps

    tenant = proxy_key.tenant
    client = openai.OpenAI(base_url=steward_proxy.base_url, api_key=proxy_key.secret,
                           max_retries=0)
    headers = {"X-Steward-Session": "e2e-1", "X-Steward-Subject": SUBJECT}
    tools = [{"type": "function", "function": {"name": "crm_lookup", "parameters": {
        "type": "object", "properties": {"input": {"type": "string"}}}}}]
    system = {"role": "system", "content": f"Assist {NAME}."}
    user = {"role": "user", "content": f"I am {NAME}, mail {EMAIL}, phone {PHONE}, "
                                       f"key {API_KEY}"}
    # 1. Streamed: the (echo) model calls the tool with the user's text as its argument.
    stream = client.chat.completions.create(model="demo-model", messages=[system, user],
                                            tools=tools, stream=True, extra_headers=headers)
    calls: dict[int, dict] = {}
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            c = calls.setdefault(tc.index, {"id": None, "args": ""})
            c["id"] = tc.id or c["id"]
            c["args"] += tc.function.arguments or ""
    call = calls[0]
    assert EMAIL in call["args"]
    # 2. The tool result carries the identifiers back; the answer repeats it, with logprobs.
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": "crm_lookup", "arguments": call["args"]}}]}
    tool = {"role": "tool", "tool_call_id": call["id"],
            "content": json.dumps({"customer": NAME, "email": EMAIL, "phone": PHONE})}
    second = client.chat.completions.create(
        model="demo-model", messages=[system, user, assistant, tool], tools=tools,
        logprobs=True, extra_headers=headers)
    assert EMAIL in second.choices[0].message.content
    # 3. A plain follow-up naming the person by surname only.
    client.chat.completions.create(model="demo-model", logprobs=True, extra_headers=headers,
                                   messages=[{"role": "user", "content": "Garcia says thanks"}])

    records = steward_proxy.wait_for_records(3)
    assert len(records) == 3
    traj = records[0]["trajectory_id"]
    assert {r["trajectory_id"] for r in records} == {traj}
    collected: list[int] = []
    # The spool is encrypted under the proxy's master key (the environment's).
    counts = Shipper(steward_proxy.spool_dir, master_key=live_master_key(),
                     enqueue=collected.extend).ship_once()
    assert counts.inserted == 3 and len(collected) == 3
    assert build_steps(collected) == {"built": 3, "quarantined": 0, "skipped": 0}

    # The served document and every stored row: none of the planted values.
    api = api_client_for(make_member("steward"), tenant)
    doc = api.get(f"/api/v1/trajectories/{traj}/").json()
    assert_clean(json.dumps(doc))
    assert_clean(all_rows_text([traj]))
    steps = doc["steps"]
    assert [s["governance"]["sanitizer_version"] for s in steps] == [SANITIZER_VERSION] * 3
    # Why, when not: the trajectory's consent, each step's eligibility and error, what is unbuilt
    # (CI of a9cadea once read False here and said no more).
    assert doc["governance"]["training_eligible"] is True, (
        doc["governance"], [(s["governance"], s.get("error")) for s in steps])
    assert doc["governance"]["findings"]["EMAIL_ADDRESS"] >= 3
    assert steps[1]["governance"]["findings"]["PERSON"] >= 1
    # Placeholders consistent across the steps.
    args = json.loads(steps[0]["action"]["messages"][0]["tool_calls"][0]["function"]
                      ["arguments"])
    assert args["input"] == ("I am <PERSON_1>, mail <EMAIL_ADDRESS_1>, phone <PHONE_NUMBER_1>, "
                             "key <OPENAI_API_KEY>")
    assert "<EMAIL_ADDRESS_1>" in steps[1]["action"]["messages"][0]["content"]
    result = steps[0]["action_result"]["tool_results"][0]["content"]
    assert json.loads(result)["email"] == "<EMAIL_ADDRESS_1>"
    assert steps[2]["observation"]["messages"][0]["content"] == "<PERSON_1> says thanks"
    # Logprob tokens spelled the identifiers: dropped; the counts are still there.
    assert "token_ids" not in steps[1]["tokens"]
    assert "logprob_tokens" in steps[1]["metadata"]["steward.tokens.dropped"]
    assert steps[1]["tokens"]["logprobs"]

    # The subject index finds the trajectory by the email's hash and by the subject header.
    by_email = SubjectIndex.objects.filter(
        tenant=tenant, hashes__overlap=SubjectIndex.keys([subject_hash(
            tenant.pk, normalize_identifier("EMAIL_ADDRESS", EMAIL))]))
    assert {str(t) for t in by_email.values_list("trajectory_id", flat=True)} == {traj}
    by_header = SubjectIndex.objects.filter(
        tenant=tenant, hashes__overlap=SubjectIndex.keys([subject_hash(tenant.pk, SUBJECT)]))
    assert {str(t) for t in by_header.values_list("trajectory_id", flat=True)} == {traj}

    # Compliance can still read what was really sent (audited).
    compliance = api_client_for(make_member("compliance"), tenant)
    raw = compliance.get(f"/api/v1/trajectories/{traj}/steps/{steps[0]['id']}/raw/"
                         "?reason=audit").json()
    assert EMAIL in raw["request"]["body_text"]


class _CountingAnalyzer:
    """A stand-in analyzer that records which strings it was asked to analyse."""

    def __init__(self, real) -> None:
        self.real = real
        self.asked: list[str] = []

    def analyze_batch(self, texts, with_ner, **options):
        self.asked.extend(texts)
        return self.real.analyze_batch(texts, with_ner, **options)


def test_analysis_cache_analyses_each_distinct_string_once(plain_sanitizer):
    """Identical strings of a batch, and strings of a recent batch, reach the analyzer once;
    the results are those of the analyzer itself, and a caller editing them cannot change
    what later hits get."""
    from governance.sanitizing import AnalysisCache

    counting = _CountingAnalyzer(plain_sanitizer.analyzer)
    cache = AnalysisCache(counting, max_entries=3)
    texts = [f"Call {NAME} at {PHONE}.", "plain words", f"Call {NAME} at {PHONE}."]
    first = cache.analyze_batch(texts, [True, True, True])
    assert counting.asked == texts[:2]
    direct = plain_sanitizer.analyzer.analyze_batch(texts, [True, True, True])
    assert [(a.spans, a.ents) for a in first] == [(d.spans, d.ents) for d in direct]
    assert first[0].spans and first[0].spans is not first[2].spans
    first[0].spans.clear()
    # Seen before: no analysis; a different option or NER choice is a different result.
    again = cache.analyze_batch(texts[:1], [True])
    assert counting.asked == texts[:2] and again[0].spans == direct[0].spans
    cache.analyze_batch(texts[:1], [False])
    cache.analyze_batch(texts[:1], [True], organizations=True)
    assert counting.asked == texts[:2] + texts[:1] * 2
    # Bounded: the least recently used result goes first.
    cache.analyze_batch(["plain words"], [True])
    assert counting.asked[-1] == "plain words" and cache.misses == 5


def test_sanitized_batch_is_the_same_with_the_cache(plain_sanitizer):
    """A batch full of repeats sanitizes exactly as without the cache: placeholders are still
    numbered per trajectory, in order."""
    from governance.sanitizing import AnalysisCache

    exchanges = [parse_exchange(
        endpoint="chat.completions", request_body=json.dumps({"model": "m", "messages": [
            {"role": "system", "content": f"You help {NAME} ({EMAIL})."},
            {"role": "user", "content": f"Call {'Tom Baker' if i % 2 else NAME} at {PHONE}"}]})
        .encode(), response_body=json.dumps(chat_response(f"Done, {NAME}.")).encode(),
        response_status=200, is_stream=False) for i in range(4)]

    def run(sanitizer):
        states = [PlaceholderState(), PlaceholderState()]
        return sanitize_exchanges(sanitizer, [(ex, states[i // 2])
                                              for i, ex in enumerate(exchanges)])

    plain = run(plain_sanitizer)
    cached_sanitizer = plain_sanitizer.with_policy(plain_sanitizer.policy)
    cached_sanitizer.analyzer = AnalysisCache(plain_sanitizer.analyzer)
    cached = run(cached_sanitizer)
    assert [r.exchange for r in cached] == [r.exchange for r in plain]
    assert [r.findings for r in cached] == [r.findings for r in plain]
    assert cached_sanitizer.analyzer.hits > cached_sanitizer.analyzer.misses


def test_a_state_committed_during_the_ner_pass_is_not_overwritten(tenant, agent, tmp_path,
                                                                    monkeypatch):
    """The trajectories are not locked across the NER pass; when another worker commits a
    trajectory's placeholder state meanwhile, the batch is sanitized again from that state
    (numbering continues, never forks) and the state written keeps both."""
    from governance import tasks

    traj = str(uuid.uuid4())
    real = tasks._sanitize
    calls: list[int] = []

    def racing(sanitizer, batch, states, histories, known):
        out = real(sanitizer, batch, states, histories, known)
        if not calls:  # another worker built an earlier step of the trajectory meanwhile
            other = PlaceholderState()
            other.label("EMAIL_ADDRESS", "someone.else@example.org", b"k")
            with tenant_context(tenant):
                write_deltas({traj: Trajectory.objects.get(pk=traj)}, {traj: other}, {})
        calls.append(len(batch))
        return out

    monkeypatch.setattr(tasks, "_sanitize", racing)
    rec = make_record(tenant.pk, agent.pk, trajectory_id=traj, request={
        "model": "m", "messages": [{"role": "user", "content": f"mail {EMAIL}"}]},
        response=chat_response("ok"))
    ship_and_build(tmp_path / "spool", [rec])
    assert calls == [1, 1]
    step = Step.objects.get(pk=rec["step_id"])
    assert step.observation["messages"][0]["content"] == "mail <EMAIL_ADDRESS_2>"
    with tenant_context(tenant):
        assert placeholder_state(traj).counters["EMAIL_ADDRESS"] == 2
    assert Trajectory.objects.get(pk=traj).sanitizer_state_seq == 2
