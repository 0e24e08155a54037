"""End to end: `steward up` as a real process (what `make up` runs) — web, proxy, shipper,
Celery worker and beat, the demo upstream — then an agent call through the printed base_url
with the official `openai` client, the trajectory visible over REST with the printed token,
and a clean Ctrl-C (SIGINT) that leaves no process behind.

Two variants: DATABASE_URL set (a throwaway database on the local server; the Celery broker is
derived from it: kombu's SQLAlchemy transport over TCP) and DATABASE_URL unset (the embedded
pgserver PostgreSQL under var/pg, the broker on its Unix socket)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import httpx
import psycopg
import pytest
from openai import AuthenticationError, OpenAI

REPO = Path(__file__).resolve().parent.parent
READY_LINE = "Ctrl-C stops everything."

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steward_cmd() -> list[str]:
    script = Path(sys.executable).parent / "steward"  # the console script `make up` runs
    return [str(script)] if script.exists() else [sys.executable, "-m", "config.cli"]


def _admin_url(url: str, dbname: str) -> str:
    return urlunparse(urlparse(url)._replace(path=f"/{dbname}", query=""))


@pytest.fixture
def throwaway_database():
    """A fresh database on the server DATABASE_URL names; dropped afterwards."""
    base = os.environ.get("DATABASE_URL")
    if not base:
        pytest.skip("DATABASE_URL is not set")
    name = f"steward_up_{uuid.uuid4().hex[:10]}"
    admin = _admin_url(base, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _admin_url(base, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Up:
    """A running `steward up` whose output is collected by a thread."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [*steward_cmd(), "up"], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # our SIGINT goes to the launcher only, as Ctrl-C would
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(READY_LINE in line for line in self.lines):
                return self.output
            if self.proc.poll() is not None:
                time.sleep(0.3)
                pytest.fail(f"steward up exited {self.proc.returncode}:\n{self.output[-6000:]}")
            time.sleep(0.2)
        pytest.fail(f"steward up not ready after {timeout}s:\n{self.output[-6000:]}")

    def value(self, label: str) -> str:
        m = re.search(rf"{label}:\s+(\S+)", self.output)
        assert m, f"no {label!r} in the banner:\n{self.output[-3000:]}"
        return m.group(1)

    def stop(self, timeout: float = 90) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self._reader.join(timeout=5)
        return code

    def force_cleanup(self) -> None:
        """After a failure: whatever is left, `steward down` stops (it reads var/run/up.json)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        subprocess.run([*steward_cmd(), "down"], cwd=REPO, env=self.env, timeout=120,
                       capture_output=True)


def _alive(entry: dict) -> bool:
    import psutil

    try:
        return psutil.Process(entry["pid"]).create_time() == entry["created"]
    except psutil.NoSuchProcess:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _port_accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def run_appliance(tmp_path: Path, database_url: str | None) -> None:
    var = tmp_path / "var"
    web_port, proxy_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "CELERY_BROKER_URL", "STEWARD_UPSTREAM_URL",
                        "STEWARD_MASTER_KEY", "STEWARD_MASTER_KEY_FILE", "DJANGO_SECRET_KEY",
                        "STEWARD_CELERY_EAGER", "STEWARD_SPOOL_DIR", "DJANGO_SETTINGS_MODULE"}}
    env.update(STEWARD_VAR_DIR=str(var), STEWARD_WEB_PORT=str(web_port),
               STEWARD_PROXY_PORT=str(proxy_port), NO_COLOR="1")
    if database_url:
        env["DATABASE_URL"] = database_url

    up = Up(env)
    try:
        up.wait_ready(timeout=150)
        base_url = up.value("base_url")
        key = up.value("proxy key")
        token = up.value("api token")
        console = up.value("console")
        assert base_url == f"http://127.0.0.1:{proxy_port}/v1"
        assert key.startswith("stw_") and token.startswith("stwt_")
        assert console == f"http://127.0.0.1:{web_port}/"
        assert "demo-admin / " in up.output
        # Issue 13.3: "up" only once the workers can build steps (the capture worker loaded
        # the sanitizer before its first heartbeat; the gpu worker runs training jobs).
        banner_at = next(i for i, line in enumerate(up.lines) if "Steward is up" in line)
        loaded_at = next((i for i, line in enumerate(up.lines)
                          if line.startswith("worker ") and "ready." in line), None)
        assert loaded_at is not None and loaded_at < banner_at, up.output[-4000:]
        assert "Steward is up.\n" in up.output + "\n" and "warming up" not in up.output
        assert any(line.startswith("gpu-worker") and "ready." in line
                   for line in up.lines[:banner_at]), up.output[-4000:]

        # Secrets were generated under var/ and are private.
        for name in ("secret.key", "master.key", "demo-credentials.json"):
            assert stat.S_IMODE((var / name).stat().st_mode) == 0o600, name
        creds = json.loads((var / "demo-credentials.json").read_text())
        assert creds["proxy_key"] == key and creds["api_token"] == token

        # An agent call through the proxy, with the official client.
        # (Clients are closed before the Ctrl-C: CPython 3.12.1's asyncio prints a spurious
        # CancelledError traceback when mitmproxy shuts down with a keep-alive client open.)
        with OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="demo-model", messages=[{"role": "user", "content": "what is 12*7?"}],
                extra_headers={"X-Steward-Session": f"up-test-{uuid.uuid4()}"})
            trajectory = raw.headers["x-steward-trajectory"]
            assert "84" in raw.parse().choices[0].message.content
        # A wrong key is refused at the proxy.
        with OpenAI(base_url=base_url, api_key="stw_wrong", max_retries=0) as bad:
            with pytest.raises(AuthenticationError):
                bad.models.list()

        # Shipped, built by the Celery worker, visible over REST with the printed token.
        deadline = time.monotonic() + 20
        seen = None
        with httpx.Client(base_url=console, timeout=10,
                          headers={"Authorization": f"Bearer {token}"}) as http:
            while time.monotonic() < deadline:
                r = http.get("api/v1/trajectories/")
                if r.status_code == 200 and trajectory in r.text:
                    seen = r
                    break
                time.sleep(0.5)
            assert seen is not None, (
                f"trajectory {trajectory} not listed within 20 s; last answer "
                f"{r.status_code} {r.text[:500]}\n{up.output[-4000:]}")
            # Its step is built within seconds too: the worker was warm before the banner.
            while time.monotonic() < deadline:
                doc = http.get(f"api/v1/trajectories/{trajectory}/").json()
                if doc["status"] == "complete":
                    break
                time.sleep(0.5)
            assert doc["status"] == "complete" and len(doc["steps"]) == 1, doc
            assert http.get("api/v1/trajectories/",
                            headers={"Authorization": "Bearer stwt_nope"}).status_code == 401
            login = httpx.get(f"{console}login/", timeout=10)
            assert login.status_code == 200

        # Subject lookups can use their index under row-level security: the leakproof key
        # operator class exists (made by the embedded set-up as its superuser, or by migrations
        # 0025 and 0031 run as one) and the index is built with it (decisions 38, 40).
        if database_url is None:
            from config.embedded import embedded_database_urls

            dsn = embedded_database_urls(var)[1]
        else:
            dsn = database_url
        with psycopg.connect(dsn) as conn:
            opclass = conn.execute(
                "SELECT o.opcname FROM pg_index i JOIN pg_opclass o ON o.oid = i.indclass[0] "
                "WHERE i.indexrelid = 'subjectindex_hashes'::regclass").fetchone()
        from governance.subject_keys import OPCLASS

        assert opclass == (OPCLASS,), opclass

        run_info = json.loads((var / "run" / "up.json").read_text())
        names = {c["name"] for c in run_info["children"]}
        assert names == {"upstream", "web", "proxy", "shipper", "worker", "gpu-worker", "beat"}

        code = up.stop()
        assert code == 0, up.output[-4000:]
        assert "all processes stopped" in up.output
        assert "Traceback" not in up.output, up.output
        time.sleep(0.5)
        left = [c for c in run_info["children"] if _alive(c) or _group_alive(c["pid"])]
        assert not left, f"left running: {left}"
        assert not _port_accepts(web_port) and not _port_accepts(proxy_port)
        assert not (var / "run" / "up.json").exists()
        if database_url is None:
            from config.embedded import running_pid

            assert "embedded PostgreSQL stopped" in up.output
            assert running_pid(var) is None
    finally:
        up.force_cleanup()


def test_up_with_database_url(tmp_path, throwaway_database):
    run_appliance(tmp_path, throwaway_database)


def test_up_embedded_postgresql(tmp_path):
    run_appliance(tmp_path, None)


class AgentLoad:
    """Agent calls through the proxy on a thread, one after the other, until stopped."""

    def __init__(self, base_url: str, key: str) -> None:
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._client = OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._client.chat.completions.create(
                    model="demo-model", messages=[{"role": "user", "content": "what is 2+3?"}])
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                self.failures.append(repr(exc))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=40)
        self._client.close()


def _child_entry(var: Path, name: str) -> dict:
    run_info = json.loads((var / "run" / "up.json").read_text())
    return next(c for c in run_info["children"] if c["name"] == name)


def _wait_restarted(up: Up, var: Path, name: str, old_pid: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = _child_entry(var, name)
        if entry["pid"] != old_pid and _alive(entry):
            return entry
        time.sleep(0.2)
    pytest.fail(f"{name} not restarted within {timeout}s:\n{up.output[-4000:]}")


@pytest.mark.timeout(420)
def test_up_restarts_a_dead_service_while_the_proxy_keeps_serving(tmp_path, throwaway_database):
    """Issue 12.12: SIGKILL the shipper, then the Celery worker, under agent load. Every agent
    call keeps succeeding, the supervisor says who died and restarts each one with backoff,
    and the restarted pair ships and builds a new call's trajectory."""
    var = tmp_path / "var"
    web_port, proxy_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in {"STEWARD_MASTER_KEY", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE",
                        "STEWARD_UPSTREAM_URL", "STEWARD_SPOOL_DIR", "STEWARD_CELERY_EAGER"}}
    env.update(STEWARD_VAR_DIR=str(var), STEWARD_WEB_PORT=str(web_port),
               STEWARD_PROXY_PORT=str(proxy_port), NO_COLOR="1",
               DATABASE_URL=throwaway_database)
    up = Up(env)
    load = None
    try:
        up.wait_ready(timeout=200)
        base_url, key, token = up.value("base_url"), up.value("proxy key"), up.value("api token")
        load = AgentLoad(base_url, key)
        for name in ("shipper", "worker"):
            before = load.ok
            old = _child_entry(var, name)
            os.killpg(old["pid"], signal.SIGKILL)  # the worker's pool processes too
            _wait_restarted(up, var, name, old["pid"])
            assert re.search(rf"{name} exited unexpectedly \(killed by SIGKILL\)", up.output)
            assert re.search(rf"restarting {name} in 1s", up.output), up.output[-3000:]
            # The supervisor writes up.json before it says "restarted", and its output
            # reaches us through a pipe: wait for the line rather than race it.
            said = time.monotonic() + 10
            while not re.search(rf"{name} restarted \(pid \d+\)", up.output):
                assert time.monotonic() < said, up.output[-3000:]
                time.sleep(0.1)
            deadline = time.monotonic() + 20
            while load.ok < before + 5 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert load.ok >= before + 5, f"the proxy stopped answering:\n{up.output[-3000:]}"
        load.stop()
        assert load.failures == [], load.failures[:5]
        assert load.ok > 10

        # The restarted shipper and worker still do their jobs: a new call gets its step.
        with OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="demo-model", messages=[{"role": "user", "content": "what is 6*7?"}],
                extra_headers={"X-Steward-Session": f"after-restart-{uuid.uuid4()}"})
            trajectory = raw.headers["x-steward-trajectory"]
        console = up.value("console")
        doc = None
        deadline = time.monotonic() + 90
        with httpx.Client(base_url=console, timeout=10,
                          headers={"Authorization": f"Bearer {token}"}) as http:
            while time.monotonic() < deadline:
                r = http.get(f"api/v1/trajectories/{trajectory}/")
                if r.status_code == 200 and r.json()["steps"]:
                    doc = r.json()
                    break
                time.sleep(0.5)
        assert doc is not None, up.output[-4000:]
        assert up.proc.poll() is None  # the supervisor is still up
        assert up.stop() == 0, up.output[-4000:]
        run_left = [c for c in json.loads((var / "run" / "up.json").read_text())["children"]
                    if _alive(c)] if (var / "run" / "up.json").exists() else []
        assert not run_left
    finally:
        if load is not None:
            load.stop()
        up.force_cleanup()


