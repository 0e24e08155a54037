"""The console's overview (live charts, counts that need action) and trajectory pages: search
with every filter, pagination that keeps them, the conversation view (placeholders marked,
everything else escaped, tool calls, rewards, versions, governance) and the audited raw read
(compliance only, reason required)."""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from governance.keyring import subject_hash
from governance.models import (
    Approval,
    AuditEvent,
    Dataset,
    DatasetVersion,
    DatasetVersionMember,
    ErasureRequest,
    Interaction,
    PendingInteraction,
    Reward,
    Step,
    SubjectIndex,
    Trajectory,
)
from governance.sanitizer import normalize_identifier
from governance.tenancy import tenant_context
from tests.govdata import add_findings, make_trajectory

ROLES = ["admin", "steward", "compliance", "auditor"]
EMAIL = "Maria.Garcia@Example.com"


@pytest.fixture
def agents(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "billing-bot"), \
        ensure_agent("system:test", tenant, "support-bot")


def chart(body: str, chart_id: str) -> dict:
    m = re.search(rf'<script id="{chart_id}" type="application/json">(.*?)</script>', body,
                  re.S)
    assert m, f"no {chart_id} in the page"
    return json.loads(m.group(1))


def ids_in(body: str) -> set[str]:
    return set(re.findall(r'href="/trajectories/([0-9a-f-]{36})/"', body))


# --- overview ---------------------------------------------------------------------------------


def test_overview_charts_count_calls_per_agent_and_hour(client, make_member, tenant, agents):
    billing, support = agents
    now = timezone.now()
    hour_ago = now - timedelta(hours=2)
    recent = now - timedelta(seconds=30)
    make_trajectory(tenant, billing, steps=3, started=recent)
    make_trajectory(tenant, billing, steps=1, started=hour_ago)
    make_trajectory(tenant, support, steps=2, started=hour_ago)
    make_trajectory(tenant, support, steps=5, started=now - timedelta(days=3))  # outside
    client.force_login(make_member("auditor"))
    body = client.get("/").content.decode()
    calls = chart(body, "chart-calls")
    assert calls["type"] == "bar" and calls["stacked"] is True
    assert len(calls["labels"]) == 24
    series = {d["label"]: d["data"] for d in calls["datasets"]}
    assert set(series) == {"billing-bot", "support-bot"}

    # The expected bars from the steps' own times (make_trajectory spaces them 1 s apart): a
    # run a few seconds after the hour puts some of the "30 s ago" steps in the hour before.
    def hour_of(at: datetime) -> datetime:
        return timezone.localtime(at).replace(minute=0, second=0, microsecond=0)

    def bucket(at: datetime) -> int:  # -1 is the current hour's bar
        return -1 - int((hour_of(now) - hour_of(at)) / timedelta(hours=1))

    def bars(*starts: tuple[datetime, int]) -> Counter:
        return Counter(bucket(at + timedelta(seconds=i)) for at, n in starts for i in range(n))

    want_billing, want_support = bars((recent, 3), (hour_ago, 1)), bars((hour_ago, 2))
    assert {i: n for i, n in enumerate(series["billing-bot"], -24) if n} == want_billing
    assert {i: n for i, n in enumerate(series["support-bot"], -24) if n} == want_support
    assert calls["labels"][-1] == timezone.localtime(now).strftime("%H:00")
    # Capture lag: the steps were built now, their calls were made 2 h ago -> ~7200 s.
    lag = chart(body, "chart-lag")
    p50 = {d["label"]: d["data"] for d in lag["datasets"]}["p50"]
    assert 7100 < p50[bucket(hour_ago)] < 7300
    assert p50[bucket(recent)] is not None and p50[bucket(recent)] < 60
    assert ">6</span> calls, last 24 h" in body


def test_overview_polls_a_fragment_that_redraws_its_charts(client, make_member, tenant, agents):
    make_trajectory(tenant, agents[0], steps=1, started=timezone.now())
    client.force_login(make_member("steward"))
    page = client.get("/").content.decode()
    assert 'hx-trigger="every 5s"' in page and 'data-chart="chart-calls"' in page
    fragment = client.get("/", HTTP_HX_REQUEST="true")
    assert fragment.status_code == 200
    text = fragment.content.decode()
    assert "<html" not in text and 'id="chart-calls"' in text and "billing-bot" in text
    assert "HX-Request" in fragment["Vary"]


