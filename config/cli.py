"""`steward` — run the whole appliance on one host (`steward up`, what `make up` runs).

`steward up` prepares var/ (secret key, master key, embedded PostgreSQL when DATABASE_URL is
unset), migrates, creates the demo tenant/login/key, and then supervises the processes of the
appliance as children: the web console + REST API (gunicorn), the proxy (mitmdump with the
Steward addon), the spool shipper, a Celery worker and Celery beat — plus a small demo
OpenAI-compatible upstream when STEWARD_UPSTREAM_URL is unset. Their output goes to the terminal
with a name prefix and to var/log/<name>.log. Ctrl-C (or SIGTERM) stops them all gracefully. One
that dies on its own after start-up is restarted with bounded exponential backoff while the
others keep running (the proxy keeps serving; the spool and the broker hold the work); during
start-up a death stops everything with a non-zero exit code.

`steward run SERVICE` execs one of those processes with the same command line, for systemd
units and containers (deploy/); `steward down` stops what a killed `steward up` left behind
(found through var/run/up.json) and the embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WEB_PORT = 8000
DEFAULT_PROXY_PORT = 8080
STARTUP_TIMEOUT = 90.0  # seconds for the web and proxy ports to accept
WORKER_READY_TIMEOUT = 180.0  # seconds for both Celery workers' first heartbeat
GRACE_SECONDS = 15.0  # SIGTERM -> SIGKILL
TAIL_LINES = 25
# A service that dies after start-up is restarted, the others keep running (the proxy keeps
# serving: the spool holds what the shipper has not moved yet, the broker what no worker has
# taken). The delay doubles with each death in a row, from RESTART_BASE_SECONDS up to
# RESTART_MAX_SECONDS, so a service that crashes at once does not spin; one that ran for
# RESTART_STABLE_SECONDS counts as healthy again and starts back at the base delay.
RESTART_BASE_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
RESTART_STABLE_SECONDS = 60.0


class Stop(BaseException):
    """Raised by the signal handler to unwind start-up (a BaseException so no `except
    Exception` in between swallows it)."""


class StartupError(RuntimeError):
    pass


# --- output -------------------------------------------------------------------------------

_out_lock = threading.Lock()
_COLORS = ["36", "32", "35", "33", "34", "31", "96", "92"]


def _tty() -> bool:
    return sys.stdout.isatty() and os.environ.get("NO_COLOR") is None


def say(message: str = "") -> None:
    """A line from the launcher itself."""
    with _out_lock:
        for line in message.splitlines() or [""]:
            sys.stdout.write(f"steward  | {line}\n")
        sys.stdout.flush()


def _write_prefixed(prefix: str, line: str) -> None:
    with _out_lock:
        try:
            sys.stdout.write(prefix + line + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            # The terminal went away (closed pipe): keep draining the child's output into its
            # log file, or the child would block on a full pipe.
            pass


# --- helpers ------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def port_accepts(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def read_or_create_secret(path: Path, make) -> str:
    """The content of a 0600 secret file, generated on first use."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # created concurrently: read theirs
        else:
            with os.fdopen(fd, "w") as f:
                f.write(make() + "\n")
    return path.read_text().strip()


def var_dir_from_env() -> Path:
    return Path(os.environ.get("STEWARD_VAR_DIR") or REPO / "var").resolve()


