"""The embedded PostgreSQL (the `pgserver` wheel) used when DATABASE_URL is unset.

The server lives under var/pg and listens on a Unix socket in its data directory only, so it
never collides with a system PostgreSQL. It is left running between commands (cleanup_mode
None) so `manage.py` calls and the processes of `steward up` share it; `steward up` stops it on
exit and `steward down` stops a left-over one.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

DATABASE_NAME = "steward"


def _server(var_dir: Path):
    import pgserver

    pgdata = Path(var_dir) / "pg"
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may start at once (web, worker, beat): serialise the first start.
    with open(pgdata.parent / "pg.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return pgserver.get_server(pgdata, cleanup_mode=None)


def embedded_database_url(var_dir: Path) -> str:
    server = _server(var_dir)
    exists = server.psql(
        f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';"
    )
    if "(1 row)" not in exists:
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")
    return server.get_uri(DATABASE_NAME)


def stop_embedded(var_dir: Path) -> bool:
    """Stop the embedded server if one is running under var_dir; True when one was stopped."""
    import subprocess

    import pgserver

    pgdata = Path(var_dir) / "pg"
    if not (pgdata / "postmaster.pid").exists():
        return False
    pg_ctl = Path(pgserver.__file__).parent / "pginstall" / "bin" / "pg_ctl"
    subprocess.run([str(pg_ctl), "-D", str(pgdata), "-m", "fast", "stop"], check=False,
                   capture_output=True)
    return True
