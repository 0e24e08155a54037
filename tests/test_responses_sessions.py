"""A Responses API agent that resends its input (decision 54): the official openai client
through the real mitmproxy, no X-Steward-Session, no previous_response_id (`store: false`, as
the OpenAI Agents SDK and zero-data-retention deployments call). Its calls are one trajectory,
and the conversation store keeps each of its items once, sanitized, as for chat sessions."""

from __future__ import annotations

import openai
import pytest

from governance.capture.conversation import observations
from governance.models import ConversationItem, Step, Trajectory
from governance.tenancy import tenant_context
from tests.live import wait_for_key
from tests.pipeline import ship_and_build

pytestmark = pytest.mark.timeout(180)

QUESTIONS = [
    "I am Maria Garcia (maria.garcia@example.com). What is 3*3?",
    "and 4*4?",
    "and 5*5?",
    "thanks, and 6*6?",
]


def _converse(client: openai.OpenAI) -> tuple[list[dict], list]:
    """The stateless multi-turn pattern of OpenAI's docs: input so far + the response's
    output items + the next user message, every other call streamed. Returns each call's
    response headers and the input it sent."""
    conversation: list = []
    headers, sent = [], []
    for i, question in enumerate(QUESTIONS):
        conversation.append({"role": "user", "content": question})
        sent.append([item if isinstance(item, dict) else item.model_dump(exclude_none=True)
                     for item in conversation])
        if i % 2:
            with client.responses.with_streaming_response.create(
                    model="demo-model", input=conversation, store=False, stream=True) as s:
                headers.append(s.headers)
                events = list(s.parse())
            assert events[-1].type == "response.completed"
            output = events[-1].response.output
        else:
            raw = client.responses.with_raw_response.create(
                model="demo-model", input=conversation, store=False)
            headers.append(raw.headers)
            output = raw.parse().output
        conversation += output  # the SDK's own output objects, sent back as they are
    return headers, sent


def test_a_stateless_responses_agent_is_one_trajectory_stored_once(steward_proxy, proxy_key,
                                                                   tmp_path):
    client = openai.OpenAI(base_url=steward_proxy.base_url, api_key=proxy_key.secret,
                           max_retries=0, timeout=30)
    headers, sent = _converse(client)
    assert len({h["x-steward-trajectory"] for h in headers}) == 1
    records = [steward_proxy.wait_for_record(h["x-steward-step"]) for h in headers]
    assert [r["trajectory_source"] for r in records] == ["new", "prefix", "prefix", "prefix"]

    # Through the real shipper and step builder: one trajectory, its items stored once.
    ship_and_build(tmp_path / "ship", records)
    trajectory = Trajectory.objects.get(pk=headers[0]["x-steward-trajectory"])
    assert (trajectory.source, trajectory.step_count) == ("new", 4)
    steps = list(Step.objects.filter(trajectory=trajectory).order_by("started_at", "id"))
    # 4 user messages and the 3 answers sent back: each once, not once per call carrying it.
    assert ConversationItem.objects.filter(trajectory=trajectory).count() == 7
    assert [len(s.appended) for s in steps] == [1, 2, 2, 2]
    with tenant_context(proxy_key.tenant):
        full = observations(steps)
    inputs = [full[s.pk]["input"] for s in steps]
    assert [len(i) for i in inputs] == [len(s) for s in sent] == [1, 3, 5, 7]
    # Sanitized once: the name and the address are placeholders, the same ones in every step.
    first = inputs[0][0]["content"]
    assert "Maria Garcia" not in first and "maria.garcia@example.com" not in first
    assert all(i[0]["content"] == first for i in inputs)
    # Everything else is what the agent sent.
    for got, want in zip(inputs, sent, strict=True):
        assert [m.get("role") for m in got] == [m.get("role") for m in want]
        assert got[1:] == want[1:]


def test_a_chained_call_stays_rule_2s_and_another_agent_is_not_joined(start_proxy, fake_upstream,
                                                           transactional_db):
    """The same conversation chained by previous_response_id stays rule 2's, and a second
    agent of the tenant sending the same opening is not joined to the first one's."""
    from governance.services import create_proxy_key, create_tenant

    proxy = start_proxy(fake_upstream.url)
    tenant = create_tenant("system:test", "acme", "Acme Bank")[0]
    keys = [create_proxy_key("system:test", tenant, name) for name in ("agent-a", "agent-b")]
    for issued in keys:
        wait_for_key(proxy, issued.secret)
    a, b = (openai.OpenAI(base_url=proxy.base_url, api_key=k.secret, max_retries=0, timeout=30)
            for k in keys)
    first = a.responses.with_raw_response.create(model="demo-model", input="what is 3*3?")
    chained = a.responses.with_raw_response.create(
        model="demo-model", input="and 4*4?", previous_response_id=first.parse().id)
    assert chained.headers["x-steward-trajectory"] == first.headers["x-steward-trajectory"]
    assert proxy.wait_for_record(chained.headers["x-steward-step"])[
        "trajectory_source"] == "previous_response"
    other = b.responses.with_raw_response.create(
        model="demo-model", input=[{"role": "user", "content": "what is 3*3?"},
                                   *first.parse().output,
                                   {"role": "user", "content": "and 4*4?"}])
    assert other.headers["x-steward-trajectory"] != first.headers["x-steward-trajectory"]


def test_a_responses_agent_with_a_sliding_window_stays_one_trajectory(steward_proxy, proxy_key):
    """Rule 4 over Responses input: an agent that sends only its last three items (the first
    question dropped from the third call on) is still one trajectory, recognised by the
    previous call's question and the answer it carries."""
    client = openai.OpenAI(base_url=steward_proxy.base_url, api_key=proxy_key.secret,
                           max_retries=0, timeout=30)
    conversation: list = []
    headers = []
    for question in ["what is 3*3?", "and 4*4?", "and 5*5?", "and 6*6?", "and 7*7?"]:
        conversation.append({"role": "user", "content": question})
        raw = client.responses.with_raw_response.create(
            model="demo-model", input=conversation[-3:], store=False)
        headers.append(raw.headers)
        conversation += raw.parse().output
    assert len({h["x-steward-trajectory"] for h in headers}) == 1
    sources = [steward_proxy.wait_for_record(h["x-steward-step"])["trajectory_source"]
               for h in headers]
    assert sources == ["new", "prefix", "window", "window", "window"]