def test_overview_counts_backlog_quarantine_approvals_and_erasures(
        client, make_member, tenant, agents):
    make_trajectory(tenant, agents[0], steps=2, state="captured")
    make_trajectory(tenant, agents[0], steps=2, state="quarantined")
    make_trajectory(tenant, agents[0], steps=1, state="quarantined")
    dataset = Dataset.objects.create(tenant=tenant, name="ds")
    for n, status in enumerate(["pending_approval", "pending_approval", "approved"], 1):
        DatasetVersion.objects.create(tenant=tenant, dataset=dataset, number=n, status=status,
                                      content_hash="0" * 64)
    ErasureRequest.objects.create(tenant=tenant, subject_hash="a" * 64, status="running")
    ErasureRequest.objects.create(tenant=tenant, subject_hash="b" * 64, status="completed")

    def item(body: str, label: str) -> tuple[str, str]:
        """(count, the markup before the label) of one "Needs attention" entry."""
        for li in re.findall(r'<li class="[a-z]+">(.*?)</li>', body, re.S):
            m = re.match(r'\s*<span class="num">(\d+)</span>(.*)' + re.escape(label + "<")
                         + "|" + r'\s*<span class="num">(\d+)</span>(.*)'
                         + re.escape(label + "\n"), li, re.S)
            if m:
                return (m.group(1) or m.group(3)), (m.group(2) or m.group(4) or "")
        raise AssertionError(label)

    expected_links = {  # role -> (approvals link, erasure link)
        "admin": (True, True), "steward": (True, False),
        "compliance": (True, True), "auditor": (True, False),
    }
    for role, (approvals, erasure) in expected_links.items():
        client.force_login(make_member(role))
        body = client.get("/").content.decode()
        assert item(body, "captured, step not built yet")[0] == "1"
        assert item(body, "quarantined")[0] == "2"
        count, link = item(body, "dataset versions awaiting approval")
        assert count == "2" and ('href="/approvals/"' in link) == approvals, role
        count, link = item(body, "erasure requests not finished")
        assert count == "1" and ('href="/erasure/"' in link) == erasure, role
        assert 'href="/trajectories/?status=quarantined"' in body


def test_overview_of_an_outsider_shows_nothing_of_the_tenant(
        client, make_member, tenant, other_tenant, agents):
    make_trajectory(tenant, agents[0], steps=1)
    client.force_login(make_member("admin", "outsider", on=other_tenant))
    body = client.get("/").content.decode()
    assert "billing-bot" not in body and "Nothing captured yet" in body


# --- the list ---------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_every_role_may_search(client, make_member, tenant, agents, role):
    t = make_trajectory(tenant, agents[0], steps=1)
    client.force_login(make_member(role))
    response = client.get("/trajectories/")
    assert response.status_code == 200
    assert ids_in(response.content.decode()) == {str(t.id)}


def test_outsider_finds_nothing_and_gets_404(client, make_member, tenant, other_tenant,
                                             agents):
    t = make_trajectory(tenant, agents[0], steps=1)
    client.force_login(make_member("admin", "outsider", on=other_tenant))
    assert ids_in(client.get("/trajectories/?agent=billing-bot").content.decode()) == set()
    assert client.get(f"/trajectories/{t.id}/").status_code == 404
    step = Step.objects.filter(trajectory=t).first()
    assert client.post(f"/trajectories/{t.id}/steps/{step.id}/raw/",
                       {"reason": "x"}).status_code == 403  # not a compliance officer there


