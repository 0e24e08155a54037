"""LangChain as agent teams run it, through the real proxy, with nothing Steward-specific set (no
X-Steward-Session): `ChatOpenAI(...).bind_tools([...])` in a tool loop, and the same loop under
a context budget kept by `trim_messages(strategy="last")`, LangChain's own sliding window.

LangChain re-serializes the model's answer when it sends it back: the tool call's arguments are
parsed into `AIMessage.tool_calls` and dumped again with `json.dumps` (`{"expression": "3*3"}`
where the model sent `{"expression":"3*3"}`). Before decision 58 that broke proxy rule 4, whose
key holds the answer as the model sent it: the windowed conversation of the second test made 6
trajectories of its 12 calls."""

from __future__ import annotations

import json

import httpx
import orjson
import pytest
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage, trim_messages
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from governance.capture.conversation import observations
from governance.models import ConversationItem, Step, Trajectory
from governance.tenancy import tenant_context
from tests.pipeline import ship_and_build

pytestmark = pytest.mark.timeout(240)

SYSTEM = "You are a support agent. Use the calculator."
TURNS = {
    "maria": ["I am Maria Garcia (maria.garcia@example.com). What is 3*3?", "and 4*4?",
              "thanks, and 5*5?"],
    "peter": ["Peter Novak here, peter.novak@example.org. What is 7*8?", "now 6*6?"],
}


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of two numbers, such as 3*3."""
    a, op, b = expression.replace(" ", "").partition("*")
    assert op == "*", expression
    return str(int(a) * int(b))


class Wire:
    """What LangChain's HTTP client sent, per call: the request body and the proxy's response
    headers (read when the headers are in; a stream is left to LangChain)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def on_response(self, response: httpx.Response) -> None:
        self.calls.append({"body": json.loads(response.request.content),
                           "headers": dict(response.headers)})


def _model(base_url: str, secret: str, wire: Wire, streaming: bool = False,
           responses: bool = False):
    return ChatOpenAI(model="demo-model", base_url=base_url, api_key=secret, max_retries=0,
                      timeout=30, streaming=streaming, use_responses_api=responses,
                      http_client=httpx.Client(event_hooks={"response": [wire.on_response]})
                      ).bind_tools([calculator])


def _turn(model, history: list, window=None) -> None:
    """One user turn of the agent loop: call the model (on the window of the history, if
    any), run the tools it calls, until it answers in text."""
    while True:
        answer = model.invoke(window(history) if window else history)
        history.append(answer)
        if not answer.tool_calls:
            assert answer.text.startswith("The tool returned: ")
            return
        for call in answer.tool_calls:
            history.append(ToolMessage(calculator.invoke(call["args"]),
                                       tool_call_id=call["id"]))


def _built(steward_proxy, proxy_key, tmp_path, wires: list[Wire]) -> list[dict]:
    records = [steward_proxy.wait_for_record(c["headers"]["x-steward-step"])
               for wire in wires for c in wire.calls]
    ship_and_build(tmp_path / "ship", records)
    return records


def _materialized(proxy_key, trajectory_id: str, key: str = "messages") -> list[list[dict]]:
    steps = list(Step.objects.filter(trajectory_id=trajectory_id).order_by("started_at", "id"))
    with tenant_context(proxy_key.tenant):
        full = observations(steps)
    return [full[s.pk][key] for s in steps]


