"""Hostile input on the web side (REST and console): NUL and control characters, invalid UTF-8,
lone surrogates, absurd numbers and nesting — in headers, query strings and JSON fields. Each
gets a clear 4xx in the caller's own shape (DRF's `{"detail": ...}` or `{"field": [...]}` on
REST; a page with the reason in the console), never a 500, and nothing already stored is lost.

Requests go through Django's real WSGI stack (every middleware, the request transaction, row
level security as the app role) against the real PostgreSQL; WSGI hands header bytes over as
latin-1 text, which is what the test client's `HTTP_*` strings are. The proxy's hostile inputs
are in tests/test_hostile_proxy.py."""

from __future__ import annotations

import json
import socket
import uuid
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from rest_framework.test import APIClient

from governance.models import Reward
from tests.govdata import make_trajectory
from tests.test_web_access_log import gunicorn_web  # noqa: F401 - a fixture used below

# Bytes no UTF-8 decoder accepts, as WSGI delivers them (latin-1 text).
INVALID_UTF8 = b"\xff\xfe\xc3\x28".decode("latin-1")
CONTROL = "a\x00b\x01c\x1b[31md\x7f"


def assert_drf_error(response: Any, *statuses: int) -> dict[str, Any]:
    """A 4xx whose body is DRF's error JSON (a `detail` string, or field -> messages)."""
    assert response.status_code in (statuses or range(400, 500)), (
        response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = response.json()
    assert isinstance(body, dict) and body, body
    if "detail" in body:
        assert isinstance(body["detail"], str) and body["detail"]
    else:
        assert all(isinstance(v, list | dict) for v in body.values()), body
    return body


@pytest.fixture
def steward(make_member, tenant, api_client_for) -> APIClient:
    return api_client_for(make_member("steward", "stew"), tenant)


@pytest.fixture
def officer(make_member, tenant, api_client_for) -> APIClient:
    return api_client_for(make_member("compliance", "comp"), tenant)


# --- the Authorization header -------------------------------------------------------------

HOSTILE_AUTHORIZATION = [
    pytest.param("\xffBearer stwt_x", id="non-utf8-scheme"),
    pytest.param("Bearer stwt_\xff\xfe\xfd", id="non-utf8-token"),
    pytest.param("Bearer " + INVALID_UTF8, id="invalid-utf8-sequence"),
    pytest.param("Bearer stwt_\x00abc", id="nul-in-token"),
    pytest.param("Bearer stwt_\x1b[2Jabc", id="escape-in-token"),
    pytest.param("Token \x7f\x7f", id="del-in-token"),
    pytest.param("Bearer stwt_" + "A" * 8000, id="8k-token"),
]


@pytest.mark.parametrize("value", HOSTILE_AUTHORIZATION)
def test_hostile_authorization_header_is_401_in_drf_shape(db, value):
    client = APIClient()
    response = client.get("/api/v1/trajectories/", HTTP_AUTHORIZATION=value)
    body = assert_drf_error(response, 401)
    assert "detail" in body
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_valid_token_still_authenticates_next_to_hostile_ones(steward):
    assert steward.get("/api/v1/trajectories/").status_code == 200


# --- query strings --------------------------------------------------------------------------

# (path, parameter) pairs the REST API reads from the query string.
QUERY_PARAMETERS = [
    ("/api/v1/trajectories/", "agent"),
    ("/api/v1/trajectories/", "session"),
    ("/api/v1/trajectories/", "since"),
    ("/api/v1/rewards/", "response_id"),
    ("/api/v1/rewards/", "trajectory_id"),
    ("/api/v1/audit/", "action"),
    ("/api/v1/audit/", "actor"),
    ("/api/v1/dataset-versions/", "status"),
    ("/api/v1/trajectories/", "cursor"),
]
# Raw query-string values (already percent-encoded, as a client would send them).
HOSTILE_QUERY_VALUES = [
    pytest.param("x%00y", id="nul"),
    pytest.param("%01%02%1b%5b31m", id="control"),
    pytest.param("%ff%fe", id="invalid-utf8"),
    pytest.param("%ed%a0%80", id="encoded-surrogate"),
    pytest.param("%c0%80", id="overlong-nul"),
]


@pytest.mark.parametrize("value", HOSTILE_QUERY_VALUES)
@pytest.mark.parametrize(("path", "name"), QUERY_PARAMETERS)
def test_hostile_query_string_is_400_in_drf_shape(make_member, tenant, api_client_for, path,
                                                 name, value):
    client = api_client_for(make_member("admin", "owner"), tenant)
    response = client.get(f"{path}?{name}={value}")
    assert_drf_error(response, 400)


def test_hostile_parameter_name_is_400(steward):
    assert_drf_error(steward.get("/api/v1/trajectories/?a%00b=1"), 400)


def test_plain_unicode_query_is_fine(steward):
    """Not everything outside ASCII is hostile: a real name in a filter is a normal search."""
    response = steward.get("/api/v1/rewards/?response_id=r%C3%A9ponse-%E2%9C%93")
    assert response.status_code == 200, response.content[:300]


# --- JSON bodies ----------------------------------------------------------------------------


def _post_json(client: APIClient, path: str, raw: bytes | str) -> Any:
    data = raw.encode() if isinstance(raw, str) else raw
    return client.generic("POST", path, data, content_type="application/json")


REWARD_FIELDS = ["response_id", "name", "comment"]
HOSTILE_STRINGS = [
    pytest.param("\\u0000", id="nul"),
    pytest.param("a\\u0000b", id="embedded-nul"),
    pytest.param("\\ud800", id="lone-surrogate"),
    pytest.param("\\udfff\\ud800", id="reversed-surrogates"),
]


@pytest.mark.parametrize("text", HOSTILE_STRINGS)
@pytest.mark.parametrize("field", REWARD_FIELDS)
def test_hostile_reward_string_is_400(steward, field, text):
    body = {"response_id": "chatcmpl-ok", "value": 1.0}
    raw = json.dumps(body)[:-1] + f', "{field}": "{text}"}}'
    response = _post_json(steward, "/api/v1/rewards/", raw)
    errors = assert_drf_error(response, 400)
    # DRF's field error, or the parser's naming the field.
    assert field in errors or field in errors.get("detail", ""), errors
    assert not Reward.objects.exists()


@pytest.mark.parametrize("raw", [
    pytest.param('{"response_id": "r", "value": 1e999}', id="infinity"),
    pytest.param('{"response_id": "r", "value": NaN}', id="nan"),
    pytest.param('{"response_id": "r", "value": -Infinity}', id="minus-infinity"),
    pytest.param('{"response_id": "r", "value": 1' + "0" * 400 + "}", id="int-overflows-float"),
    pytest.param('{"response_id": "r", "value": 1' + "0" * 5000 + "}", id="5000-digit-int"),
    pytest.param('{"response_id": "r", "value": "1\\u0000"}', id="nul-in-number-string"),
    pytest.param('{"response_id": "r", "value": 1, "final": "\\u0000"}', id="nul-in-bool"),
    pytest.param('{"trajectory_id": "\\u0000", "value": 1}', id="nul-in-uuid"),
    pytest.param('{"trajectory_id": "' + "f" * 10000 + '", "value": 1}', id="long-uuid"),
])
def test_hostile_reward_number_is_400(steward, raw):
    assert_drf_error(_post_json(steward, "/api/v1/rewards/", raw), 400)
    assert not Reward.objects.exists()


@pytest.mark.parametrize("raw", [
    pytest.param(b'{"response_id": "r\xff", "value": 1}', id="invalid-utf8-body"),
    pytest.param(b"\xef\xbb\xbf\xff\xfe", id="bom-then-garbage"),
    pytest.param(b'{"response_id": "r", "value": 1', id="truncated"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, id="nested-100k"),
    pytest.param(b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, id="nested-objects-50k"),
    pytest.param(b"\x00" * 64, id="nul-bytes"),
    pytest.param(b'"just a string"', id="not-an-object"),
    pytest.param(b"[]", id="a-list"),
])
def test_hostile_json_body_is_400(steward, raw):
    assert_refused(steward, "/api/v1/rewards/", raw, Reward)


def assert_refused(client: APIClient, path: str, raw: bytes | str, model: Any) -> None:
    """POSTing `raw` is a 400 in DRF's shape and stores no `model` row."""
    assert_drf_error(_post_json(client, path, raw), 400)
    assert not model.objects.exists()


@pytest.mark.parametrize("subject", [
    pytest.param("\\u0000", id="nul"),
    pytest.param("maria\\u0000@example.com", id="embedded-nul"),
    pytest.param("\\ud83d", id="lone-surrogate"),
    pytest.param("\\u0001\\u0002\\u001b", id="control-only"),
    pytest.param("   ", id="blank"),
])
def test_hostile_erasure_subject_is_400(officer, subject):
    from governance.models import ErasureRequest

    assert_refused(officer, "/api/v1/erasure-requests/", f'{{"subject": "{subject}"}}',
                   ErasureRequest)


@pytest.mark.parametrize("raw", [
    pytest.param('{"name": "a\\u0000b"}', id="nul-in-name"),
    pytest.param('{"name": "\\ud800"}', id="surrogate-in-name"),
    pytest.param('{"name": "ok", "agent_ids": [1' + "0" * 30 + "]}", id="agent-id-overflow"),
    pytest.param('{"name": "ok", "agent_ids": [9223372036854775808]}', id="agent-id-int8+1"),
    pytest.param('{"name": "ok", "since": "2026-13-45T99:99"}', id="bad-date"),
    pytest.param('{"name": "ok", "since": "\\u0000"}', id="nul-date"),
    pytest.param('{"name": "ok", "since": "99999-01-01T00:00:00Z"}', id="year-99999"),
    pytest.param('{"name": "ok", "reward_min": 1e999, "reward_name": "r"}', id="inf-bound"),
    pytest.param('{"name": "ok", "classification": "\\u0000"}', id="nul-choice"),
])
def test_hostile_dataset_definition_is_400(steward, raw):
    from governance.models import Dataset

    assert_refused(steward, "/api/v1/datasets/", raw, Dataset)


@pytest.mark.parametrize("raw", [
    pytest.param('{"dataset_version": 1, "config": {"seed": "\\u0000"}}', id="nul-in-config"),
    pytest.param('{"dataset_version": 1, "config": {"\\ud800": 1}}', id="surrogate-config-key"),
    pytest.param('{"dataset_version": 1, "config": ' + '{"a": ' * 5000 + "1" + "}" * 5001,
                 id="deep-config"),
    pytest.param('{"dataset_version": 99999999999999999999, "config": {}}', id="huge-version"),
    pytest.param('{"dataset_version": "\\u0000"}', id="nul-version"),
    pytest.param('{"dataset_version": 1, "reward_params": {"k": "\\u001b[31m"}}',
                 id="escape-in-reward-params"),
    pytest.param('{"dataset_version": 1, "base_model": "\\u0000"}', id="nul-base-model"),
])
def test_hostile_training_job_launch_is_400(steward, raw):
    from trainer.models import TrainingJob

    assert_refused(steward, "/api/v1/training-jobs/", raw, TrainingJob)


@pytest.mark.parametrize("raw", [
    pytest.param('{"classification": "\\u0000", "steps_days": 1, "raw_days": 1, '
                 '"findings_days": 1, "audit_days": 1}', id="nul-classification"),
    pytest.param('{"classification": "*", "steps_days": 1' + "0" * 30 + ', "raw_days": 1, '
                 '"findings_days": 1, "audit_days": 1}', id="days-overflow"),
    pytest.param('{"classification": "*", "steps_days": -1, "raw_days": 1, '
                 '"findings_days": 1, "audit_days": 1}', id="negative-days"),
])
def test_hostile_retention_policy_is_400(make_member, tenant, api_client_for, raw):
    from governance.models import RetentionPolicy

    assert_refused(api_client_for(make_member("compliance", "comp"), tenant),
                   "/api/v1/retention-policies/", raw, RetentionPolicy)


@pytest.mark.parametrize("path", [
    "/api/v1/trajectories/%00/", "/api/v1/trajectories/%ff/",
    "/api/v1/dataset-versions/99999999999999999999999/",
    "/api/v1/erasure-requests/-1/", "/api/v1/datasets/1%00/",
])
def test_hostile_object_ids_are_404(make_member, tenant, api_client_for, path):
    response = api_client_for(make_member("admin", "owner"), tenant).get(path)
    assert response.status_code == 404, (response.status_code, response.content[:200])


def test_raw_read_reason_with_nul_is_400(officer, tenant):
    """The reason is recorded as a hash, but a NUL in it is still refused, not half-stored."""
    from governance.models import AuditEvent
    from governance.services import ensure_agent

    trajectory = make_trajectory(tenant, ensure_agent("system:test", tenant, "bot"), steps=1)
    step = trajectory.steps.first()
    before = AuditEvent.objects.count()
    response = officer.get(f"/api/v1/trajectories/{trajectory.pk}/steps/{step.pk}/raw/"
                           "?reason=audit%00check")
    assert_drf_error(response, 400)
    assert AuditEvent.objects.count() == before  # nothing read, nothing recorded


def test_hostile_accept_and_content_type_headers(steward):
    response = steward.get("/api/v1/trajectories/", HTTP_ACCEPT="\xff\xfe/\x7f")
    assert response.status_code in (200, 406), response.status_code
    response = steward.generic("POST", "/api/v1/rewards/", b'{"response_id": "r", "value": 1}',
                               content_type="application/json; charset=\xff\xfe")
    assert response.status_code in (201, 400, 415), (response.status_code,
                                                     response.content[:300])
    response = steward.generic("POST", "/api/v1/rewards/", b'{"response_id": "r", "value": 1}',
                               content_type="\xff/\xfe")
    assert_drf_error(response, 415)


# Header lines a client can put on the wire that the test client cannot express (NUL, bare
# CR): the real web server, gunicorn with the appliance's command line, refuses them itself.
RAW_HEADER_LINES = [
    pytest.param(b"Authorization: Bearer stwt_\x00abc", id="nul-in-authorization"),
    pytest.param(b"Content-Type: application/json; charset=\x00", id="nul-in-content-type"),
    pytest.param(b"X-Anything: a\rb", id="bare-cr"),
    pytest.param(b"Authorization: Bearer \xff\xfe\xfd", id="non-utf8-authorization"),
    pytest.param(b"Bad Name: x", id="space-in-name"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("line", RAW_HEADER_LINES)
def test_hostile_header_bytes_on_the_wire(gunicorn_web, line):  # noqa: F811
    """Never a 500, and the server keeps answering."""
    base, _log = gunicorn_web
    url = urlparse(base)
    body = b'{"response_id": "r", "value": 1}'
    request = (b"POST /api/v1/rewards/ HTTP/1.1\r\nHost: 127.0.0.1\r\n" + line + b"\r\n"
               + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n"
               + b"\r\n" + body)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:300]
    assert httpx.get(base + "/api/v1/trajectories/").status_code == 401


def test_accepted_rows_survive_a_hostile_neighbour(steward, tenant):
    """A refused request loses nothing already accepted (the request transaction is its own)."""
    good = steward.post("/api/v1/rewards/", {"response_id": "chatcmpl-1", "value": 0.5},
                        format="json")
    assert good.status_code == 201
    bad = _post_json(steward, "/api/v1/rewards/", '{"response_id": "x\\u0000", "value": 1}')
    assert_drf_error(bad, 400)
    assert list(Reward.objects.values_list("response_id", flat=True)) == ["chatcmpl-1"]
    listed = steward.get("/api/v1/rewards/").json()
    assert [r["response_id"] for r in listed["results"]] == ["chatcmpl-1"]


# --- the console ----------------------------------------------------------------------------


@pytest.mark.parametrize("query", [
    "session=a%00b", "agent=%ff%fe", "started_after=%00", "subject=%00",
    "subject_ref=%00%ff", "page=%00", "status=%1b",
])
def test_hostile_console_search_is_a_page_not_a_500(client, make_member, query):
    client.force_login(make_member("compliance"))
    response = client.get(f"/trajectories/?{query}")
    assert response.status_code in (200, 303, 400), response.status_code


def test_console_subject_post_with_nul_says_why(client, make_member):
    client.force_login(make_member("compliance"))
    response = client.post("/trajectories/", {"subject": "maria\x00@example.com"})
    assert response.status_code == 200
    assert "Null characters are not allowed" in response.content.decode()


def test_hostile_login_form_is_a_page(client, db):
    """NUL, control characters, a 10,000-character username: the login page again, nothing
    authenticated, nothing counted by the throttle (tests/test_login_throttle.py)."""
    from axes.models import AccessAttempt

    for username in ("a\x00b", "x" * 10_000, "\x1b[2J\x07"):
        response = client.post("/login/", {"username": username, "password": "\x00"})
        assert response.status_code == 200, response.status_code
        assert "_auth_user_id" not in client.session
    assert not AccessAttempt.objects.filter(username__startswith="xxxx").exists()


def test_unused_uuid_is_404_not_500(steward):
    assert steward.get(f"/api/v1/trajectories/{uuid.uuid4()}/").status_code == 404
