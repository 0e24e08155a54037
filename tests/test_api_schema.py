"""API quality: the OpenAPI document is complete and valid, and schemathesis, run in-process
against the real WSGI application and PostgreSQL (row-level security on), finds no server error
and no response that contradicts the schema; without a valid token every protected operation
answers 401/403.

The run is bounded (MAX_EXAMPLES per operation and generation mode) so the suite stays fast.
Generated path ids are swapped, half of the time, for ids of real objects of the tenant, so the
GETs, updates and actions also run on objects that exist (not only on 404s)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
)

from governance import services
from tests.govdata import make_trajectory
from tests.pipeline import chat_response, make_record, ship_and_build

ROOT = Path(__file__).resolve().parent.parent
MAX_EXAMPLES = 15
# Operations anyone may call (they hold no tenant data).
PUBLIC = {"GET /api/v1/atdp/schema/"}
# Answers DRF gives to a refused or malformed request (in DRF's JSON error shape); drf-spectacular
# documents the success responses only, so these are accepted on top of the documented ones.
ERROR_STATUSES = {400, 401, 403, 404, 405, 409, 410, 415}


def test_openapi_schema_validates_without_warnings():
    """`manage.py spectacular --validate --fail-on-warn`: every view resolves to a documented
    operation, every serializer field has a type, and the result is valid OpenAPI 3."""
    out = subprocess.run(
        [sys.executable, "manage.py", "spectacular", "--validate", "--fail-on-warn",
         "--format", "openapi-json", "--file", "/dev/null"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Warning" not in out.stderr and "Error" not in out.stderr, out.stderr


@pytest.fixture
def wsgi_app() -> Iterator[WSGIHandler]:
    """Django's real WSGI handler, called in-process. Its request signals would close the
    test's database connection (it sits in the test transaction); Django's test client
    detaches them the same way."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield WSGIHandler()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def api_schema(wsgi_app, tenant, make_member):
    """The served document, read with a token: /api/schema/ is not public."""
    issued = services.create_api_token("system:test", tenant, make_member("auditor", "schema"))
    return schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app,
                                          headers={"Authorization": f"Bearer {issued.secret}"})


@pytest.fixture
def world(tenant, other_tenant, make_member, tmp_path) -> dict[str, Any]:
    """Tenant acme with members of every role, captured trajectories (through the real shipper
    and step builder, so raw payloads are real ciphertext), sanitized ones for datasets,
    rewards, a dataset with a draft and a version awaiting approval, a retention policy,
    training jobs and checkpoints, an erasure request. Globex has a trajectory of its own."""
    members = {role: make_member(role, f"{role}-m") for role in
               ("admin", "steward", "compliance", "auditor")}
    bot = services.ensure_agent("system:test", tenant, "support-bot")
    foreign = services.ensure_agent("system:test", other_tenant, "support-bot")
    base = time.time() - 3600
    captured = [str(uuid.uuid4()) for _ in range(2)]
    records = [
        make_record(tenant.pk, bot.pk, trajectory_id=captured[0], session="s-1",
                    source="session", t=base, subject="alice@example.com",
                    response=chat_response("a", rid="chatcmpl-a")),
        make_record(tenant.pk, bot.pk, trajectory_id=captured[0], session="s-1",
                    source="session", t=base + 5, response=chat_response("b")),
        make_record(tenant.pk, bot.pk, trajectory_id=captured[1], t=base + 60,
                    consent="no-train", response=chat_response("c")),
        make_record(other_tenant.pk, foreign.pk, t=base + 30, response=chat_response()),
    ]
    ship_and_build(tmp_path / "spool", records)
    sanitized = [make_trajectory(tenant, bot, steps=2, raw=None) for _ in range(3)]
    steward = members["steward"]
    services.record_reward(steward, tenant, value=1.0, response_id="chatcmpl-a")
    services.record_reward(steward, tenant, value=0.5, trajectory_id=sanitized[0].pk)
    dataset = services.create_dataset(steward, tenant, name="support")
    draft = services.freeze_dataset_version(steward, dataset)
    pending = services.freeze_dataset_version(steward, dataset)
    services.request_approval(steward, pending)
    policy = services.set_retention_policy("system:test", tenant, "public", steps_days=30,
                                           raw_days=7, findings_days=30, audit_days=365)
    jobs, checkpoints = _training_objects(tenant, pending, members["admin"], tmp_path)
    erasures: list[int] = []
    if importlib.util.find_spec("governance.erasure") is not None:
        from governance.erasure import request_erasure

        # Pending (its job is queued after the commit, which a test transaction never makes).
        erasures.append(request_erasure(members["admin"], tenant, "bob@example.com")[0].pk)
    from governance.models import Reward, Step

    steps = [str(s) for s in Step.objects.filter(tenant=tenant).values_list("id", flat=True)]
    return {
        "members": members,
        # path parameter values of real objects, per path prefix
        "ids": {
            "/api/v1/trajectories/": [*captured, *(str(t.pk) for t in sanitized)],
            "/api/v1/rewards/": list(Reward.objects.filter(tenant=tenant)
                                     .values_list("id", flat=True)),
            "/api/v1/datasets/": [dataset.pk],
            "/api/v1/dataset-versions/": [draft.pk, pending.pk],
            "/api/v1/retention-policies/": [policy.pk],
            "/api/v1/training-jobs/": jobs,
            "/api/v1/checkpoints/": checkpoints,
            "/api/v1/erasure-requests/": erasures,
        },
        "steps": steps,
    }


