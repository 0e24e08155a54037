"""The proxy's routing table (issue 7): canary routes and context updates, per tenant and agent.

What the event loop does per captured request is `RoutingTable.plan(...)`: a few dict lookups
that decide the session's arm and return a `Plan` (upstream URL, model name, context updates to
apply), then `apply_plan(...)` rewrites the parsed body. No database, disk or network call.

Snapshot. A daemon thread loads the live routes (canary/promoted) and the context updates in
force (canary/active) through SECURITY DEFINER functions of migration 0007 (the proxy connects
as the app role, which cannot read across tenants under row-level security) and swaps one
immutable `Snapshot` (one attribute assignment, so readers never lock). It LISTENs on the
channel `steward_routing`, which triggers NOTIFY at the commit of every change of those tables
(payload: table, row id, new status). A notification that a route or update left the live
states drops it from the snapshot at once (no query), then the thread reloads: a rollback is in
force for the next request, within a millisecond or so of its commit, without a restart.
It also reloads every STEWARD_ROUTING_REFRESH_SECONDS (5 s) in case a notification was lost
(the connection dropped between two LISTENs).

Database down: the proxy keeps the last snapshot it loaded (routes and updates go on exactly as
they were; a rollback made meanwhile cannot be committed anyway) and logs once per outage. Each
snapshot is also written to `proxy-routes.json` beside the key snapshot and read at start-up, so
a proxy restarted during an outage still routes as before (docs/decisions.md, decision 11).

Assignment. Only NEW sessions are assigned: a trajectory id this process has not seen before
whose trajectory is new (a new uuid4, or an `X-Steward-Session` seen for the first time — its
trajectory id is uuid5 of tenant, agent and session, wire/ids.py). An inferred continuation
(prefix / previous_response_id) that is unknown here belongs to a trajectory that began before
anything was recorded and is never assigned mid-way. A new session goes to the candidate iff
HMAC-SHA256(key, "<route id>:<trajectory id>"), read as a number in [0, 1), is below the
route's share (`assignment_point`). The key is the server's (derived from STEWARD_MASTER_KEY,
proxy/addon.py), so nobody outside can predict or choose a session's arm, and the arm does not
depend on arrival order: whatever order, time of day or burst sessions come in, each one is
an independent draw with probability `share`, and every proxy instance with the same key puts
the same session on the same arm. Over n sessions the realized share is within
~2*sqrt(share*(1-share)/n) of the target (within 1 point from a few thousand sessions on;
tests/test_routing.py checks 20 000). A promoted route sends every new session to the
candidate. Sessions seen before a route started stay off it.

Stickiness. trajectory id -> (route id, arm) lives in one bounded LRU (STEWARD_ROUTE_STICKY_MAX,
200 000 sessions; an evicted session that comes back counts as new, and the hash gives it the
same arm again). A restart must not move a session either: with the same key the hash gives
the same arm, and (in case the key or a route's share changed) every assignment is also
appended (by the refresh thread, off the event loop) to the journal
`proxy-route-assignments.jsonl` next to the snapshot; at start-up the proxy reloads the
journal plus the arms recorded on shipped trajectories (Trajectory.route/route_arm, for a new
instance or a lost journal) of the routes still live. Inferred trajectories do not survive a
restart anyway (decision 1), so they start a new, newly assigned, trajectory. Several proxy
instances share the master key, so an `X-Steward-Session` first seen by two of them at once
gets the same arm from both.

A rollback (or stop) ends the route: every session, candidate ones included, takes the normal
config on its next request — stickiness yields to rollback by design.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from proxy.keys import PolledConnection, write_snapshot_file
from wire.rewrite import apply_context_update

log = logging.getLogger("steward.routing")

CHANNEL = "steward_routing"
ROUTES_SQL = """
SELECT route_id, tenant_id, agent_id, status, share, candidate_upstream_url, candidate_model,
       context_update_id