def test_filters_by_agent_session_time_and_status(client, make_member, tenant, agents):
    billing, support = agents
    now = timezone.now()
    a = make_trajectory(tenant, billing, steps=2, started=now - timedelta(days=2))
    b = make_trajectory(tenant, support, steps=2, started=now - timedelta(hours=5))
    Trajectory.objects.filter(pk=b.pk).update(session_id="sess-42")
    quarantined = make_trajectory(tenant, billing, steps=2, state="quarantined",
                                  started=now - timedelta(hours=3))
    pending = make_trajectory(tenant, billing, steps=1, state="captured",
                              started=now - timedelta(hours=2))
    no_train = make_trajectory(tenant, support, steps=1, consent="no-train",
                               started=now - timedelta(hours=1))
    unsanitized = make_trajectory(tenant, support, steps=1, sanitized=False,
                                  started=now - timedelta(minutes=30))
    client.force_login(make_member("steward"))

    def found(query: str) -> set[str]:
        response = client.get(f"/trajectories/?{query}")
        assert response.status_code == 200, query
        return ids_in(response.content.decode())

    every = {str(t.id) for t in (a, b, quarantined, pending, no_train, unsanitized)}
    assert found("") == every
    assert found("agent=billing-bot") == {str(a.id), str(quarantined.id), str(pending.id)}
    assert found("agent=nobody") == set()
    assert found("session=sess-42") == {str(b.id)}
    after = (now - timedelta(hours=4)).strftime("%Y-%m-%dT%H:%M")
    before = (now - timedelta(minutes=90)).strftime("%Y-%m-%dT%H:%M")
    assert found(f"started_after={after}") == {str(quarantined.id), str(pending.id),
                                               str(no_train.id), str(unsanitized.id)}
    assert found(f"started_after={after}&started_before={before}") == {
        str(quarantined.id), str(pending.id)}
    # The form shows what it filters by (a datetime-local value), the pager keeps it.
    body = client.get(f"/trajectories/?started_after={after}").content.decode()
    assert f'name="started_after" type="datetime-local" value="{after}"' in body
    assert found("status=quarantined") == {str(quarantined.id)}
    assert found("status=pending") == {str(pending.id)}
    assert found("status=no-train") == {str(no_train.id)}
    assert found("status=complete") == {str(a.id), str(b.id), str(no_train.id),
                                        str(unsanitized.id)}
    assert found("status=eligible") == {str(a.id), str(b.id)}
    assert found("agent=support-bot&status=eligible") == {str(b.id)}


def test_bad_filters_give_a_message_not_a_500(client, make_member, tenant, agents):
    t = make_trajectory(tenant, agents[0], steps=1)
    client.force_login(make_member("auditor"))
    response = client.get("/trajectories/?started_after=yesterday-ish&agent=billing-bot"
                          "&reward_min=abc&status=bogus")
    assert response.status_code == 200
    body = response.content.decode()
    assert 'role="alert"' in body and "Started after: Enter a valid date/time." in body
    assert "Reward at least" in body and "Status" in body
    # Nothing is listed under an invalid filter (issue 13.8: the whole list looked filtered).
    assert ids_in(body) == set() and "Nothing is listed while a filter is invalid" in body
    assert 'value="yesterday-ish"' in body  # what was typed stays in the form
    assert ids_in(client.get("/trajectories/?status=bogus").content.decode()) == set()
    assert ids_in(client.get("/trajectories/?agent=billing-bot").content.decode()) == {
        str(t.id)}
    body = client.get("/trajectories/?started_after=2026-01-02T00:00"
                      "&started_before=2026-01-01T00:00").content.decode()
    assert "Must be later than" in body
    body = client.get("/trajectories/?reward_min=0.5").content.decode()
    assert "Name the reward" in body


