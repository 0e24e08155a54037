"""The proxy's key table: SHA-256(proxy key) -> tenant + agent, refreshed in a background thread.

The event loop only does `KeyTable.lookup(secret)`: one sha256 and one dict get. A daemon thread
polls PostgreSQL with psycopg (no Django in the proxy process) every STEWARD_KEY_REFRESH_SECONDS:
a cheap `count(*), max(updated_at)` probe, and a full reload of the (small) table only when that
changed. Revoking a key bumps its `updated_at`, so a revocation takes effect within one refresh
interval. The table is swapped atomically (one attribute assignment), so readers never lock.

Database down: the proxy keeps the last table it loaded (fail-open for keys it already knew;
keys created during the outage are unknown, revocations made during it apply when the database
is back) and logs once per outage. Each loaded table is also written to a snapshot file (key
hashes and ids only — no secrets), which is read at start-up, so a proxy restarted during an
outage still authenticates the keys it knew.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

log = logging.getLogger("steward.keys")

# SECURITY DEFINER functions (migration 0004): the key table spans every tenant, which the
# app role cannot read directly under row-level security. They return hashes and ids only.
PROBE_SQL = "SELECT key_count, max_updated_at FROM steward_proxy_keys_version()"
LOAD_SQL = """
SELECT key_hash, key_id, tenant_id, tenant_slug, agent_id, agent_name, revoked
FROM steward_proxy_keys()
"""


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key_id: int
    tenant_id: int
    tenant_slug: str
    agent_id: int
    agent_name: str
    revoked: bool


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def write_snapshot_file(path: Path, doc: dict, what: str) -> None:
    """Replace `path` with `doc` as JSON atomically (write a 0600 temp file, fsync, rename), so
    a proxy restarted during a database outage never reads half a snapshot. Failure is logged,
    not raised: the in-memory table stays in force."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(doc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        log.exception("%s: cannot write snapshot %s", what, path)


class PolledConnection:
    """The one autocommit psycopg connection a background poller (key table, routing table)
    keeps open between polls; reconnects lazily after drop_connection() (an outage)."""

    database_url: str
    application_name = "steward-proxy"
    _conn = None

    def _connect(self):
        import psycopg

        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.database_url, autocommit=True, connect_timeout=5,
                                         application_name=self.application_name)
        return self._conn

    def drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # already broken
                pass
        self._conn = None


class KeyTable(PolledConnection):
    def __init__(self, database_url: str, snapshot_path: Path | None = None,
                 refresh_seconds: float = 1.0) -> None:
        self.database_url = database_url
        self.snapshot_path = snapshot_path
        self.refresh_seconds = refresh_seconds
        self.table: dict[str, KeyInfo] = {}
        self.loaded_from: str = "empty"  # "empty" | "snapshot" | "database"
        self.loaded = threading.Event()  # set after the first successful database load
        self._version: tuple | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn = None
        self._outage = False
        self._load_snapshot()

    # -- event loop -------------------------------------------------------------------
    def lookup(self, secret: str) -> KeyInfo | None:
        """The key's tenant/agent, or None when unknown. Revoked keys are returned (revoked
        True) so the caller can say so."""
        return self.table.get(hash_key(secret))

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="steward-key-refresh",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # closing a broken connection may fail; nothing to do
                pass

    # -- background thread ------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
                if self._outage:
                    log.warning("key table: database reachable again (%d keys)",
                                len(self.table))
                self._outage = False
            except Exception as e:
                self.drop_connection()
                if not self._outage:
                    log.warning("key table: database unreachable, keeping the last table of %d "
                              "keys (%s): %s", len(self.table), self.loaded_from, e)
                self._outage = True
            self._stop.wait(self.refresh_seconds)

    def refresh(self) -> bool:
        """Reload when the probe changed. Returns True when the table was reloaded."""
        conn = self._connect()
        with conn.cursor() as cur:
            cur.execute(PROBE_SQL)
            count, max_updated = cur.fetchone()
            version = (count, max_updated.isoformat() if max_updated else None)
            if version == self._version:
                return False
            cur.execute(LOAD_SQL)
            rows = cur.fetchall()
        self.table = {
            row[0]: KeyInfo(key_id=row[1], tenant_id=row[2], tenant_slug=row[3],
                            agent_id=row[4], agent_name=row[5], revoked=bool(row[6]))
            for row in rows
        }
        self._version = version
        self.loaded_from = "database"
        self.loaded.set()
        self._write_snapshot()
        return True

    # -- snapshot ---------------------------------------------------------------------
    def _write_snapshot(self) -> None:
        if self.snapshot_path is None:
            return
        doc = {"written_at": time.time(),
               "keys": {h: [k.key_id, k.tenant_id, k.tenant_slug, k.agent_id, k.agent_name,
                            k.revoked] for h, k in self.table.items()}}
        write_snapshot_file(self.snapshot_path, doc, "key table")

    def _load_snapshot(self) -> None:
        if self.snapshot_path is None or not self.snapshot_path.exists():
            return
        try:
            doc = orjson.loads(self.snapshot_path.read_bytes())
            self.table = {h: KeyInfo(int(v[0]), int(v[1]), str(v[2]), int(v[3]), str(v[4]),
                                     bool(v[5]))
                          for h, v in doc["keys"].items()}
            self.loaded_from = "snapshot"
            log.info("key table: %d keys from snapshot %s", len(self.table),
                     self.snapshot_path)
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            log.exception("key table: ignoring unreadable snapshot %s", self.snapshot_path)