FROM steward_proxy_routes()
"""
UPDATES_SQL = """
SELECT update_id, tenant_id, agent_id, kind, content, version, status, content_hash
FROM steward_proxy_context_updates()
"""
ASSIGNMENTS_SQL = "SELECT route_id, trajectory_id, arm FROM steward_proxy_route_assignments(%s)"

CONTROL, CANDIDATE = "control", "candidate"
# The HKDF purpose (wire.crypto.derive_key) of the key that assigns sessions.
ASSIGNMENT_KEY_PURPOSE = "canary-assignment"
NEW_SOURCES = ("new", "session")  # trajectory sources that may start a session (inference.py)


class Route:
    __slots__ = ("route_id", "tenant_id", "agent_id", "status", "share", "upstream_url",
                 "model", "context_update_id")

    def __init__(self, route_id: int, tenant_id: int, agent_id: int, status: str,
                 share: float, upstream_url: str, model: str,
                 context_update_id: int | None) -> None:
        self.route_id = route_id
        self.tenant_id = tenant_id
        self.agent_id = agent_id
        self.status = status
        self.share = share
        self.upstream_url = upstream_url
        self.model = model
        self.context_update_id = context_update_id

    def as_list(self) -> list:
        return [self.route_id, self.tenant_id, self.agent_id, self.status, self.share,
                self.upstream_url, self.model, self.context_update_id]


class Update:
    __slots__ = ("update_id", "tenant_id", "agent_id", "kind", "content", "version", "status",
                 "content_hash")

    def __init__(self, update_id: int, tenant_id: int, agent_id: int, kind: str, content: dict,
                 version: int, status: str, content_hash: str) -> None:
        self.update_id = update_id
        self.tenant_id = tenant_id
        self.agent_id = agent_id
        self.kind = kind
        self.content = content
        self.version = version
        self.status = status
        self.content_hash = content_hash

    def as_list(self) -> list:
        return [self.update_id, self.tenant_id, self.agent_id, self.kind, self.content,
                self.version, self.status, self.content_hash]

    def version_info(self) -> dict:
        return {"id": self.update_id, "version": self.version, "hash": self.content_hash,
                "kind": self.kind}


class Snapshot:
    """Immutable after construction: routes by (tenant, agent), updates by id and the active
    updates by (tenant, agent)."""

    __slots__ = ("routes", "updates", "active")

    def __init__(self, routes: list[Route], updates: list[Update]) -> None:
        self.routes: dict[tuple[int, int], Route] = {(r.tenant_id, r.agent_id): r
                                                     for r in routes}
        self.updates: dict[int, Update] = {u.update_id: u for u in updates}
        active: dict[tuple[int, int], list[Update]] = {}
        for u in sorted(updates, key=lambda u: (u.kind, u.version)):
            if u.status == "active":
                active.setdefault((u.tenant_id, u.agent_id), []).append(u)
        self.active: dict[tuple[int, int], tuple[Update, ...]] = {
            k: tuple(v) for k, v in active.items()}

    @classmethod
    def empty(cls) -> Snapshot:
        return cls([], [])


class Plan:
    """What the proxy does to one request: route/arm (None/"": no route), the candidate's
    upstream and model ("" = unchanged) and the context updates to apply."""

    __slots__ = ("route_id", "arm", "upstream_url", "model", "updates")

    def __init__(self, route_id: int | None = None, arm: str = "", upstream_url: str = "",
                 model: str = "", updates: tuple[Update, ...] = ()) -> None:
        self.route_id = route_id
        self.arm = arm
        self.upstream_url = upstream_url
        self.model = model
        self.updates = updates

    @property
    def changes_request(self) -> bool:
        return bool(self.upstream_url or self.model or self.updates)


NO_PLAN = Plan()


def assignment_point(key: bytes, route_id: int, trajectory_id: str) -> float:
    """Where a session falls in [0, 1) for a route: the first 8 bytes of
    HMAC-SHA256(key, "<route id>:<trajectory id>") over 2**64. Keyed, so only the server can
    compute it; per route, so one session's arms in successive canaries are independent."""
    digest = hmac.digest(key, f"{route_id}:{trajectory_id}".encode(), "sha256")
    return int.from_bytes(digest[:8], "big") / 2.0**64