def test_subject_filter_finds_by_email_without_keeping_it(client, make_member, tenant, agents):
    by_header = make_trajectory(tenant, agents[0], steps=1,
                                subject_hash=subject_hash(tenant.pk, EMAIL))
    by_content = make_trajectory(tenant, agents[1], steps=1)
    SubjectIndex.objects.create(
        tenant=tenant, trajectory=by_content, step=by_content.steps.first(),
        source="step", hashes=SubjectIndex.keys([subject_hash(tenant.pk,
                                               normalize_identifier("EMAIL_ADDRESS", EMAIL))]))
    other = make_trajectory(tenant, agents[0], steps=1,
                            subject_hash=subject_hash(tenant.pk, "bob@example.com"))
    client.force_login(make_member("compliance"))
    # The search form POSTs the subject (never in a URL, so never in an access log) and is
    # redirected to a signed reference to its hashes.
    page = client.get("/trajectories/").content.decode()
    assert re.search(r'<form method="post" action="/trajectories/"[^>]*hx-post=', page)
    response = client.post("/trajectories/", {"subject": EMAIL.lower()})
    assert response.status_code == 303
    location = response["Location"]
    assert "subject_ref=" in location and "maria" not in location.lower()
    body = client.get(location).content.decode()
    assert ids_in(body) == {str(by_header.id), str(by_content.id)}
    assert "maria" not in body.lower() and str(other.id) not in body
    # A hand-made GET with the subject: the same redirect.
    response = client.get("/trajectories/", {"subject": EMAIL.lower()})
    # (The reference is timestamp-signed: equal up to the signature's second, same result.)
    assert response.status_code == 303 and "maria" not in response["Location"].lower()
    assert response["Location"].split("subject_ref=")[0] == location.split("subject_ref=")[0]
    assert ids_in(client.get(response["Location"]).content.decode()) == {
        str(by_header.id), str(by_content.id)}
    # htmx: the same, the pushed URL carries no identifier either.
    response = client.post("/trajectories/", {"subject": EMAIL}, HTTP_HX_REQUEST="true",
                           HTTP_HX_TARGET="results")
    assert response.status_code == 200
    assert "maria" not in response["HX-Push-Url"].lower()
    assert ids_in(response.content.decode()) == {str(by_header.id), str(by_content.id)}
    # A tampered reference is a message, not a 500.
    body = client.get("/trajectories/?subject_ref=abc:def").content.decode()
    assert "damaged" in body


def test_reward_filter_uses_the_latest_final_value(client, make_member, tenant, agents):
    good = make_trajectory(tenant, agents[0], steps=1)
    corrected = make_trajectory(tenant, agents[0], steps=1)
    by_response = make_trajectory(tenant, agents[0], steps=2, response_ids=["r-1", "r-2"])
    unrewarded = make_trajectory(tenant, agents[0], steps=1)
    Reward.objects.create(tenant=tenant, trajectory_id=good.id, value=0.9)
    Reward.objects.create(tenant=tenant, trajectory_id=corrected.id, value=0.95)
    Reward.objects.create(tenant=tenant, trajectory_id=corrected.id, value=0.1)  # later
    Reward.objects.create(tenant=tenant, response_id="r-2", value=0.7)
    Reward.objects.create(tenant=tenant, trajectory_id=unrewarded.id, value=0.99, final=False)
    Reward.objects.create(tenant=tenant, trajectory_id=unrewarded.id, name="other", value=1)
    client.force_login(make_member("steward"))

    def found(query: str) -> set[str]:
        return ids_in(client.get(f"/trajectories/?{query}").content.decode())

    assert found("reward_name=reward&reward_min=0.5") == {str(good.id), str(by_response.id)}
    assert found("reward_name=reward&reward_max=0.5") == {str(corrected.id)}
    assert found("reward_name=reward&reward_min=0.8&reward_max=1") == {str(good.id)}
    assert found("reward_name=other&reward_min=0") == {str(unrewarded.id)}
    # The same rule as dataset selection (governance.datasets.latest_reward_value).
    from governance.datasets import latest_reward_value

    with tenant_context(tenant):
        expected = {str(t.pk) for t in Trajectory.objects.for_tenant(tenant).annotate(
            v=latest_reward_value(tenant.pk, "reward")).filter(v__gte=0.5)}
    assert found("reward_name=reward&reward_min=0.5") == expected
    # The matching value is shown in its own column.
    body = client.get("/trajectories/?reward_name=reward&reward_max=0.5").content.decode()
    assert '<th scope="col">reward</th>' in body and "<td>0.1</td>" in body


