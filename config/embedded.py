"""The embedded PostgreSQL (the `pgserver` wheel) used when DATABASE_URL is unset.

The server lives under var/pg and listens on a Unix socket in its data directory only (no TCP
port), so it never collides with a system PostgreSQL. It is left running between commands
(cleanup_mode None) so `manage.py` calls and the processes of `steward up` share it; `steward up`
stops it on exit and `steward down` stops a left-over one.

When run as root, pgserver runs the server as the system user `pgserver` (PostgreSQL refuses to
run as root), so stopping it must go through that user too.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
import warnings
from pathlib import Path

DATABASE_NAME = "steward"
PGSERVER_SYSTEM_USER = "pgserver"

# platformdirs warns on every start when XDG_RUNTIME_DIR is unset (containers, cron); pgserver
# only uses that directory for a lock file, so the warning is noise in every manage.py call.
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")


def pgdata_dir(var_dir: Path) -> Path:
    return Path(var_dir).resolve() / "pg"


def _server(var_dir: Path):
    import pgserver

    pgdata = pgdata_dir(var_dir)
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may start at once (web, worker, beat): serialise the first start.
    with open(pgdata.parent / "pg.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return pgserver.get_server(pgdata, cleanup_mode=None)


def embedded_database_url(var_dir: Path) -> str:
    """Start (or attach to) the embedded server and return the URL of the `steward` database,
    e.g. postgresql://postgres:@/steward?host=/path/var/pg (a Unix-socket host)."""
    server = _server(var_dir)
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
    if "(1 row)" not in exists:
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")
    return server.get_uri(DATABASE_NAME)


def running_pid(var_dir: Path) -> int | None:
    """The postmaster's pid when the embedded server under var_dir is running, else None."""
    pid_file = pgdata_dir(var_dir) / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().splitlines()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by another user
    return pid


def stop_embedded(var_dir: Path, timeout: float = 30.0) -> bool:
    """Stop the embedded server if one is running under var_dir; True when one was stopped."""
    pid = running_pid(var_dir)
    if pid is None:
        return False
    from pgserver._commands import pg_ctl

    user = PGSERVER_SYSTEM_USER if os.geteuid() == 0 else None
    try:
        # "fast": roll back open transactions and disconnect clients, then a clean shutdown.
        pg_ctl(["-m", "fast", "-w", "-t", str(int(timeout)), "stop"],
               pgdata=pgdata_dir(var_dir), user=user, timeout=timeout + 5)
    except Exception:  # noqa: BLE001 - fall back to signalling the postmaster directly
        try:
            os.kill(pid, signal.SIGINT)  # PostgreSQL's "fast shutdown" signal
        except ProcessLookupError:
            return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running_pid(var_dir) is None:
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGQUIT)  # immediate shutdown; recovery runs on the next start
    except ProcessLookupError:
        pass
    return True