def takes_candidate(key: bytes, route_id: int, trajectory_id: str, share: float) -> bool:
    """A new session goes to the route's candidate with probability `share`, decided by the
    keyed hash of its trajectory id (module docstring: Assignment)."""
    return assignment_point(key, route_id, trajectory_id) < share


# --- rewriting a request body (wire/rewrite.py) -------------------------------------------


def apply_plan(endpoint: str, body: Any, plan: Plan) -> list[Update]:
    """Rewrite the parsed request body in place for the plan (model, context updates;
    wire/rewrite.py). Returns the updates that changed it (recorded in the step's versions)."""
    if not isinstance(body, dict):
        return []
    if plan.model and "model" in body:
        body["model"] = plan.model
    return [update for update in plan.updates
            if apply_context_update(endpoint, body, update.kind, update.content)]


# --- the table ----------------------------------------------------------------------------


class RoutingTable(PolledConnection):
    application_name = "steward-proxy-routing"

    def __init__(self, database_url: str, snapshot_path: Path | None = None,
                 journal_path: Path | None = None, refresh_seconds: float = 5.0,
                 sticky_max: int = 200_000, assignment_key: bytes | None = None) -> None:
        self.database_url = database_url
        # The proxy passes a key derived from the master key (stable across restarts and
        # instances); without one (unit use) a random key still gives unpredictable,
        # order-independent arms, kept across a restart by the journal.
        self.assignment_key = assignment_key or os.urandom(32)
        self.snapshot_path = snapshot_path
        self.journal_path = journal_path
        self.refresh_seconds = refresh_seconds
        self.sticky_max = sticky_max
        self.snapshot = Snapshot.empty()
        self.loaded_from = "empty"  # "empty" | "snapshot" | "database"
        self.reloads = 0  # successful database loads (tests wait on it)
        self.last_reload = 0.0
        # Event loop only: trajectory id -> (route id or 0, arm); 0/"" = seen without a route.
        self.sessions: collections.OrderedDict[str, tuple[int, str]] = \
            collections.OrderedDict()
        # Assignments to journal: appended by the event loop, drained by the thread (deque
        # append/popleft are thread-safe).
        self._journal: collections.deque[tuple[int, str, str]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn = None
        self._outage = False
        # A second connection that only LISTENs, read by the event loop (never by the thread):
        # see poll_notifications.
        self._loop: Any = None
        self._listener: Any = None
        self._listener_pending = False  # handed to the loop, not attached yet
        # (table, row id) -> monotonic time the fast path dropped it: a reload whose query
        # started before that must not bring the row back (it read the pre-rollback state).
        self._tombstones: dict[tuple[str, int], float] = {}
        self._load_snapshot()

    # -- event loop -------------------------------------------------------------------
    def plan(self, tenant_id: int, agent_id: int, trajectory_id: str, source: str) -> Plan:
        """The plan of one captured request (module docstring: assignment and stickiness)."""
        self.poll_notifications()
        snap = self.snapshot
        key = (tenant_id, agent_id)
        route = snap.routes.get(key)
        active = snap.active.get(key, ())
        sessions = self.sessions
        known = sessions.get(trajectory_id)
        if known is not None:
            sessions.move_to_end(trajectory_id)
        if route is None:
            if known is None:
                self._remember(trajectory_id, (0, ""))
            return Plan(updates=active) if active else NO_PLAN
        if known is not None and known[0] == route.route_id:
            arm = known[1]
        elif known is None and source in NEW_SOURCES:
            arm = self._assign(route, trajectory_id)
            self._remember(trajectory_id, (route.route_id, arm))
            self._journal.append((route.route_id, trajectory_id, arm))
        else:
            # A session that began before this route (or on an ended one): it stays off it.
            if known is None:
                self._remember(trajectory_id, (0, ""))
            updates = self._control_updates(route, active)
            return Plan(updates=updates) if updates else NO_PLAN
        if arm == CANDIDATE:
            update = snap.updates.get(route.context_update_id) \
                if route.context_update_id else None
            updates = active
            if update is not None:
                updates = tuple(u for u in active
                                if u.kind != update.kind and u.update_id != update.update_id)
                updates += (update,)
            return Plan(route.route_id, CANDIDATE, route.upstream_url, route.model, updates)
        return Plan(route.route_id, CONTROL, updates=self._control_updates(route, active))

    @staticmethod
    def _control_updates(route: Route, active: tuple[Update, ...]) -> tuple[Update, ...]:
        # Control never gets the route's own update (active once the route is promoted), so a
        # control session keeps its context for its lifetime.
        if route.context_update_id:
            return tuple(u for u in active if u.update_id != route.context_update_id)
        return active

    def _assign(self, route: Route, trajectory_id: str) -> str:
        if route.status == "promoted":
            return CANDIDATE
        return CANDIDATE if takes_candidate(self.assignment_key, route.route_id,
                                            trajectory_id, route.share) else CONTROL

    def _remember(self, trajectory_id: str, value: tuple[int, str]) -> None:
        sessions = self.sessions
        sessions[trajectory_id] = value
        if len(sessions) > self.sticky_max:
            sessions.popitem(last=False)

    # -- the event loop's listener --------------------------------------------------------
    def attach_loop(self, loop: Any) -> None:
        """The proxy's event loop (mitmproxy's `running` hook): the thread then opens the
        listener connection and registers it there."""
        self._loop = loop

    def poll_notifications(self) -> None:
        """Event loop, before each plan and whenever the listener socket is readable: apply the
        notifications that have already ARRIVED (libpq's read of what the socket holds — no
        query, no wait). PostgreSQL sends them at commit, before the committing client even
        sees its COMMIT answered, so a request made after a rollback returned finds the
        rollback here even when the refresh thread has not run yet.

        No readiness check first: libpq keeps its socket non-blocking, so PQconsumeInput
        returns at once when nothing came (one recv, as cheap as the zero-timeout select it
        replaces), and unlike select() it works for descriptors >= FD_SETSIZE (1024)."""
        listener = self._listener
        if listener is None:
            return
        pg = listener.pgconn
        try:
            pg.consume_input()
            while (note := pg.notifies()) is not None:
                self._fast_path(note.extra.decode("utf-8", "replace"))
        except Exception as e:  # broken connection: the thread opens a new one
            log.warning("routing: listener connection lost: %s", e)
            self._drop_listener(listener)

    def _drop_listener(self, listener: Any) -> None:
        """Event loop only."""
        if self._listener is listener:
            self._listener = None
        try:
            if self._loop is not None:
                self._loop.remove_reader(listener.pgconn.socket)
        except Exception:  # already closed
            pass
        try:
            listener.close()
        except Exception:  # already broken
            pass

    def _open_listener(self) -> None:
        """Thread: connect and LISTEN (blocking), then hand the connection to the loop."""
        import psycopg

        conn = psycopg.connect(self.database_url, autocommit=True, connect_timeout=5,
                               application_name="steward-proxy-routing-listen")
        conn.execute(f"LISTEN {CHANNEL}")
        loop = self._loop

        def attach() -> None:
            self._listener_pending = False
            self._listener = conn
            # Read as soon as something arrives, also when no request comes: a listener that
            # never reads would hold back PostgreSQL's notification queue.
            loop.add_reader(conn.pgconn.socket, self.poll_notifications)

        self._listener_pending = True
        loop.call_soon_threadsafe(attach)

    # -- lifecycle --------------------------------------------------------------------
    def load_initial(self) -> None:
        """Before serving (bounded by the connect timeout): the snapshot from the database, the
        assignments recorded on shipped trajectories, then the local journal (newer)."""
        try:
            self.refresh()
            with self._connect().cursor() as cur:
                cur.execute(ASSIGNMENTS_SQL, [self.sticky_max])
                rows = cur.fetchall()
            for route_id, trajectory_id, arm in reversed(rows):  # oldest first: LRU order
                self.sessions[trajectory_id] = (int(route_id), arm)
        except Exception as e:
            self.drop_connection()
            log.warning("routing: initial load failed, starting from %s: %s",
                        self.loaded_from, e)
        self._load_journal()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="steward-routing-refresh",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._flush_journal()
        self.drop_connection()
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.close()
            except Exception:  # already broken
                pass

    # -- background thread ------------------------------------------------------------
    def _run(self) -> None:
        listening = False
        while not self._stop.is_set():
            try:
                conn = self._connect()
                if not listening:
                    conn.execute(f"LISTEN {CHANNEL}")
                    listening = True
                    self.refresh()  # changes made before LISTEN took effect
                if self._outage:
                    log.warning("routing: PostgreSQL connection restored")
                    self._outage = False
                if self._listener is None and not self._listener_pending \
                        and self._loop is not None:
                    self._open_listener()
                notified = False
                # Short waits so the journal is flushed and stop() is noticed promptly.
                for note in conn.notifies(timeout=0.2, stop_after=1):
                    notified = True
                    self._fast_path(note.payload)
                if notified or time.monotonic() - self.last_reload >= self.refresh_seconds:
                    # Drain a burst of notifications (one per changed row) into one reload.
                    for note in conn.notifies(timeout=0.001):
                        self._fast_path(note.payload)
                    self.refresh()
            except Exception as e:
                listening = False
                self.drop_connection()
                if not self._outage:
                    # Worded apart from the key table's message (tests count that one).
                    log.warning("routing: no connection to PostgreSQL, keeping the last "
                                "snapshot (%d routes, %s): %s", len(self.snapshot.routes),
                                self.loaded_from, e)
                self._outage = True
                self._flush_journal()
                self._stop.wait(min(self.refresh_seconds, 1.0))
                continue
            self._flush_journal()

    def _fast_path(self, payload: str) -> None:
        """Drop a route or update that a notification says is no longer live, without waiting
        for the reload's queries: a rollback is in force microseconds after it arrives."""
        try:
            note = orjson.loads(payload)
            table, row_id, status = note.get("t"), note.get("id"), note.get("status")
        except (orjson.JSONDecodeError, AttributeError):
            return
        snap = self.snapshot
        if table in ("governance_policyroute", "governance_contextupdate") \
                and isinstance(row_id, int) and status not in ("canary", "promoted", "active"):
            self._tombstones[(table, row_id)] = time.monotonic()
        if table == "governance_policyroute" and status not in ("canary", "promoted"):
            routes = [r for r in snap.routes.values() if r.route_id != row_id]
            if len(routes) != len(snap.routes):
                self.snapshot = Snapshot(routes, list(snap.updates.values()))
        elif table == "governance_contextupdate" and status not in ("canary", "active"):
            if row_id in snap.updates:
                self.snapshot = Snapshot(list(snap.routes.values()),
                                         [u for u in snap.updates.values()
                                          if u.update_id != row_id])

    def refresh(self) -> None:
        """Load routes and updates and swap the snapshot (tiny tables: live rows only)."""
        conn = self._connect()
        started = time.monotonic()
        with conn.cursor() as cur:
            cur.execute(ROUTES_SQL)
            route_rows = cur.fetchall()
            cur.execute(UPDATES_SQL)
            update_rows = cur.fetchall()
        routes = [Route(int(r[0]), int(r[1]), int(r[2]), r[3], float(r[4]), r[5] or "",
                        r[6] or "", int(r[7]) if r[7] is not None else None)
                  for r in route_rows]
        updates = []
        for u in update_rows:
            try:
                content = orjson.loads(u[4])
            except orjson.JSONDecodeError:
                continue
            if isinstance(content, dict):
                updates.append(Update(int(u[0]), int(u[1]), int(u[2]), u[3], content, int(u[5]),
                                      u[6], u[7]))
        self._install(routes, updates, started)

    def _install(self, routes: list[Route], updates: list[Update], started: float) -> None:
        """Swap in what a reload read. Rows a notification dropped after its query began stay
        out (the query may predate the rollback's commit); older tombstones are settled."""
        fresh = {k for k, t in list(self._tombstones.items()) if t >= started}
        for k in [k for k, t in list(self._tombstones.items()) if t < started]:
            self._tombstones.pop(k, None)
        if fresh:
            routes = [r for r in routes if ("governance_policyroute", r.route_id) not in fresh]
            updates = [u for u in updates
                       if ("governance_contextupdate", u.update_id) not in fresh]
        self.snapshot = Snapshot(routes, updates)
        self.loaded_from = "database"
        self.reloads += 1
        self.last_reload = time.monotonic()
        self._write_snapshot(routes, updates)

    # -- snapshot and journal ---------------------------------------------------------
    def _write_snapshot(self, routes: list[Route], updates: list[Update]) -> None:
        if self.snapshot_path is None:
            return
        doc = {"written_at": time.time(), "routes": [r.as_list() for r in routes],
               "updates": [u.as_list() for u in updates]}
        write_snapshot_file(self.snapshot_path, doc, "routing")

    def _load_snapshot(self) -> None:
        if self.snapshot_path is None or not self.snapshot_path.exists():
            return
        try:
            doc = orjson.loads(self.snapshot_path.read_bytes())
            routes = [Route(*r) for r in doc["routes"]]
            updates = [Update(*u) for u in doc["updates"]]
            self.snapshot = Snapshot(routes, updates)
            self.loaded_from = "snapshot"
        except (OSError, ValueError, KeyError, TypeError):
            log.exception("routing: ignoring unreadable snapshot %s", self.snapshot_path)

    def _flush_journal(self) -> None:
        if not self._journal:
            return
        lines = []
        while self._journal:
            try:
                lines.append(orjson.dumps(list(self._journal.popleft())) + b"\n")
            except IndexError:
                break
        if self.journal_path is None:
            return
        try:
            self.journal_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.journal_path, "ab") as f:
                f.write(b"".join(lines))
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            log.exception("routing: cannot append to %s", self.journal_path)

    def _load_journal(self) -> None:
        """Merge the journal's assignments of routes still live, and rewrite it with only
        those (so it never grows past one canary's sessions)."""
        path = self.journal_path
        if path is None or not path.exists():
            return
        # Nothing loaded (database down and no snapshot): keep every entry, we cannot tell
        # which routes are still live.
        live = None if self.loaded_from == "empty" else {
            r.route_id for r in self.snapshot.routes.values()}
        kept: list[tuple[int, str, str]] = []
        try:
            for line in path.read_bytes().splitlines():
                try:
                    route_id, trajectory_id, arm = orjson.loads(line)
                except (orjson.JSONDecodeError, ValueError, TypeError):
                    continue  # a torn last line after a crash
                if (live is None or route_id in live) and arm in (CONTROL, CANDIDATE):
                    kept.append((int(route_id), str(trajectory_id), arm))
        except OSError:
            log.exception("routing: cannot read %s", path)
            return
        for route_id, trajectory_id, arm in kept[-self.sticky_max:]:
            self.sessions[trajectory_id] = (route_id, arm)
            self.sessions.move_to_end(trajectory_id)
        try:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(b"".join(orjson.dumps(list(e)) + b"\n" for e in kept))
            os.replace(tmp, path)
        except OSError:
            log.exception("routing: cannot compact %s", path)
        while len(self.sessions) > self.sticky_max:
            self.sessions.popitem(last=False)
