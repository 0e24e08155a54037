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


# The same two roles as a production install (deploy/postgres-init.sql): the owner runs
# migrations; the services connect as the app role, which owns nothing and has NOBYPASSRLS, so
# row-level security applies to it. Authentication is `trust` on the Unix socket in var/pg
# (pgserver's initdb), so no passwords.
OWNER_ROLE = "steward_owner"
APP_ROLE = "steward_app"

_ROLES_SQL = f"""
DO $$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{OWNER_ROLE}') THEN
        CREATE ROLE {OWNER_ROLE} LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{APP_ROLE}') THEN
        CREATE ROLE {APP_ROLE} LOGIN;
    END IF;
END $$;
ALTER ROLE {OWNER_ROLE} NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE;
ALTER ROLE {APP_ROLE} NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE;
"""

# A database created before the roles existed has its objects owned by `postgres`: hand them
# to the owner role (REASSIGN OWNED cannot take objects from the bootstrap superuser).
_OWNERSHIP_SQL = f"""
ALTER DATABASE {DATABASE_NAME} OWNER TO {OWNER_ROLE};
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT c.oid::regclass AS name FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
               AND c.relowner <> '{OWNER_ROLE}'::regrole LOOP
        EXECUTE format('ALTER TABLE %s OWNER TO {OWNER_ROLE}', r.name);
    END LOOP;
    FOR r IN SELECT c.oid::regclass AS name FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'public' AND c.relkind = 'S'
               AND c.relowner <> '{OWNER_ROLE}'::regrole
               AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.objid = c.oid
                               AND d.deptype IN ('a', 'i')) LOOP
        EXECUTE format('ALTER SEQUENCE %s OWNER TO {OWNER_ROLE}', r.name);
    END LOOP;
    FOR r IN SELECT p.oid::regprocedure AS name FROM pg_proc p
             JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = 'public' AND p.proowner <> '{OWNER_ROLE}'::regrole LOOP
        EXECUTE format('ALTER FUNCTION %s OWNER TO {OWNER_ROLE}', r.name);
    END LOOP;
END $$;
"""


def _role_uri(uri: str, role: str) -> str:
    """pgserver's URI (postgresql://postgres:@/steward?host=...) with another user."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


def embedded_database_urls(var_dir: Path) -> tuple[str, str]:
    """Start (or attach to) the embedded server, make sure the `steward` database and both
    roles exist, and return (app URL, owner URL), e.g.
    postgresql://steward_app@/steward?host=/path/var/pg (a Unix-socket host)."""
    server = _server(var_dir)
    # One lock for the set-up too: web, worker and beat may all start at once.
    with open(pgdata_dir(var_dir).parent / "pg.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _psql(server, _ROLES_SQL, "postgres")
        exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
        if "(1 row)" not in exists:
            server.psql(f"CREATE DATABASE {DATABASE_NAME} OWNER {OWNER_ROLE};")
        owner = server.psql(f"SELECT pg_get_userbyid(datdba) FROM pg_database "
                            f"WHERE datname = '{DATABASE_NAME}';")
        if OWNER_ROLE not in owner:
            _psql(server, _OWNERSHIP_SQL, DATABASE_NAME)
    uri = server.get_uri(DATABASE_NAME)
    return _role_uri(uri, APP_ROLE), _role_uri(uri, OWNER_ROLE)


def _psql(server, sql: str, database: str) -> None:
    """Run SQL as the superuser in `database`, stopping at the first error (server.psql
    neither stops nor reports one)."""
    import subprocess

    from pgserver._commands import POSTGRES_BIN_PATH

    proc = subprocess.run([str(POSTGRES_BIN_PATH / "psql"), "-q", "-v", "ON_ERROR_STOP=1",
                           server.get_uri(database)], input=sql, text=True,
                          capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"embedded PostgreSQL set-up failed: {proc.stderr.strip()}")


_ensured: dict[Path, tuple[str, str]] = {}


def ensure_embedded(var_dir: Path) -> tuple[str, str]:
    """embedded_database_urls, once per process (the lazy backend calls it per connection)."""
    key = Path(var_dir).resolve()
    if key not in _ensured:
        _ensured[key] = embedded_database_urls(var_dir)
    return _ensured[key]


def expected_database_urls(var_dir: Path) -> tuple[str, str]:
    """The (app, owner) URLs of the embedded database without starting it: pgserver listens on
    a Unix socket in its data directory."""
    host = pgdata_dir(var_dir)
    return (f"postgresql://{APP_ROLE}@/{DATABASE_NAME}?host={host}",
            f"postgresql://{OWNER_ROLE}@/{DATABASE_NAME}?host={host}")


def embedded_database_url(var_dir: Path) -> str:
    """The app role's URL of the embedded database (see embedded_database_urls)."""
    return embedded_database_urls(var_dir)[0]


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