def _training_objects(tenant, version, user, tmp_path) -> tuple[list[int], list[int]]:
    """Training jobs (running, failed, completed) and checkpoints (one whose files are gone,
    one tainted), written straight into the tables as the trainer would leave them: the
    fuzzer then cancels, resumes and exports real objects (the version is not approved, so a
    resume is refused; nothing reaches a broker)."""
    from trainer.models import Checkpoint, TrainingJob

    def job(status: str) -> TrainingJob:
        return TrainingJob.objects.create(
            tenant=tenant, dataset_version=version, requested_by=user, reward_fn="exact_match",
            base_model="tiny", base_model_path=str(tmp_path / "models" / "tiny"),
            output_dir=str(tmp_path / "train"), status=status, step=2, total_steps=4)

    running, failed, done = (job(s) for s in ("running", "failed", "completed"))
    gone = Checkpoint.objects.create(
        tenant=tenant, job=done, step=2, path=str(tmp_path / "train" / "gone"),
        weight_version="w2", manifest={"files": {}}, manifest_sha256="0" * 64)
    tainted = Checkpoint.objects.create(
        tenant=tenant, job=done, step=4, path=str(tmp_path / "train" / "t"), parent=gone,
        weight_version="w4", manifest={"files": {}}, manifest_sha256="1" * 64,
        status="tainted", tainted_reason="erasure")
    return [running.pk, failed.pk, done.pk], [gone.pk, tainted.pk]


def _real_ids(world: dict[str, Any], path: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for prefix, values in world["ids"].items():
        if path.startswith(prefix) and values:
            out["id"] = values
    if "{step_id}" in path and world["steps"]:
        out["step_id"] = world["steps"]
    return out


def _token(tenant, user) -> str:
    return services.create_api_token("system:test", tenant, user).secret


def _operations(api_schema) -> list[Any]:
    ops = [result.ok() for result in api_schema.get_all_operations()]
    assert len(ops) >= 25, [op.label for op in ops]
    return ops


def _documented_or_drf_error(response, case) -> None:
    documented = {int(code) for code in case.operation.definition.raw.get("responses", {})
                  if code.isdigit()}
    assert response.status_code in documented | ERROR_STATUSES, (
        case.operation.label, response.status_code, response.text[:500])
    # DRF's error shape: an object ({"detail": ...} or field -> messages). A path that no
    # route matches (e.g. a non-numeric id) is answered by Django's own 404 page instead.
    if response.status_code in ERROR_STATUSES - documented - {404, 405}:
        assert response.headers.get("content-type", [""])[0].startswith("application/json")
        assert isinstance(response.json(), dict), response.text[:500]


CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance,
          response_headers_conformance]


def _fuzz(operation, mode: GenerationMode, headers: dict[str, str],
          real: dict[str, list[Any]], seen: dict[str, set[int]]) -> None:
    strategy = operation.as_strategy(generation_mode=mode)

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(strategy)
        if real and case.path_parameters and data.draw(st.booleans()):
            for name, values in real.items():
                if name in case.path_parameters:
                    case.path_parameters[name] = data.draw(st.sampled_from(values))
        response = case.call(headers=headers)
        seen.setdefault(operation.label, set()).add(response.status_code)
        case.validate_response(response, checks=CHECKS, headers=headers)
        _documented_or_drf_error(response, case)

    try:
        run()
    except Unsatisfiable:
        # Negative data for an operation without parameters or body: there is none to make.
        if mode is not GenerationMode.NEGATIVE:
            raise