def test_restart_backoff_doubles_up_to_a_bound_and_resets_after_a_stable_run(tmp_path):
    from config.cli import RESTART_MAX_SECONDS, RESTART_STABLE_SECONDS, Child

    child = Child("shipper", ["true"], {}, tmp_path, "36")
    delays = []
    for _ in range(8):
        child.started_at = 1000.0  # died at once, every time
        delays.append(child.schedule_restart(1001.0))
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30] and RESTART_MAX_SECONDS == 30
    child.started_at = 2000.0
    assert child.schedule_restart(2000.0 + RESTART_STABLE_SECONDS) == 1  # healthy again
    assert child.restart_at == 2000.0 + RESTART_STABLE_SECONDS + 1


@pytest.mark.timeout(900)
def test_up_runs_a_training_job_launched_over_rest(tmp_path, throwaway_database):
    """Issue 13.2: under `steward up` a GRPO job launched over REST on an approved version is
    taken by the gpu-queue worker `make up` starts, and completes (it stayed "queued" forever
    when no worker listened on that queue)."""
    var = tmp_path / "var"
    web_port, proxy_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in {"STEWARD_MASTER_KEY", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE",
                        "STEWARD_UPSTREAM_URL", "STEWARD_SPOOL_DIR", "STEWARD_CELERY_EAGER"}}
    env.update(STEWARD_VAR_DIR=str(var), STEWARD_WEB_PORT=str(web_port),
               STEWARD_PROXY_PORT=str(proxy_port), NO_COLOR="1",
               DATABASE_URL=throwaway_database)
    up = Up(env)
    try:
        up.wait_ready(timeout=200)
        base_url, key, token = up.value("base_url"), up.value("proxy key"), up.value("api token")
        console = up.value("console")
        tenant = re.search(r"\(tenant (\S+),", up.output).group(1)
        trajectories = {}
        with OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30) as client:
            for a, b in ((3, 4), (5, 2)):
                raw = client.chat.completions.with_raw_response.create(
                    model="demo-model", messages=[{"role": "user", "content": f"{a}+{b}="}],
                    extra_headers={"X-Steward-Session": f"sum-{a}-{b}-{uuid.uuid4()}"})
                trajectories[raw.headers["x-steward-trajectory"]] = a + b
        comp = subprocess.run(
            [*steward_cmd(), "manage", "create_api_token", "--tenant", tenant, "--user", "comp",
             "--role", "compliance"], cwd=REPO, capture_output=True, text=True, timeout=120,
            env={**env, "STEWARD_MASTER_KEY_FILE": str(var / "master.key")})
        assert comp.returncode == 0, comp.stderr[-2000:]
        comp_token = comp.stdout.strip().splitlines()[-1]
        admin = httpx.Client(base_url=console + "api/v1/", timeout=30,
                             headers={"Authorization": f"Bearer {token}"})
        officer = httpx.Client(base_url=console + "api/v1/", timeout=30,
                               headers={"Authorization": f"Bearer {comp_token}"})
        with admin, officer:
            deadline = time.monotonic() + 90
            for tid in trajectories:
                while admin.get(f"trajectories/{tid}/").json().get("status") != "complete":
                    assert time.monotonic() < deadline, up.output[-3000:]
                    time.sleep(0.5)
            for tid, answer in trajectories.items():
                r = admin.post("rewards/", json={"trajectory_id": tid, "name": "reference",
                                                 "value": float(answer)})
                assert r.status_code in (200, 201), r.text
            r = admin.post("datasets/", json={"name": "sums"})
            assert r.status_code == 201, r.text
            r = admin.post(f"datasets/{r.json()['id']}/freeze/")
            assert r.status_code == 201 and r.json()["size"] == 2, r.text
            vid = r.json()["id"]
            assert admin.post(f"dataset-versions/{vid}/request-approval/").status_code == 200
            r = officer.post(f"dataset-versions/{vid}/approve/", json={"reason": "read it"})
            assert r.status_code == 200, r.text
            r = admin.post("training-jobs/", json={
                "dataset_version": vid, "reward_fn": "reference_answer",
                "config": {"total_steps": 2, "save_every": 2, "train_batch_size": 2,
                           "group_size": 2, "max_response_length": 4, "seed": 1,
                           "device": "cpu"}})
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            deadline = time.monotonic() + 600
            job = r.json()
            while job["status"] not in ("completed", "failed") and time.monotonic() < deadline:
                time.sleep(2)
                job = admin.get(f"training-jobs/{job_id}/").json()
            assert job["status"] == "completed", (job, up.output[-4000:])
        assert "gpu-worker" in up.output and "run_training_job" in up.output
        assert up.stop() == 0, up.output[-4000:]
    finally:
        up.force_cleanup()
