"""A raw request body as its delta against the session's previous one (governance/capture/
rawstore.py, issue 16): a common prefix and suffix, the bytes between — and, when the
conversation comes again after a change near its start, copies of the base's blocks inside
those bytes (decision 48)."""

from __future__ import annotations

import base64

import orjson
import pytest

from governance.capture.rawstore import COPY_MIN, apply_delta, request_delta


def _body(system: str, turns: int, tail: str = "") -> bytes:
    messages = [{"role": "system", "content": system}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"Order {i}: where is parcel {i * 7919}? " * 8},
                     {"role": "assistant", "content": f"Parcel {i * 7919} left the depot."}]
    if tail:
        messages.append({"role": "user", "content": tail})
    return orjson.dumps({"model": "m", "messages": messages, "tools": [{"type": "function"}]})


def _literal(delta: dict) -> int:
    return len(base64.b64decode(delta["middle"]))


def test_an_appended_message_is_the_middle_alone():
    base = _body("Be brief.", 30)
    body = _body("Be brief.", 30, tail="And parcel 12?")
    delta = request_delta(base, body)
    assert delta is not None and "copies" not in delta  # the form every delta had before
    assert _literal(delta) < 100 and apply_delta(base, delta) == body


def test_a_changed_first_message_copies_the_rest_of_the_conversation():
    """The system prompt with the time in it: the common prefix ends inside it, so the whole
    conversation after it would be the middle; its blocks are copied from the base instead."""
    base = _body("Be brief. It is 09:14:02.", 30)
    body = _body("Be brief. It is 09:14:39.", 30, tail="And parcel 12?")
    delta = request_delta(base, body)
    assert delta is not None and delta["copies"], delta
    assert _literal(delta) < 100, _literal(delta)
    assert all(length >= COPY_MIN for _, _, length in delta["copies"])
    assert apply_delta(base, delta) == body
    # An edit near the start, another in the middle, and a message appended: two copies.
    edited = _body("Be brief. It is 09:15:00.", 30, tail="x")
    body2 = edited.replace(b"Order 14:", b"Order XIV:", 1)
    delta2 = request_delta(base, body2)
    assert delta2 is not None and len(delta2["copies"]) >= 2
    assert apply_delta(base, delta2) == body2 and _literal(delta2) < 200


def _turns(sizes: list[int], cleared: frozenset[int] = frozenset()) -> list[dict]:
    """A user message then tool results of these sizes (numbered, so no two are alike); those
    in `cleared` replaced by a short marker, as agents that clear old tool output send them."""
    out = [{"role": "user", "content": "Fix the failing build."}]
    for n, size in enumerate(sizes):
        text = "".join(f"line {n}.{k}: build step output, nothing to see\n"
                       for k in range(size // 44 + 1))[:size]
        out += [{"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"call_{n}", "type": "function",
                    "function": {"name": "read_file", "arguments": f'{{"n": {n}}}'}}]},
                {"role": "tool", "tool_call_id": f"call_{n}",
                 "content": "[output cleared]" if n in cleared else text}]
    return out


def _request(messages: list[dict]) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                    *messages],
                         "tools": [{"type": "function"}]})


@pytest.mark.parametrize("dropped_kb", [2, 12, 60])
def test_dropped_oldest_turns_of_any_size_copy_the_rest(dropped_kb):
    """An agent keeping a context budget drops its oldest turns after the task, then appends
    the new one: the rest of the conversation is copied from the base, however large the turn
    it dropped (stepping one probe at a time passed 4 KB at most: sealed whole every call)."""
    sizes = [dropped_kb * 1024] + [3000 + 97 * n for n in range(1, 25)]
    history = _turns(sizes + [2500])
    base = _request(history[:-2])  # the task, every turn but the newest
    body = _request([history[0], *history[3:]])  # the oldest turn dropped, the newest added
    delta = request_delta(base, body)
    assert delta is not None and delta["copies"], dropped_kb
    assert apply_delta(base, delta) == body
    assert _literal(delta) < 3000, _literal(delta)  # the new turn, little else


def test_old_tool_results_cleared_in_place_copy_what_is_between():
    """Clearing old tool results (context editing) rewrites several messages in the middle of
    the conversation: what lies between them is copied; only the markers and the new turn are
    literal."""
    sizes = [9000, 400, 15000, 3000, 20000, 3000, 3000]
    base = _request(_turns(sizes[:-1]))
    body = _request(_turns(sizes, cleared=frozenset({0, 2, 4})))
    delta = request_delta(base, body)
    assert delta is not None and len(delta["copies"]) >= 3
    assert apply_delta(base, delta) == body
    assert _literal(delta) < 3000 + 400, _literal(delta)


def test_an_unrelated_body_is_stored_whole_and_a_bad_delta_is_refused():
    base = _body("Be brief.", 30)
    other = orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": f"Something else entirely, {i}."} for i in range(300)]})
    assert request_delta(base, other) is None
    body = _body("Be brief. It is 09:14:39.", 30, tail="?")
    delta = request_delta(_body("Be brief. It is 09:14:02.", 30), body)
    assert delta is not None and delta["copies"]
    for bad in ([[10**9, 0, 300]], [[0, len(base), 300]], [[0, -1, 300]], [[0, 0, 0]]):
        with pytest.raises(ValueError):
            apply_delta(base, {**delta, "copies": bad})
    with pytest.raises(ValueError):  # a copy of other bytes than it was made with
        apply_delta(base[:200] + b"x" + base[201:], delta)
