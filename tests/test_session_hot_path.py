"""The addon's hot path with and without `X-Steward-Session` (proxy/addon.py): a session-named
call takes no prefix hashes before forwarding, and one whose agent only names sessions costs no
hashing and no re-parse of its answer at all; trajectory linking without a session still works,
also onto a session's conversation when the agent mixes both. The real hooks in process, with
the real spool writer and key table (from its snapshot file) and the records read back."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
from mitmproxy import http
from mitmproxy.test import tflow

import proxy.addon as addon
import proxy.inference as inference
from proxy.keys import KeyTable, hash_key
from proxy.spool import SpoolWriter
from tests.live import read_spool

MASTER = os.urandom(32)
SECRET = "stw_hot_path_test"
OTHER = "stw_hot_path_other_agent"


def sse_answer(text: str) -> bytes:
    chunks = [{"id": "c1", "object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": part}}]}
              for part in (text[:3], text[3:])]
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + \
        b"data: [DONE]\n\n"


@pytest.fixture
def steward(tmp_path: Path):
    (tmp_path / "proxy-keys.json").write_bytes(orjson.dumps({"keys": {
        hash_key(SECRET): [1, 7, "t", 3, "bot", False],
        hash_key(OTHER): [2, 7, "t", 4, "other-bot", False]}}))
    s = addon.Steward()
    s.settings = addon.Settings(
        spool_dir=tmp_path / "spool", spool_max_bytes=1024**3, spool_full_policy="reject",
        max_request_bytes=10 * 1024 * 1024, upstream_timeout=600.0, upstream_api_key="sk",
        key_refresh_seconds=1.0, database_url="", master_key_env="", master_key_file="")
    s.keys = KeyTable("", tmp_path / "proxy-keys.json")
    s.spool = SpoolWriter(tmp_path / "spool", MASTER, batch_ms=5, prepare=addon.spool_form)
    yield s
    s.spool.close()


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """How often the inference hashing and the answer re-parse run (the real functions)."""
    seen: Counter = Counter()

    def counting(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            seen[name] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counting(inference, "canonical_message")  # every prefix / extension hash goes through it
    counting(addon, "prefix_hashes")
    counting(addon, "chat_answer")  # the SSE re-parse of the answer
    counting(addon, "response_id")
    counting(addon, "responses_answer")  # rule 3b's parse of a Responses answer
    return seen


async def exchange(s: addon.Steward, messages: list, answer: str, *, session: str | None = None,
                   secret: str = SECRET, endpoint: str = "/v1/chat/completions",
                   request: dict | None = None) -> http.HTTPFlow:
    """One captured call through the hooks, streamed answer fed through the addon's tee."""
    body = orjson.dumps(request or {"model": "m", "messages": messages, "stream": True})
    headers = {"Host": "127.0.0.1:8080", "Authorization": f"Bearer {secret}",
               "Content-Type": "application/json", "Content-Length": str(len(body))}
    if session is not None:
        headers["X-Steward-Session"] = session
    flow = tflow.tflow()
    flow.request = http.Request.make("POST", f"http://127.0.0.1:8080{endpoint}", body, headers)
    s.requestheaders(flow)
    s.request(flow)
    assert flow.response is None, flow.response and flow.response.content
    flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    s.responseheaders(flow)
    output = [{"type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": answer}]}]
    flow.response.stream(sse_answer(answer) if endpoint.endswith("completions") else
                         b"data: " + orjson.dumps({"type": "response.completed", "response": {
                             "id": f"resp_{answer}", "output": output}}) + b"\n\n")
    s.response(flow)
    await asyncio.sleep(0)  # _finish runs on the next loop iteration
    return flow


def trajectory(flow: http.HTTPFlow) -> tuple[str, str]:
    cap = flow.metadata["steward"]
    return cap.decision.trajectory_id, cap.decision.source


def spooled(s: addon.Steward, tmp_path: Path, count: int) -> list[dict]:
    s._hand_off()
    deadline = time.monotonic() + 10
    while s.spool.records_written < count:
        assert time.monotonic() < deadline, "the spool writer did not write"
        time.sleep(0.01)
    return read_spool(tmp_path / "spool", MASTER)