def upstream_root(url: str) -> str:
    """STEWARD_UPSTREAM_URL names the server root; a trailing /v1 is tolerated and stripped."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def _gunicorn_control_args(run_dir: Path) -> list[str]:
    """gunicorn >= 24 opens a control socket, by default in ~/.gunicorn (shared by every
    instance of the user): keep ours under var/run."""
    try:
        from gunicorn.config import KNOWN_SETTINGS
    except ImportError:
        return []
    if any(s.name == "control_socket" for s in KNOWN_SETTINGS):
        return ["--control-socket", str(run_dir / "gunicorn.ctl")]
    return []


def _tool(name: str) -> list[str]:
    """A console script of this environment (next to the interpreter), else from PATH."""
    local = Path(sys.executable).parent / name
    return [str(local)] if local.exists() else [name]


# --- supervised children ------------------------------------------------------------------


class Child:
    """One supervised process: its own session (so the terminal's Ctrl-C reaches only the
    launcher, which then stops the children in order), output pumped line by line to the
    terminal and to var/log/<name>.log, the last lines kept for the post-mortem."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path,
                 color: str) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc: subprocess.Popen | None = None
        self._pump: threading.Thread | None = None
        self.started_at = 0.0  # time.monotonic() of the latest start
        self.deaths_in_a_row = 0
        self.restart_at: float | None = None  # set while a restart is pending
        label = f"{name:<10} | "
        self.prefix = f"\x1b[{color}m{label}\x1b[0m" if _tty() else label

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._log: IO[str] = open(self.log_path, "a", buffering=1)  # noqa: SIM115
        self._log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} start: "
                        f"{' '.join(self.argv)}\n")
        self.proc = subprocess.Popen(
            self.argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._pump = threading.Thread(target=self._pump_output, name=f"pump-{self.name}",
                                      daemon=True)
        self._pump.start()

    def _pump_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.tail.append(line)
            self._log.write(line + "\n")
            _write_prefixed(self.prefix, line)
        self.proc.stdout.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        if self.running():
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the child's whole process group (gunicorn or Celery pool workers that
        outlived their parent included)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def close(self) -> None:
        if self._pump is not None:
            self._pump.join(timeout=2)
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def schedule_restart(self, now: float) -> float:
        """After a death: when to start again (bounded exponential backoff); returns the
        delay in seconds."""
        if now - self.started_at >= RESTART_STABLE_SECONDS:
            self.deaths_in_a_row = 0
        self.deaths_in_a_row += 1
        delay = min(RESTART_MAX_SECONDS, RESTART_BASE_SECONDS * 2 ** (self.deaths_in_a_row - 1))
        self.restart_at = now + delay
        return delay

    def restart(self) -> None:
        # What the dead leader left in its group (Celery pool processes, gunicorn workers)
        # would hold ports and broker messages: it goes first.
        self.kill_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self.close()
        self.restart_at = None
        self.start()