def test_pagination_keeps_the_filters(client, make_member, tenant, agents):
    now = timezone.now()
    trajs = [Trajectory(id=uuid.uuid4(), tenant=tenant, agent=agents[0], session_id="s",
                        started_at=now - timedelta(minutes=i), last_step_at=now)
             for i in range(120)]
    Trajectory.objects.bulk_create(trajs)
    make_trajectory(tenant, agents[1], steps=1)  # another agent, never listed below
    client.force_login(make_member("auditor"))
    body = client.get("/trajectories/?agent=billing-bot&session=s").content.decode()
    assert len(ids_in(body)) == 50 and "120 trajectories match" in body
    assert "Page 1 of 3" in body
    next_link = re.search(r'<a href="([^"]+)"[^>]*rel="next"', body).group(1)
    next_link = next_link.replace("&amp;", "&")
    assert "agent=billing-bot" in next_link and "session=s" in next_link
    assert "page=2" in next_link
    page2 = client.get(next_link).content.decode()
    assert len(ids_in(page2)) == 50 and "Page 2 of 3" in page2
    assert not ids_in(page2) & ids_in(body)
    page3 = client.get(next_link.replace("page=2", "page=3")).content.decode()
    assert len(ids_in(page3)) == 20 and 'rel="next"' not in page3
    prev_link = re.search(r'<a href="([^"]+)"[^>]*rel="prev"', page3).group(1)
    assert "agent=billing-bot" in prev_link and "page=2" in prev_link
    newest = sorted(trajs, key=lambda t: t.started_at, reverse=True)
    assert {str(t.id) for t in newest[100:]} == ids_in(page3)
    # Past the end: the last page, never an error.
    assert ids_in(client.get("/trajectories/?agent=billing-bot&page=99").content.decode()) \
        == ids_in(page3)
    # htmx: only the results region, with the URL to push.
    response = client.get("/trajectories/?agent=billing-bot&page=2", HTTP_HX_REQUEST="true",
                          HTTP_HX_TARGET="results")
    fragment = response.content.decode()
    assert fragment.lstrip().startswith('<div id="results"') and "<form" not in fragment
    assert response["HX-Push-Url"] == "/trajectories/?agent=billing-bot&page=2"


def test_the_count_stops_at_its_cap(client, make_member, tenant, agents, monkeypatch):
    from governance.views import trajectories

    monkeypatch.setattr(trajectories, "COUNT_CAP", 60)
    now = timezone.now()
    Trajectory.objects.bulk_create(
        [Trajectory(id=uuid.uuid4(), tenant=tenant, agent=agents[0], started_at=now,
                    last_step_at=now) for _ in range(130)])
    client.force_login(make_member("auditor"))
    body = client.get("/trajectories/").content.decode()
    assert "More than 60 trajectories" in body and 'rel="next"' in body
    assert "Page 1</span>" in body  # no "of N": unknown
    # The deepest page says how to go further back instead of offering another page.
    monkeypatch.setattr(trajectories, "MAX_PAGE", 2)
    body = client.get("/trajectories/?page=5").content.decode()
    assert "Page 2</span>" in body and 'rel="next"' not in body
    assert "older trajectories are found with" in body


# --- the conversation -------------------------------------------------------------------------


@pytest.fixture
def conversation(tenant, agents):
    """Two chat steps: a tool call with placeholders in its arguments, then the tool's result
    and the answer; rewards on the trajectory and on the second step's response id."""
    traj = make_trajectory(tenant, agents[0], steps=2, response_ids=["resp-1", "resp-2"],
                           subject_hash=subject_hash(tenant.pk, EMAIL))
    first, second = Step.objects.filter(trajectory=traj).order_by("started_at")
    system = {"role": "system", "content": "You are a bank assistant."}
    user = {"role": "user", "content": "I am <PERSON_1>, mail <EMAIL_ADDRESS_2>. "
                                       "<script>alert(1)</script>"}
    call = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "lookup_account",
            "arguments": json.dumps({"email": "<EMAIL_ADDRESS_2>", "limit": 3})}}]}
    tool = {"role": "tool", "tool_call_id": "call_1",
            "content": "balance 12 EUR for <PERSON_1> & co"}
    Step.objects.filter(pk=first.pk).update(
        observation_rest={"messages": [system, user], "tools": [{"type": "function"}]},
        action={"messages": [call], "finish_reason": "tool_calls"},
        versions={"gen_ai.request.model": "gpt-x", "gen_ai.response.model": "gpt-x-0601",
                  "system_prompt_hash": "a" * 64, "tool_schema_hash": "b" * 64,
                  "harness_version": "bank-agent 1.2"},
        retention_until=timezone.now() + timedelta(days=30))
    Step.objects.filter(pk=second.pk).update(
        observation_rest={"messages": [system, user, call, tool]},
        action={"messages": [{"role": "assistant", "content": "Your balance is 12 EUR."}],
                "finish_reason": "stop"},
        versions={"gen_ai.request.model": "gpt-x", "gen_ai.response.model": "gpt-x-0602",
                  "system_prompt_hash": "a" * 64, "tool_schema_hash": "b" * 64,
                  "harness_version": "bank-agent 1.2"})
    Reward.objects.create(tenant=tenant, trajectory_id=traj.id, name="resolved", value=1.0)
    Reward.objects.create(tenant=tenant, response_id="resp-2", name="helpful", value=0.25,
                          final=False, comment="first look")
    return traj


