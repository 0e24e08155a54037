"""The canary control plane (issue 7): services (validation, audit, tenant scoping, the context
update lifecycle), the arm comparison and its decision rule on synthetic reward data, and the
beat task's automatic rollback — seen by the real proxy within one request."""

from __future__ import annotations

import math
import random
import time
import uuid

import openai
import orjson
import pytest
from django.utils import timezone

from evolution import canary as routing
from evolution.canary import (
    activate_context_update,
    compare_arms,
    create_context_update,
    decide,
    get_context_update,
    get_route,
    msprt,
    msprt_log_likelihood_ratio,
    promote_route,
    reject_context_update,
    rollback_context_update,
    rollback_route,
    sequential_decision,
    start_canary,
    stop_route,
)
from evolution.models import ContextUpdate, PolicyRoute
from governance.models import AuditEvent, Interaction, Reward, Trajectory
from governance.services import ServiceConflict, ServiceError, ensure_agent
from tests.live import wait_for_key
from tests.welch import student_t_two_sided_p, welch_p, welch_t_test

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def agent(tenant):
    return ensure_agent("system:test", tenant, "bot")


def events(action: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=action).order_by("seq"))


# --- statistics (pure) ----------------------------------------------------------------------


def test_student_t_tail_matches_tables():
    # Two-sided critical values: t(10) = 2.228 at 0.05, t(30) = 2.042, t(inf) ~ z = 1.960.
    assert student_t_two_sided_p(2.228, 10) == pytest.approx(0.05, abs=5e-4)
    assert student_t_two_sided_p(2.042, 30) == pytest.approx(0.05, abs=5e-4)
    assert student_t_two_sided_p(1.960, 1e6) == pytest.approx(0.05, abs=5e-4)
    assert student_t_two_sided_p(0.0, 5) == pytest.approx(1.0)
    t, df, p = welch_t_test([1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    # By hand: variances 5/3 and 7/2, se^2 = 5/12 + 7/12 = 1 -> t = 2; Welch-Satterthwaite
    # df = 1 / ((5/12)^2/3 + (7/12)^2/5) = 7.941; the tail by numerical integration of the
    # t density: p = 0.080781.
    assert t == pytest.approx(2.0) and df == pytest.approx(7.941176, abs=1e-5)
    assert p == pytest.approx(0.080781, abs=1e-5)


def test_msprt_likelihood_ratio_by_hand():
    # delta 0.1, V 0.01, tau^2 0.03: 0.5 ln(0.01 / 0.04) + 0.03 * 0.01 / (2 * 0.01 * 0.04)
    # = -0.693147 + 0.375.
    assert msprt_log_likelihood_ratio(0.1, 0.01, 0.03) == pytest.approx(-0.318147, abs=1e-6)
    assert msprt_log_likelihood_ratio(0.0, 0.01, 0.03) < 0  # no difference: evidence for H0
    assert msprt_log_likelihood_ratio(0.3, 0.0, 0.03) == math.inf
    # The p-value is 1/Lambda: 200 sessions per arm, means 0.5 / 0.6, variances 0.25: V =
    # 0.0025, tau^2 = 0.25 * 0.25 = 0.0625.
    p, log_lr = msprt(200, 0.5, 0.25, 200, 0.6, 0.25)
    expected = 0.5 * math.log(0.0025 / 0.065) + 0.0625 * 0.01 / (2 * 0.0025 * 0.065)
    assert log_lr == pytest.approx(expected) and p == pytest.approx(math.exp(-expected))
    assert sequential_decision(200, 0.5, 0.25, 200, 0.6, 0.25) == ("wait", p)  # p = 0.28
    assert sequential_decision(200, 0.5, 0.25, 200, 0.7, 0.25)[0] == "promote"
    assert sequential_decision(200, 0.7, 0.25, 200, 0.5, 0.25)[0] == "rollback"


# --- the reward rule under continuous monitoring (simulated canaries) ---------------------
#
# A canary as the beat task sees it: every look (30 s) 27 more control and 3 more candidate
# sessions (share 0.1) with a 0/1 reward, decided as soon as both arms have 30 rewards, and
# ended at the first promote or rollback. 1000 canaries of 100 looks each (2700 + 300
# sessions). Summary statistics are drawn per look with numpy (binomial batch sums), so the
# whole run takes about a second per rule.

LOOKS, CONTROL_PER_LOOK, CANDIDATE_PER_LOOK, MIN_PER_ARM = 100, 27, 3, 30


def simulated_canaries(rule, p_control: float, p_candidate: float, n: int,
                       seed: int, looks: int = LOOKS) -> dict[str, int]:
    """How n simulated canaries end under `rule(n_c, mean_c, var_c, n_k, mean_k, var_k) ->
    decision`: {"promote": .., "rollback": .., "wait": ..} (wait: undecided at the end)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sums_c = rng.binomial(CONTROL_PER_LOOK, p_control, size=(n, looks)).cumsum(axis=1)
    sums_k = rng.binomial(CANDIDATE_PER_LOOK, p_candidate, size=(n, looks)).cumsum(axis=1)
    n_c = CONTROL_PER_LOOK * np.arange(1, looks + 1)
    n_k = CANDIDATE_PER_LOOK * np.arange(1, looks + 1)
    first = int(np.argmax(np.minimum(n_c, n_k) >= MIN_PER_ARM))
    outcomes = {"promote": 0, "rollback": 0, "wait": 0}
    for sc, sk in zip(sums_c.tolist(), sums_k.tolist(), strict=True):
        decision = "wait"
        for look in range(first, looks):
            nc, nk = int(n_c[look]), int(n_k[look])
            mc, mk = sc[look] / nc, sk[look] / nk
            # 0/1 rewards: the sample variance is n/(n-1) * m(1-m).
            decision = rule(nc, mc, nc / (nc - 1) * mc * (1 - mc),
                            nk, mk, nk / (nk - 1) * mk * (1 - mk))
            if decision != "wait":
                break
        outcomes[decision] += 1
    return outcomes


def msprt_rule(*stats) -> str:
    return sequential_decision(*stats)[0]


def old_welch_peeking_rule(nc, mc, vc, nk, mk, vk) -> str:
    """The replaced rule: Welch's fixed-sample test at every look, decide on p < 0.05."""
    p = welch_p(nc, mc, vc, nk, mk, vk)
    return "wait" if p >= 0.05 else ("promote" if mk > mc else "rollback")


def test_no_better_candidate_is_promoted_at_the_nominal_rate_under_continuous_monitoring():
    n, alpha = 1000, routing.ALPHA
    # alpha plus three binomial standard deviations of a rate measured on n canaries.
    bound = alpha + 3 * math.sqrt(alpha * (1 - alpha) / n)
    sequential = simulated_canaries(msprt_rule, 0.6, 0.6, n, seed=13)
    peeking = simulated_canaries(old_welch_peeking_rule, 0.6, 0.6, n, seed=13)
    print(f"candidate == control, {LOOKS} looks, {n} canaries: mSPRT {sequential}, "
          f"Welch at every look {peeking}")
    assert sequential["promote"] / n <= bound
    assert (sequential["promote"] + sequential["rollback"]) / n <= bound
    # Why it was replaced: the same canaries, judged by the fixed-sample test at every look,
    # promote a candidate that is no better several times as often as the nominal 5 %.
    assert peeking["promote"] / n > bound
    assert peeking["promote"] > 2 * max(sequential["promote"], 1)


def test_a_real_improvement_is_promoted_and_a_real_regression_rolled_back():
    n = 200
    better = simulated_canaries(msprt_rule, 0.5, 0.7, n, seed=5, looks=150)
    worse = simulated_canaries(msprt_rule, 0.7, 0.5, n, seed=6, looks=150)
    print(f"0.5 -> 0.7: {better}; 0.7 -> 0.5: {worse}")
    assert better["promote"] / n >= 0.9 and better["rollback"] == 0
    assert worse["rollback"] / n >= 0.9 and worse["promote"] == 0


def rewards(rng: random.Random, n: int, mean: float, sd: float = 0.2) -> list[float]:
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_decide_rolls_back_worse_promotes_better_and_waits_for_the_minimum():
    rng = random.Random(7)
    common = dict(errors_control=0, interactions_control=100, errors_candidate=0,
                  interactions_candidate=100, min_sessions_per_arm=30,
                  max_error_rate_increase=0.05)
    worse = decide(rewards(rng, 60, 0.7), rewards(rng, 60, 0.5), **common)
    assert worse.decision == "rollback" and worse.p_value < 0.05
    assert worse.mean_candidate < worse.mean_control and "worse" in worse.reason
    better = decide(rewards(rng, 60, 0.5), rewards(rng, 60, 0.7), **common)
    assert better.decision == "promote" and better.p_value < 0.05
    same = decide(rewards(rng, 60, 0.5), rewards(rng, 60, 0.5), **common)
    assert same.decision == "wait" and same.p_value >= 0.05
    # Far worse but too few sessions: wait for the minimum per arm.
    few = decide(rewards(rng, 60, 0.9), rewards(rng, 10, 0.1), **common)
    assert few.decision == "wait" and "30 per arm" in few.reason
    assert (few.n_control, few.n_candidate) == (60, 10)


def test_decide_rolls_back_on_an_error_rate_increase_even_with_few_samples():
    rng = random.Random(1)
    bad = decide(rewards(rng, 3, 0.5), rewards(rng, 2, 0.9), errors_control=1,
                 interactions_control=50, errors_candidate=4, interactions_candidate=12,
                 min_sessions_per_arm=30, max_error_rate_increase=0.05)
    assert bad.decision == "rollback" and "error rate" in bad.reason
    assert bad.error_rate_candidate == pytest.approx(4 / 12)
    # Too few candidate calls to judge an error rate: one failure out of three is not enough.
    early = decide([], [], errors_control=0, interactions_control=5, errors_candidate=1,
                   interactions_candidate=3, min_sessions_per_arm=30,
                   max_error_rate_increase=0.05)
    assert early.decision == "wait"
    # Within the allowed increase: no rollback.
    ok = decide([], [], errors_control=2, interactions_control=100, errors_candidate=3,
                interactions_candidate=100, min_sessions_per_arm=30,
                max_error_rate_increase=0.05)
    assert ok.decision == "wait"


def test_zero_variance_arms():
    common = dict(errors_control=0, interactions_control=0, errors_candidate=0,
                  interactions_candidate=0, min_sessions_per_arm=5, max_error_rate_increase=0.1)
    assert decide([1.0] * 5, [0.0] * 5, **common).decision == "rollback"
    assert decide([0.0] * 5, [1.0] * 5, **common).decision == "promote"
    assert decide([1.0] * 5, [1.0] * 5, **common).decision == "wait"


# --- compare_arms on synthetic data ---------------------------------------------------------


def synthetic_arm(tenant, agent, route, arm: str, values: list[float | None],
                  errors: int = 0, calls: int = 1) -> list[Trajectory]:
    """Trajectories of one arm with a final reward each (None: no reward) and `calls`
    interactions each, the first `errors` of them failing (HTTP 502)."""
    now = timezone.now()
    out = []
    failing = errors
    for value in values:
        traj = Trajectory.objects.create(
            id=uuid.uuid4(), tenant=tenant, agent=agent, started_at=now, last_step_at=now,
            route=route, route_arm=arm)
        for _ in range(calls):
            status = 502 if failing > 0 else 200
            failing -= 1
            Interaction.objects.create(
                flow_id=str(uuid.uuid4()), tenant=tenant, agent=agent, trajectory=traj,
                step_id=uuid.uuid4(), endpoint="chat.completions", method="POST",
                path="/v1/chat/completions", status_code=status, started_at=now)
        if value is not None:
            # An earlier provisional reward and an older final one: only the latest final counts.
            Reward.objects.create(tenant=tenant, trajectory_id=traj.pk, value=-100.0,
                                  final=False)
            Reward.objects.create(tenant=tenant, trajectory_id=traj.pk, value=100.0)
            Reward.objects.create(tenant=tenant, trajectory_id=traj.pk, value=value)
        out.append(traj)
    return out


def test_compare_arms_reads_latest_final_rewards_and_errors(tenant, agent):
    route = start_canary("system:test", tenant, agent, candidate_ref="candidate:1", share=0.1,
                         model="cand", min_sessions_per_arm=20)
    rng = random.Random(3)
    synthetic_arm(tenant, agent, route, "control", rewards(rng, 40, 0.8) + [None] * 3)
    synthetic_arm(tenant, agent, route, "candidate", rewards(rng, 25, 0.4), errors=1)
    result = compare_arms(route)
    assert (result.n_control, result.n_candidate) == (40, 25)
    assert (result.sessions_control, result.sessions_candidate) == (43, 25)
    assert result.mean_control == pytest.approx(0.8, abs=0.1)
    assert result.mean_candidate == pytest.approx(0.4, abs=0.1)
    assert result.error_rate_control == 0 and result.error_rate_candidate == pytest.approx(1 / 25)
    assert result.decision == "rollback" and result.p_value < 1e-6
    # Other routes' trajectories do not count.
    assert math.isclose(compare_arms(route).mean_control, result.mean_control)


def test_compare_arms_waits_with_too_few_and_rolls_back_on_errors(tenant, agent):
    route = start_canary("system:test", tenant, agent, candidate_ref="c", share=0.5,
                         model="cand", min_sessions_per_arm=30, max_error_rate_increase=0.1)
    synthetic_arm(tenant, agent, route, "control", [0.5] * 5, calls=4)
    synthetic_arm(tenant, agent, route, "candidate", [0.9] * 3, calls=4)
    assert compare_arms(route).decision == "wait"
    synthetic_arm(tenant, agent, route, "candidate", [None] * 2, errors=8, calls=4)
    result = compare_arms(route)
    assert result.decision == "rollback" and result.interactions_candidate == 20
    assert result.error_rate_candidate == pytest.approx(8 / 20)


# --- services -------------------------------------------------------------------------------


def test_context_update_validation_versions_and_audit(tenant, agent, make_member):
    steward = make_member("steward", "sue")
    first = create_context_update(steward, tenant, agent, kind="system_prompt",
                                  content={"snippet": "Be kind."}, reason="tone")
    second = create_context_update("system:evolution", tenant, agent.pk, kind="tool_schema",
                                   content={"tools": {"search": {"description": "Find"}}})
    assert (first.version, second.version) == (1, 2)
    assert first.status == second.status == "draft"
    assert first.created_by == steward and len(first.content_hash) == 64
    event = events("context_update.created")[0]
    assert event.actor == f"user:{steward.pk}" and event.object_id == str(first.pk)
    assert "Be kind" not in orjson.dumps(event.payload).decode()  # content stays out
    bad = [("nope", {"snippet": "x"}), ("system_prompt", {"snippet": ""}),
           ("system_prompt", {"snippet": "x", "extra": 1}), ("system_prompt", "x"),
           ("tool_schema", {"tools": {}}), ("tool_schema", {"tools": {"bad name": {"a": 1}}}),
           ("tool_schema", {"tools": {"f": {"parameters": "x"}}}),
           ("tool_schema", {"tools": {"f": {"name": "g"}}})]
    for kind, content in bad:
        with pytest.raises(ServiceError):
            create_context_update("system:test", tenant, agent, kind=kind, content=content)
    assert ContextUpdate.objects.count() == 2


def test_start_canary_validation_conflicts_and_scoping(tenant, other_tenant, agent, settings):
    settings.STEWARD_ENGINE_ALLOWLIST = "sglang-b=http://sglang:30000"
    other_agent = ensure_agent("system:test", other_tenant, "bot")
    for kwargs in [dict(share=0, model="m"), dict(share=1.5, model="m"),
                   dict(share=float("nan"), model="m"), dict(share=True, model="m"),
                   dict(share=0.1, upstream_url="ftp://x"),
                   dict(share=0.1, upstream_url="http://x/?q=1"),
                   dict(share=0.1, upstream_url="http://not-listed:30000"),  # a free URL
                   dict(share=0.1, model=""),  # changes nothing
                   dict(share=0.1, model="m", min_sessions_per_arm=1),
                   dict(share=0.1, model="m", max_error_rate_increase=2)]:
        with pytest.raises(ServiceError):
            start_canary("system:test", tenant, agent, candidate_ref="c", **kwargs)
    with pytest.raises(type(other_agent).DoesNotExist):  # another tenant's agent
        start_canary("system:test", tenant, other_agent, candidate_ref="c", share=0.1,
                     model="m")
    foreign_update = create_context_update("system:test", other_tenant, other_agent,
                                           kind="system_prompt", content={"snippet": "x"})
    with pytest.raises(ContextUpdate.DoesNotExist):
        start_canary("system:test", tenant, agent, candidate_ref="c", share=0.1,
                     context_update=foreign_update)
    route = start_canary("system:test", tenant, agent, candidate_ref="candidate:9", share=0.05,
                         upstream_url="http://sglang:30000/", model="m")
    assert route.candidate_upstream_url == "http://sglang:30000" and route.status == "canary"
    assert events("route.canary_started")[-1].payload["candidate_ref"] == "candidate:9"
    with pytest.raises(ServiceConflict):
        start_canary("system:test", tenant, agent, candidate_ref="c2", share=0.1, model="m")
    assert get_route(tenant, route.pk) == route
    with pytest.raises(PolicyRoute.DoesNotExist):
        get_route(other_tenant, route.pk)
    with pytest.raises(ContextUpdate.DoesNotExist):
        get_context_update(tenant, foreign_update.pk)


def test_promotion_activates_the_update_and_supersedes_the_previous(tenant, agent):
    old = create_context_update("system:test", tenant, agent, kind="system_prompt",
                                content={"snippet": "v1"})
    activate_context_update("system:test", old, "approved")
    new = create_context_update("system:test", tenant, agent, kind="system_prompt",
                                content={"snippet": "v2"})
    route = start_canary("system:test", tenant, agent, candidate_ref="c", share=0.1,
                         context_update=new)
    new.refresh_from_db()
    assert new.status == "canary"
    with pytest.raises(ServiceConflict):  # a canary update is activated by promotion only
        activate_context_update("system:test", new, "skip the canary")
    with pytest.raises(ServiceError):
        promote_route("system:test", route, "")  # a reason is required
    promote_route("system:test", route, "looks good")
    route.refresh_from_db()
    old.refresh_from_db()
    new.refresh_from_db()
    assert route.status == "promoted" and route.decided_at is not None
    assert (old.status, new.status) == ("rolled_back", "active")
    assert new.activated_at is not None and old.rolled_back_at is not None
    assert events("route.promoted")[-1].payload["superseded_context_updates"] == [old.pk]
    with pytest.raises(ServiceConflict):
        promote_route("system:test", route, "twice")
    with pytest.raises(ServiceConflict):  # a promoted route must be stopped first
        start_canary("system:test", tenant, agent, candidate_ref="c2", share=0.1, model="m")
    # Rolling back a promoted route rolls back its update too.
    rollback_route("system:test", route, "regression reported")
    new.refresh_from_db()
    assert new.status == "rolled_back"
    assert events("route.rolled_back")[-1].payload["context_update_rolled_back"] == new.pk
    with pytest.raises(ServiceConflict):
        rollback_route("system:test", route, "again")
    start_canary("system:test", tenant, agent, candidate_ref="c3", share=0.1, model="m")


def test_direct_context_update_lifecycle(tenant, agent):
    update = create_context_update("system:test", tenant, agent, kind="tool_schema",
                                   content={"tools": {"f": {"description": "d"}}})
    with pytest.raises(ServiceConflict):
        rollback_context_update("system:test", update, "not active")
    activate_context_update("system:test", update, "ok")
    rollback_context_update("system:test", update, "bad")
    activate_context_update("system:test", update, "re-apply")  # rolled back -> active again
    assert ContextUpdate.objects.get(pk=update.pk).status == "active"
    draft = create_context_update("system:test", tenant, agent, kind="tool_schema",
                                  content={"tools": {"f": {"description": "e"}}})
    reject_context_update("system:test", draft, "gate failed")
    with pytest.raises(ServiceConflict):
        activate_context_update("system:test", draft, "rejected stays rejected")
    actions = [e.action for e in AuditEvent.objects.filter(object_type="context_update")]
    assert actions.count("context_update.activated") == 2
    assert "context_update.rolled_back" in actions and "context_update.rejected" in actions


def test_stop_route(tenant, agent):
    update = create_context_update("system:test", tenant, agent, kind="system_prompt",
                                   content={"snippet": "x"})
    route = start_canary("system:test", tenant, agent, candidate_ref="c", share=0.1,
                         context_update=update)
    stop_route("system:test", route, "superseded by a new base model")
    assert PolicyRoute.objects.get(pk=route.pk).status == "stopped"
    assert ContextUpdate.objects.get(pk=update.pk).status == "rolled_back"


def test_evaluate_canaries_rolls_back_worse_and_is_idempotent(tenant, other_tenant, agent):
    from evolution.canary import evaluate_canaries

    rng = random.Random(11)
    worse = start_canary("system:test", tenant, agent, candidate_ref="worse", share=0.1,
                         model="cand", min_sessions_per_arm=30)
    synthetic_arm(tenant, agent, worse, "control", rewards(rng, 40, 0.8))
    synthetic_arm(tenant, agent, worse, "candidate", rewards(rng, 40, 0.3))
    other_agent = ensure_agent("system:test", other_tenant, "bot")
    better = start_canary("system:test", other_tenant, other_agent, candidate_ref="better",
                          share=0.1, model="cand", min_sessions_per_arm=30)
    synthetic_arm(other_tenant, other_agent, better, "control", rewards(rng, 40, 0.3))
    synthetic_arm(other_tenant, other_agent, better, "candidate", rewards(rng, 40, 0.8))

    assert evaluate_canaries() == {"rolled_back": 1, "promoted": 1}
    assert PolicyRoute.objects.get(pk=worse.pk).status == "rolled_back"
    assert PolicyRoute.objects.get(pk=better.pk).status == "promoted"
    event = events("route.rolled_back")[-1]
    assert event.actor == "system:canary" and event.tenant_id == tenant.pk
    assert event.payload["automatic"] is True
    assert event.payload["comparison"]["decision"] == "rollback"
    assert PolicyRoute.objects.get(pk=worse.pk).decision_reason.startswith("automatic:")
    assert evaluate_canaries() == {}  # nothing left in canary: a rerun changes nothing
    assert len(events("route.rolled_back")) == 1


def test_a_person_deciding_first_wins(tenant, agent):
    rng = random.Random(5)
    route = start_canary("system:test", tenant, agent, candidate_ref="c", share=0.1,
                         model="cand", min_sessions_per_arm=30)
    synthetic_arm(tenant, agent, route, "control", rewards(rng, 40, 0.8))
    synthetic_arm(tenant, agent, route, "candidate", rewards(rng, 40, 0.2))
    stale = PolicyRoute.objects.get(pk=route.pk)
    rollback_route("system:test", route, "manual")
    assert routing.evaluate_route(stale) == "skipped"
    assert len(events("route.rolled_back")) == 1


# --- the beat task and the proxy ------------------------------------------------------------


def test_automatic_rollback_stops_routing_within_one_request(transactional_db, start_proxy,
                                                             fake_upstream):
    from evolution.canary import evaluate_canaries
    from governance.services import create_proxy_key, create_tenant

    tenant = create_tenant("system:test", "acme")[0]
    issued = create_proxy_key("system:test", tenant, "bot")
    agent = issued.record.agent
    route = start_canary("system:test", tenant, agent, candidate_ref="candidate:3", share=1.0,
                         model="cand-model", min_sessions_per_arm=30)
    proxy = start_proxy(fake_upstream.url)
    wait_for_key(proxy, issued.secret)
    client = openai.OpenAI(base_url=proxy.base_url, api_key=issued.secret, max_retries=0,
                           timeout=30)

    def model_seen(session: str) -> str:
        client.chat.completions.create(model="demo-model", extra_headers={
            "X-Steward-Session": session}, messages=[{"role": "user", "content": "2+2?"}])
        return orjson.loads(fake_upstream.last_request()["body"])["model"]

    assert model_seen("live-session") == "cand-model"
    rng = random.Random(2)
    synthetic_arm(tenant, agent, route, "control", rewards(rng, 40, 0.9))
    synthetic_arm(tenant, agent, route, "candidate", rewards(rng, 40, 0.2))
    t0 = time.monotonic()
    assert evaluate_canaries() == {"rolled_back": 1}
    assert model_seen("live-session") == "demo-model"  # the very next request
    assert model_seen(f"new-{uuid.uuid4()}") == "demo-model"
    elapsed = time.monotonic() - t0
    event = events("route.rolled_back")[-1]
    assert event.actor == "system:canary" and event.object_id == str(route.pk)
    print(f"automatic rollback to control: {elapsed * 1000:.1f} ms including the evaluation")
