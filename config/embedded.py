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

from governance.subject_keys import CREATE_SQL

DATABASE_NAME = "steward"
PGSERVER_SYSTEM_USER = "pgserver"

# platformdirs warns on every start when XDG_RUNTIME_DIR is unset (containers, cron); pgserver
# only uses that directory for a lock file, so the warning is noise in every manage.py call.
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")


def pgdata_dir(var_dir: Path) -> Path:
    return Path(var_dir).resolve() / "pg"


def _sbin_on_path() -> None:
    """As root, pgserver creates its system user with `useradd` (PostgreSQL refuses to run as
    root), found through PATH; a minimal PATH (/usr/bin:/bin: cron, a bare `env -i`) lacks
    /usr/sbin, and the first start on a fresh machine failed with FileNotFoundError."""
    if os.geteuid() != 0:
        return
    parts = os.environ.get("PATH", "").split(os.pathsep)
    missing = [d for d in ("/usr/sbin", "/sbin") if d not in parts]
    if missing:
        os.environ["PATH"] = os.pathsep.join([p for p in parts if p] + missing)


def _server(var_dir: Path):
    import pgserver

    _sbin_on_path()
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
        # What only a superuser may create, before the owner role migrates (decision 38).
        _psql(server, CREATE_SQL, DATABASE_NAME)
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


def running_pid(var_dir: Path, pgdata: Path | None = None) -> int | None:
    """The postmaster's pid when the embedded server under var_dir (or the one on `pgdata`)
    is running, else None."""
    pid_file = (pgdata or pgdata_dir(var_dir)) / "postmaster.pid"
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


def stop_embedded(var_dir: Path, timeout: float = 30.0, pgdata: Path | None = None) -> bool:
    """Stop the embedded server if one is running under var_dir (or on `pgdata`, e.g. the
    test server's test_pgdata_dir); True when one was stopped."""
    pgdata = pgdata or pgdata_dir(var_dir)
    pid = running_pid(var_dir, pgdata)
    if pid is None:
        return False
    from pgserver._commands import pg_ctl

    user = PGSERVER_SYSTEM_USER if os.geteuid() == 0 else None
    try:
        # "fast": roll back open transactions and disconnect clients, then a clean shutdown.
        pg_ctl(["-m", "fast", "-w", "-t", str(int(timeout)), "stop"],
               pgdata=pgdata, user=user, timeout=timeout + 5)
    except Exception:  # noqa: BLE001 - fall back to signalling the postmaster directly
        try:
            os.kill(pid, signal.SIGINT)  # PostgreSQL's "fast shutdown" signal
        except ProcessLookupError:
            return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running_pid(var_dir, pgdata) is None:
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGQUIT)  # immediate shutdown; recovery runs on the next start
    except ProcessLookupError:
        pass
    return True


# --- the test server ----------------------------------------------------------------------
# `make test` with DATABASE_URL unset (a fresh machine): a second embedded PostgreSQL, under
# var/pg-test, that listens on 127.0.0.1 as well as its socket. The test suite needs what a CI
# server gives it: a superuser that may create the test database, roles and settings, and can
# read past row-level security for fixtures and assertions (tests/conftest.py); and a TCP port,
# because several tests put a cuttable TCP relay between a process and PostgreSQL
# (tests/relay.py). The appliance's own server (var/pg) stays socket-only and keeps its
# NOCREATEDB roles. Authentication is `trust` (pgserver's initdb): a test-only cluster with no
# data worth protecting, on loopback only. Durability is off: nothing in it must survive a crash.
TEST_PGDATA = "pg-test"
TEST_SUPERUSER = "postgres"
TEST_BROKER_DATABASE = "steward_broker"


def test_pgdata_dir(var_dir: Path) -> Path:
    return Path(var_dir).resolve() / TEST_PGDATA


def _free_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _running_tcp_port(pgdata: Path) -> int | None:
    """The TCP port of a running server on pgdata (postmaster.pid's fourth line), else None."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid, port, status = int(lines[0]), int(lines[3]), lines[7].strip()
    except (FileNotFoundError, IndexError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, run as the pgserver system user
    return port if status == "ready" else None


def test_server_url(var_dir: Path) -> str:
    """Start (or attach to) the test server and return its superuser URL for the `steward`
    database, e.g. postgresql://postgres@127.0.0.1:41234/steward. The broker database
    (TEST_BROKER_DATABASE, kombu's SQLAlchemy transport) exists too."""
    from pgserver._commands import initdb, pg_ctl

    _sbin_on_path()
    pgdata = test_pgdata_dir(var_dir)
    pgdata.mkdir(parents=True, exist_ok=True)
    user = None
    if os.geteuid() == 0:
        # PostgreSQL refuses to run as root; pgserver's own helpers run it as `pgserver`.
        from pgserver._commands import POSTGRES_BIN_PATH
        from pgserver.utils import ensure_prefix_permissions, ensure_user_exists

        entry = ensure_user_exists(PGSERVER_SYSTEM_USER)
        ensure_prefix_permissions(pgdata)
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        os.chown(pgdata, entry.pw_uid, entry.pw_gid)
        user = PGSERVER_SYSTEM_USER
    with open(pgdata.parent / "pg-test.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel pytest runs start it once
        port = _running_tcp_port(pgdata)
        if port is None:
            if not (pgdata / "PG_VERSION").exists():
                initdb(["--auth=trust", "--auth-local=trust", "--encoding=utf8",
                        "-U", TEST_SUPERUSER], pgdata=pgdata, user=user)
            port = _free_tcp_port()
            options = (f"-h 127.0.0.1 -p {port} -k {pgdata} -c fsync=off "
                       "-c synchronous_commit=off -c full_page_writes=off "
                       "-c max_connections=300")
            pg_ctl(["-w", "-t", "60", "-o", options, "-l", str(pgdata / "log"), "start"],
                   pgdata=pgdata, user=user, timeout=90)
        url = f"postgresql://{TEST_SUPERUSER}@127.0.0.1:{port}"
        import socket

        import psycopg

        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except OSError as exc:
            raise RuntimeError(
                f"the embedded test PostgreSQL in {pgdata} is running but 127.0.0.1:{port} does "
                f"not answer ({exc}); was it started in another network namespace? Stop it "
                "with `.venv/bin/steward down`.") from exc

        with psycopg.connect(f"{url}/postgres", autocommit=True) as conn:
            for name in (DATABASE_NAME, TEST_BROKER_DATABASE):
                if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                [name]).fetchone() is None:
                    conn.execute(f'CREATE DATABASE "{name}"')
    return f"{url}/{DATABASE_NAME}"