def test_conversation_marks_placeholders_and_escapes_everything_else(
        client, make_member, conversation):
    client.force_login(make_member("auditor"))
    response = client.get(f"/trajectories/{conversation.id}/")
    assert response.status_code == 200
    body = response.content.decode()
    assert '<mark class="ph" title="PERSON">&lt;PERSON_1&gt;</mark>' in body
    assert '<mark class="ph" title="EMAIL_ADDRESS">&lt;EMAIL_ADDRESS_2&gt;</mark>' in body
    assert "<script>alert(1)</script>" not in body
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "balance 12 EUR for <mark" in body and "&amp; co" in body
    # The tool call: its function and its arguments as indented JSON, placeholders marked.
    assert '<code class="fn">lookup_account</code>' in body
    assert ('&quot;email&quot;: &quot;<mark class="ph" title="EMAIL_ADDRESS">'
            '&lt;EMAIL_ADDRESS_2&gt;</mark>&quot;,\n  &quot;limit&quot;: 3') in body
    assert "result of <code>call_1</code>" in body
    # The second request repeats the first exchange: shown once, not twice.
    assert body.count("You are a bank assistant.") == 1
    assert "3 earlier messages of the conversation" in body
    assert "Your balance is 12 EUR." in body


def test_detail_shows_rewards_versions_governance_and_approvals(
        client, make_member, tenant, conversation, people):
    dataset = Dataset.objects.create(tenant=tenant, name="bank-sft")
    version = DatasetVersion.objects.create(tenant=tenant, dataset=dataset, number=3,
                                            status="approved", content_hash="0" * 64)
    DatasetVersionMember.objects.create(tenant=tenant, version=version, trajectory=conversation)
    users, _ = people
    Approval.objects.create(tenant=tenant, version=version, decided_by=users["compliance"],
                            decision="approve", reason="sampled 20, fine")
    client.force_login(users["steward"])
    body = client.get(f"/trajectories/{conversation.id}/").content.decode()
    # Rewards on a timeline: name, value, final or not, where they landed.
    assert "<strong>resolved</strong> = 1.0" in body and "on the trajectory" in body
    assert "<strong>helpful</strong> = 0.25" in body and "provisional" in body
    assert 'on <a href="#step-2">step 2</a>' in body and "first look" in body
    assert 'id="chart-rewards"' in body
    # Versions per step, a change against the previous step flagged.
    assert "gpt-x-0601" in body and "gpt-x-0602" in body and "bank-agent 1.2" in body
    assert f'title="{"a" * 64}"' in body and body.count('class="badge warn">changed') == 1
    # Governance.
    assert "<dt>Classification</dt><dd>internal</dd>" in body
    assert "<code>test-1</code>" in body and "eligible" in body
    assert "named (stored as a keyed hash only)" in body
    assert "bank-sft v3" in body and "Approved by comp" in body
    assert f'href="/datasets/versions/{version.pk}/"' in body


def test_detail_lists_quarantined_calls_and_pending_ones(client, make_member, tenant, agents):
    traj = make_trajectory(tenant, agents[0], steps=2, state="quarantined")
    PendingInteraction.objects.filter(trajectory=traj, state="quarantined").update(
        reason="sanitizer failed: ValueError")
    client.force_login(make_member("auditor"))
    body = client.get(f"/trajectories/{traj.id}/").content.decode()
    assert "Calls without a step" in body and "sanitizer failed: ValueError" in body
    assert '<span class="badge">not eligible</span>' in body


# --- the raw read -----------------------------------------------------------------------------


