"""Canary routing in the proxy (issue 7): keyed-hash assignment (share within a point), sticky
sessions, context updates applied only for their tenant and agent, and rollbacks in force on the
very next request — through the real proxy (mitmdump + addon), the official openai client and
the demo upstream."""

from __future__ import annotations

import hmac
import os
import time
import uuid
from pathlib import Path

import openai
import orjson
import pytest

from governance.capture.steps import step_json
from proxy.routing import (
    ASSIGNMENT_KEY_PURPOSE,
    CANDIDATE,
    CONTROL,
    Plan,
    Route,
    RoutingTable,
    Snapshot,
    Update,
    apply_plan,
    takes_candidate,
)
from tests.live import wait_for_key
from wire.ids import session_trajectory_id

pytestmark = pytest.mark.timeout(180)

SNIPPET = "Always answer in French."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def table_with(routes: list[Route], updates: list[Update] = (), **kw) -> RoutingTable:
    table = RoutingTable("", **kw)
    table.snapshot = Snapshot(list(routes), list(updates))
    return table


# --- assignment (pure) -------------------------------------------------------------------


@pytest.mark.parametrize("share", [0.01, 0.05, 0.1, 0.2, 1 / 3, 0.5, 0.95])
def test_share_of_new_sessions_is_within_one_point_over_20000(share):
    # A fixed key and fixed sessions, so the run is reproducible (a random key would fail
    # this 3-sigma check about once in 400 runs per share).
    table = table_with([Route(7, 1, 2, "canary", share, "", "cand", None)],
                       assignment_key=b"steward-test-assignment-key-0001")
    arms = [table.plan(1, 2, session_trajectory_id(1, 2, f"user-{i}"), "session").arm
            for i in range(20_000)]
    candidates = arms.count(CANDIDATE)
    assert abs(candidates / 20_000 - share) <= 0.01, (share, candidates)
    print(f"share {share:.4f}: {candidates}/20000 = {candidates / 20_000:.4f}")


