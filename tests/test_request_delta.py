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