@pytest.fixture
def built(tenant, agents, tmp_path):
    from tests.pipeline import chat_response, make_record, ship_and_build

    rec = make_record(tenant.pk, agents[0].pk, subject="customer-4711", request={
        "model": "m", "messages": [{"role": "user", "content": f"I am Maria Garcia, {EMAIL}"}]},
        response=chat_response("hi"))
    ship_and_build(tmp_path / "spool", [rec])
    return rec


def raw_url(rec: dict) -> str:
    return f"/trajectories/{rec['trajectory_id']}/steps/{rec['step_id']}/raw/"


def test_compliance_reads_the_raw_payload_with_a_reason(client, make_member, built):
    client.force_login(make_member("compliance"))
    page = client.get(f"/trajectories/{built['trajectory_id']}/").content.decode()
    assert f'action="{raw_url(built)}"' in page and 'for="reason-' in page
    assert EMAIL not in page  # the sanitized view never shows it
    response = client.post(raw_url(built), {"reason": "ticket 42: disputed redaction"})
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    body = response.content.decode()
    assert EMAIL in body and "recorded in the audit log" in body and "HTTP 200" in body
    event = AuditEvent.objects.get(action="raw.read")
    assert event.object_id == built["step_id"]
    assert event.payload["reason_length"] == len("ticket 42: disputed redaction")
    # htmx: the step's raw region only.
    fragment = client.post(raw_url(built), {"reason": "second look"},
                           HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in fragment and EMAIL in fragment
    assert AuditEvent.objects.filter(action="raw.read").count() == 2


def test_raw_read_without_a_reason_is_a_message_and_no_audit(client, make_member, built):
    client.force_login(make_member("compliance"))
    response = client.post(raw_url(built), {"reason": "   "})
    assert response.status_code == 400
    body = response.content.decode()
    assert "the reason is required" in body and EMAIL not in body
    fragment = client.post(raw_url(built), {"reason": ""}, HTTP_HX_REQUEST="true")
    assert fragment.status_code == 200 and "the reason is required" in fragment.content.decode()
    assert not AuditEvent.objects.filter(action="raw.read").exists()


@pytest.mark.parametrize("role", ["admin", "steward", "auditor"])
def test_other_roles_get_no_form_and_a_forced_post_is_403(client, make_member, built, role):
    client.force_login(make_member(role))
    page = client.get(f"/trajectories/{built['trajectory_id']}/").content.decode()
    assert "Read raw payload" not in page and raw_url(built) not in page
    response = client.post(raw_url(built), {"reason": "curious"})
    assert response.status_code == 403
    assert EMAIL not in response.content.decode()
    assert not AuditEvent.objects.filter(action="raw.read").exists()


def test_raw_read_after_retention_says_it_is_gone(client, make_member, tenant, built):
    Interaction.objects.filter(flow_id=built["flow_id"]).update(raw_ciphertext=None)
    client.force_login(make_member("compliance"))
    response = client.post(raw_url(built), {"reason": "audit 7"})
    assert response.status_code == 410
    body = response.content.decode()
    assert "Gone for good" in body and "destroyed by its retention" in body
    # Gone is for good: that step offers no second try (the other steps still would).
    assert f'action="{raw_url(built)}"' not in body
    assert not AuditEvent.objects.filter(action="raw.read").exists()
    # Another trajectory's step under this trajectory: 404.
    other = make_trajectory(tenant, Trajectory.objects.get(pk=built["trajectory_id"]).agent,
                            steps=1)
    step = Step.objects.filter(trajectory=other).first()
    assert client.post(f"/trajectories/{built['trajectory_id']}/steps/{step.id}/raw/",
                       {"reason": "x"}).status_code == 404
    assert client.get(raw_url(built)).status_code == 405


def test_detail_shows_the_deadlines_that_apply_defaults_and_policy(
        client, make_member, tenant, agents):
    """Issue 13.8: with no policy the defaults (365 days, raw payloads 7) apply and the page
    says so; a policy for the classification changes them; a destroyed raw payload says so."""
    from governance.services import set_retention_policy

    started = timezone.now().replace(microsecond=0) - timedelta(days=1)
    t = make_trajectory(tenant, agents[0], steps=1, started=started)
    client.force_login(make_member("steward"))
    fmt = "%Y-%m-%d %H:%M"
    local = timezone.localtime

    def retention() -> str:
        body = client.get(f"/trajectories/{t.id}/").content.decode()
        return re.search(r"<dd data-retention>(.*?)</dd>", body, re.S).group(1)

    text = retention()
    assert "no deadline set" not in text
    assert f"steps kept until {local(started + timedelta(days=365)).strftime(fmt)}" in text
    assert f"raw payloads destroyed by {local(started + timedelta(days=7)).strftime(fmt)}" in text
    assert "the defaults: no retention policy set" in text

    admin = make_member("admin", "ada")
    set_retention_policy(admin, tenant, "internal", steps_days=30, raw_days=2,
                         findings_days=30, audit_days=400)
    text = retention()
    assert f"steps kept until {local(started + timedelta(days=30)).strftime(fmt)}" in text
    assert f"raw payloads destroyed by {local(started + timedelta(days=2)).strftime(fmt)}" in text
    assert "the tenant's retention policy" in text

    Interaction.objects.filter(trajectory=t).update(raw_ciphertext=None)
    assert "raw payloads already destroyed" in retention()


def test_list_shows_status_findings_and_the_time_zone(client, make_member, tenant, agents):
    """Issue 13.8: a 502 capture, a quarantined call and one still processing do not look
    like successes; findings are counted; the times say their zone."""

    ok = make_trajectory(tenant, agents[0], steps=1)
    failed = make_trajectory(tenant, agents[0], steps=2)
    Interaction.objects.filter(trajectory=failed).update(status_code=502)
    quarantined = make_trajectory(tenant, agents[0], steps=1, state="quarantined")
    processing = make_trajectory(tenant, agents[0], steps=1, state="captured")
    step = Step.objects.get(trajectory=ok)
    add_findings(tenant, step, ["EMAIL_ADDRESS", "EMAIL_ADDRESS"])
    client.force_login(make_member("auditor"))
    body = client.get("/trajectories/").content.decode()

    def row(t) -> str:
        m = re.search(rf'<tr><td><a href="/trajectories/{t.id}/">.*?</tr>', body, re.S)
        return m.group(0)

    assert '<span class="badge ok">ok</span>' in row(ok) and "<td>2</td>" in row(ok)
    assert "HTTP 502 ×2" in row(failed) and "badge ok" not in row(failed)
    assert "quarantined ×1" in row(quarantined)
    assert "processing ×1" in row(processing)
    assert "Started (UTC)" in body


def test_unmatched_rewards_are_listed_to_who_posts_rewards(client, make_member, tenant,
                                                           other_tenant, agents):
    """Issue 13.8: a reward for a trajectory id that does not exist is still accepted (late
    binding) but listed; one that matches (now or later) is not; another tenant's are not."""
    from governance.services import record_reward

    captured = make_trajectory(tenant, agents[0], steps=1, response_ids=["chatcmpl-here"])
    ghost = uuid.uuid4()
    record_reward("system:test", tenant, value=0.5, trajectory_id=ghost, name="typo")
    record_reward("system:test", tenant, value=1.0, trajectory_id=captured.pk, name="fine")
    record_reward("system:test", tenant, value=0.2, response_id="chatcmpl-here", name="ok")
    record_reward("system:test", tenant, value=0.3, response_id="chatcmpl-later", name="early")
    record_reward("system:test", other_tenant, value=0.9, trajectory_id=uuid.uuid4(),
                  name="theirs")
    client.force_login(make_member("steward"))
    assert 'href="/rewards/unmatched/"' in client.get("/trajectories/").content.decode()
    body = client.get("/rewards/unmatched/").content.decode()
    assert f"trajectory <code>{ghost}</code>" in body and "<strong>typo</strong>" in body
    assert "response <code>chatcmpl-later</code>" in body
    for matched in ("<strong>fine</strong>", "<strong>ok</strong>", "theirs"):
        assert matched not in body
    # The capture arrives: the early reward leaves the list by itself.
    make_trajectory(tenant, agents[0], steps=1, response_ids=["chatcmpl-later"])
    assert "chatcmpl-later" not in client.get("/rewards/unmatched/").content.decode()
    client.force_login(make_member("auditor"))
    assert client.get("/rewards/unmatched/").status_code == 403
    assert 'href="/rewards/unmatched/"' not in client.get("/trajectories/").content.decode()
