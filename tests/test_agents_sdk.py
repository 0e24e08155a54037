"""The OpenAI Agents SDK as agent teams run it, through the real proxy, with nothing
Steward-specific set (no X-Steward-Session): an agent with a function tool, its conversations
held the SDK's own ways — `result.to_input_list()` plus the next message, and streamed runs with
a `SQLiteSession` — two at once. Each conversation is one trajectory (proxy inference rule 3b,
decision 54, checked with the SDK itself rather than our reading of it), its items stored once
and sanitized, every step's input materialized as the SDK sent it."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from agents import (
    Agent,
    OpenAIResponsesModel,
    Runner,
    SQLiteSession,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from governance.capture.conversation import observations
from governance.models import ConversationItem, Step, Trajectory
from governance.tenancy import tenant_context
from tests.pipeline import ship_and_build

pytestmark = pytest.mark.timeout(240)

TURNS = {
    "maria": ["I am Maria Garcia (maria.garcia@example.com). What is 3*3?", "and 4*4?",
              "thanks, and 5*5?"],
    "peter": ["Peter Novak here, peter.novak@example.org. What is 7*8?", "now 6*6?"],
}


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of two numbers, such as 3*3.

    Args:
        expression: the expression, e.g. "12 * 7".
    """
    a, op, b = re.fullmatch(r"\s*(\d+)\s*([-+*/])\s*(\d+)\s*", expression).groups()
    x, y = int(a), int(b)
    return str({"+": x + y, "-": x - y, "*": x * y, "/": x / y}[op])


class Wire:
    """What the SDK's HTTP client sent and got back, per call: the request body and the
    proxy's response headers."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def on_response(self, response: httpx.Response) -> None:
        # Called once the headers are in, for the request that got them.
        self.calls.append({"body": json.loads(response.request.content),
                           "headers": dict(response.headers)})


async def _conversations(base_url: str, secret: str) -> dict[str, Wire]:
    """Both customers' conversations, turn by turn interleaved: Maria's through Runner.run with
    the input list, Peter's streamed with a SQLiteSession. Returns each one's wire."""
    set_tracing_disabled(True)  # no trace export to OpenAI from a test
    wires = {name: Wire() for name in TURNS}
    agents = {}
    for name, wire in wires.items():
        client = AsyncOpenAI(base_url=base_url, api_key=secret, max_retries=0, timeout=30,
                             http_client=httpx.AsyncClient(event_hooks={
                                 "response": [wire.on_response]}))
        agents[name] = Agent(name="support", tools=[calculator],
                             instructions="You are a support agent. Use the calculator.",
                             model=OpenAIResponsesModel("demo-model", client))
    history: list = []
    session = SQLiteSession("peter")
    for turn in range(max(len(t) for t in TURNS.values())):
        if turn < len(TURNS["maria"]):
            result = await Runner.run(agents["maria"],
                                      history + [{"role": "user",
                                                  "content": TURNS["maria"][turn]}])
            history = result.to_input_list()
            assert result.final_output.startswith("The tool returned: ")
        if turn < len(TURNS["peter"]):
            streamed = Runner.run_streamed(agents["peter"], TURNS["peter"][turn],
                                           session=session)
            async for _ in streamed.stream_events():
                pass
            assert streamed.final_output.startswith("The tool returned: ")
    return wires


def test_agents_sdk_conversations_are_one_trajectory_each(steward_proxy, proxy_key, tmp_path):
    wires = asyncio.run(_conversations(steward_proxy.base_url, proxy_key.secret))
    trajectories = {}
    for name, wire in wires.items():
        # Two model calls a turn: the function call, then the answer to its output.
        assert len(wire.calls) == 2 * len(TURNS[name])
        assert all(c["body"].get("previous_response_id") is None for c in wire.calls)
        ids = {c["headers"]["x-steward-trajectory"] for c in wire.calls}
        assert len(ids) == 1, f"{name}: {len(ids)} trajectories"
        trajectories[name] = ids.pop()
    assert trajectories["maria"] != trajectories["peter"]

    records = [steward_proxy.wait_for_record(c["headers"]["x-steward-step"])
               for wire in wires.values() for c in wire.calls]
    # Inferred from the input items (rule 3b): each conversation's first call is new, every
    # later one extends it.
    sources = [r["trajectory_source"] for r in records]
    assert sources == [s for name in TURNS for s in
                       ["new"] + ["prefix"] * (2 * len(TURNS[name]) - 1)], sources
    ship_and_build(tmp_path / "ship", records)
    for name, wire in wires.items():
        trajectory = Trajectory.objects.get(pk=trajectories[name])
        assert trajectory.step_count == len(wire.calls)
        steps = list(Step.objects.filter(trajectory=trajectory).order_by("started_at", "id"))
        sent = [c["body"]["input"] for c in wire.calls]
        # Each item once: the last call carried every item of the conversation.
        items = ConversationItem.objects.filter(trajectory=trajectory, kind="message")
        assert items.count() == len(sent[-1])
        with tenant_context(proxy_key.tenant):
            full = observations(steps)
        inputs = [full[s.pk]["input"] for s in steps]
        assert [len(i) for i in inputs] == [len(s) for s in sent]
        customer = TURNS[name][0].split(" (")[0].split(" here")[0]
        for got, want in zip(inputs, sent, strict=True):
            # What the SDK sent, item for item, the customer's identifiers sanitized.
            assert [(i.get("type"), i.get("role")) for i in got] == [
                (i.get("type"), i.get("role")) for i in want]
            assert customer not in json.dumps(got)
            assert [i.get("call_id") for i in got] == [i.get("call_id") for i in want]
        # The tool's outputs come through as the SDK sent them.
        outputs = [i["output"] for i in inputs[-1] if i.get("type") == "function_call_output"]
        assert outputs == [i["output"] for i in sent[-1]
                           if i.get("type") == "function_call_output"]
        assert full[steps[0].pk]["instructions"] == "You are a support agent. Use the calculator."
