"""Console of the evolution control plane: /evolution/ (candidates with their gate pipeline,
open proposals with their evidence) and a candidate's page (gate results, the canary
comparison chart, promote / rollback buttons). Every role reads; promote is for
manage_evolution (admin, steward), rollback for rollback_policy (admin, steward, compliance);
the others see why not, a forced POST is refused; an outsider gets 404; every action is
audited; a refusal is a message, never a 500."""

from __future__ import annotations

import json
import re

import pytest

from evolution import gates as ev
from evolution import services as svc
from evolution.models import Candidate, Proposal
from governance import services as gov
from governance.models import AuditEvent, Trajectory
from tests.govdata import make_trajectory
from trainer.models import Checkpoint, TrainingJob

ROLES = ["admin", "steward", "compliance", "auditor"]


@pytest.fixture(autouse=True)
def candidate_engine(settings):
    """The URL the candidates below are served at is one the operator allow-listed (a
    candidate never names a free URL); nothing listens there."""
    settings.STEWARD_ENGINE_ALLOWLIST = "dead-end=http://127.0.0.1:9"


def arm(tenant, agent, route, name: str, rewards: list[float]) -> None:
    for value in rewards:
        traj = make_trajectory(tenant, agent, steps=1)
        Trajectory.objects.filter(pk=traj.pk).update(route=route, route_arm=name)
        gov.record_reward("system:test", tenant, value=value, trajectory_id=traj.pk)


def in_canary(users, tenant, agent, model: str) -> Candidate:
    """A candidate whose offline gates passed (recorded as the task would) and whose canary
    route is open."""
    cand = svc.propose_candidate(users["steward"], tenant, agent=agent,
                                 upstream_url="http://127.0.0.1:9", model=model)
    Candidate.objects.filter(pk=cand.pk).update(status="running")
    for gate, metrics in (("shadow_eval", {"candidate": {"mean": 0.8, "std": 0.1, "n": 10},
                                           "current": {"mean": 0.7, "std": 0.1, "n": 10}}),
                          ("replay", {}), ("safety", {})):
        assert svc.record_offline_gate(cand.pk, tenant.pk,
                                       ev.Decision(gate, True, f"{gate} fine", metrics))
    assert svc.start_candidate_canary(cand.pk, tenant.pk) == "started"
    cand.refresh_from_db()
    return cand