@pytest.mark.timeout(600)
def test_schemathesis_admin_no_server_errors(api_schema, world, tenant):
    """Every operation, positive and negative data, with an admin's token: no 5xx, every
    response conforms to the schema."""
    headers = {"Authorization": f"Bearer {_token(tenant, world['members']['admin'])}"}
    seen: dict[str, set[int]] = {}
    failures: list[str] = []
    for operation in _operations(api_schema):
        real = _real_ids(world, operation.path)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(operation, mode, headers, real, seen)
            except Exception as exc:  # every operation's failure in one report
                failures.append(f"{operation.label} [{mode.value}]: {exc}")
    assert not failures, "\n\n".join(failures)
    # The run reached real objects, not only 404s and refusals.
    ok = {label for label, codes in seen.items() if codes & {200, 201, 204}}
    print("SEEN", {k: sorted(v) for k, v in seen.items()})
    assert "GET /api/v1/trajectories/{id}/" in ok, seen
    assert "GET /api/v1/dataset-versions/{id}/" in ok, seen
    assert "GET /api/v1/trajectories/{id}/rewards/" in ok, seen
    assert "GET /api/v1/retention-policies/{id}/" in ok, seen
    assert "GET /api/v1/training-jobs/{id}/" in ok, seen
    assert "GET /api/v1/checkpoints/{id}/" in ok, seen
    assert len(ok) >= 15, seen


@pytest.mark.timeout(600)
def test_schemathesis_compliance_reaches_raw_and_approval(api_schema, world, tenant):
    """The operations an admin may not call (raw payloads, approve, reject), fuzzed as the
    compliance officer who may."""
    headers = {"Authorization": f"Bearer {_token(tenant, world['members']['compliance'])}"}
    seen: dict[str, set[int]] = {}
    labels = {"GET /api/v1/trajectories/{id}/steps/{step_id}/raw/",
              "POST /api/v1/dataset-versions/{id}/approve/",
              "POST /api/v1/dataset-versions/{id}/reject/"}
    operations = [op for op in _operations(api_schema) if op.label in labels]
    assert {op.label for op in operations} == labels
    for operation in operations:
        _fuzz(operation, GenerationMode.POSITIVE, headers, _real_ids(world, operation.path),
              seen)
    assert seen.keys() == labels


def _malformed(response: Any) -> bool:
    """A query string with a control character or invalid UTF-8 (which schemathesis generates)
    is refused whoever asks: 400 from governance.input_checks, before any view or
    authentication — it holds no data either way."""
    if response.status_code != 400:
        return False
    body = json.loads(response.text)
    return isinstance(body, dict) and str(body.get("detail", "")).startswith(
        "Malformed request:")


def _refused_without_token(operation, real: dict[str, list[Any]]) -> None:
    strategy = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
    public = operation.label in PUBLIC

    @settings(max_examples=8, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(strategy)
        for name, values in real.items():
            if name in case.path_parameters:
                case.path_parameters[name] = data.draw(st.sampled_from(values))
        headers = data.draw(st.sampled_from(BAD_AUTH))
        if case.headers:
            case.headers.pop("Authorization", None)
        response = case.call(headers=headers)
        if _malformed(response):
            return  # refused before authentication, as the web server's own parser would
        if public:
            assert response.status_code == 200, response.text[:300]
        else:
            assert response.status_code in (401, 403), (
                operation.label, headers, response.status_code, response.text[:300])

    run()


# No token, an unknown one, a malformed header, another scheme.
BAD_AUTH: list[dict[str, str]] = [
    {}, {"Authorization": "Bearer stwt_not-a-real-token"}, {"Authorization": "Bearer"},
    {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer a b"}]


@pytest.mark.timeout(300)
def test_without_a_valid_token_only_401_or_403(api_schema, world):
    """Without a valid token every protected operation refuses (401/403, never 2xx, never
    5xx), whatever the parameters, real ids included; the public one answers."""
    failures: list[str] = []
    operations = _operations(api_schema)
    for operation in operations:
        try:
            _refused_without_token(operation, _real_ids(world, operation.path))
        except Exception as exc:
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
    assert PUBLIC <= {op.label for op in operations}
