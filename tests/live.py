"""Fixtures that start real processes: the fake upstream (proxy/demo_upstream.py on a thread)
and mitmdump with the Steward addon (a subprocess on a free port, talking to the test database).

Tests that start a proxy need committed rows, so they use `transactional_db` (the fixtures here
request it). Typical use:

    def test_x(steward_proxy, proxy_key):
        client = openai.OpenAI(base_url=steward_proxy.base_url, api_key=proxy_key.secret)
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
MITMDUMP = REPO / ".venv" / "bin" / "mitmdump"
UPSTREAM_API_KEY = "sk-upstream-test-credential"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0, process: subprocess.Popen | None = None
                  ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


def database_url_from_django(role: str | None = None) -> str:
    """A libpq URL for the database Django is connected to (the test database in tests).
    `role`: the connection assumes it at start (options=-c role=...), e.g. the app role
    steward_app, so row-level security applies to it as in production."""
    from django.db import connection

    s = connection.settings_dict
    url = _libpq_url(s)
    if role:
        url += ("&" if "?" in url else "?") + "options=" + quote(f"-c role={role}", safe="")
    return url


# The role the proxy subprocess connects as: the app role, as in production. It reads the key
# table through the SECURITY DEFINER function steward_proxy_keys(); row-level security shows
# the app role no key row otherwise, so a proxy that read the table directly fails here.
PROXY_DATABASE_ROLE = "steward_app"


def _libpq_url(s: dict) -> str:
    auth = quote(s.get("USER") or "", safe="")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"], safe="")
    host = s.get("HOST") or ""
    port = s.get("PORT") or ""
    name = quote(s["NAME"], safe="")
    if not host or host.startswith("/"):  # Unix socket directory
        query = f"?host={quote(host, safe='')}" if host else ""
        query += f"{'&' if query else '?'}port={port}" if port else ""
        return f"postgresql://{auth}@/{name}{query}"
    return f"postgresql://{auth}@{host}{':' + str(port) if port else ''}/{name}"


def master_key() -> bytes:
    return base64.b64decode(os.environ["STEWARD_MASTER_KEY"])


def read_spool(spool_dir: Path, key: bytes | None = None) -> list[dict[str, Any]]:
    """Every decodable record in a spool directory, in write order (wire.spool.read_batches),
    in its JSON form (bodies base64, as the sealed raw payload holds them): what tests compare
    is the record, whichever spool format carried it."""
    from wire.spool import json_form, read_batches

    records: list[dict[str, Any]] = []
    if not Path(spool_dir).exists():
        return records
    for batch in read_batches(Path(spool_dir), key or master_key()):
        records.extend(json_form(r) for r in batch.records)
    return records


@dataclass
class ProxyProcess:
    url: str  # http://127.0.0.1:PORT (the server root)
    port: int
    spool_dir: Path
    log_path: Path
    process: subprocess.Popen
    env: dict[str, str] = field(repr=False, default_factory=dict)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def records(self) -> list[dict[str, Any]]:
        return read_spool(self.spool_dir)

    def wait_for_record(self, step_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """The spool record of a step (the writer thread fsyncs every 20 ms)."""
        deadline = time.monotonic() + timeout
        while True:
            for record in self.records():
                if record["step_id"] == step_id:
                    return record
            if time.monotonic() > deadline:
                raise AssertionError(f"no spool record for step {step_id}; proxy log:\n"
                                     + self.log()[-3000:])
            time.sleep(0.05)

    def wait_for_records(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            records = self.records()
            if len(records) >= count or time.monotonic() > deadline:
                return records
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def wait_for_key(proxy: ProxyProcess, secret: str, timeout: float = 20.0) -> None:
    """Poll until the proxy's key table accepts `secret` (GET /v1/models answers non-401)."""
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        try:
            status = httpx.get(proxy.base_url + "/models",
                               headers={"Authorization": f"Bearer {secret}"}, timeout=5
                               ).status_code
        except httpx.HTTPError:
            status = None
        if status not in (None, 401):
            return
        time.sleep(0.1)
    raise AssertionError(f"proxy never accepted the key (last status {status}); log:\n"
                         + proxy.log()[-3000:])