def test_a_session_named_call_costs_no_hashing_and_no_reparse(steward, calls, tmp_path):
    async def go() -> None:
        turn1 = [{"role": "user", "content": "hello"}]
        f1 = await exchange(steward, turn1, "hi there", session="s-1")
        turn2 = [*turn1, {"role": "assistant", "content": "hi there"},
                 {"role": "user", "content": "again"}]
        f2 = await exchange(steward, turn2, "sure", session="s-1")
        assert trajectory(f1) == trajectory(f2) and trajectory(f1)[1] == "session"
        assert f2.metadata["steward"].hashes is None
        # Responses API with a session: its response id is not parsed out of the stream.
        await exchange(steward, [], "r1", session="s-2", endpoint="/v1/responses",
                       request={"model": "m", "input": "hi", "stream": True})
    asyncio.run(go())
    assert calls == Counter(), calls
    records = spooled(steward, tmp_path, 3)
    assert [r["session_id"] for r in records] == ["s-1", "s-1", "s-2"]
    assert records[0]["trajectory_source"] == "session"


def test_linking_without_a_session_still_works_and_mixing_links_onto_a_session(
        steward, calls, tmp_path):
    async def go() -> None:
        turn1 = [{"role": "user", "content": "what is 2+3?"}]
        f1 = await exchange(steward, turn1, "5")
        assert calls["prefix_hashes"] == 1 and calls["chat_answer"] == 1
        turn2 = [*turn1, {"role": "assistant", "content": "5"},
                 {"role": "user", "content": "and times 4?"}]
        f2 = await exchange(steward, turn2, "20")
        assert trajectory(f2) == (trajectory(f1)[0], "prefix")

        # This agent also sends unnamed calls, so its session-named ones feed the index
        # (after the response, not before forwarding): an unnamed follow-up links onto them.
        named = [{"role": "user", "content": "a named conversation"}]
        before = calls["prefix_hashes"]
        f3 = await exchange(steward, named, "noted", session="s-9")
        assert f3.metadata["steward"].hashes is None  # none taken before forwarding
        assert calls["prefix_hashes"] == before + 1 and calls["chat_answer"] == 3
        f4 = await exchange(steward, [*named, {"role": "assistant", "content": "noted"},
                                         {"role": "user", "content": "more"}], "ok")
        assert trajectory(f4) == (trajectory(f3)[0], "prefix")

        # Another agent that only names sessions: its calls never hash, whatever this one does.
        seen = sum(calls.values())
        await exchange(steward, named, "noted", session="s-9", secret=OTHER)
        assert sum(calls.values()) == seen
        # An unrelated unnamed conversation is not linked to anything.
        f6 = await exchange(steward, [{"role": "user", "content": "unrelated"},
                                         {"role": "assistant", "content": "x"},
                                         {"role": "user", "content": "y"}], "z")
        assert trajectory(f6)[1] == "new"
    asyncio.run(go())
    sources = [r["trajectory_source"] for r in spooled(steward, tmp_path, 6)]
    assert sources == ["new", "prefix", "session", "prefix", "session", "new"]


def test_an_unnamed_responses_agent_costs_one_parse_of_its_answer(steward, calls, tmp_path):
    """Rule 3b (decision 54): a stateless Responses call without a session name hashes its
    input before forwarding and parses its streamed answer once (id and output items together),
    and its follow-up that resends both continues the trajectory."""
    async def go() -> None:
        first = {"model": "m", "input": "what is 2+3?", "stream": True, "store": False}
        f1 = await exchange(steward, [], "5", endpoint="/v1/responses", request=first)
        assert calls["responses_answer"] == 1 and calls["response_id"] == 0
        assert calls["prefix_hashes"] == 1  # before forwarding; reused after the answer
        follow = {"model": "m", "stream": True, "store": False, "input": [
            {"role": "user", "content": "what is 2+3?"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "5"}]},
            {"role": "user", "content": "and times 4?"}]}
        f2 = await exchange(steward, [], "20", endpoint="/v1/responses", request=follow)
        assert trajectory(f2) == (trajectory(f1)[0], "prefix")
        assert calls["responses_answer"] == 2 and calls["chat_answer"] == 0
        # Chained by previous_response_id: rule 2, only the id read, no items hashed.
        hashed = calls["prefix_hashes"]
        chained = {"model": "m", "stream": True, "input": "and plus 1?",
                   "previous_response_id": "resp_20"}
        f3 = await exchange(steward, [], "21", endpoint="/v1/responses", request=chained)
        assert trajectory(f3) == (trajectory(f1)[0], "previous_response")
        assert calls["prefix_hashes"] == hashed and calls["response_id"] == 1
        assert calls["responses_answer"] == 2
    asyncio.run(go())