@pytest.fixture
def world(people, tenant, other_tenant):
    users, _ = people
    agent = gov.ensure_agent("system:test", tenant, "support")
    second = gov.ensure_agent("system:test", tenant, "billing")
    cand = in_canary(users, tenant, agent, "support-v2")
    arm(tenant, agent, cand.route, "control", [0.2, 0.3, 0.25])
    arm(tenant, agent, cand.route, "candidate", [0.8, 0.9, 0.7])
    stopped = svc.propose_candidate(users["steward"], tenant, agent=second,
                                    upstream_url="http://127.0.0.1:9", model="billing-v2")
    Candidate.objects.filter(pk=stopped.pk).update(status="running")
    svc.record_offline_gate(stopped.pk, tenant.pk, ev.Decision(
        "shadow_eval", False, "mean reward 0.100 on 5 held-out examples is below the current "
        "policy's 0.700 minus the margin 0.020 (needs >= 0.680)"))
    # Failures for a proposal: three tool errors of the support agent.
    failing = []
    for _ in range(3):
        traj = make_trajectory(tenant, agent, steps=1)
        traj.steps.update(observation_rest={"messages": [
            {"role": "user", "content": "find 3"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "lookup", "arguments": '{"id": 3}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Error: not found"}]})
        gov.record_reward("system:test", tenant, value=0.0, trajectory_id=traj.pk)
        failing.append(traj)
    proposal = [p for p in svc.propose_updates(users["steward"], tenant) if p.kind == "skill"][0]
    # Another tenant's candidate.
    foreign_agent = gov.ensure_agent("system:test", other_tenant, "bot")
    foreign = svc.propose_candidate(users["outsider"], other_tenant, agent=foreign_agent,
                                    upstream_url="http://127.0.0.1:9", model="secret-model")
    return {"users": users, "cand": cand, "stopped": stopped, "proposal": proposal,
            "failing": failing, "foreign": foreign, "agent": agent}


def login(client, world, role):
    client.force_login(world["users"][role])
    return client


@pytest.mark.parametrize("page", ["/evolution/", "/evolution/candidates/1/"])
def test_anonymous_is_sent_to_login(client, db, page):
    r = client.get(page)
    assert r.status_code == 302 and r["Location"].startswith("/login/")


@pytest.mark.parametrize("role", ROLES)
def test_every_role_reads_the_pipeline_proposals_and_the_canary_chart(client, world, role):
    login(client, world, role)
    cand, stopped, proposal = world["cand"], world["stopped"], world["proposal"]
    body = client.get("/evolution/").content.decode()
    assert f"/evolution/candidates/{cand.pk}/" in body
    assert f"/evolution/candidates/{stopped.pk}/" in body
    for label in ("Shadow eval", "Replay check", "Regression &amp; safety", "Canary", "Promote"):
        assert label in body
    assert "reward 0.800 vs 0.700 (n=10)" in body
    assert "skipped" in body  # the stopped candidate never reached its later gates
    assert "secret-model" not in body
    # The proposal with its evidence: the cluster's signature, tool, size, sample links.
    assert f'id="proposal-{proposal.pk}"' in body and "<code>tool_error</code>" in body
    assert "<code>lookup</code>" in body and "3 trajectories" in body
    for traj in world["failing"]:
        assert f'href="/trajectories/{traj.pk}/"' in body
    page = client.get(f"/evolution/candidates/{cand.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    chart = json.loads(re.search(r'<script id="chart-canary" type="application/json">(.*?)'
                                 r"</script>", html, re.S).group(1))
    assert chart["labels"] == ["control (n=3)", "candidate (n=3)"]
    assert chart["datasets"][1]["label"] == "mean" and chart["datasets"][1]["data"] == [0.25, 0.8]
    assert 'data-chart="chart-canary"' in html
    failed = client.get(f"/evolution/candidates/{stopped.pk}/").content.decode()
    assert "below the current policy&#x27;s 0.700" in failed


@pytest.mark.parametrize("role,promote,rollback", [
    ("admin", True, True), ("steward", True, True), ("compliance", False, True),
    ("auditor", False, False)])
def test_buttons_follow_the_permissions(client, world, role, promote, rollback):
    login(client, world, role)
    html = client.get(f"/evolution/candidates/{world['cand'].pk}/").content.decode()
    assert (f'action="/evolution/candidates/{world["cand"].pk}/promote/"' in html) == promote
    assert (f'action="/evolution/candidates/{world["cand"].pk}/rollback/"' in html) == rollback
    if not promote:
        assert "Promoting needs the <code>manage_evolution</code> permission" in html
    if not rollback:
        assert "Rolling back needs the <code>rollback_policy</code> permission" in html
    listing = client.get("/evolution/").content.decode()
    assert ('action="/evolution/propose/"' in listing) == promote


def test_forced_posts_of_roles_without_the_permission_are_refused(client, world):
    cand = world["cand"]
    login(client, world, "compliance")
    assert client.post(f"/evolution/candidates/{cand.pk}/promote/",
                       {"reason": "x"}).status_code == 403
    assert client.post(f"/evolution/proposals/{world['proposal'].pk}/accept/",
                       {"content": "x"}).status_code == 403
    login(client, world, "auditor")
    assert client.post(f"/evolution/candidates/{cand.pk}/rollback/",
                       {"reason": "x"}).status_code == 403
    cand.refresh_from_db()
    assert cand.status == "running"


def test_an_outsider_gets_404(client, world):
    login(client, world, "outsider")
    cand = world["cand"]
    assert client.get(f"/evolution/candidates/{cand.pk}/").status_code == 404
    assert client.post(f"/evolution/candidates/{cand.pk}/promote/",
                       {"reason": "x"}).status_code == 404
    assert client.post(f"/evolution/candidates/{cand.pk}/rollback/",
                       {"reason": "x"}).status_code == 404
    assert client.post(f"/evolution/proposals/{world['proposal'].pk}/dismiss/",
                       {"reason": "x"}).status_code == 404
    body = client.get("/evolution/").content.decode()
    assert "secret-model" in body and f"/evolution/candidates/{cand.pk}/" not in body


def test_promote_and_rollback_from_the_console_are_audited(client, world):
    cand = world["cand"]
    login(client, world, "steward")
    r = client.post(f"/evolution/candidates/{cand.pk}/promote/", {"reason": ""}, follow=True)
    assert r.status_code == 200 and "Not promoted: a reason is required" in r.content.decode()
    r = client.post(f"/evolution/candidates/{cand.pk}/promote/",
                    {"reason": "canary looks better"}, follow=True)
    assert f"Candidate {cand.pk} promoted." in r.content.decode()
    cand.refresh_from_db()
    assert cand.status == "promoted" and cand.route.status == "promoted"
    event = AuditEvent.objects.get(action="candidate.promoted")
    assert event.actor == f"user:{world['users']['steward'].pk}"
    login(client, world, "compliance")
    r = client.post(f"/evolution/candidates/{cand.pk}/rollback/",
                    {"reason": "customer complaints"}, follow=True)
    assert f"Candidate {cand.pk} rolled back." in r.content.decode()
    cand.refresh_from_db()
    assert cand.status == "rolled_back" and cand.route.status == "rolled_back"
    assert AuditEvent.objects.filter(action="route.rolled_back").count() == 1
    # Twice: a message, not a 500.
    r = client.post(f"/evolution/candidates/{cand.pk}/rollback/", {"reason": "again"},
                    follow=True)
    assert "Not rolled back: candidate" in r.content.decode()
    html = client.get(f"/evolution/candidates/{cand.pk}/").content.decode()
    assert "nothing to roll back" in html


def test_accept_and_dismiss_proposals(client, world, tenant):
    login(client, world, "steward")
    prop = world["proposal"]
    r = client.post(f"/evolution/proposals/{prop.pk}/accept/",
                    {"content": "Look the id up in the CRM first."})
    prop.refresh_from_db()
    assert prop.status == "accepted" and r["Location"] == f"/evolution/candidates/" \
        f"{prop.candidate_id}/"
    assert prop.candidate.context_update.content == {"snippet": "Look the id up in the CRM first."}
    r = client.post(f"/evolution/proposals/{prop.pk}/accept/", {"content": "again"}, follow=True)
    assert "Not accepted: proposal" in r.content.decode()
    r = client.post(f"/evolution/proposals/{prop.pk}/dismiss/", {"reason": "x"}, follow=True)
    assert "Not dismissed" in r.content.decode()
    assert AuditEvent.objects.filter(action="proposal.accepted").count() == 1
    r = client.post("/evolution/failures/", follow=True)
    assert r.status_code == 200 and "open proposal" in r.content.decode()


def test_a_tainted_checkpoint_is_refused_from_the_console(client, world, tenant, people):
    from tests.test_training_jobs import make_version

    users, _ = people
    version, _ = make_version(tenant, people, name="console")
    job = TrainingJob.objects.create(tenant=tenant, dataset_version=version,
                                     reward_fn="exact_match",
                                     base_model="tiny-qwen2", base_model_path="/nonexistent")
    ckpt = Checkpoint.objects.create(tenant=tenant, job=job, step=1, path="/nonexistent",
                                     weight_version="1", manifest={}, manifest_sha256="0" * 64,
                                     status="tainted", tainted_reason="erasure request 4")
    login(client, world, "steward")
    page = client.get(f"/checkpoints/{ckpt.pk}/").content.decode()
    assert "A tainted checkpoint can never enter the gate pipeline." in page
    r = client.post("/evolution/propose/", {"checkpoint": ckpt.pk, "agent": world["agent"].pk,
                                            "back": "checkpoint"}, follow=True)
    assert r.status_code == 200
    assert "Not proposed: refused: checkpoint" in r.content.decode()
    assert "is tainted (erasure request 4)" in r.content.decode()
    assert not Candidate.objects.filter(checkpoint=ckpt).exists()
    r = client.post("/evolution/propose/", {"checkpoint": "x"}, follow=True)
    assert "Choose a checkpoint and the agent" in r.content.decode()
    assert Proposal.objects.filter(status="open").count() >= 1


# --- in a real browser --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_browser_draws_the_canary_chart_and_promotes(console, world):
    """Chart.js draws the canary comparison (three series over two arms); the steward promotes
    with the form; the pages raise no browser error."""
    cand = world["cand"]
    cp = console(world["users"]["steward"])
    cp.go("/evolution/")
    cp.shot("evolution")
    cp.go(f"/evolution/candidates/{cand.pk}/")
    page = cp.page
    page.wait_for_function("() => typeof Chart !== 'undefined' && Chart.getChart("
                           "document.querySelector('canvas[data-chart=chart-canary]'))")
    drawn = page.evaluate("() => { const c = Chart.getChart(document.querySelector("
                          "'canvas[data-chart=chart-canary]')); return [c.data.labels.length, "
                          "c.data.datasets.length] }")
    assert drawn == [2, 3]
    cp.shot("candidate-canary")
    page.get_by_label("Reason for promoting").fill("the candidate arm is better")
    page.get_by_role("button", name="Promote").click()
    page.wait_for_url(f"**/evolution/candidates/{cand.pk}/")
    assert f"Candidate {cand.pk} promoted." in page.content()
    cand.refresh_from_db()
    assert cand.status == "promoted"
    cp.shot("candidate-promoted")
    cp.assert_clean()


# --- issue 13.8: the propose form's defaults, the candidate page refreshing itself ------------


def test_propose_form_forces_an_agent_and_offers_only_eval_splits_that_exist(
        client, world, tenant, people):
    login(client, world, "steward")
    page = client.get("/evolution/").content.decode()
    form = page[page.index('id="propose"'):]
    # No agent is preselected (it was the alphabetically first one).
    assert '<option value="" selected disabled>— choose the agent —</option>' in form
    assert not re.search(r'<select id="pc-agent"[^>]*>(?:(?!</select>).)*<option value="\d+" '
                         r'selected', form, re.S)
    # No approved version: no "tenant's default" that does not exist, and no way to submit.
    assert "the tenant's default" not in form
    assert "no approved version to evaluate on" in form
    assert re.search(r'<button type="submit" disabled>Propose as candidate', form)

    from tests.test_training_jobs import make_version

    version, _ = make_version(tenant, people, name="held-out")
    form = client.get("/evolution/").content.decode()
    form = form[form.index('id="propose"'):]
    assert "— choose an approved version —" in form and "held-out v1" in form
    assert '<select id="pc-eval" name="eval_version" required>' in form
    svc.set_evolution_policy(people[0]["admin"], tenant, eval_version=version.pk)
    form = client.get("/evolution/").content.decode()
    assert "the tenant's default: held-out v1" in form[form.index('id="propose"'):]


def test_propose_without_an_eval_split_that_exists_is_refused(client, world, tenant, people):
    from tests.test_training_jobs import make_version

    users, _ = people
    version, _ = make_version(tenant, people, name="only-train")
    job = TrainingJob.objects.create(tenant=tenant, dataset_version=version,
                                     reward_fn="exact_match", base_model="tiny-qwen2",
                                     base_model_path="/nonexistent")
    ckpt = Checkpoint.objects.create(tenant=tenant, job=job, step=1, path="/nonexistent",
                                     weight_version="1", manifest={}, manifest_sha256="0" * 64)
    login(client, world, "steward")
    before = Candidate.objects.count()
    r = client.post("/evolution/propose/", {"checkpoint": ckpt.pk, "agent": world["agent"].pk},
                    follow=True)
    assert "there is no held-out eval split for its shadow eval" in r.content.decode()
    assert Candidate.objects.count() == before


def test_candidate_page_polls_while_its_gates_run_and_reloads_when_they_move_on(
        client, world, people, tenant):
    users, _ = people
    cand = svc.propose_candidate(users["steward"], tenant, agent=world["agent"],
                                 upstream_url="http://127.0.0.1:9", model="m-poll")
    Candidate.objects.filter(pk=cand.pk).update(status="running")
    login(client, world, "auditor")
    url = f"/evolution/candidates/{cand.pk}/"
    page = client.get(url).content.decode()
    poll = f'hx-get="{url}?stage=shadow_eval&amp;status=running" hx-trigger="every 2s"'
    assert poll in page
    htmx = {"HTTP_HX_REQUEST": "true", "HTTP_HX_TARGET": "candidate-live"}
    same = client.get(url, {"stage": "shadow_eval", "status": "running"}, **htmx)
    assert same.status_code == 200 and "<h1>" not in same.content.decode()
    assert poll in same.content.decode()
    svc.record_offline_gate(cand.pk, tenant.pk, ev.Decision("shadow_eval", True, "fine", {}))
    moved = client.get(url, {"stage": "shadow_eval", "status": "running"}, **htmx)
    assert moved["HX-Refresh"] == "true"
    # A stopped candidate's page does not poll.
    assert "hx-trigger" not in client.get(
        f"/evolution/candidates/{world['stopped'].pk}/").content.decode().split(
        'id="candidate-live"')[1].split(">")[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_browser_candidate_page_refreshes_itself_while_gates_run(console, world, people, tenant):
    users, _ = people
    cand = svc.propose_candidate(users["steward"], tenant, agent=world["agent"],
                                 upstream_url="http://127.0.0.1:9", model="m-live")
    Candidate.objects.filter(pk=cand.pk).update(status="running")
    cp = console(users["auditor"])
    cp.go(f"/evolution/candidates/{cand.pk}/")
    page = cp.page
    gate = page.locator(".gate", has_text="Shadow eval")
    assert "running" in gate.inner_text()
    # The gate task records its result; nobody touches the page.
    svc.record_offline_gate(cand.pk, tenant.pk, ev.Decision("shadow_eval", True, "fine", {}))
    page.wait_for_function("() => document.querySelector('.gate-pipeline .gate')"
                           ".textContent.includes('passed')", timeout=15_000)
    assert "running" in page.locator(".gate", has_text="Replay").inner_text()
    svc.record_offline_gate(cand.pk, tenant.pk, ev.Decision("replay", False, "tools worse", {}))
    page.wait_for_function("() => document.querySelector('[data-candidate-status]')"
                           ".textContent.includes('Failed')", timeout=15_000)
    page.wait_for_timeout(2500)
    assert page.locator("#candidate-live[hx-trigger]").count() == 0  # polling stopped
    cp.shot("candidate-live")
    cp.assert_clean()