def test_assignment_is_a_keyed_hash_of_the_session_not_its_arrival_order():
    key = bytes(range(32))
    ids = [session_trajectory_id(1, 2, f"session-{i}") for i in range(2000)]
    route = Route(7, 1, 2, "canary", 0.3, "", "cand", None)
    first = table_with([route], assignment_key=key)
    arms = {i: first.plan(1, 2, i, "session").arm for i in ids}
    # Another instance (or a restart) with the same key, sessions arriving in another order:
    # the same arm for every session.
    other = table_with([route], assignment_key=key)
    for i in reversed(ids):
        assert other.plan(1, 2, i, "session").arm == arms[i]
    # It is the HMAC of "<route>:<trajectory id>" under the key, compared with the share.
    for i in ids[:50]:
        point = int.from_bytes(hmac.digest(key, f"7:{i}".encode(), "sha256")[:8],
                               "big") / 2**64
        assert (arms[i] == CANDIDATE) == (point < 0.3) == takes_candidate(key, 7, i, 0.3)
    # Without the key the arms cannot be predicted: another key assigns other sessions (about
    # 2 * 0.3 * 0.7 = 42 % of them differ), and the next route re-draws every session.
    stranger = table_with([route], assignment_key=b"x" * 32)
    differ = sum(stranger.plan(1, 2, i, "session").arm != arms[i] for i in ids) / len(ids)
    assert 0.35 < differ < 0.49, differ
    next_route = sum(takes_candidate(key, 8, i, 0.3) != (arms[i] == CANDIDATE)
                     for i in ids) / len(ids)
    assert 0.35 < next_route < 0.49, next_route
    # Arrival order no longer decides: the first sessions are not a fixed pattern (the old
    # counter put exactly the 4th, 7th, 10th... session on the candidate at share 0.3).
    assert [arms[i] == CANDIDATE for i in ids[:10]] != [
        (k + 1) * 3 // 10 > k * 3 // 10 for k in range(10)]


def test_sessions_are_sticky_and_only_new_ones_are_assigned():
    table = table_with([Route(7, 1, 2, "canary", 0.5, "", "cand", None)])
    ids = [str(uuid.uuid4()) for _ in range(50)]
    first = {i: table.plan(1, 2, i, "session").arm for i in ids}
    assert set(first.values()) == {CONTROL, CANDIDATE}
    for _ in range(3):
        for i in ids:
            assert table.plan(1, 2, i, "prefix").arm == first[i]
    # An inferred continuation of a trajectory never seen here began before the route: off it.
    assert table.plan(1, 2, str(uuid.uuid4()), "prefix").route_id is None
    # Another agent / tenant: no route.
    assert table.plan(1, 3, ids[0], "new").route_id is None
    assert table.plan(9, 2, str(uuid.uuid4()), "new").route_id is None


def test_promotion_keeps_control_sessions_and_sends_new_ones_to_candidate():
    route = Route(7, 1, 2, "canary", 0.5, "", "cand", None)
    table = table_with([route])
    ids = [str(uuid.uuid4()) for _ in range(10)]
    before = {i: table.plan(1, 2, i, "new").arm for i in ids}
    table.snapshot = Snapshot([Route(7, 1, 2, "promoted", 0.5, "", "cand", None)], [])
    assert {i: table.plan(1, 2, i, "prefix").arm for i in ids} == before
    assert all(table.plan(1, 2, str(uuid.uuid4()), "new").arm == CANDIDATE for _ in range(20))
    # Rolled back: nothing routes any more, candidate sessions included.
    table.snapshot = Snapshot([], [])
    assert all(table.plan(1, 2, i, "prefix").route_id is None for i in ids)


def test_sessions_seen_before_the_route_stay_off_it():
    table = table_with([])
    old = str(uuid.uuid4())
    assert table.plan(1, 2, old, "session").route_id is None
    table.snapshot = Snapshot([Route(7, 1, 2, "canary", 1.0, "", "cand", None)], [])
    assert table.plan(1, 2, old, "session").route_id is None
    assert table.plan(1, 2, str(uuid.uuid4()), "session").arm == CANDIDATE


def test_sticky_map_is_bounded():
    table = table_with([Route(7, 1, 2, "canary", 0.5, "", "", None)], sticky_max=100)
    for _ in range(1000):
        table.plan(1, 2, str(uuid.uuid4()), "new")
    assert len(table.sessions) == 100


def test_assignments_survive_a_restart_through_the_journal(tmp_path):
    snap = tmp_path / "proxy-routes.json"
    journal = tmp_path / "proxy-route-assignments.jsonl"
    route = Route(7, 1, 2, "canary", 0.3, "", "cand", None)
    table = table_with([route], snapshot_path=snap, journal_path=journal)
    table._write_snapshot([route], [])
    ids = [str(uuid.uuid4()) for _ in range(40)]
    arms = {i: table.plan(1, 2, i, "session").arm for i in ids}
    table._flush_journal()

    # A restart with the database unreachable: snapshot file + journal.
    restarted = RoutingTable("postgresql://nobody@127.0.0.1:1/none", snapshot_path=snap,
                             journal_path=journal)
    restarted.load_initial()
    assert restarted.loaded_from == "snapshot"
    assert {i: restarted.plan(1, 2, i, "session").arm for i in ids} == arms
    # (Each table has its own random key here: the arms come from the journal, not the hash.)


def _notification_applied_by_the_plan(listener_fds: list[int] | None = None) -> None:
    """No refresh thread at all: the plan itself reads the listener socket (non-blocking) and
    drops the rolled-back route, so the request after a rollback never races the thread."""
    import psycopg

    from tests.live import database_url_from_django

    url = database_url_from_django()
    table = table_with([Route(7, 1, 2, "canary", 1.0, "", "cand", None)],
                       [update("system_prompt", {"snippet": "x"}, uid=3)])
    session = str(uuid.uuid4())
    assert table.plan(1, 2, session, "session").arm == CANDIDATE
    listener = psycopg.connect(url, autocommit=True)
    if listener_fds is not None:
        listener_fds.append(listener.fileno())
    listener.execute("LISTEN steward_routing")
    table._listener = listener
    with psycopg.connect(url, autocommit=True) as other:
        other.execute("SELECT pg_notify('steward_routing', %s), pg_notify('steward_routing', %s)",
                      [orjson.dumps({"t": "governance_policyroute", "id": 7,
                                     "status": "rolled_back"}).decode(),
                       orjson.dumps({"t": "governance_contextupdate", "id": 3,
                                     "status": "rolled_back"}).decode()])
    # The notifications travel to the listener's socket (a moment on a loaded machine); nothing
    # but the plan reads them — no refresh thread runs here, and each plan only reads what
    # has arrived (it never waits).
    deadline = time.monotonic() + 10
    while True:
        plan = table.plan(1, 2, session, "session")
        if (plan.route_id is None and plan.updates == ()) or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    assert plan.route_id is None and plan.updates == ()
    listener.close()


def test_a_notification_that_arrived_is_applied_before_the_next_plan(db):
    _notification_applied_by_the_plan()


def test_the_listener_works_on_a_descriptor_above_1024(db):
    """select() cannot watch a descriptor >= FD_SETSIZE (ValueError): a busy proxy with
    more than a thousand connections open must still see a rollback on its next request."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1100:
        if hard != resource.RLIM_INFINITY and hard < 1100:
            pytest.skip(f"the descriptor limit ({hard}) is below 1100")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
    filler = []
    try:
        while not filler or filler[-1] < 1030:  # every low descriptor taken
            filler.append(os.open(os.devnull, os.O_RDONLY))
        fds: list[int] = []
        _notification_applied_by_the_plan(fds)
        assert fds[0] >= 1024
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_reload_that_predates_a_rollback_does_not_bring_it_back():
    table = table_with([Route(7, 1, 2, "canary", 1.0, "", "cand", None)])
    table._fast_path(orjson.dumps({"t": "governance_policyroute", "id": 7,
                                   "status": "rolled_back"}).decode())
    assert not table.snapshot.routes
    # The thread's reload query began just before the fast path ran: it still says canary.
    stale = Route(7, 1, 2, "canary", 1.0, "", "cand", None)
    table._install([stale], [], time.monotonic() - 1)
    assert not table.snapshot.routes
    # A reload that began after the rollback settles the tombstone.
    table._install([], [], time.monotonic())
    assert not table._tombstones


def test_restart_reloads_arms_recorded_on_shipped_trajectories(transactional_db):
    """A fresh proxy instance (no journal) takes the arms of live routes' trajectories from
    the database, through the SECURITY DEFINER function, as the app role."""
    from django.utils import timezone

    from evolution.canary import start_canary, stop_route
    from governance.models import Trajectory
    from governance.services import create_tenant, ensure_agent
    from tests.live import PROXY_DATABASE_ROLE, database_url_from_django

    tenant = create_tenant("system:test", "acme")[0]
    agent = ensure_agent("system:test", tenant, "bot")
    route = start_canary("system:test", tenant, agent, candidate_ref="c", share=0.5,
                         model="cand")
    now = timezone.now()
    arms = {}
    for i in range(6):
        arm = CANDIDATE if i % 2 else CONTROL
        traj = Trajectory.objects.create(id=uuid.uuid4(), tenant=tenant, agent=agent,
                                         started_at=now, last_step_at=now, route=route,
                                         route_arm=arm)
        arms[str(traj.pk)] = arm
    table = RoutingTable(database_url_from_django(PROXY_DATABASE_ROLE))
    table.load_initial()
    table.drop_connection()
    assert table.loaded_from == "database"
    assert table.snapshot.routes[(tenant.pk, agent.pk)].route_id == route.pk
    assert {t: table.plan(tenant.pk, agent.pk, t, "session").arm for t in arms} == arms
    stop_route("system:test", route, "done")
    table = RoutingTable(database_url_from_django(PROXY_DATABASE_ROLE))
    table.load_initial()
    table.drop_connection()
    assert not table.sessions and not table.snapshot.routes  # ended routes: nothing to keep


# --- rewriting the request (pure) -----------------------------------------------------------


def update(kind: str, content: dict, uid: int = 3, version: int = 2) -> Update:
    return Update(uid, 1, 2, kind, content, version, "active", "h" * 64)


def test_system_prompt_snippet_is_appended_or_inserted():
    plan = Plan(updates=(update("system_prompt", {"snippet": SNIPPET}),))
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "hi"}]}
    assert [u.update_id for u in apply_plan("chat.completions", body, plan)] == [3]
    assert body["messages"][0] == {"role": "system", "content": f"Be brief.\n\n{SNIPPET}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    apply_plan("chat.completions", body, plan)
    assert body["messages"][0] == {"role": "system", "content": SNIPPET}
    body = {"model": "m", "messages": [{"role": "system",
                                        "content": [{"type": "text", "text": "x"}]}]}
    apply_plan("chat.completions", body, plan)
    assert body["messages"][0]["content"][-1] == {"type": "text", "text": SNIPPET}
    body = {"model": "m", "input": "hi", "instructions": "Be brief."}
    apply_plan("responses", body, plan)
    assert body["instructions"] == f"Be brief.\n\n{SNIPPET}"
    assert apply_plan("completions", {"model": "m", "prompt": "x"}, plan) == []


def test_tool_schema_is_rewritten_by_name_and_model_replaced():
    new = {"description": "Exact arithmetic on decimals",
           "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}
    plan = Plan(7, CANDIDATE, "", "cand-model",
                (update("tool_schema", {"tools": {"calculator": new}}),))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    assert len(apply_plan("chat.completions", body, plan)) == 1
    assert body["model"] == "cand-model"
    assert body["tools"][0]["function"] == {"name": "calculator", **new}
    assert TOOLS[0]["function"]["description"] == "Evaluate arithmetic"  # caller's copy intact
    flat = {"model": "m", "input": "x", "tools": [{"type": "function", "name": "calculator",
                                                   "parameters": {}}]}
    apply_plan("responses", flat, plan)
    assert flat["tools"][0]["description"] == new["description"]
    other = {"model": "m", "messages": [], "tools": [{"type": "function", "function": {
        "name": "search", "parameters": {}}}]}
    assert apply_plan("chat.completions", other, plan) == []  # no tool of that name: unchanged


# --- through the real proxy ---------------------------------------------------------------


def client_for(proxy, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key=secret, max_retries=0, timeout=30)


def chat(client: openai.OpenAI, session: str | None = None, content: str = "what is 2+3?",
         **kw):
    headers = {"X-Steward-Session": session} if session else None
    return client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": content}],
        extra_headers=headers, **kw)


def upstream_body(server) -> dict:
    return orjson.loads(server.last_request()["body"])


@pytest.fixture
def world(transactional_db):
    """Tenant acme with agents a1, a2 and tenant other with agent a1, each with a key."""
    from governance.services import create_proxy_key, create_tenant

    acme = create_tenant("system:test", "acme")[0]
    other = create_tenant("system:test", "other")[0]
    keys = {"a1": create_proxy_key("system:test", acme, "a1"),
            "a2": create_proxy_key("system:test", acme, "a2"),
            "other": create_proxy_key("system:test", other, "a1")}
    return acme, other, keys


CANDIDATE_KEY = "sk-candidate-engine-credential"


@pytest.fixture
def candidate_upstream(settings):
    """A second demo upstream, listed as the operator's candidate engine `candidate` with its
    own credential (the web side reads Django settings, the proxy its environment: start())."""
    from proxy.demo_upstream import start_in_thread

    server = start_in_thread()
    settings.STEWARD_ENGINE_ALLOWLIST = f"candidate={server.url}"
    yield server
    server.stop()


def engine_env() -> dict[str, str]:
    """The proxy's view of the operator's candidate engines: the same as the web's."""
    from django.conf import settings

    return {"STEWARD_ENGINE_ALLOWLIST": settings.STEWARD_ENGINE_ALLOWLIST,
            "STEWARD_ENGINE_CANDIDATE_API_KEY": CANDIDATE_KEY}


def start(start_proxy, upstream, keys) -> object:
    proxy = start_proxy(upstream.url, STEWARD_ROUTING_REFRESH_SECONDS="30", **engine_env())
    for issued in keys.values():
        wait_for_key(proxy, issued.secret)
    return proxy


def wait_for_model(client, server, model: str, timeout: float = 10.0) -> None:
    """Poll with fresh sessions until the proxy's snapshot routes them to `model` (used only
    to wait for a route created while the proxy runs; share 1.0 routes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        chat(client, f"probe-{uuid.uuid4()}")
        if server.last_request() is not None and upstream_body(server)["model"] == model:
            return
        time.sleep(0.05)
    raise AssertionError(f"the proxy never routed to {model}")


def test_share_and_stickiness_end_to_end(world, start_proxy, fake_upstream, candidate_upstream,
                                         tmp_path):
    from evolution.canary import start_canary
    from evolution.models import PolicyRoute
    from governance.models import Step, Trajectory
    from tests.pipeline import ship_and_build

    acme, _, keys = world
    agent = keys["a1"].record.agent
    route = start_canary("system:test", acme, agent, candidate_ref="candidate:1", share=0.1,
                         upstream_url=candidate_upstream.url, model="cand-model")
    proxy = start(start_proxy, fake_upstream, keys)  # loads the route before serving
    client = client_for(proxy, keys["a1"].secret)
    fake_upstream.clear()
    candidate_upstream.clear()
    arms: dict[str, str] = {}
    for i in range(200):
        session = f"s-{i}"
        raw = chat(client, session)
        assert raw.parse().choices[0].message.content == "2 + 3 = 5."
        arms[session] = raw.headers["x-steward-trajectory"]
    cand = [orjson.loads(r["body"]) for r in candidate_upstream.requests]
    control = [orjson.loads(r["body"]) for r in fake_upstream.requests]
    # The keyed hash of each session's trajectory id under the proxy's key (derived from the
    # master key) decides: exactly the sessions it puts below the share are on the candidate.
    import os

    from wire.crypto import derive_key, load_master_key

    key = derive_key(load_master_key(os.environ["STEWARD_MASTER_KEY"]),
                     ASSIGNMENT_KEY_PURPOSE)
    hashed = {s for s, traj in arms.items() if takes_candidate(key, route.pk, traj, 0.1)}
    assert len(cand) == len(hashed) and len(control) == 200 - len(hashed)
    assert 5 <= len(hashed) <= 40  # Binomial(200, 0.1): 20 +- 4
    assert {b["model"] for b in cand} == {"cand-model"}
    assert {b["model"] for b in control} == {"demo-model"}

    # Sticky: each session's later calls (with the answer appended) stay on its arm.
    records = {r["trajectory_id"]: r for r in proxy.wait_for_records(200)}
    on_candidate = [s for s in arms if records[arms[s]]["routing"]["route"]["arm"] == CANDIDATE]
    assert set(on_candidate) == hashed
    for session in [*on_candidate[:5], "s-0", "s-1", "s-2"]:
        expected = records[arms[session]]["routing"]["route"]["arm"]
        for _ in range(3):
            n_cand = len(candidate_upstream.requests)
            chat(client, session, content="and 4+4?")
            went = CANDIDATE if len(candidate_upstream.requests) > n_cand else CONTROL
            assert went == expected, session

    # Shipped: the trajectory carries the route and arm; each step's versions name them.
    all_records = proxy.wait_for_records(200 + 24)
    ship_and_build(tmp_path / "ship", all_records)
    trajs = Trajectory.objects.filter(route=route)
    assert trajs.filter(route_arm=CANDIDATE).count() == len(hashed)
    assert trajs.filter(route_arm=CONTROL).count() == 200 - len(hashed)
    step = Step.objects.filter(trajectory__route_arm=CANDIDATE).first()
    assert step.versions["route"] == {"id": route.pk, "arm": CANDIDATE}
    assert step_json(step)[1]["gen_ai.request.model"] == "cand-model"  # from its column
    assert PolicyRoute.objects.get(pk=route.pk).status == "canary"


def test_context_update_only_for_its_tenant_and_agent_and_gone_after_rollback(
        world, start_proxy, fake_upstream, tmp_path):
    from evolution.canary import (
        activate_context_update,
        create_context_update,
        rollback_context_update,
    )
    from governance.models import Step
    from tests.pipeline import ship_and_build

    acme, _, keys = world
    agent = keys["a1"].record.agent
    proxy = start(start_proxy, fake_upstream, keys)
    clients = {name: client_for(proxy, k.secret) for name, k in keys.items()}
    new_schema = {"description": "Exact decimal arithmetic", "parameters": {
        "type": "object", "properties": {"expr": {"type": "string"}}}}
    snippet = create_context_update("system:test", acme, agent, kind="system_prompt",
                                    content={"snippet": SNIPPET}, reason="tone")
    schema = create_context_update("system:test", acme, agent, kind="tool_schema",
                                   content={"tools": {"calculator": new_schema}}, reason="t")
    activate_context_update("system:test", snippet, "approved")
    activate_context_update("system:test", schema, "approved")
    deadline = time.monotonic() + 10
    while True:  # the NOTIFY arrives in milliseconds; allow a slow CI machine
        chat(clients["a1"], tools=TOOLS)
        body = upstream_body(fake_upstream)
        if (body["messages"][0].get("content") == SNIPPET
                and body["tools"][0]["function"]["description"] == new_schema["description"]) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert body["messages"][0] == {"role": "system", "content": SNIPPET}
    assert body["tools"][0]["function"] == {"name": "calculator", **new_schema}

    for name in ("a2", "other"):  # another agent of the tenant, the same agent name elsewhere
        chat(clients[name], tools=TOOLS)
        body = upstream_body(fake_upstream)
        assert body["messages"] == [{"role": "user", "content": "what is 2+3?"}], name
        assert body["tools"] == TOOLS, name

    rollback_context_update("system:test", snippet, "complaints")
    raw = chat(clients["a1"], tools=TOOLS)  # the very next request
    body = upstream_body(fake_upstream)
    assert body["messages"] == [{"role": "user", "content": "what is 2+3?"}]
    assert body["tools"][0]["function"] == {"name": "calculator", **new_schema}

    # The step records which update (id, version, hash) shaped its request.
    proxy.wait_for_record(raw.headers["x-steward-step"])
    ship_and_build(tmp_path / "ship", proxy.records())
    last = Step.objects.get(pk=raw.headers["x-steward-step"])
    assert last.versions["context_update"] == {"id": schema.pk, "version": schema.version,
                                               "hash": schema.content_hash}
    with_both = [s for s in Step.objects.filter(trajectory__agent=agent)
                 if len(s.versions.get("context_updates", [])) == 2]
    assert with_both and {u["id"] for u in with_both[0].versions["context_updates"]} == {
        snippet.pk, schema.pk}


def test_rollback_is_in_force_on_the_very_next_request(world, start_proxy, fake_upstream,
                                                       candidate_upstream):
    from evolution.canary import create_context_update, rollback_route, start_canary

    acme, _, keys = world
    agent = keys["a1"].record.agent
    proxy = start(start_proxy, fake_upstream, keys)
    client = client_for(proxy, keys["a1"].secret)
    update = create_context_update("system:test", acme, agent, kind="system_prompt",
                                   content={"snippet": SNIPPET}, reason="candidate prompt")
    route = start_canary("system:test", acme, agent, candidate_ref="candidate:2", share=1.0,
                         upstream_url=candidate_upstream.url, model="cand-model",
                         context_update=update)
    wait_for_model(client, candidate_upstream, "cand-model")
    chat(client, "sticky-1")
    body = upstream_body(candidate_upstream)
    assert body["model"] == "cand-model" and body["messages"][0]["content"] == SNIPPET

    n_candidate = len(candidate_upstream.requests)
    t0 = time.monotonic()
    rollback_route("system:test", route, "manual rollback")
    chat(client, "sticky-1")  # the same session's very next request
    elapsed = time.monotonic() - t0
    assert len(candidate_upstream.requests) == n_candidate, "still routed to the candidate"
    body = upstream_body(fake_upstream)
    assert body["model"] == "demo-model"
    assert body["messages"] == [{"role": "user", "content": "what is 2+3?"}]
    print(f"rollback to control on the next request: {elapsed * 1000:.1f} ms round trip")


def test_database_down_keeps_the_last_snapshot(world, start_proxy, fake_upstream,
                                               candidate_upstream, tmp_path):
    """A proxy restarted while PostgreSQL is unreachable routes from its snapshot file."""
    from evolution.canary import start_canary

    acme, _, keys = world
    agent = keys["a1"].record.agent
    start_canary("system:test", acme, agent, candidate_ref="c", share=1.0, model="cand-model")
    spool = tmp_path / "shared" / "spool"
    proxy = start_proxy(fake_upstream.url, spool_dir=spool)
    wait_for_key(proxy, keys["a1"].secret)
    chat(client_for(proxy, keys["a1"].secret), "s-1")
    assert upstream_body(fake_upstream)["model"] == "cand-model"
    proxy.stop()
    assert Path(spool.parent / "proxy-routes.json").exists()
    down = start_proxy(fake_upstream.url, spool_dir=spool,
                       DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")
    wait_for_key(down, keys["a1"].secret)  # keys from their snapshot too
    chat(client_for(down, keys["a1"].secret), "s-1")
    assert upstream_body(fake_upstream)["model"] == "cand-model"
    chat(client_for(down, keys["a1"].secret), "s-new")
    assert upstream_body(fake_upstream)["model"] == "cand-model"


# --- the operator's engines only, each with its own credential (issue 12, item 2) ----------


def auth_of(request: dict) -> str | None:
    return next((v for k, v in request["headers"] if k.lower() == "authorization"), None)


def test_the_candidate_engine_gets_its_own_credential_never_the_upstream_key(
        world, start_proxy, fake_upstream, candidate_upstream):
    from evolution.canary import start_canary
    from tests.live import UPSTREAM_API_KEY

    acme, _, keys = world
    start_canary("system:test", acme, keys["a1"].record.agent, candidate_ref="candidate:5",
                 share=1.0, upstream_url="candidate", model="cand-model")  # by engine name
    proxy = start(start_proxy, fake_upstream, keys)
    fake_upstream.clear()
    candidate_upstream.clear()
    for i in range(3):
        chat(client_for(proxy, keys["a1"].secret), f"s-{i}")
    chat(client_for(proxy, keys["a2"].secret), "control-arm")  # a2 has no route
    assert len(candidate_upstream.requests) == 3
    assert {auth_of(r) for r in candidate_upstream.requests} == {f"Bearer {CANDIDATE_KEY}"}
    assert not any(UPSTREAM_API_KEY in str(r["headers"]) for r in candidate_upstream.requests)
    assert [auth_of(r) for r in fake_upstream.requests] == [f"Bearer {UPSTREAM_API_KEY}"]


def test_a_route_to_an_engine_the_operator_did_not_list_is_not_followed(
        world, start_proxy, fake_upstream, candidate_upstream):
    """A route row naming any other host (written before the allow-list, or straight into the
    table) sends nothing there: the calls stay on the control upstream, unchanged."""
    from evolution.canary import start_canary
    from evolution.models import PolicyRoute
    from proxy.demo_upstream import start_in_thread

    rogue = start_in_thread()
    try:
        acme, _, keys = world
        route = start_canary("system:test", acme, keys["a1"].record.agent,
                             candidate_ref="candidate:6", share=1.0,
                             upstream_url=candidate_upstream.url, model="cand-model")
        PolicyRoute.objects.filter(pk=route.pk).update(candidate_upstream_url=rogue.url)
        proxy = start(start_proxy, fake_upstream, keys)
        fake_upstream.clear()
        for i in range(3):
            raw = chat(client_for(proxy, keys["a1"].secret), f"s-{i}")
            assert raw.status_code == 200
        assert len(rogue.requests) == 0 and len(candidate_upstream.requests) == 0
        assert [upstream_body(fake_upstream)["model"]] == ["demo-model"]
        assert len(fake_upstream.requests) == 3
        assert "names an engine that is not in STEWARD_ENGINE_ALLOWLIST" in proxy.log()
    finally:
        rogue.stop()
