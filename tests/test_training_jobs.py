"""Training on governed data (trainer app): the approval gate at launch AND inside the task,
a tiny GRPO job writing metrics and checkpoints with lineage manifests (Merkle root), tainting
on erasure, exports (verl RL/SFT parquet read back with pyarrow, ATDP JSONL against the
schema; REST and CLI), every role and an outsider on the endpoints, and one end-to-end job on
a real Celery worker (queue `gpu`, Redis) that is cancelled and resumed from its checkpoint."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from governance import services as gov
from governance.capture.atdp import atdp_schema
from governance.models import AuditEvent, Step
from governance.services import ServiceConflict, ServiceForbidden
from tests.govdata import make_trajectory
from tests.live import celery_worker
from trainer import services
from trainer.lineage import manifest_sha256, merkle_root
from trainer.models import Checkpoint, TrainingJob, TrainingMetric
from trainer.tasks import run_training_job

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}}}}}]
TINY = {"total_steps": 3, "save_every": 2, "train_batch_size": 2, "group_size": 2,
        "max_response_length": 4, "seed": 1, "device": "cpu"}


# --- data ----------------------------------------------------------------------------------


def sum_trajectory(tenant, agent, a: int, b: int, *, reference: str | None = "text",
                   tools: bool = False):
    """A one-step chat trajectory asking a+b, the agent's reply, and its reference answer as a
    final late-bound reward (`text`: the comment; `json`: a JSON comment; `value`: the value)."""
    traj = make_trajectory(tenant, agent, steps=1)
    obs = {"messages": [{"role": "system", "content": "you add"},
                        {"role": "user", "content": f"{a}+{b}="}], "params": {}}
    if tools:
        obs["tools"] = TOOLS
    Step.objects.filter(trajectory=traj).update(
        observation_rest=obs, action={"messages": [{"role": "assistant", "content": str(a + b)}],
                                 "finish_reason": "stop"},
        versions={"gen_ai.request.model": "m", "gen_ai.response.model": "m",
                  "system_prompt_hash": hashlib.sha256(b"you add").hexdigest(),
                  "tool_schema_hash": None, "harness_version": "steward-proxy/0.1"})
    if reference == "text":
        gov.record_reward("system:test", tenant, value=1.0, trajectory_id=traj.pk,
                          name="reference", comment=str(a + b))
    elif reference == "json":
        gov.record_reward("system:test", tenant, value=1.0, trajectory_id=traj.pk,
                          name="reference", comment=json.dumps({"answer": a + b,
                                                                "tolerance": 0.5}))
    elif reference == "value":
        gov.record_reward("system:test", tenant, value=float(a + b), trajectory_id=traj.pk,
                          name="reference")
    # A provisional reference never counts (late-bound: only final rows).
    gov.record_reward("system:test", tenant, value=0.0, trajectory_id=traj.pk,
                      name="reference", comment="999", final=False)
    return traj


@pytest.fixture
def var_dir(settings, tmp_path):
    settings.VAR_DIR = tmp_path / "var"
    return settings.VAR_DIR


def make_version(tenant, people, *, name: str = "sums", n: int = 4, decide: str = "approve"):
    """A frozen version of n sum trajectories (+1 without a reference), taken to `decide`:
    draft | pending | approve | reject."""
    users, _ = people
    agent = gov.ensure_agent("system:test", tenant, f"bot-{name}")
    kinds = ["text", "json", "value", "text"]
    trajs = [sum_trajectory(tenant, agent, i % 10, (i * 3) % 10, reference=kinds[i % 4],
                            tools=i == 0) for i in range(n)]
    trajs.append(sum_trajectory(tenant, agent, 1, 1, reference=None))
    ds = gov.create_dataset(users["steward"], tenant, name=name, agent_ids=[agent.pk])
    version = gov.freeze_dataset_version(users["steward"], ds)
    if decide != "draft":
        gov.request_approval(users["steward"], version)
    if decide == "approve":
        gov.approve_version(users["compliance"], version, "reviewed the sample")
    elif decide == "reject":
        gov.reject_version(users["compliance"], version, "not fit")
    version.refresh_from_db()
    return version, trajs


def events(action: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=action).order_by("seq"))


# --- the Merkle root (a pure function with a documented definition) -------------------------


def test_merkle_root_matches_the_documented_definition():
    def h(b: bytes) -> bytes:
        return hashlib.sha256(b).digest()

    ids = [str(uuid.UUID(int=i)) for i in (3, 1, 2)]
    s = sorted(ids)
    leaf = [h(b"\x00" + t.encode()) for t in s]
    assert merkle_root([]) == hashlib.sha256(b"").hexdigest()
    assert merkle_root(ids[:1]) == leaf_hex(ids[0])
    two = sorted(ids[:2])
    assert merkle_root(ids[:2]) == h(b"\x01" + h(b"\x00" + two[0].encode())
                                     + h(b"\x00" + two[1].encode())).hex()
    # Three leaves: the odd one is carried up unchanged, never paired with itself.
    assert merkle_root(ids) == h(b"\x01" + h(b"\x01" + leaf[0] + leaf[1]) + leaf[2]).hex()
    # Order, case and duplicates of the input do not matter; membership does.
    assert merkle_root(reversed(ids)) == merkle_root([t.upper() for t in ids + ids[:1]])
    assert merkle_root(ids[:2] + ids[:1]) == merkle_root(ids[:2]) != merkle_root(ids)
    # No duplicate-last-node ambiguity: [a, b, c] and [a, b, c, c'] never share a root.
    assert merkle_root(ids + [str(uuid.UUID(int=4))]) != merkle_root(ids)
    assert merkle_root([uuid.UUID(t) for t in ids]) == merkle_root(ids)


def leaf_hex(tid: str) -> str:
    return hashlib.sha256(b"\x00" + tid.encode()).hexdigest()


# --- the gate -------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["draft", "pending", "reject", "invalidated"])
def test_unapproved_rejected_or_invalidated_versions_are_never_trained_or_exported(
        tenant, people, var_dir, tmp_path, state):
    users, clients = people
    version, trajs = make_version(tenant, people, decide="approve" if state == "invalidated"
                                  else state)
    if state == "invalidated":
        gov.invalidate_versions_containing("system:erasure", tenant, [trajs[0].pk], "erased")
        version.refresh_from_db()
    with pytest.raises(ServiceConflict, match="refused"):
        services.launch_training_job(users["steward"], tenant, version, config=TINY)
    for fmt in ("verl-rl", "verl-sft", "atdp-jsonl"):
        with pytest.raises(ServiceConflict, match="refused"):
            services.export_dataset_version(users["steward"], version, fmt, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    r = clients["steward"].post("/api/v1/training-jobs/", {"dataset_version": version.pk,
                                                           "config": TINY}, format="json")
    assert r.status_code == 409 and "refused" in r.json()["detail"]
    r = clients["steward"].get(f"/api/v1/dataset-versions/{version.pk}/export/?format=verl-rl")
    assert r.status_code == 409
    with pytest.raises(CommandError, match="refused"):
        call_command("export_dataset", version_id=version.pk, fmt="atdp-jsonl",
                     out=str(tmp_path / "cli.jsonl"))
    assert TrainingJob.objects.count() == 0 and not events("dataset_version.exported")


def test_the_task_refuses_a_version_invalidated_after_the_launch(tenant, people, var_dir):
    users, _ = people
    version, trajs = make_version(tenant, people)
    job = services.launch_training_job(users["steward"], tenant, version, config=TINY)
    assert job.status == "queued" and events("training_job.launched")
    # Erasure (or retention) withdraws the approval while the job waits in the queue.
    gov.invalidate_versions_containing("system:erasure", tenant, [trajs[1].pk], "erased")
    assert run_training_job(job.pk) == "refused"
    job.refresh_from_db()
    assert job.status == "refused" and "invalidated" in job.error
    assert TrainingMetric.objects.count() == 0 and Checkpoint.objects.count() == 0
    assert events("training_job.refused")[0].payload["error"].startswith("refused")
    # Idempotent: the message delivered again claims nothing.
    assert run_training_job(job.pk) == "skipped"


def test_the_task_refuses_a_version_whose_content_drifted(tenant, people, var_dir):
    users, _ = people
    version, trajs = make_version(tenant, people)
    job = services.launch_training_job(users["steward"], tenant, version, config=TINY)
    Step.objects.filter(trajectory=trajs[0]).update(sanitizer_version="tampered")
    assert run_training_job(job.pk) == "refused"
    job.refresh_from_db()
    assert "content hash" in job.error


def test_the_task_finds_its_tenant_through_the_definer_function_only(tenant, people,
                                                                     var_dir):
    """As the app role with no tenant set, the job row is invisible (row-level security);
    steward_training_job_tenant gives the task its tenant id and nothing else."""
    users, _ = people
    version, _ = make_version(tenant, people)
    job = services.launch_training_job(users["steward"], tenant, version, config=TINY)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT set_config('role', 'steward_app', true)")
        cur.execute("SELECT count(*) FROM trainer_trainingjob")
        assert cur.fetchone()[0] == 0
        cur.execute("SELECT steward_training_job_tenant(%s), steward_training_job_tenant(-1)",
                    [job.pk])
        assert cur.fetchone() == (tenant.pk, None)
        cur.execute("SELECT current_setting('steward.system', true)")
        assert cur.fetchone()[0] in ("", "off")
        cur.execute("SELECT set_config('role', 'none', true)")


# --- a tiny job: metrics, checkpoints, lineage, taint ---------------------------------------


def run_tiny_job(tenant, people, **config):
    users, _ = people
    version, trajs = make_version(tenant, people)
    job = services.launch_training_job(users["steward"], tenant, version,
                                       config={**TINY, **config})
    assert run_training_job(job.pk) == "completed"
    job.refresh_from_db()
    return job, version, trajs


def test_a_tiny_job_writes_metrics_and_checkpoints_with_a_lineage_manifest(tenant, people,
                                                                           var_dir):
    job, version, trajs = run_tiny_job(tenant, people)
    assert (job.status, job.step, job.total_steps, job.attempts) == ("completed", 3, 3, 1)
    # 4 members with a reference become tasks; the 5th has none (and the provisional "999"
    # never counts as a reference).
    assert job.data_summary == {"members": 5, "examples": 5, "tasks": 4,
                                "skipped": {"no reference": 1}}
    metrics = list(TrainingMetric.objects.filter(job=job).order_by("step"))
    assert [m.step for m in metrics] == [1, 2, 3]
    assert all(0.0 <= m.reward_mean <= 1.0 and m.tokens_per_s > 0 for m in metrics)
    assert job.last_metrics["step"] == 3 and "reward_mean" in job.last_metrics

    ckpts = list(Checkpoint.objects.filter(job=job).order_by("step"))
    assert [(c.step, c.weight_version, c.status) for c in ckpts] == [(2, "2", "ok"),
                                                                     (3, "3", "ok")]
    assert ckpts[0].parent is None and ckpts[1].parent == ckpts[0]
    member_ids = [str(t.pk) for t in trajs]
    for ckpt in ckpts:
        m = ckpt.manifest
        assert m["trajectories_merkle_root"] == merkle_root(member_ids)
        assert m["dataset_version"] == {"id": version.pk, "dataset": version.dataset_id,
                                        "number": 1, "content_hash": version.content_hash,
                                        "size": 5}
        assert m["approvals"] == [version.approval.pk]
        assert m["sanitizer_versions"] == ["test-1"]
        assert m["seed"] == 1 and m["config"]["total_steps"] == 3
        assert m["config"]["model_path"] == str(var_dir / "models" / "tiny-qwen2")
        assert m["code_version"]["trainer_sources_sha256"]
        assert m["step"] == ckpt.step and m["weight_version"] == ckpt.weight_version
        # manifest.json next to the checkpoint is the stored manifest; its hash is recorded.
        on_disk = json.loads((Path(ckpt.path) / "manifest.json").read_text())
        assert on_disk == m and manifest_sha256(on_disk) == ckpt.manifest_sha256
        for rel, digest in m["files"].items():
            assert hashlib.sha256((Path(ckpt.path) / rel).read_bytes()).hexdigest() == digest
        assert "model/model.safetensors" in m["files"]
    assert ckpts[1].manifest["parent_checkpoint"] == {
        "id": ckpts[0].pk, "step": 2, "manifest_sha256": ckpts[0].manifest_sha256}
    assert [e.payload["status"] for e in events("checkpoint.created")] == ["ok", "ok"]
    assert events("training_job.completed")[0].object_id == str(job.pk)
    # Finished: a redelivered message runs nothing again.
    assert run_training_job(job.pk) == "skipped"

    # Export of a clean checkpoint works; erasure of one member taints every checkpoint of
    # the jobs whose version held it, and a tainted checkpoint is never exported.
    users, _ = people
    out = services.export_checkpoint(users["steward"], ckpts[1], var_dir / "c.tar")
    assert out["manifest_sha256"] == ckpts[1].manifest_sha256
    other_agent_traj = make_trajectory(tenant, gov.ensure_agent("system:test", tenant, "x"))
    assert services.mark_checkpoints_tainted("system:erasure", tenant, [other_agent_traj.pk],
                                             "erasure 1") == []
    tainted = services.mark_checkpoints_tainted("system:erasure", tenant, [trajs[2].pk],
                                                "erasure request 7")
    assert sorted(tainted) == sorted(c.pk for c in ckpts)
    assert {c.status for c in Checkpoint.objects.all()} == {"tainted"}
    assert len(events("checkpoint.tainted")) == 2
    with pytest.raises(ServiceForbidden, match="tainted"):
        services.export_checkpoint(users["steward"], ckpts[1], var_dir / "d.tar")
    assert services.mark_checkpoints_tainted("system:erasure", tenant, [trajs[2].pk], "x") == []


def test_cancel_of_a_queued_job_and_resume_validation(tenant, people, var_dir):
    users, _ = people
    version, _ = make_version(tenant, people)
    job = services.launch_training_job(users["steward"], tenant, version, config=TINY)
    job = services.cancel_training_job(users["steward"], job)
    assert job.status == "cancelled" and job.finished_at is not None
    assert run_training_job(job.pk) == "skipped"  # the queued message finds it cancelled
    with pytest.raises(ServiceConflict):
        services.cancel_training_job(users["steward"], job)
    with pytest.raises(gov.ServiceError, match="at least"):
        services.resume_training_job(users["steward"], job, total_steps=0)
    job = services.resume_training_job(users["steward"], job, total_steps=2)
    assert (job.status, job.total_steps, job.config["total_steps"]) == ("queued", 2, 2)
    assert run_training_job(job.pk) == "completed"
    with pytest.raises(ServiceConflict):
        services.resume_training_job(users["steward"], TrainingJob.objects.get(pk=job.pk))

    # Running: cancelling (the task stops after its step) — unless its worker is gone (no
    # heartbeat for longer than STEWARD_TRAIN_STALE_SECONDS): then cancelled at once.
    from datetime import timedelta

    from django.utils import timezone

    for age, expected in ((timedelta(seconds=5), "cancelling"), (timedelta(hours=1),
                                                                 "cancelled")):
        job = services.launch_training_job(users["steward"], tenant, version, config=TINY)
        TrainingJob.objects.filter(pk=job.pk).update(status="running",
                                                     heartbeat_at=timezone.now() - age)
        assert services.cancel_training_job(users["steward"], job).status == expected


def test_a_lost_message_is_sent_again(tenant, people, var_dir):
    from datetime import timedelta

    from django.utils import timezone

    from config.celery import app
    from trainer.tasks import enqueue_queued_jobs

    users, _ = people
    version, _ = make_version(tenant, people)
    job = services.launch_training_job(users["steward"], tenant, version,
                                       config={**TINY, "total_steps": 1})
    assert enqueue_queued_jobs() == 0  # fresh: its message may still be on its way
    TrainingJob.objects.filter(pk=job.pk).update(created_at=timezone.now() - timedelta(hours=1))
    app.conf.task_always_eager = True
    try:
        assert enqueue_queued_jobs() == 1
    finally:
        app.conf.task_always_eager = False
    job.refresh_from_db()
    assert (job.status, job.step) == ("completed", 1)
    assert enqueue_queued_jobs() == 0


def test_launch_validates_its_inputs(tenant, other_tenant, people, var_dir):
    users, _ = people
    version, _ = make_version(tenant, people)
    launch = services.launch_training_job
    for kwargs, message in [
        ({"reward_fn": "nope"}, "unknown reward function"),
        ({"config": {"model_path": "/etc"}}, "set by Steward"),
        ({"config": {"totl_steps": 3}}, "unknown GRPOConfig keys"),
        ({"config": {"group_size": 0}}, "group_size"),
        ({"base_model": "../../etc"}, "base_model"),
        ({"base_model": "missing-model"}, "not found"),
    ]:
        with pytest.raises(gov.ServiceError, match=message):
            launch(users["steward"], tenant, version, **kwargs)
    with pytest.raises(gov.ServiceError, match="unknown dataset version"):
        launch(users["steward"], other_tenant, version)


# --- exports ----------------------------------------------------------------------------------


def test_exports_read_back_with_the_specified_schemas(tenant, people, var_dir, tmp_path):
    users, _ = people
    version, trajs = make_version(tenant, people)
    ids = sorted(str(t.pk) for t in trajs)
    approval = version.approval.pk

    rl = services.export_dataset_version(users["steward"], version, "verl-rl",
                                         tmp_path / "rl.parquet")
    assert rl["rows"] == 4 and rl["skipped"] == {"no reference": 1}
    table = pq.read_table(tmp_path / "rl.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model",
                                  "extra_info"]
    assert str(table.schema.field("reward_model").type) == \
        "struct<style: string, ground_truth: string>"
    assert str(table.schema.field("extra_info").type) == (
        "struct<trajectory_id: string, approval_id: int64, content_hash: string, "
        "index: int64, split: string>")
    rows = table.to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 3]
    assert {r["extra_info"]["trajectory_id"] for r in rows} < set(ids)
    assert all(r["extra_info"]["approval_id"] == approval
               and r["extra_info"]["content_hash"] == version.content_hash
               and r["extra_info"]["split"] == "train" and r["ability"] == "agent"
               and r["data_source"] == "steward/acme/sums"
               and r["reward_model"]["style"] == "rule" for r in rows)
    by_id = {r["extra_info"]["trajectory_id"]: r for r in rows}
    for t in trajs[:4]:
        r = by_id[str(t.pk)]
        user = r["prompt"][-1]["content"]
        a, b = (int(x) for x in user.rstrip("=").split("+"))
        assert [m["role"] for m in r["prompt"]] == ["system", "user"]
        gt = r["reward_model"]["ground_truth"]
        assert gt == str(a + b) or json.loads(gt) == {"answer": a + b, "tolerance": 0.5}

    sft = services.export_dataset_version(users["steward"], version, "verl-sft",
                                          tmp_path / "sft.parquet")
    assert sft["rows"] == 5
    table = pq.read_table(tmp_path / "sft.parquet")
    assert table.column_names == ["messages", "tools", "extra_info"]
    rows = table.to_pylist()
    assert all([m["role"] for m in r["messages"]] == ["system", "user", "assistant"]
               for r in rows)
    with_tools = [r for r in rows if r["tools"]]
    assert len(with_tools) == 1
    fn = with_tools[0]["tools"][0]["function"]
    # The parameter schema is an object (a struct), not JSON text; a row without tools has an
    # empty list, never null (tests/test_verl_exports.py has verl read both).
    assert fn["name"] == "add" and fn["parameters"] == TOOLS[0]["function"]["parameters"]
    assert sft["tool_parameters"] == "struct"
    assert sum(r["tools"] == [] for r in rows) == 4
    assert sorted(r["extra_info"]["trajectory_id"] for r in rows) == ids

    atdp = services.export_dataset_version(users["steward"], version, "atdp-jsonl",
                                           tmp_path / "t.jsonl")
    docs = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert atdp["rows"] == 5 and [d["id"] for d in docs] == ids
    for doc in docs:
        jsonschema.validate(doc, atdp_schema())
        assert doc["governance"]["approval"]["id"] == approval
        assert doc["governance"]["approval"]["content_hash"] == version.content_hash
    exported = events("dataset_version.exported")
    assert [e.payload["format"] for e in exported] == ["verl-rl", "verl-sft", "atdp-jsonl"]
    assert exported[2].payload["sha256"] == \
        hashlib.sha256((tmp_path / "t.jsonl").read_bytes()).hexdigest()

    # The CLI: same file, last line JSON.
    out = tmp_path / "cli.parquet"
    from io import StringIO

    buf = StringIO()
    call_command("export_dataset", version_id=version.pk, fmt="verl-sft", out=str(out),
                 stdout=buf)
    assert json.loads(buf.getvalue().strip().splitlines()[-1])["rows"] == 5
    assert pq.read_table(out).num_rows == 5
    with pytest.raises(CommandError, match="unknown dataset version"):
        call_command("export_dataset", version_id=version.pk + 999, fmt="verl-sft",
                     out=str(out))


# --- REST: every role and an outsider -----------------------------------------------------------


def test_rest_roles_and_outsider(tenant, people, var_dir):
    users, clients = people
    job, version, _ = run_tiny_job(tenant, people)
    ckpt = Checkpoint.objects.get(job=job, step=3)
    body = {"dataset_version": version.pk, "config": TINY}

    def status(who, method, url, data=None):
        return getattr(clients[who], method)(url, data, format="json").status_code

    for who in ("admin", "steward"):
        r = clients[who].post("/api/v1/training-jobs/", body, format="json")
        assert r.status_code == 201 and r.json()["status"] == "queued", r.content
    for who in ("compliance", "auditor"):
        assert status(who, "post", "/api/v1/training-jobs/", body) == 403
    r = clients["outsider"].post("/api/v1/training-jobs/", body, format="json")
    assert r.status_code == 400 and "dataset_version" in r.json()
    r = clients["steward"].post("/api/v1/training-jobs/", {**body, "reward_fn": "x"},
                                format="json")
    assert r.status_code == 400 and "unknown reward function" in r.content.decode()

    detail = clients["steward"].get(f"/api/v1/training-jobs/{job.pk}/").json()
    assert detail["progress"] == 1.0 and [m["step"] for m in detail["metrics"]] == [1, 2, 3]
    assert [c["step"] for c in detail["checkpoints"]] == [2, 3]
    listed = clients["admin"].get("/api/v1/training-jobs/").json()["results"]
    assert len(listed) == 3
    assert clients["outsider"].get("/api/v1/training-jobs/").json()["results"] == []
    # Reading needs read_training (compliance and auditors hold it); acting does not follow.
    for who in ("compliance", "auditor"):
        r = clients[who].get("/api/v1/training-jobs/")
        assert r.status_code == 200 and len(r.json()["results"]) == 3
        r = clients[who].get(f"/api/v1/training-jobs/{job.pk}/")
        assert r.status_code == 200 and [m["step"] for m in r.json()["metrics"]] == [1, 2, 3]
        assert status(who, "post", f"/api/v1/training-jobs/{job.pk}/cancel/") == 403
        assert status(who, "post", f"/api/v1/training-jobs/{job.pk}/resume/", {}) == 403
    assert status("outsider", "get", f"/api/v1/training-jobs/{job.pk}/") == 404
    assert status("outsider", "post", f"/api/v1/training-jobs/{job.pk}/cancel/") == 404
    assert status("steward", "post", f"/api/v1/training-jobs/{job.pk}/cancel/") == 409
    queued = listed[0]["id"]
    r = clients["steward"].post(f"/api/v1/training-jobs/{queued}/cancel/")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    r = clients["admin"].post(f"/api/v1/training-jobs/{queued}/resume/", {"total_steps": 4},
                              format="json")
    assert r.status_code == 200 and r.json()["total_steps"] == 4

    # Checkpoint lineage: every role reads it; the outsider sees nothing.
    for who in ("admin", "steward", "compliance", "auditor"):
        r = clients[who].get(f"/api/v1/checkpoints/{ckpt.pk}/")
        assert r.status_code == 200 and r.json()["manifest"]["trajectories_merkle_root"]
    assert len(clients["auditor"].get(f"/api/v1/checkpoints/?job={job.pk}").json()
               ["results"]) == 2
    assert clients["outsider"].get("/api/v1/checkpoints/").json()["results"] == []
    assert status("outsider", "get", f"/api/v1/checkpoints/{ckpt.pk}/") == 404
    r = clients["steward"].get(f"/api/v1/checkpoints/{ckpt.pk}/export/")
    assert r.status_code == 200 and r["Content-Type"] == "application/x-tar"
    assert b"manifest.json" in b"".join(r.streaming_content)
    assert status("auditor", "get", f"/api/v1/checkpoints/{ckpt.pk}/export/") == 403

    # Dataset exports: launch_training (admin, steward) only; files stream back.
    url = f"/api/v1/dataset-versions/{version.pk}/export/"
    for who in ("admin", "steward"):
        r = clients[who].get(url + "?format=atdp-jsonl")
        assert r.status_code == 200, r.content
        lines = b"".join(r.streaming_content).decode().splitlines()
        assert len(lines) == 5
    r = clients["admin"].get(url + "?format=verl-rl")
    assert r.status_code == 200 and b"".join(r.streaming_content)[:4] == b"PAR1"
    for who in ("compliance", "auditor"):
        assert status(who, "get", url + "?format=verl-rl") == 403
    assert status("outsider", "get", url + "?format=verl-rl") == 404
    assert status("steward", "get", url + "?format=csv") == 400
    assert status("steward", "get", url) == 400

    # Erasure taints; a tainted checkpoint's export is refused over REST too.
    services.mark_checkpoints_tainted("system:erasure", tenant,
                                      [version.members.first().trajectory_id], "erased")
    r = clients["steward"].get(f"/api/v1/checkpoints/{ckpt.pk}/export/")
    assert r.status_code == 403 and "tainted" in r.json()["detail"]
    assert clients["auditor"].get(f"/api/v1/checkpoints/{ckpt.pk}/").json()["status"] == \
        "tainted"


def test_openapi_schema_lists_the_training_endpoints(tenant, people):
    _, clients = people
    r = clients["admin"].get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    paths = json.loads(r.content)["paths"]
    for p in ("/api/v1/training-jobs/", "/api/v1/training-jobs/{id}/cancel/",
              "/api/v1/checkpoints/{id}/", "/api/v1/dataset-versions/{id}/export/"):
        assert p in paths, sorted(paths)


# --- end to end: a real Celery worker on queue gpu ------------------------------------------------


def _wait(pred, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; worker log:\n"
                         + log.read_text(errors="replace")[-4000:])


@pytest.mark.timeout(600)
def test_celery_worker_runs_cancels_and_resumes_a_job(transactional_db, tenant, people,
                                                      var_dir, tmp_path):
    users, clients = people
    version, trajs = make_version(tenant, people)
    log = tmp_path / "worker.log"
    with celery_worker("gpu", log, "gpu-test", STEWARD_VAR_DIR=str(var_dir)):
        r = clients["steward"].post("/api/v1/training-jobs/", {
            "dataset_version": version.pk,
            "config": {**TINY, "total_steps": 5000, "save_every": 100000}}, format="json")
        assert r.status_code == 201, r.content
        job_id = r.json()["id"]
        # The worker starts (it preloads the sanitizer), claims the job, builds the tiny
        # model: slow on a busy 2-core machine, hence the generous limits.
        _wait(lambda: TrainingJob.objects.get(pk=job_id).step >= 2, 360, "two steps", log)
        r = clients["steward"].post(f"/api/v1/training-jobs/{job_id}/cancel/")
        assert r.status_code == 200 and r.json()["status"] == "cancelling"
        job = _wait(lambda: TrainingJob.objects.filter(pk=job_id, status="cancelled").first(),
                    60, "the cancellation", log)
        stop = Checkpoint.objects.get(job_id=job_id)  # written when it stopped
        assert stop.step == job.step < 5000 and stop.parent is None
        assert stop.manifest["trajectories_merkle_root"] == \
            merkle_root([str(t.pk) for t in trajs])
        assert TrainingMetric.objects.filter(job_id=job_id).count() == job.step

        r = clients["steward"].post(f"/api/v1/training-jobs/{job_id}/resume/",
                                    {"total_steps": job.step + 2}, format="json")
        assert r.status_code == 200, r.content
        job = _wait(lambda: TrainingJob.objects.filter(pk=job_id, status="completed").first(),
                    120, "the resumed job to complete", log)
        assert job.step == stop.step + 2 and job.attempts == 2
        last = Checkpoint.objects.get(job_id=job_id, step=job.step)
        assert last.parent == stop  # lineage runs through the resume
        assert list(TrainingMetric.objects.filter(job_id=job_id).order_by("step")
                    .values_list("step", flat=True)) == list(range(1, job.step + 1))
        assert "trainer.tasks.run_training_job" in log.read_text()
