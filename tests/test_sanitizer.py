"""Sanitizer core: recognizers (incl. the false-positive rules), operators and policy,
placeholder consistency across steps, JSON shape preservation, property tests with canaries.

The Sanitizer (spaCy + recognizers) is loaded once for the module."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from governance import recognizers as R
from governance.sanitizer import (
    SANITIZER_VERSION,
    PlaceholderState,
    Policy,
    Sanitizer,
    normalize_identifier,
)


@pytest.fixture(scope="module")
def sanitizer() -> Sanitizer:
    return Sanitizer(Policy(secret=b"k" * 32))


def kinds(sanitizer: Sanitizer, text: str) -> set[str]:
    return {f["entity_type"] for f in sanitizer.sanitize_text(text).findings}


POSITIVES = [
    ("OPENAI_API_KEY", "key sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z_-AbCdEf"),
    ("OPENAI_API_KEY", "OPENAI_API_KEY=sk-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb"),
    ("AWS_ACCESS_KEY", "id AKIAIOSFODNN7EXAMPLE here"),
    ("AWS_SECRET_KEY", "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    ("GITHUB_TOKEN", "token ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789 ok"),
    ("GITHUB_TOKEN", "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123"),
    ("SLACK_TOKEN", "xoxb-123456789012-123456789012-AbCdEfGhIjKlMnOpQrStUvWx"),
    ("STRIPE_KEY", "sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
    ("STRIPE_KEY", "rk_live_4eC39HqLyjWDarjtT1zdp7dc"),
    ("GOOGLE_API_KEY", "AIzaSyA-1234567890abcdefghijklmnopqrstu"),
    ("BEARER_TOKEN", "Authorization: Bearer abcDEF123456ghiJKL789"),
    ("JWT", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3"),
    ("PRIVATE_KEY", "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n"
                    "-----END RSA PRIVATE KEY-----"),
    ("URL_PASSWORD", "postgres://app:s3cr3tPass@db.internal:5432/orders"),
    ("EMAIL_ADDRESS", "write to maria.garcia@example.co.uk today"),
    ("PHONE_NUMBER", "call me at +44 20 7946 0958"),
    ("PHONE_NUMBER", "my number (415) 555-0132 x123"),
    ("PHONE_NUMBER", "tel 030 1234567"),
    ("PHONE_NUMBER", "mobile 090-1234-5678"),
    ("IBAN_CODE", "IBAN GB82 WEST 1234 5698 7654 32"),
    ("IBAN_CODE", "DE89370400440532013000"),
    ("CREDIT_CARD", "card 4111 1111 1111 1111"),
    ("CREDIT_CARD", "amex 378282246310005"),
    ("IP_ADDRESS", "from 203.0.113.7 at noon"),
    ("IP_ADDRESS", "from 2001:db8:85a3::8a2e:370:7334 at noon"),
    ("US_SSN", "SSN 123-45-6789"),
    ("UK_NINO", "NI number AB 12 34 56 C"),
    ("UK_NHS", "NHS 943 476 5919"),
    ("IN_PAN", "PAN ABCPE1234F"),
    ("IN_AADHAAR", "Aadhaar 2345 6789 0124"),
    ("PERSON", "Hi, my name is John O'Neil and I need help."),
    ("PERSON", "Dear Pénélope Grégoire, thank you."),
    ("PERSON", "Thanks,\nJayson die Pelser"),
    ("SECRET", 'config password: "Tr0ub4dor&3x"'),
]


@pytest.mark.parametrize(("entity", "text"), POSITIVES)
def test_recognizes(sanitizer, entity, text):
    assert entity in kinds(sanitizer, text)


BENIGN = [
    "Order ORD-12345 shipped", "SKU-AB-1234 is back in stock", "upgrade to v1.2.3 today",
    "release 2.0.11 fixed it", "see JIRA-123 and INC0012345", "commit 3f9a1c2b7d4e merged",
    "sha 9fceb02d0ae598e95dc970b74767f19372d61af8", "at 2024-05-01T12:34:56Z",
    "at 2024-05-01 12:34:56", "epoch 1715000000", "total $1,234.56", "price €49.99",
    "build 10.0.19045.2965", "tracking TRK1234567890", "id 6f1c1d2e-5b0a-4c59-9b6e-3e7a2d1f0c42",
    "localhost 127.0.0.1", "Please send the IBAN and the BIC.",
]


@pytest.mark.parametrize("text", BENIGN)
def test_benign_agent_vocabulary_is_kept(sanitizer, text):
    result = sanitizer.sanitize_text(text)
    assert result.text == text, result.findings


def test_checksums_are_required(sanitizer):
    assert "CREDIT_CARD" not in kinds(sanitizer, "card 4111 1111 1111 1112")  # Luhn fails
    assert "IBAN_CODE" not in kinds(sanitizer, "IBAN GB82 WEST 1234 5698 7654 33")
    assert "IN_AADHAAR" not in kinds(sanitizer, "Aadhaar 2345 6789 0123")  # Verhoeff fails


def test_iban_word_is_not_an_organisation():
    s = Sanitizer(Policy(detect_organizations=True))
    text = "Please check the IBAN before the transfer to Deutsche Bank."
    findings = s.sanitize_text(text).findings
    assert not any(f["entity_type"] == "ORGANIZATION" and f["start"] == 17 for f in findings)


def test_findings_never_carry_values(sanitizer):
    r = sanitizer.sanitize_text("Mail maria@example.com, key sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tU")
    assert r.findings and "maria@example.com" not in json.dumps(r.findings)
    assert set(r.findings[0]) >= {"entity_type", "path", "start", "end", "score", "recognizer"}
    assert ("EMAIL_ADDRESS", "maria@example.com") in r.identifiers
    assert not any(t == "OPENAI_API_KEY" for t, _ in r.identifiers)  # secrets are not subjects


def chat_body(user: str, args: dict, tool_result: str) -> dict:
    return {
        "model": "gpt-4o-mini", "user": "end-user-42",
        "messages": [
            {"role": "system", "content": "You help customers of Acme."},
            {"role": "user", "content": [{"type": "text", "text": user},
                                         {"type": "image_url",
                                          "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_abc", "type": "function",
                 "function": {"name": "lookup_customer", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "call_abc", "content": tool_result},
        ],
        "tools": [{"type": "function", "function": {"name": "lookup_customer",
                                                    "parameters": {"type": "object"}}}],
        "temperature": 0.2,
    }


def assert_same_shape(before, after):
    if isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys()
        for k in before:
            assert_same_shape(before[k], after[k])
    elif isinstance(before, list):
        assert isinstance(after, list) and len(before) == len(after)
        for b, a in zip(before, after, strict=True):
            assert_same_shape(b, a)
    elif isinstance(before, str):
        assert isinstance(after, str)
    else:
        assert before == after


def test_structure_preserved_and_structural_fields_untouched(sanitizer):
    body = chat_body("I am Maria Garcia, card 4111 1111 1111 1111.",
                     {"customer_name": "Maria Garcia", "email": "maria@example.com",
                      "order_id": "ORD-1234", "limit": 5},
                     '{"owner": "Garcia", "status": "ok"}')
    r = sanitizer.sanitize_body("request", body)
    assert_same_shape(body, r.body)
    out = r.body
    assert out["model"] == "gpt-4o-mini"
    assert [m["role"] for m in out["messages"]] == ["system", "user", "assistant", "tool"]
    call = out["messages"][2]["tool_calls"][0]
    assert call["id"] == "call_abc" and call["function"]["name"] == "lookup_customer"
    args = json.loads(call["function"]["arguments"])
    assert args["order_id"] == "ORD-1234" and args["limit"] == 5
    assert args["customer_name"] == "<PERSON_1>" and args["email"] == "<EMAIL_ADDRESS_1>"
    assert json.loads(out["messages"][3]["content"])["owner"] == "<PERSON_1>"
    assert out["user"] == "<SUBJECT_ID_1>"
    assert out["messages"][1]["content"][1]["image_url"]["url"] == "data:image/png;base64,AAAA"
    assert "Maria" not in json.dumps(out) and "4111" not in json.dumps(out)
    paths = {f["path"] for f in r.findings}
    assert "$.messages[2].tool_calls[0].function.arguments" in paths
    assert any(f.get("value_path") == "$.customer_name" for f in r.findings)


def test_placeholders_consistent_across_steps(sanitizer):
    state = PlaceholderState()
    s1 = sanitizer.sanitize_body("request", chat_body(
        "My name is Maria Garcia, email maria@example.com", {"q": "x"}, "ok"), state)
    # The next step is another call: the state travels as JSON (as the step builder stores it).
    stored = json.dumps(state.to_json())
    assert "maria" not in stored.lower() and "garcia" not in stored.lower()
    state2 = PlaceholderState.from_json(stored)
    s2 = sanitizer.sanitize_bodies([
        ("request", chat_body("Bob Stone here. Is maria@example.com updated for Garcia?",
                              {"customer_name": "Maria Garcia"}, "ok")),
        ("response", {"object": "chat.completion", "id": "chatcmpl-1", "model": "m",
                      "choices": [{"index": 0, "finish_reason": "stop", "message": {
                          "role": "assistant", "content": "Done, Maria Garcia is updated."}}]}),
    ], state2)
    t1 = json.dumps(s1.body)
    t2 = json.dumps([r.body for r in s2])
    assert "<PERSON_1>" in t1 and "<EMAIL_ADDRESS_1>" in t1
    assert "Is <EMAIL_ADDRESS_1> updated for <PERSON_1>" in t2  # alias: surname alone
    assert "<PERSON_2> here" in t2  # a new person gets the next number
    assert "Done, <PERSON_1> is updated." in t2


def test_operators_and_policy():
    secret = b"s" * 32
    text = "Contact Maria Garcia at maria@example.com, key AKIAIOSFODNN7EXAMPLE, ACME-PROJECT-X."
    hashed = Sanitizer(Policy(operators={"EMAIL_ADDRESS": "hash", "PERSON": "redact"},
                              deny_list=["acme-project-x"], secret=secret)).sanitize_text(text)
    assert "<PERSON>" in hashed.text and "<AWS_ACCESS_KEY>" in hashed.text
    assert "<DENY_LIST>" in hashed.text
    tag = [w for w in hashed.text.split() if w.startswith("<EMAIL_ADDRESS:")][0]
    again = Sanitizer(Policy(operators={"EMAIL_ADDRESS": "hash"}, secret=secret)).sanitize_text(
        "mail MARIA@example.com")
    assert tag.rstrip(",") in again.text  # keyed hash: stable per tenant, normalised
    other = Sanitizer(Policy(operators={"EMAIL_ADDRESS": "hash"}, secret=b"o" * 32))
    assert tag.rstrip(",") not in other.sanitize_text("mail maria@example.com").text
    allowed = Sanitizer(Policy(allow_list=["support@acme.com"])).sanitize_text(
        "write to support@acme.com or maria@example.com")
    assert "support@acme.com" in allowed.text and "maria@example.com" not in allowed.text
    with pytest.raises(ValueError):
        Policy(operators={"PERSON": "reversible"})
    assert "secret" not in Policy(secret=secret).to_dict()


def test_idempotent(sanitizer):
    first = sanitizer.sanitize_text("I am Maria Garcia, +44 20 7946 0958.")
    second = sanitizer.sanitize_text(first.text)
    assert second.text == first.text and not second.findings


def test_responses_api_and_logprobs(sanitizer):
    tokens = ["Mail ", "maria", "@", "example", ".com", " now"]
    body = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": [{
        "index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": "".join(tokens)},
        "logprobs": {"content": [{"token": t, "logprob": -0.1, "bytes": list(t.encode()),
                                  "top_logprobs": [{"token": t, "logprob": -0.1,
                                                    "bytes": list(t.encode())}]}
                                 for t in tokens]}}]}
    out = sanitizer.sanitize_body("response", body).body
    lp = out["choices"][0]["logprobs"]["content"]
    assert len(lp) == len(tokens)
    assert "maria" not in json.dumps(lp) and "example" not in json.dumps(lp)
    assert "".join(t["token"] for t in lp) == out["choices"][0]["message"]["content"]
    resp = {"id": "resp_1", "object": "response", "model": "gpt-4.1", "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [
            {"type": "summary_text", "text": "User Maria Garcia wants a refund."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "refund",
         "arguments": '{"iban": "DE89370400440532013000"}'}],
        "instructions": "Customer phone +44 20 7946 0958."}
    out = sanitizer.sanitize_body("response", resp).body
    dumped = json.dumps(out)
    assert "Garcia" not in dumped and "DE8937" not in dumped and "7946" not in dumped
    assert out["output"][1]["name"] == "refund" and out["output"][1]["call_id"] == "call_1"
    assert json.loads(out["output"][1]["arguments"]) == {"iban": "<IBAN_CODE_1>"}


def test_batch_with_one_state_per_item(sanitizer):
    a, b = PlaceholderState(), PlaceholderState()
    res = sanitizer.sanitize_bodies([
        ("request", {"model": "m", "prompt": "Mail ann@example.com"}),
        ("request", {"model": "m", "prompt": "Mail bob@example.com"}),
    ], [a, b])
    # Two trajectories: each starts its own numbering.
    assert res[0].body["prompt"] == res[1].body["prompt"] == "Mail <EMAIL_ADDRESS_1>"


def test_tldextract_stays_offline(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    R.offline_tldextract()
    import tldextract

    assert tldextract.extract("mail.example.co.uk").suffix == "co.uk"
    from presidio_analyzer.predefined_recognizers import EmailRecognizer

    found = EmailRecognizer().analyze("write to a@b.example.com", ["EMAIL_ADDRESS"])
    assert found


def test_presidio_analyzer_uses_our_recognizers(sanitizer):
    results = sanitizer.presidio_analyzer().analyze(
        "key AKIAIOSFODNN7EXAMPLE for Maria Garcia", language="en")
    assert {"AWS_ACCESS_KEY", "PERSON"} <= {r.entity_type for r in results}


def test_normalize_identifier():
    assert normalize_identifier("PHONE_NUMBER", "+1 (415) 555-0132") == normalize_identifier(
        "PHONE_NUMBER", "415.555.0132")
    assert normalize_identifier("EMAIL_ADDRESS", " Alice@X.com") == "alice@x.com"
    assert SANITIZER_VERSION


# --- property tests ----------------------------------------------------------------------------

CANARIES = {
    "EMAIL_ADDRESS": "zq.canary.7731@example.org",
    "OPENAI_API_KEY": "sk-proj-CanaryCanary0123456789abcdefXYZ",
    "AWS_ACCESS_KEY": "AKIACANARY0123456789",
    "CREDIT_CARD": "4539 1488 0343 6467",
    "IBAN_CODE": "DE89370400440532013000",
    "PHONE_NUMBER": "+44 20 7946 0958",
    "US_SSN": "219-09-9999",
    "JWT": "eyJhbGciOiJIUzI1NiJ9.eyJjYW5hcnkiOiJ5ZXMifQ.c2lnbmF0dXJlX2NhbmFyeV8x",
    "GITHUB_TOKEN": "ghp_CanaryCanaryCanaryCanary0123456789ab",
}
filler = st.text(alphabet=st.sampled_from(list("abcdefghij klmnopqrstuvwxyz.,!?\n")),
                 max_size=40)
where = st.sampled_from(["user", "system", "args_value", "args_note", "tool", "response"])


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entity=st.sampled_from(sorted(CANARIES)), before=filler, after=filler, place=where,
       n_msgs=st.integers(min_value=0, max_value=3))
def test_canary_never_survives_and_shape_never_changes(sanitizer, entity, before, after, place,
                                                        n_msgs):
    canary = CANARIES[entity]
    text = f"{before} {canary} {after}"
    body = chat_body("hello there", {"order_id": "ORD-1"}, "ok")
    body["messages"] += [{"role": "user", "content": f"{before} message {i}"}
                         for i in range(n_msgs)]
    if place == "user":
        body["messages"][1]["content"][0]["text"] = text
    elif place == "system":
        body["messages"][0]["content"] = text
    elif place == "args_value":
        body["messages"][2]["tool_calls"][0]["function"]["arguments"] = json.dumps(
            {"value": canary, "n": 3})
    elif place == "args_note":
        body["messages"][2]["tool_calls"][0]["function"]["arguments"] = json.dumps(
            {"note": text, "list": [text, 1]})
    elif place == "tool":
        body["messages"][3]["content"] = text
    if place == "response":
        kind = "response"
        body = {"id": "chatcmpl-9", "object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": text}}]}
    else:
        kind = "request"
    result = sanitizer.sanitize_body(kind, body)
    dumped = json.dumps(result.body)
    assert canary not in dumped and canary not in json.dumps(result.body, ensure_ascii=False)
    digits = "".join(ch for ch in canary if ch.isdigit())
    if entity in {"CREDIT_CARD", "PHONE_NUMBER", "US_SSN"}:
        assert digits not in "".join(ch for ch in dumped if ch.isdigit())
    assert_same_shape(body, result.body)
    if kind == "request":
        json.loads(result.body["messages"][2]["tool_calls"][0]["function"]["arguments"])
    assert canary not in json.dumps(result.findings)