def stop_children(children: list[Child], grace: float = GRACE_SECONDS) -> None:
    """Graceful stop: the proxy first (no new traffic; it flushes its spool), then the rest
    together; SIGKILL for whatever has not exited after `grace` seconds."""
    proxies = [c for c in children if c.name == "proxy"]
    others = [c for c in children if c.name != "proxy"]
    for group in (proxies, others):
        for child in group:
            child.send(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(c.running() for c in group):
            time.sleep(0.1)
        for child in group:
            if child.running():
                say(f"{child.name} did not stop within {grace:.0f}s; killing it")
                child.kill_group(signal.SIGKILL)
            if child.proc is not None:
                try:
                    child.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
    # Stray grandchildren (a pool worker whose parent was killed) go with their group.
    for child in children:
        if child.group_alive():
            child.kill_group(signal.SIGTERM)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(c.group_alive() for c in children):
        time.sleep(0.1)
    for child in children:
        if child.group_alive():
            child.kill_group(signal.SIGKILL)
        child.close()


# --- the run file (lets `steward down` find a running or crashed `up`) --------------------


def _create_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - gone or inaccessible: treated as not ours
        return None


def write_run_file(path: Path, children: list[Child]) -> None:
    procs = [{"name": c.name, "pid": c.pid, "created": _create_time(c.pid)}
             for c in children if c.pid]
    data = {"pid": os.getpid(), "created": _create_time(os.getpid()), "children": procs}
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: `steward down` and anyone watching read this file while the
    # supervisor rewrites it after a restart, and must never see it empty or half written.
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


def _same_process(entry: dict[str, Any]) -> bool:
    """True when pid still names the process we recorded (guards against pid reuse)."""
    pid, created = entry.get("pid"), entry.get("created")
    return bool(pid) and created is not None and _create_time(pid) == created


# --- the services (shared by `steward up` and `steward run`) -------------------------------

SERVICES = ("web", "proxy", "shipper", "worker", "gpu-worker", "beat")


class ServiceConfig:
    def __init__(self, *, var_dir: Path, host: str, web_port: int, proxy_port: int,
                 upstream: str, access_log: str = "-") -> None:
        self.var_dir = var_dir
        self.host = host
        self.web_port = web_port
        self.proxy_port = proxy_port
        self.upstream = upstream
        self.access_log = access_log


def service_argv(name: str, cfg: ServiceConfig, single_host: bool = False) -> list[str]:
    """The command line of one service. `single_host` (steward up): small fixed pool sizes
    and no worker-to-worker chatter, since there is only one worker."""
    py = sys.executable
    run_dir = cfg.var_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    if name == "web":
        workers = ["--workers", "2", "--threads", "4"] if single_host else []
        return [
            *_tool("gunicorn"), "config.wsgi", "--bind", f"{cfg.host}:{cfg.web_port}",
            "--worker-class", "gthread", *workers, "--graceful-timeout", "10",
            "--timeout", "120", "--access-logfile", cfg.access_log, "--error-logfile", "-",
            # gunicorn closes an idle keep-alive connection after 2 s by default: a client
            # polling every 2 s (a progress page, a script waiting for a job) then sends on a
            # connection the server is closing and gets ECONNRESET. 30 s outlasts such polls.
            "--keep-alive", "30",
            # Paths only in the access log: a query string may carry a data subject or a
            # raw-read reason (config/gunicorn_logging.py).
            "--logger-class", "config.gunicorn_logging.QuerylessAccessLogger",
            *_gunicorn_control_args(run_dir),
        ]
    if name == "proxy":
        if not cfg.upstream:
            raise SystemExit("steward: STEWARD_UPSTREAM_URL is not set")
        return [
            *_tool("mitmdump"), "--mode", f"reverse:{cfg.upstream}@{cfg.host}:{cfg.proxy_port}",
            "-s", str(REPO / "proxy" / "addon.py"),
            "--set", "flow_detail=0", "--set", "connection_strategy=lazy",
            "--set", f"confdir={cfg.var_dir / 'mitmproxy'}",
        ]
    if name == "shipper":
        return [py, str(REPO / "manage.py"), "ship_spool"]
    if name in ("worker", "gpu-worker"):
        gpu = name == "gpu-worker"
        argv = [py, "-m", "celery", "-A", "config", "worker", "--loglevel", "INFO",
                "-Q", "gpu" if gpu else "capture,sanitize,celery",
                "-n", ("gpu@%h" if gpu else "steward@%h")]
        if gpu:
            argv += ["-c", "1"]  # one training job per GPU host at a time
        elif single_host:
            argv += ["-c", "2"]
        if single_host or not os.environ.get("CELERY_BROKER_URL"):
            # One worker, or the embedded broker (kombu's SQLAlchemy transport, which has no
            # fan-out): nothing for gossip/mingle/heartbeat to do.
            argv += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        return argv
    if name == "beat":
        return [py, "-m", "celery", "-A", "config", "beat", "--loglevel", "INFO",
                "--schedule", str(cfg.var_dir / "celerybeat-schedule")]
    raise ValueError(f"unknown service {name!r}")


def run_service(name: str, extra: list[str]) -> int:
    """`steward run SERVICE`: exec one service in the foreground with the same command line
    `steward up` uses (for systemd units and containers). Needs DATABASE_URL and the keys in
    the environment; nothing is generated here."""
    env = dict(os.environ)
    var_dir = var_dir_from_env()
    env["STEWARD_VAR_DIR"] = str(var_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
    env.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    env["PYTHONUNBUFFERED"] = "1"
    if not env.get("DATABASE_URL"):
        from config.embedded import embedded_database_urls

        # development only: the app role, and the owner for the broker's own tables
        env["DATABASE_URL"], owner = embedded_database_urls(var_dir)
        env.setdefault("DATABASE_OWNER_URL", owner)
    cfg = ServiceConfig(
        var_dir=var_dir, host=os.environ.get("STEWARD_BIND_HOST", "127.0.0.1"),
        web_port=_env_port("STEWARD_WEB_PORT", DEFAULT_WEB_PORT),
        proxy_port=_env_port("STEWARD_PROXY_PORT", DEFAULT_PROXY_PORT),
        upstream=upstream_root(os.environ.get("STEWARD_UPSTREAM_URL", "")))
    argv = service_argv(name, cfg) + extra
    os.chdir(REPO)
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


# --- steward up ---------------------------------------------------------------------------

_DECLARE_QUEUES = """
from kombu import Queue
from config.celery import app
with app.connection_for_write() as conn:
    for name in ("capture", "gpu"):
        Queue(name).bind(conn.default_channel).declare()
"""


class Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.var_dir = var_dir_from_env()
        self.log_dir = self.var_dir / "log"
        self.run_file = self.var_dir / "run" / "up.json"
        self.children: list[Child] = []
        self.embedded = False
        self.env: dict[str, str] = {}
        self.shutting_down = False
        # Heartbeats older than this launch belong to an earlier run (governance/workers.py).
        self.launched_at = datetime.datetime.now(datetime.UTC)

    # signals: the first one unwinds start-up or ends the supervision loop; during shutdown
    # a second one skips the grace period.
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.shutting_down:
            for child in self.children:
                child.kill_group(signal.SIGKILL)
            return
        self.shutting_down = True
        raise Stop(signal.Signals(signum).name)

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        code = 0
        try:
            self.prepare()
            self.start_services()
            code = self.supervise()
        except Stop as stop:
            say(f"{stop.args[0] if stop.args else 'signal'} received: stopping")
        except StartupError as exc:
            say(f"start-up failed: {exc}")
            code = 1
        finally:
            self.shutting_down = True
            self.shutdown()
        return code

    def _child(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, env or self.env, self.log_dir,
                      _COLORS[len(self.children) % len(_COLORS)])
        self.children.append(child)
        child.start()
        write_run_file(self.run_file, self.children)
        return child

    def _manage(self, *args: str) -> str:
        """Run a manage.py command to completion; its output is shown only if it fails."""
        proc = subprocess.run([sys.executable, str(REPO / "manage.py"), *args], cwd=REPO,
                              env=self.env, capture_output=True, text=True)
        with open(self.log_dir / "setup.log", "a") as log:
            log.write(f"--- manage.py {' '.join(args)} (exit {proc.returncode})\n")
            log.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise StartupError(f"manage.py {' '.join(args)} exited {proc.returncode}:\n"
                               + (proc.stderr or proc.stdout).strip()[-4000:])
        return proc.stdout

    def prepare(self) -> None:
        env = dict(os.environ)
        self.var_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env["STEWARD_VAR_DIR"] = str(self.var_dir)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
        env["DJANGO_SETTINGS_MODULE"] = "config.settings"

        # 1. Secrets, generated under var/ on first start unless the environment has them.
        if not env.get("DJANGO_SECRET_KEY"):
            env["DJANGO_SECRET_KEY"] = read_or_create_secret(
                self.var_dir / "secret.key", lambda: secrets.token_urlsafe(50))
        if not env.get("STEWARD_MASTER_KEY"):
            from wire.crypto import load_master_key

            key_file = env.get("STEWARD_MASTER_KEY_FILE") or str(self.var_dir / "master.key")
            load_master_key("", key_file, create=True)  # validates an existing one too
            env["STEWARD_MASTER_KEY_FILE"] = key_file

        self.web_host = self.args.host
        self.web_port = self.args.web_port
        self.proxy_port = self.args.proxy_port
        for what, port in (("STEWARD_WEB_PORT", self.web_port),
                           ("STEWARD_PROXY_PORT", self.proxy_port)):
            if port_in_use(self.web_host, port):
                raise StartupError(f"port {port} ({what}) is already in use on {self.web_host}; "
                                   f"set {what} to a free port")
        env["STEWARD_WEB_PORT"] = str(self.web_port)
        env["STEWARD_PROXY_PORT"] = str(self.proxy_port)

        # 2. The database: the configured server, else the embedded one. The services connect
        # as the app role (row-level security applies); `migrate` runs as the owner
        # (DATABASE_OWNER_URL), which is also the embedded broker's role: kombu creates its
        # own tables on first use, and they hold no tenant data.
        if not env.get("DATABASE_URL"):
            from config.embedded import embedded_database_urls

            say(f"starting the embedded PostgreSQL in {self.var_dir / 'pg'}")
            self.embedded = True
            env["DATABASE_URL"], owner = embedded_database_urls(self.var_dir)
            env.setdefault("DATABASE_OWNER_URL", owner)
        self.env = env

        # 3. Schema, static files, demo tenant + credentials.
        say("migrating the database")
        self._manage("migrate", "--noinput")
        # Declare the workers' queues once before any worker starts: kombu's SQLAlchemy
        # transport (the embedded broker) creates its tables on first use, and two workers
        # starting at once race on that CREATE (one dies with a UniqueViolation).
        self._manage("shell", "-c", _DECLARE_QUEUES)
        self._manage("collectstatic", "--noinput", "-v", "0")
        self.creds = json.loads(self._manage("bootstrap_demo", "--json").strip().splitlines()[-1])

    def start_services(self) -> None:
        env = self.env
        py = sys.executable

        # 4. The upstream: the configured one, else the demo model server.
        self.demo_upstream = not env.get("STEWARD_UPSTREAM_URL")
        if self.demo_upstream:
            port = free_port()
            self._child("upstream", [py, "-m", "proxy.demo_upstream", "--host", "127.0.0.1",
                                     "--port", str(port)])
            env["STEWARD_UPSTREAM_URL"] = f"http://127.0.0.1:{port}"
            self._wait_ports([("upstream", port)], timeout=30)
        self.upstream = upstream_root(env["STEWARD_UPSTREAM_URL"])

        # 5. The appliance.
        cfg = ServiceConfig(var_dir=self.var_dir, host=self.web_host, web_port=self.web_port,
                            proxy_port=self.proxy_port, upstream=self.upstream,
                            access_log=str(self.log_dir / "web-access.log"))
        # The gpu-queue worker runs training jobs and evolution gates on the CPU here, one at a
        # time (concurrency 1); a GPU host runs `steward run gpu-worker` instead.
        for name in ("web", "proxy", "shipper", "worker", "gpu-worker", "beat"):
            self._child(name, service_argv(name, cfg, single_host=True))

        # 6. Ready when the web and proxy ports accept.
        self._wait_ports([("web", self.web_port), ("proxy", self.proxy_port)],
                         timeout=STARTUP_TIMEOUT)
        self._wait_proxy_knows_key(timeout=30)
        ready = self._wait_workers_ready(timeout=WORKER_READY_TIMEOUT)
        self.print_banner(workers_ready=ready)

    def _fail_if_a_child_died(self) -> None:
        """During start-up a death stops everything (restarts begin once the banner is out)."""
        dead = self._check_children()
        if dead is not None:
            self._report_death(dead)
            raise StartupError(f"{dead.name} exited during start-up")

    def _wait_workers_ready(self, timeout: float) -> bool:
        """Wait until both Celery workers reported in (governance/workers.py: a heartbeat row
        started after this launch). The capture worker loads the sanitizer before its first
        heartbeat, so after this the first call's steps are built in seconds. False after
        `timeout`: the banner then says the workers are still warming up."""
        import psycopg

        say("waiting for the Celery workers (the capture worker loads the sanitizer first)")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._fail_if_a_child_died()
            try:
                with psycopg.connect(self.env["DATABASE_URL"], connect_timeout=5) as conn:
                    rows = conn.execute(
                        "SELECT queues FROM governance_workerheartbeat WHERE started_at >= %s",
                        [self.launched_at]).fetchall()
            except psycopg.Error:
                rows = []
            consumed = {q for (queues,) in rows for q in queues}
            if {"capture", "gpu"} <= consumed:
                return True
            time.sleep(0.5)
        return False

    def _wait_proxy_knows_key(self, timeout: float) -> None:
        """The proxy loads its key table in a background thread after it starts listening;
        the banner is printed once it accepts the demo key, so the first copy-pasted call
        does not get a 401."""
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            f"http://127.0.0.1:{self.proxy_port}/v1/models",
            headers={"Authorization": f"Bearer {self.creds['proxy_key']}"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._fail_if_a_child_died()
            try:
                with urllib.request.urlopen(req, timeout=5):
                    return
            except urllib.error.HTTPError as exc:
                # Steward's own refusal says Server: steward; any other answer came from
                # the upstream, i.e. the key was accepted.
                if not (exc.code == 401 and exc.headers.get("Server", "").startswith("steward")):
                    return
            except OSError:
                pass
            time.sleep(0.3)
        say(f"warning: the proxy did not accept the demo key within {timeout:.0f}s "
            f"(see {self.log_dir / 'proxy.log'})")

    def _check_children(self) -> Child | None:
        for child in self.children:
            if not child.running():
                return child
        return None

    def _report_death(self, child: Child) -> None:
        code = child.proc.returncode if child.proc else None
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        time.sleep(0.3)  # let the pump print the last lines first
        say(f"{child.name} exited unexpectedly ({how}); its last lines ({child.log_path}):")
        for line in list(child.tail)[-15:]:
            say(f"  {line}")

    def _wait_ports(self, ports: list[tuple[str, int]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = dict(ports)
        while pending:
            self._fail_if_a_child_died()
            for name, port in list(pending.items()):
                if port_accepts(port):
                    del pending[name]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise StartupError("not listening after {:.0f}s: {}".format(
                    timeout, ", ".join(f"{n} (port {p})" for n, p in pending.items())))
            time.sleep(0.2)

    def supervise(self) -> int:
        """Until a signal (Stop): restart whatever dies, with backoff, and log it."""
        while True:
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is None and not child.running():
                    self._report_death(child)
                    delay = child.schedule_restart(now)
                    say(f"restarting {child.name} in {delay:.0f}s "
                        f"(death {child.deaths_in_a_row} in a row; the others keep running)")
                elif child.restart_at is not None and now >= child.restart_at:
                    child.restart()
                    write_run_file(self.run_file, self.children)
                    say(f"{child.name} restarted (pid {child.pid})")
            time.sleep(0.5)

    def shutdown(self) -> None:
        if self.children:
            stop_children(self.children)
            say("all processes stopped")
        if self.embedded:
            from config.embedded import stop_embedded

            if stop_embedded(self.var_dir):
                say("embedded PostgreSQL stopped")
        self.run_file.unlink(missing_ok=True)

    def print_banner(self, workers_ready: bool = True) -> None:
        c = self.creds
        shown = "127.0.0.1" if self.web_host in ("0.0.0.0", "", "::") else self.web_host
        base_url = f"http://{shown}:{self.proxy_port}/v1"
        console = f"http://{shown}:{self.web_port}/"
        upstream = self.upstream + (" (demo model server)" if self.demo_upstream else "")
        database = "embedded PostgreSQL (var/pg)" if self.embedded else "DATABASE_URL"
        model = "demo-model" if self.demo_upstream else "<your model>"
        status = ("Steward is up." if workers_ready else
                  "Steward is up, but the Celery workers are still warming up: calls are "
                  "captured now,\ntheir steps (and any training job) wait until the workers "
                  f"report in (see {self.log_dir / 'worker.log'}).")
        say(f"""
{status}

  base_url:   {base_url}
  proxy key:  {c['proxy_key']}   (tenant {c['tenant']}, agent {c['agent']})
  upstream:   {upstream}
  console:    {console}   login: {c['username']} / {c['password']}
  api token:  {c['api_token']}   (REST, {c['username']})
  database:   {database}
  logs:       {self.log_dir}/   credentials: {self.var_dir / 'demo-credentials.json'}

Point an agent at Steward (OpenAI Python client):

  from openai import OpenAI
  client = OpenAI(base_url="{base_url}", api_key="{c['proxy_key']}")
  reply = client.chat.completions.create(
      model="{model}", messages=[{{"role": "user", "content": "Hello"}}],
      extra_headers={{"X-Steward-Session": "demo-session-1"}})
  print(reply.choices[0].message.content)

Then list the captured trajectories over REST:

  curl -s -H "Authorization: Bearer {c['api_token']}" {console}api/v1/trajectories/

Ctrl-C stops everything.
""".strip("\n"))


# --- steward down -------------------------------------------------------------------------


def down() -> int:
    var_dir = var_dir_from_env()
    run_file = var_dir / "run" / "up.json"
    stopped_any = False
    if run_file.exists():
        try:
            data = json.loads(run_file.read_text())
        except ValueError:
            data = {}
        if _same_process(data):
            # A running `steward up`: let it stop its children and the database itself.
            print(f"stopping steward up (pid {data['pid']})")
            os.kill(data["pid"], signal.SIGTERM)
            deadline = time.monotonic() + GRACE_SECONDS * 2 + 15
            while time.monotonic() < deadline and _same_process(data):
                time.sleep(0.2)
            stopped_any = True
        for entry in data.get("children", []):
            if _same_process(entry):  # left over from an `up` that was killed
                print(f"stopping left-over {entry['name']} (pid {entry['pid']})")
                try:
                    os.killpg(entry["pid"], signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    os.kill(entry["pid"], signal.SIGTERM)
                stopped_any = True
        for entry in data.get("children", []):
            deadline = time.monotonic() + GRACE_SECONDS
            while time.monotonic() < deadline and _same_process(entry):
                time.sleep(0.2)
            if _same_process(entry):
                os.kill(entry["pid"], signal.SIGKILL)
        run_file.unlink(missing_ok=True)

    from config.embedded import stop_embedded, test_pgdata_dir

    if stop_embedded(var_dir):
        print(f"embedded PostgreSQL stopped ({var_dir / 'pg'})")
        stopped_any = True
    if stop_embedded(var_dir, pgdata=test_pgdata_dir(var_dir)):  # left running by `make test`
        print(f"embedded test PostgreSQL stopped ({test_pgdata_dir(var_dir)})")
        stopped_any = True
    if not stopped_any:
        print(f"nothing to stop under {var_dir}")
    return 0


# --- entry point --------------------------------------------------------------------------


def _env_port(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return int(value) if value else default
    except ValueError:
        raise SystemExit(f"steward: {name} must be a port number, got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steward",
        description="Steward: a data-governance proxy for LLM agents. `steward up` runs the "
        "whole appliance on this host (console, REST API, proxy, shipper, Celery worker and "
        "beat) on embedded defaults; configure it with environment variables (see "
        "deploy/steward.env.sample).",
        epilog="Management commands (tenants, keys, tokens, users, audit): "
        "steward manage help.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    up = sub.add_parser(
        "up", help="run the appliance in the foreground (Ctrl-C stops it)",
        description="Run the appliance in the foreground. Unset DATABASE_URL: an embedded "
        "PostgreSQL under STEWARD_VAR_DIR/pg. Unset CELERY_BROKER_URL: kombu's SQLAlchemy "
        "transport on the same database. Unset STEWARD_UPSTREAM_URL: a small demo "
        "OpenAI-compatible server. Prints the proxy base_url, a demo proxy key, the console "
        "login and an API token once everything accepts connections.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    up.add_argument("--web-port", type=int,
                    default=_env_port("STEWARD_WEB_PORT", DEFAULT_WEB_PORT),
                    help="console + REST API port (env STEWARD_WEB_PORT)")
    up.add_argument("--proxy-port", type=int,
                    default=_env_port("STEWARD_PROXY_PORT", DEFAULT_PROXY_PORT),
                    help="LLM proxy port (env STEWARD_PROXY_PORT)")
    up.add_argument("--host", default=os.environ.get("STEWARD_BIND_HOST", "127.0.0.1"),
                    help="address the web and proxy ports bind to; 0.0.0.0 to serve other "
                    "hosts (env STEWARD_BIND_HOST)")
    run = sub.add_parser(
        "run", help="run one service in the foreground (for systemd units and containers)",
        description="Exec one service with the command line `steward up` uses, configured "
        "from the environment (DATABASE_URL, CELERY_BROKER_URL, STEWARD_*; see "
        "deploy/steward.env.sample). Arguments after the service name are appended, e.g. "
        "`steward run worker -c 8` or `steward run web --workers 8`.",
    )
    run.add_argument("service", choices=SERVICES)
    run.add_argument("extra", nargs=argparse.REMAINDER,
                     help="extra arguments for gunicorn, mitmdump or celery")
    sub.add_parser(
        "manage", help="a Django management command, e.g. `steward manage create_tenant SLUG` "
        "(`steward manage help` lists them)", add_help=False)
    sub.add_parser(
        "down", help="stop a running or left-over `steward up` and its embedded PostgreSQL",
        description="Stop what `steward up` left running under STEWARD_VAR_DIR (default "
        "<repo>/var): a running `steward up`, orphaned children of a killed one, and the "
        "embedded PostgreSQL.",
    )
    return parser


def manage(args: list[str]) -> int:
    """`steward manage COMMAND ...`: Django's manage.py with this environment's interpreter
    (so it works without activating .venv), e.g. `.venv/bin/steward manage create_tenant acme`.
    Configured like the services: DATABASE_URL, else the embedded PostgreSQL."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(["steward manage", *args])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["manage"]:
        # Before argparse: every option after the command name is the command's own.
        return manage(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "up":
        return Launcher(args).run()
    if args.command == "down":
        return down()
    if args.command == "run":
        return run_service(args.service, args.extra)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