def _same_shape(got: list[dict], sent: list[dict]) -> None:
    """The messages (or Responses input items) LangChain sent, one for one: types, roles, tool
    calls and their ids."""
    def shape(m: dict) -> tuple:
        return (m.get("type"), m.get("role"), m.get("tool_call_id") or m.get("call_id"),
                [c["id"] for c in m.get("tool_calls") or ()])

    assert [shape(m) for m in got] == [shape(m) for m in sent]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_langchain_tool_loops_are_one_trajectory_each(steward_proxy, proxy_key, tmp_path, api):
    """Chat completions, and the Responses API (`use_responses_api=True`: the whole input
    resent as items, the model's function calls echoed back; rule 3b)."""
    key = "messages" if api == "chat" else "input"
    wires = {name: Wire() for name in TURNS}
    models = {name: _model(steward_proxy.base_url, proxy_key.secret, wires[name],
                           streaming=(name == "peter"), responses=(api == "responses"))
              for name in TURNS}
    histories = {name: [SystemMessage(SYSTEM)] for name in TURNS}
    for turn in range(max(len(t) for t in TURNS.values())):  # the two interleaved
        for name, turns in TURNS.items():
            if turn < len(turns):
                histories[name].append(HumanMessage(turns[turn]))
                _turn(models[name], histories[name])

    trajectories = {}
    for name, wire in wires.items():
        assert len(wire.calls) == 2 * len(TURNS[name])  # the tool call, then the answer
        ids = {c["headers"]["x-steward-trajectory"] for c in wire.calls}
        assert len(ids) == 1, f"{name}: {len(ids)} trajectories"
        trajectories[name] = ids.pop()
    assert trajectories["maria"] != trajectories["peter"]

    records = _built(steward_proxy, proxy_key, tmp_path, list(wires.values()))
    assert [r["trajectory_source"] for r in records] == [
        s for name in TURNS for s in ["new"] + ["prefix"] * (2 * len(TURNS[name]) - 1)]
    for name, wire in wires.items():
        assert Trajectory.objects.get(pk=trajectories[name]).step_count == len(wire.calls)
        sent = [c["body"][key] for c in wire.calls]
        # Each message once: the last call carried every message of the conversation.
        assert ConversationItem.objects.filter(trajectory_id=trajectories[name],
                                               kind="message").count() == len(sent[-1])
        got = _materialized(proxy_key, trajectories[name], key)
        customer = TURNS[name][0].split(" (")[0].split(" here")[0]
        for messages, want in zip(got, sent, strict=True):
            _same_shape(messages, want)
            assert customer not in json.dumps(messages)
        assert got[-1][0]["content"] == SYSTEM


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_langchain_trim_messages_window_is_one_trajectory(steward_proxy, proxy_key, tmp_path,
                                                          api):
    """A context budget of 6 messages besides the system prompt: from the second turn on, every
    call that starts a turn has dropped the previous turn, its user message included, so no
    earlier request is a prefix of it; what ties it to the conversation is the previous call's
    answer it carries, as LangChain sends it back (rule 4; over Responses input items too)."""
    key = "messages" if api == "chat" else "input"
    wire = Wire()
    model = _model(steward_proxy.base_url, proxy_key.secret, wire, responses=(api == "responses"))

    def window(history: list) -> list:
        return trim_messages(history, max_tokens=7, token_counter=len, strategy="last",
                             include_system=True, start_on="human")

    history = [SystemMessage(SYSTEM)]
    turns = 6
    for turn in range(turns):
        history.append(HumanMessage(f"Anna Berg (anna.berg{turn}@example.com) asks: what is "
                                    f"{turn + 2}*{turn + 3}?"))
        _turn(model, history, window)

    sent = [c["body"][key] for c in wire.calls]
    assert len(sent) == 2 * turns
    firsts = [m for m in sent[1:] if m[1]["content"].startswith("Anna Berg (anna.berg0@")]
    assert len(firsts) < len(sent) - 1, "the window never dropped the first user message"
    ids = {c["headers"]["x-steward-trajectory"] for c in wire.calls}
    assert len(ids) == 1, f"{len(ids)} trajectories of {len(sent)} calls"
    trajectory_id = ids.pop()

    records = _built(steward_proxy, proxy_key, tmp_path, [wire])
    sources = [r["trajectory_source"] for r in records]
    assert sources[0] == "new" and "window" in sources and set(sources) <= {
        "new", "prefix", "window"}, sources
    assert Trajectory.objects.get(pk=trajectory_id).step_count == len(sent)
    # Each distinct message stored once, however many windows carried it.
    distinct = {orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for messages in sent
                for m in messages}
    assert ConversationItem.objects.filter(trajectory_id=trajectory_id,
                                           kind="message").count() == len(distinct)
    got = _materialized(proxy_key, trajectory_id, key)
    for messages, want in zip(got, sent, strict=True):
        _same_shape(messages, want)
        assert "Anna Berg" not in json.dumps(messages)
