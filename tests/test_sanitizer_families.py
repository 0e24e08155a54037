"""Recognizer families on examples nobody here wrote: positive and negative cases taken from the
libraries' own documentation/tests (python-stdnum, phonenumbers, detect-secrets, gitleaks) and
from the third-party corpora committed under tests/bench/data (presidio-research's synthetic set,
gitleaks' rule test cases), plus a property test: a planted value of every family never survives
in any placement of an OpenAI body.

Everything goes through the product path (`Sanitizer.sanitize_bodies`, what the step builder and
`manage.py sanitize` call), with the default policy. The Sanitizer is loaded once per module."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from governance.sanitizer import Policy, Sanitizer
from tests.bench.sanitize_eval_thirdparty import (
    PLACEMENTS,
    leaked,
    load_secrets,
    load_synth,
    place,
    read_back,
    shape_ok,
)


@pytest.fixture(scope="module")
def sanitizer() -> Sanitizer:
    return Sanitizer(Policy(secret=b"f" * 32))


def out_text(sanitizer: Sanitizer, text: str, how: str = "user") -> str:
    body = place(text, how)
    result = sanitizer.sanitize_bodies([("request", body)])[0]
    assert shape_ok(body, result.body)
    back = read_back(result.body, how)
    assert back is not None
    return back


# --- per family: the libraries' own examples ----------------------------------------------------

# (family, text, value that must not survive) — from the libraries' docs and tests.
LIBRARY_POSITIVES = [
    # python-stdnum docs: iban.validate('GR16 0110 1050 0000 1054 7023 795')
    ("IBAN", "Please pay to GR16 0110 1050 0000 1054 7023 795 by Friday.",
     "GR16 0110 1050 0000 1054 7023 795"),
    ("IBAN", "iban: gr1601101050000010547023795", "gr1601101050000010547023795"),
    # python-stdnum luhn docs / the card networks' published test numbers
    ("CREDIT_CARD", "card 4111 1111 1111 1111 exp 12/29", "4111 1111 1111 1111"),
    ("CREDIT_CARD", "JCB 3530111333300000 on file", "3530111333300000"),
    ("CREDIT_CARD", "Maestro 6759649826438453 declined", "6759649826438453"),
    # phonenumbers README: "+442083661177", "020 8366 1177"; its CH example "044 668 18 00"
    ("PHONE_NUMBER", "Ring +442083661177 after six", "+442083661177"),
    ("PHONE_NUMBER", "Office: 020 8366 1177", "020 8366 1177"),
    ("PHONE_NUMBER", "Zürich office +41 44 668 18 00", "+41 44 668 18 00"),
    ("PHONE_NUMBER", "Appelez le 01.84.17.61.18", "01.84.17.61.18"),
    # detect-secrets' README / test data: keyword assignments
    ("SECRET", 'password = "hunter2isnotsafe"', "hunter2isnotsafe"),
    ("SECRET", "export MAILSAC_TOKEN=k_eVa8dcZ0YGPCdwYQTD0pU2r6s5Cd0f2Pn7Q1",
     "k_eVa8dcZ0YGPCdwYQTD0pU2r6s5Cd0f2Pn7Q1"),
    ("SECRET", '{"refreshToken": "8xLOxBtZp8Rnd2ZxKwD1Tg0bTc"}', "8xLOxBtZp8Rnd2ZxKwD1Tg0bTc"),
    ("SECRET", "GET https://api.example.com/v1/items?key=AbC123dEf456GhI789 HTTP/1.1",
     "AbC123dEf456GhI789"),
    # a secret word that ends the key's word: at the end, a separator, a digit, a camelCase
    # capital, a plural (the boundary that keeps "passenger" from naming a password)
    ("SECRET", "userPass: hunter22", "hunter22"),
    ("SECRET", 'const passwordHash = "x9Qw7Lm2";', "x9Qw7Lm2"),
    ("SECRET", "DB_PASSWORD1=hunter22x", "hunter22x"),
    ("SECRET", "apikeys=Zx9Kq2Lm7Np4Rt6Vw8Ya", "Zx9Kq2Lm7Np4Rt6Vw8Ya"),
    ("SECRET", "Authorization: Bearer abcdefgh12345678", "abcdefgh12345678"),
    ("SECRET", "aws_secret: wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
     "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    # Presidio's own recognizer docs: "My driver license is ..." and dates
    ("US_DRIVER_LICENSE", "My driver's license number is H12234567", "H12234567"),
    ("DATE_OF_BIRTH", "She was born on 2/8/1935 in a small town.", "2/8/1935"),
    ("AGE", "Patient is a 47-year-old male with chest pain.", "47"),
    ("AGE", "My father retired at the age of 66", "66"),
    ("STREET_ADDRESS", "Ship it to 1600 Amphitheatre Parkway, Mountain View, CA 94043",
     "1600 Amphitheatre Parkway"),
    ("STREET_ADDRESS", "Wohnhaft in der Feldstrasse 42, 8004 Zürich", "Feldstrasse 42"),
    ("STREET_ADDRESS", "Consegna in Via Roma 131, Torino", "Via Roma 131"),
    ("LOCATION", "I'm moving to Den Haag next month.", "Den Haag"),
    ("PERSON", "follow up with patricia desrosiers in a couple of months",
     "patricia desrosiers"),
    ("PERSON", "The founders: Kónya, Becker and Vasquez.", "Becker"),
]

LIBRARY_NEGATIVES = [
    # stdnum: a bad IBAN check digit, a card failing Luhn
    ("IBAN", "ref GR16 0110 1050 0000 1054 7023 796 rejected", "GR16 0110 1050 0000 1054 7023 796"),
    ("CREDIT_CARD", "order 4111 1111 1111 1112 shipped", "4111 1111 1111 1112"),
    # version strings, dates and prices are not phones
    ("PHONE_NUMBER", "build 10.0.19045.2965 installed", "10.0.19045.2965"),
    ("PHONE_NUMBER", "due 2024-05-01 at noon", "2024-05-01"),
    # keyword rules on non-secret values (detect-secrets' own false-positive filters)
    ("SECRET", 'api_key = os.environ["OPENAI_API_KEY"]', "os.environ"),
    ("SECRET", "password: ${DB_PASSWORD}", "${DB_PASSWORD}"),
    ("SECRET", "token_type: bearer", "bearer"),
    # a secret word inside a longer word names no secret: tau-bench's airline tool schemas and
    # policy (recorded sessions) had "such", "Each" and "payment" redacted as passwords
    ("SECRET", "The first name of the passenger, such as 'Noah'.", "such"),
    ("SECRET", "- Passengers: Each reservation can have at most five passengers.", "Each"),
    ("SECRET", "flights, passengers, payment methods, created time", "payment"),
    ("SECRET", "PASSENGERS: Lenient1 listed", "Lenient1"),
    ("SECRET", "tokenizer: bert-base-uncased-v2", "bert-base-uncased-v2"),
    ("SECRET", "Head north by compass: Marker99 is the waypoint", "Marker99"),
    # an environment dump: spaCy read the assignment "SHELL=/bin" as a place
    ("LOCATION", "export SHELL=/bin/bash", "SHELL=/bin/bash"),
    ("SECRET", "commit 9fceb02d0ae598e95dc970b74767f19372d61af8 merged",
     "9fceb02d0ae598e95dc970b74767f19372d61af8"),
    # a date that is not a date of birth, a country alone, a bare number: kept by default
    ("DATE_TIME", "The invoice is due on 2024-05-01.", "2024-05-01"),
    ("COUNTRY", "We ship to Canada and Norway.", "Canada"),
    ("AGE", "Add 53 items to the cart.", "53"),
    ("STREET_ADDRESS", "Take the main road to the station.", "main road"),
    # ticket and tracking ids are neither places nor Presidio's medical licences
    ("LOCATION", "see INC4075079 and BUG-53404", "INC4075079"),
    ("MEDICAL_LICENSE", "tracking TRK4847666515 shipped", "TRK4847666515"),
]


@pytest.mark.parametrize(("family", "text", "value"), LIBRARY_POSITIVES,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(LIBRARY_POSITIVES)])
@pytest.mark.parametrize("how", PLACEMENTS)
def test_library_positive_never_survives(sanitizer, family, text, value, how):
    assert value not in out_text(sanitizer, text, how)


# The shell's working directories in an agent's environment dump or tool output: a path under a
# key that spells "pwd", not a password; and the same key with no path still is one.
@pytest.mark.parametrize("text", ["PWD=/home/alice/project\nOLDPWD=/home/alice",
                                  '{"cwd": "/srv/app", "pwd": "/srv/app"}'])
@pytest.mark.parametrize("how", PLACEMENTS)
def test_a_working_directory_is_no_password(sanitizer, text, how):
    out = out_text(sanitizer, text, how)
    assert "<SECRET>" not in out and ("/home/alice/project" in out or "/srv/app" in out)


@pytest.mark.parametrize("how", PLACEMENTS)
def test_a_pwd_that_is_no_path_is_a_password(sanitizer, how):
    for text in ('{"db_pwd": "Tr0ub4dor3x"}', "PWD=Tr0ub4dor3x"):
        assert "Tr0ub4dor3x" not in out_text(sanitizer, text, how)


@pytest.mark.parametrize(("family", "text", "value"), LIBRARY_NEGATIVES,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(LIBRARY_NEGATIVES)])
def test_library_negative_is_kept(sanitizer, family, text, value):
    assert value in out_text(sanitizer, text)


# --- per family: the third-party corpora ---------------------------------------------------------

# Most a family may leak on its first labelled examples of the corpus (all three placements):
# regression guards at the figures the benchmark measures (tests/bench/sanitize_eval_thirdparty).
CORPUS_LIMITS = {"CREDIT_CARD": 0.0, "IBAN_CODE": 0.0, "US_SSN": 0.0, "EMAIL_ADDRESS": 0.0,
                 "PHONE_NUMBER": 0.05, "AGE": 0.0, "DOB": 0.0, "IP_ADDRESS": 0.0,
                 "STREET_ADDRESS": 0.25, "PERSON": 0.30}


@pytest.fixture(scope="module")
def synth_by_family() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for rec in load_synth(None):
        for label, _s, _e, value in rec["spans"]:
            out.setdefault(label, []).append((rec["text"], value))
    return out


@pytest.mark.parametrize("family", sorted(CORPUS_LIMITS))
def test_presidio_research_family(sanitizer, synth_by_family, family):
    examples = synth_by_family[family][:25]
    bodies = [place(text, how) for text, _ in examples for how in PLACEMENTS]
    results = sanitizer.sanitize_bodies([("request", b) for b in bodies])
    leaks = 0
    for k, r in enumerate(results):
        text, value = examples[k // len(PLACEMENTS)]
        back = read_back(r.body, PLACEMENTS[k % len(PLACEMENTS)])
        assert back is not None and shape_ok(bodies[k], r.body)
        leaks += leaked(family, value, back)
    assert leaks <= CORPUS_LIMITS[family] * len(bodies), f"{leaks} of {len(bodies)} leaked"


def test_gitleaks_positive_cases(sanitizer):
    """One test case per gitleaks rule (the first of each), in all three placements."""
    first: dict[str, dict] = {}
    for rec in load_secrets(None):
        first.setdefault(rec["rule"], rec)
    cases = list(first.values())
    bodies = [place(c["text"], how) for c in cases for how in PLACEMENTS]
    results = sanitizer.sanitize_bodies([("request", b) for b in bodies])
    leaks = [cases[k // 3]["rule"] for k, r in enumerate(results)
             if cases[k // 3]["spans"][0][3] in (read_back(r.body, PLACEMENTS[k % 3]) or "")]
    assert len(leaks) <= 0.05 * len(bodies), sorted(set(leaks))


# --- property: planted values of every family never survive, in any placement --------------------

@pytest.mark.parametrize(("key", "value"), [
    ("dob", "1961-03-14"), ("dateOfBirth", "14/03/1961"), ("age", "47"),
    ("shipping_address", "12 Rue de la Paix"), ("addressLine1", "Feldstrasse 42"),
    ("postalCode", "8004"), ("city", "Mogyorósbánya"), ("refreshToken", "abcDEF123ghiJKL"),
    ("firstName", "Zofia"), ("customer_name", "Ana Ruiz"),
])
def test_key_aware_fields(sanitizer, key, value):
    body = {"model": "m", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "update", "arguments": json.dumps({key: value, "id": 7})}}]}]}
    result = sanitizer.sanitize_bodies([("request", body)])[0]
    args = json.loads(result.body["messages"][0]["tool_calls"][0]["function"]["arguments"])
    assert args[key] != value and args["id"] == 7


PLANTS = {
    "EMAIL_ADDRESS": ("write to {v} now", "zq.canary.7731@example.org"),
    "PHONE_NUMBER": ("call {v} today", "+44 20 7946 0958"),
    "CREDIT_CARD": ("card {v} expires", "4539 1488 0343 6467"),
    "IBAN_CODE": ("iban {v}", "DE89370400440532013000"),
    "US_SSN": ("ssn {v}", "219-09-9999"),
    "SECRET": ("OPENAI_API_KEY={v}", "sk-proj-CanaryCanary0123456789abcdefXYZ"),
    "SECRET_KEYWORD": ('sessionToken: "{v}"', "Zx9Kq2Lm7Np4Rt6Vw8Ya"),
    "AWS_ACCESS_KEY": ("id {v}", "AKIACANARY0123456789"),
    "JWT": ("auth {v}", "eyJhbGciOiJIUzI1NiJ9.eyJjYW5hcnkiOiJ5ZXMifQ.c2lnbmF0dXJlX2NhbmFyeV8x"),
    "URL_PASSWORD": ("db {v}", "postgres://app:Canary0Pass@db.internal:5432/x"),
    "DATE_OF_BIRTH": ("I was born on {v}.", "14 March 1961"),
    "AGE": ("he is aged {v}.", "73"),
    "STREET_ADDRESS": ("ship to {v}.", "4711 Kastanienallee 12"),
    "PERSON": ("my name is {v}.", "Zofia Kowalczyk"),
}
filler = st.text(alphabet=st.sampled_from(list("abcdefghij klmnopqrstuvwxyz,!?\n")), max_size=40)
placement = st.sampled_from(["user", "system", "tool_arg_value", "tool_arg_note", "tool_result",
                             "tool_result_json", "response"])


# Families that only a cue identifies go into tool arguments under a key that names them (a bare
# {"value": "73"} is no age); the others stand alone there.
VALUE_KEYS = {"AGE": "age", "DATE_OF_BIRTH": "dateOfBirth", "STREET_ADDRESS": "address",
              "PERSON": "full_name"}


def _planted_body(how: str, sentence: str, value: str, key: str = "value") -> tuple[str, dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body: dict = {"model": "m", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]}
    if how == "user":
        body["messages"][1]["content"] = sentence
    elif how == "system":
        body["messages"][0]["content"] = sentence
    elif how == "tool_arg_value":
        call["function"]["arguments"] = json.dumps({key: value, "n": 3})
    elif how == "tool_arg_note":
        call["function"]["arguments"] = json.dumps({"note": sentence, "list": [sentence, 1]})
    elif how == "tool_result":
        body["messages"][3]["content"] = sentence
    elif how == "tool_result_json":
        body["messages"][3]["content"] = json.dumps({"status": "ok", "rows": [{"text": sentence}]})
    else:
        return "response", {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
                            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                "role": "assistant", "content": sentence}}]}
    return "request", body


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(PLANTS)), before=filler, after=filler, how=placement)
def test_planted_value_never_survives(sanitizer, family, before, after, how):
    template, value = PLANTS[family]
    sentence = f"{before} {template.format(v=value)} {after}".strip()
    kind, body = _planted_body(how, sentence, value, VALUE_KEYS.get(family, "value"))
    result = sanitizer.sanitize_bodies([(kind, body)])[0]
    dumped = json.dumps(result.body, ensure_ascii=False)
    assert value not in dumped and value not in json.dumps(result.body)
    digits = "".join(c for c in value if c.isdigit())
    if family in {"PHONE_NUMBER", "CREDIT_CARD", "US_SSN", "IBAN_CODE"}:
        assert digits not in "".join(c for c in dumped if c.isdigit())
    assert shape_ok(body, result.body)
    if kind == "request":
        json.loads(result.body["messages"][2]["tool_calls"][0]["function"]["arguments"])
    assert value not in json.dumps(result.findings)


# --- the recall rules of issue 14: names, address blocks, places, keyed JSON numbers ------------

# (text, value that must not survive): one or two per rule in governance/sanitizer/names.py.
NAME_RULE_POSITIVES = [
    # a known first name + a surname not in the gazetteer
    ("Please forward the file to Edvard Petrussen by Monday.", "Petrussen"),
    # a name on a line of its own (a signature, after a quote mark)
    ("Best regards,\nEsat Jeknić\n", "Jeknić"),
    ("Thanks,\n> Ella H. Snider", "Snider"),
    # strong one-word cues
    ("We adopted a dog named Vrenka last year.", "Vrenka"),
    ("Hi, call me Tovah please.", "Tovah"),
    ("My son Dariel starts school in May.", "Dariel"),
    ("Her last name is Okonkwo-Brandt.", "Okonkwo-Brandt"),
    # a known first name after a verb of speech
    ("said Gladys to the team", "Gladys"),
    ("Run the job with Python, then tell Jordan.", "Jordan"),
    # the unfamiliar members of a list with two known names in it
    ("The founders: Monjeau, Graves and Reed.", "Monjeau"),
    # Cyrillic capitals
    ("Contact: Юлия Смирнова", "Смирнова"),
]

# (text, words that must be kept): ids, versions, shas, ordinary capitalised words; and no
# PERSON anywhere (a city may be replaced, as a LOCATION).
NAME_RULE_NEGATIVES = [
    ("Release v2.3.1 (commit 9fceb02d0ae598e95dc970b74767f19372d61af8, ticket INC4075079) is "
     "out.", ["v2.3.1", "9fceb02d0ae598e95dc970b74767f19372d61af8", "INC4075079"]),
    ("The Build Pipeline\nRelease Notes\nDeploy Staging",
     ["Build Pipeline", "Release Notes", "Deploy Staging"]),
    ("The file named README is in the repo.", ["README"]),
    ("We named the branch feature-login.", ["feature-login"]),
    ("Talk to Berlin team and ask Docker about Kubernetes.", ["Docker", "Kubernetes"]),
    ("Meet with Sydney office and the Madrid team at 10.", ["office", "team"]),
]


@pytest.mark.parametrize(("text", "value"), NAME_RULE_POSITIVES,
                         ids=[f"name-{i}" for i in range(len(NAME_RULE_POSITIVES))])
@pytest.mark.parametrize("how", PLACEMENTS)
def test_name_rule_positive(sanitizer, text, value, how):
    assert value not in out_text(sanitizer, text, how)


@pytest.mark.parametrize(("text", "kept"), NAME_RULE_NEGATIVES,
                         ids=[f"not-name-{i}" for i in range(len(NAME_RULE_NEGATIVES))])
def test_name_rule_negative(sanitizer, text, kept):
    out = out_text(sanitizer, text)
    assert all(word in out for word in kept) and "<PERSON_" not in out, out


def test_place_before_a_speech_verb_name_is_no_person(sanitizer):
    """"to Paris region": Paris is a first name in the gazetteer, but here it is a place."""
    out = out_text(sanitizer, "Deploy to Paris region, then tell Jordan")
    assert "Jordan" not in out
    assert "<PERSON_" not in out.split("then")[0], out


@pytest.mark.parametrize(("text", "gone", "kept"), [
    # the block crosses a blank line to its country line
    ("Ship to:\n12 Kastanienallee\n10435 Berlin\n\nGermany", ["Kastanienallee", "10435"],
     []),
    ("Ship to:\nul. Kościuszki 5\nSuwałki\n\nPoland 11248", ["Kościuszki", "Suwałki", "11248"],
     []),
    # ... but not to a sentence after the blank line
    ("Notes:\n12 Main Street\n\nThe build failed on step 3.", ["Main Street"],
     ["The build failed on step 3."]),
])
def test_address_block_over_a_blank_line(sanitizer, text, gone, kept):
    out = out_text(sanitizer, text)
    assert not any(v in out for v in gone), out
    assert all(v in out for v in kept), out


def _keyed_number_body(obj: dict) -> dict:
    return {"model": "m", "messages": [
        {"role": "user", "content": "update the record"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "update", "arguments": json.dumps(obj)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"row": obj})}]}


@pytest.mark.parametrize(("key", "value", "replaced"), [
    ("age", 73, True), ("patient_age", 73, True), ("zip", 94107, True),
    ("birth_year", 1961, True), ("year", 2024, False), ("count", 73, False),
    ("price", 9.5, False),
])
def test_keyed_json_number(sanitizer, key, value, replaced):
    """A JSON number under an age/zip/birth-year key is that entity; other numbers stay."""
    body = _keyed_number_body({key: value, "id": 7})
    result = sanitizer.sanitize_bodies([("request", body)])[0].body
    args = json.loads(result["messages"][1]["tool_calls"][0]["function"]["arguments"])
    row = json.loads(result["messages"][2]["content"])["row"]
    for obj in (args, row):
        assert obj["id"] == 7
        if replaced:
            assert obj[key] != value and str(value) not in json.dumps(obj)
        else:
            assert obj[key] == value


def test_trimmed_address_piece_inside_a_timestamp_is_kept(sanitizer):
    """The agent-traffic regression: the phone takes "4589" of an address match "4589 Total
    2005", and the rest stops inside a timestamp, so it is not replaced as an address."""
    out = out_text(sanitizer, "phone number: (934)585-4589 Total 2005-07-09T16:41:23.115794Z "
                              "incl. VAT.")
    assert "585-4589" not in out and "Total 2005-07-09T16:41:23.115794Z" in out, out