def wait_for_rejection(proxy: ProxyProcess, secret: str, timeout: float = 20.0) -> float:
    """Poll until the proxy answers 401 for `secret`; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        status = httpx.get(proxy.base_url + "/models",
                           headers={"Authorization": f"Bearer {secret}"}, timeout=5).status_code
        if status == 401:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError("proxy still accepts the key")


def serve_app(app: Any) -> tuple[str, Any]:
    """Serve an aiohttp web.Application on a free port in a background event loop; returns
    (base url, stop function). For fake upstreams (SGLang, OpenAI-compatible) in tests."""
    import asyncio
    import threading

    from aiohttp import web

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    # No access log: its lines would print after pytest's capture has closed.
    runner = web.AppRunner(app, access_log=None)
    ready = threading.Event()

    async def start() -> None:
        await runner.setup()
        await web.SockSite(runner, sock).start()

    def run() -> None:
        # Everything on the server's own thread: the main thread may have a running loop
        # already (Playwright's sync API), where run_until_complete would refuse to run.
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the test HTTP server did not start")

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


@contextmanager
def celery_worker(queues: str, log_path: Path, name: str, **env: str
                  ) -> Iterator[subprocess.Popen]:
    """A real Celery worker subprocess (solo pool) consuming `queues` ("capture", "gpu" or
    "capture,gpu") from the broker this process's app publishes to — CELERY_BROKER_URL from the
    environment wins over app.conf, so the worker must be given the same URL — against the test
    database under the NOBYPASSRLS app role, as in production. Stale messages of those queues
    from earlier tests are purged first. `env` adds to or overrides the worker's environment;
    its log goes to `log_path`. Stopped (terminate, then kill) when the block ends."""
    from django.db import connection

    from config.celery import app

    with app.connection_for_write() as conn:
        for queue in queues.split(","):
            try:
                conn.default_channel.queue_purge(queue)
            except Exception:  # noqa: BLE001 - the queue may not exist yet
                pass
    s = connection.settings_dict
    proc_env = {
        **os.environ,
        "DATABASE_URL": f"postgresql://{s['USER']}@{s['HOST'] or '127.0.0.1'}:"
                        f"{s['PORT'] or 5432}/{s['NAME']}",
        "STEWARD_DB_SCOPE_ROLE": "steward_app",
        "STEWARD_MASTER_KEY": os.environ["STEWARD_MASTER_KEY"],
        "CELERY_BROKER_URL": app.conf.broker_url,
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    with open(log_path, "ab") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", queues, "-c", "1",
             "--pool", "solo", "--without-heartbeat", "--without-gossip", "--without-mingle",
             "-l", "info", "-n", f"{name}-{os.getpid()}@%h"],
            cwd=REPO, env=proc_env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        yield worker
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()


@pytest.fixture
def fake_upstream() -> Iterator[Any]:
    """The demo upstream on a free port: `.url` (server root), `.requests` (recorded requests,
    newest last), `.last_request()`, `.clear()`."""
    from proxy.demo_upstream import start_in_thread

    server = start_in_thread()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mitmproxy_confdir(tmp_path_factory) -> Path:
    """One mitmproxy confdir (its CA is generated once) for every proxy of the run."""
    return tmp_path_factory.mktemp("mitmproxy-conf")


@pytest.fixture
def start_proxy(transactional_db, tmp_path, mitmproxy_confdir) -> Iterator[Any]:
    """start_proxy(upstream_url, spool_dir=None, scripts=(), **env) -> ProxyProcess.
    `env` overrides the proxy's environment (e.g. STEWARD_UPSTREAM_TIMEOUT="1"); `scripts`
    are more mitmproxy scripts loaded after the addon (e.g. a fault injector)."""
    started: list[ProxyProcess] = []

    def start(upstream_url: str, spool_dir: Path | None = None, scripts: tuple = (),
              **env: str) -> ProxyProcess:
        port = free_port()
        n = len(started)
        spool = spool_dir or tmp_path / f"proxy{n}" / "spool"
        log_path = tmp_path / f"proxy{n}.log"
        proc_env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",  # the log file is read by tests while it runs
            "DATABASE_URL": database_url_from_django(PROXY_DATABASE_ROLE),
            "STEWARD_SPOOL_DIR": str(spool),
            "STEWARD_MASTER_KEY": os.environ["STEWARD_MASTER_KEY"],
            "STEWARD_UPSTREAM_API_KEY": UPSTREAM_API_KEY,
            "STEWARD_KEY_REFRESH_SECONDS": "0.2",
            "STEWARD_UPSTREAM_TIMEOUT": "30",
            "STEWARD_PROXY_PORT": str(port),
            **env,
        }
        cmd = [str(MITMDUMP), "--mode", f"reverse:{upstream_url}", "--listen-host",
               "127.0.0.1", "--listen-port", str(port), "-s", str(REPO / "proxy" / "addon.py"),
               "--set", f"confdir={mitmproxy_confdir}", "--set", "flow_detail=0"]
        for script in scripts:
            cmd += ["-s", str(script)]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, env=proc_env, stdout=log, stderr=subprocess.STDOUT,
                                       cwd=REPO)
        proxy = ProxyProcess(f"http://127.0.0.1:{port}", port, spool, log_path, process,
                             proc_env)
        started.append(proxy)
        try:
            wait_for_port(port, process=process)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}; proxy log:\n{proxy.log()}") from e
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture
def steward_proxy(start_proxy, fake_upstream) -> ProxyProcess:
    """mitmdump + the Steward addon in reverse mode to `fake_upstream`, default settings."""
    return start_proxy(fake_upstream.url)


@dataclass
class LiveKey:
    secret: str
    key: Any  # governance.models.ProxyKey
    tenant: Any
    agent: Any


@pytest.fixture
def proxy_key(transactional_db, steward_proxy) -> LiveKey:
    """A real `stw_` key (tenant "acme", agent "agent-1"), already accepted by steward_proxy."""
    from governance.services import create_proxy_key, create_tenant

    tenant = create_tenant("system:test", "acme", "Acme Bank")[0]
    issued = create_proxy_key("system:test", tenant, "agent-1")
    wait_for_key(steward_proxy, issued.secret)
    return LiveKey(issued.secret, issued.record, tenant, issued.record.agent)


__all__ = ["PROXY_DATABASE_ROLE", "LiveKey", "ProxyProcess", "UPSTREAM_API_KEY", "celery_worker",
           "database_url_from_django", "free_port", "master_key", "read_spool", "serve_app",
           "wait_for_key", "wait_for_port", "wait_for_rejection"]
