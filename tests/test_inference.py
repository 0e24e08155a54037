"""Trajectory inference (proxy/inference.py): pure functions, no database, no processes."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import orjson

from proxy.inference import (
    NEW,
    PREFIX,
    PREVIOUS_RESPONSE,
    SESSION,
    WINDOW,
    WINDOW_LOOKBACK,
    Decision,
    TrajectoryIndex,
    canonical_item,
    canonical_message,
    decide,
    prefix_hashes,
    responses_items,
)
from wire.ids import STEWARD_NAMESPACE, new_id, session_trajectory_id
from wire.openai import chat_answer, message_text, response_id, responses_answer
from wire.sse import data_payloads

SCOPE = (1, 2)
SYSTEM = {"role": "system", "content": "You are helpful."}
USER = {"role": "user", "content": "what is 2+2?"}
ANSWER = {"role": "assistant", "content": "4", "refusal": None}


def chat(index, messages, scope=SCOPE, session=None):
    return decide(index, scope, "chat.completions", {"messages": messages}, session)


def test_session_id_is_uuid5_scoped_to_tenant_and_agent():
    assert STEWARD_NAMESPACE == uuid.UUID("6f1c1d2e-5b0a-4c59-9b6e-3e7a2d1f0c42")
    expected = str(uuid.uuid5(STEWARD_NAMESPACE, "1:2:run-7"))
    assert session_trajectory_id(1, 2, "run-7") == expected
    assert session_trajectory_id(1, 3, "run-7") != expected
    index = TrajectoryIndex()
    decision = chat(index, [USER], session="run-7")
    assert (decision.trajectory_id, decision.source) == (expected, SESSION)


def test_canonicalisation_ignores_cosmetic_differences():
    a = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    b = {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": "{}"}, "index": 0}],
        "refusal": None, "reasoning_content": "hmm", "annotations": []}
    assert canonical_message(a) == canonical_message(b)
    parts = {"role": "user", "content": [{"type": "text", "text": "he"},
                                         {"type": "text", "text": "llo"}]}
    assert canonical_message(parts) == canonical_message({"role": "user", "content": "hello"})
    assert canonical_message(USER) != canonical_message({**USER, "role": "system"})
    assert message_text([{"type": "image_url", "image_url": {}}, "x"]) == "x"


def test_prefix_hashes_are_a_chain():
    msgs = [SYSTEM, USER, ANSWER]
    hashes = prefix_hashes(msgs)
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert prefix_hashes(msgs[:2]) == hashes[:2]
    assert prefix_hashes([USER, SYSTEM])[1] != hashes[1]  # order matters


def test_continuation_after_the_answer_keeps_the_trajectory():
    index = TrajectoryIndex()
    first = chat(index, [SYSTEM, USER])
    assert first.source == NEW
    index.record_chat(SCOPE, [SYSTEM, USER], ANSWER, first.trajectory_id)
    follow_up = [SYSTEM, USER, {"role": "assistant", "content": "4"},
                 {"role": "user", "content": "and 3+3?"}]
    decision = chat(index, follow_up)
    assert (decision.trajectory_id, decision.source) == (first.trajectory_id, PREFIX)
    # ... and a third turn continues from the second.
    index.record_chat(SCOPE, follow_up, {"role": "assistant", "content": "6"},
                      decision.trajectory_id)
    third = chat(index, follow_up + [{"role": "assistant", "content": "6"},
                                     {"role": "user", "content": "thanks"}])
    assert third.trajectory_id == first.trajectory_id


def test_rewritten_answer_still_continues():
    index = TrajectoryIndex()
    first = chat(index, [USER])
    index.record_chat(SCOPE, [USER], ANSWER, first.trajectory_id)
    edited = [USER, {"role": "assistant", "content": "four"}, {"role": "user", "content": "ok"}]
    assert chat(index, edited).trajectory_id == first.trajectory_id


def test_identical_request_and_shared_opening_are_new_trajectories():
    index = TrajectoryIndex()
    first = chat(index, [SYSTEM, USER])
    index.record_chat(SCOPE, [SYSTEM, USER], ANSWER, first.trajectory_id)
    assert chat(index, [SYSTEM, USER]).source == NEW  # a retry or another conversation
    # Same system prompt and first user turn, but then a different user message: no assistant
    # message follows the stored state, so it is not a continuation.
    branched = chat(index, [SYSTEM, USER, {"role": "user", "content": "more"}])
    assert branched.source == NEW


def test_longest_prefix_wins():
    index = TrajectoryIndex()
    index.record_chat(SCOPE, [USER], ANSWER, "t-short")
    long_req = [USER, ANSWER, {"role": "user", "content": "next"}]
    index.record_chat(SCOPE, long_req, {"role": "assistant", "content": "done"}, "t-long")
    decision = chat(index, long_req + [{"role": "assistant", "content": "done"},
                                       {"role": "user", "content": "again"}])
    assert decision.trajectory_id == "t-long"


def test_scopes_are_isolated():
    index = TrajectoryIndex()
    index.record_chat(SCOPE, [USER], ANSWER, "t1")
    follow_up = [USER, ANSWER, {"role": "user", "content": "next"}]
    assert chat(index, follow_up).trajectory_id == "t1"
    assert chat(index, follow_up, scope=(1, 99)).source == NEW
    assert chat(index, follow_up, scope=(7, 2)).source == NEW


def test_lru_is_bounded():
    index = TrajectoryIndex(max_entries=4)
    for i in range(10):
        index.record_chat(SCOPE, [{"role": "user", "content": str(i)}], ANSWER, f"t{i}")
    assert len(index._states[SCOPE]) == 4
    old = [{"role": "user", "content": "0"}, ANSWER, {"role": "user", "content": "x"}]
    assert chat(index, old).source == NEW
    recent = [{"role": "user", "content": "9"}, ANSWER, {"role": "user", "content": "x"}]
    assert chat(index, recent).trajectory_id == "t9"


def test_responses_previous_response_id():
    index = TrajectoryIndex()
    index.record_response(SCOPE, "resp_1", "t1")
    decision = decide(index, SCOPE, "responses", {"previous_response_id": "resp_1"}, None)
    assert (decision.trajectory_id, decision.source) == ("t1", PREVIOUS_RESPONSE)
    assert decide(index, SCOPE, "responses", {"previous_response_id": "nope"}, None).source == NEW
    assert decide(index, (9, 9), "responses", {"previous_response_id": "resp_1"},
                  None).source == NEW


def test_completions_and_non_json_are_new():
    index = TrajectoryIndex()
    assert decide(index, SCOPE, "completions", {"prompt": "x"}, None).source == NEW
    assert decide(index, SCOPE, "chat.completions", None, None).source == NEW
    assert decide(index, SCOPE, "chat.completions", {"messages": "x"}, None).source == NEW


def sse(*payloads) -> bytes:
    return b"".join(b"data: " + orjson.dumps(p) + b"\n\n" for p in payloads) + \
        b"data: [DONE]\n\n"


def test_chat_answer_from_json_and_stream():
    body = orjson.dumps({"choices": [{"index": 0, "message": ANSWER}]})
    assert chat_answer(body, False) == ANSWER
    stream = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "4"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "type": "function",
             "function": {"name": "calc", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "{\"a\":"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "1}"}}]}}]},
        {"choices": [], "usage": {"total_tokens": 3}},
    )
    message = chat_answer(stream, True)
    assert message["content"] == "4"
    assert message["tool_calls"] == [{"id": "c1", "type": "function",
                                      "function": {"name": "calc", "arguments": "{\"a\":1}"}}]
    assert chat_answer(b"not json", False) is None
    assert chat_answer(b"data: [DONE]\n\n", True) is None


def test_stream_with_payloads_that_are_not_json_keeps_the_others():
    good = [{"choices": [{"index": 0, "delta": {"content": part}}]} for part in ("a", "b", "c")]
    for junk in (b"{broken", b'{"x": 1}, {"y": 2}', b"1, 2, 3", b"[", b"]"):
        stream = (b"data: " + orjson.dumps(good[0]) + b"\n\ndata: " + junk + b"\n\n"
                  b"data: " + orjson.dumps(good[1]) + b"\n\n: a comment\n\n"
                  b"data: " + orjson.dumps(good[2]) + b"\n\ndata: [DONE]\n\n")
        assert chat_answer(stream, True)["content"] == "abc", junk
        assert [d for d in data_payloads(stream) if isinstance(d, dict)][:1] == good[:1]


def test_streamed_answer_matches_what_the_agent_sends_back():
    index = TrajectoryIndex()
    stream = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "4"}}]})
    index.record_chat(SCOPE, [USER], chat_answer(stream, True), "t1")
    follow_up = [USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "?"}]
    assert chat(index, follow_up).trajectory_id == "t1"


def test_response_id_from_json_and_stream():
    assert response_id(orjson.dumps({"id": "resp_9", "object": "response"}), False) == "resp_9"
    stream = (b"event: response.created\ndata: "
              + orjson.dumps({"type": "response.created", "response": {"id": "resp_7"}})
              + b"\n\n")
    assert response_id(stream, True) == "resp_7"
    assert response_id(b"", True) is None


def test_new_id_is_a_canonical_random_uuid4():
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000
    for text in list(ids)[:100]:
        parsed = uuid.UUID(text)
        assert str(parsed) == text and parsed.version == 4 and parsed.variant == uuid.RFC_4122



def _tool_turn(conversation: str, k: int) -> tuple[dict, dict]:
    """Call k's answer (a tool call with its own id, as models give) and the tool's result."""
    call_id = f"call_{conversation}_{k}"
    answer = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "lookup", "arguments": f'{{"page": {k}}}'}}]}
    return answer, {"role": "tool", "tool_call_id": call_id, "content": f"page {k} of notes"}


def _windowed_session(index, conversation: str, calls: int, keep: int) -> list:
    """An agent that sends its system prompt and only its last `keep` messages (the first user
    message dropped once the window is full, as trim_messages(strategy="last") does); each
    call's answer is learnt as the proxy learns it. Returns each call's decision."""
    history: list[dict] = [{"role": "user", "content": f"Summarise the notes of {conversation}"}]
    decisions = []
    for k in range(calls):
        request = [SYSTEM, *history[-keep:]]
        decision = chat(index, request)
        decisions.append(decision)
        answer, result = _tool_turn(conversation, k)
        index.record_chat(SCOPE, request, answer, decision.trajectory_id)
        history += [answer, result]
    return decisions


def test_a_sliding_window_that_drops_the_first_user_message_stays_one_trajectory():
    index = TrajectoryIndex()
    decisions = _windowed_session(index, "acme", calls=12, keep=4)
    assert {d.trajectory_id for d in decisions} == {decisions[0].trajectory_id}
    sources = [d.source for d in decisions]
    # Until the window is full the history still extends the first request (rule 3).
    assert sources == [NEW, PREFIX] + [WINDOW] * 10


def test_tool_arguments_compare_by_the_json_they_hold():
    """An SDK that parses the model's tool arguments and dumps them again (LangChain:
    json.dumps) echoes the same call in other bytes: whitespace, key order, escapes."""
    sent = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "book", "arguments": '{"city":"Zürich","nights":2}'}}]}
    echo = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call_1",
         "function": {"name": "book", "arguments": '{"nights": 2, "city": "Z\\u00fcrich"}'}}]}
    assert canonical_message(sent) == canonical_message(echo)
    other = {**echo, "tool_calls": [{**echo["tool_calls"][0], "function": {
        "name": "book", "arguments": '{"nights": 3, "city": "Zürich"}'}}]}
    assert canonical_message(sent) != canonical_message(other)
    # Arguments that are no JSON document are compared as they are.
    for raw in ("3*3", "{not json", "", "[1, 2"):
        plain = {**sent, "tool_calls": [{**sent["tool_calls"][0], "function": {
            "name": "book", "arguments": raw}}]}
        assert orjson.loads(canonical_message(plain))[2] == [["call_1", "book", raw]]
    # Responses API function calls likewise.
    call = {"type": "function_call", "call_id": "c1", "name": "book",
            "arguments": '{"city":"Bern"}'}
    assert canonical_item(call) == canonical_item({**call, "arguments": '{ "city": "Bern" }'})


def test_a_window_finds_an_answer_whose_arguments_the_agent_dumped_again():
    """Rule 4 keys the answer as the model sent it; a LangChain agent under
    trim_messages(strategy="last") sends it back with json.dumps's spacing (decision 58)."""
    index = TrajectoryIndex()
    request = [SYSTEM, {"role": "user", "content": "book Bern"}]
    answer = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_9", "type": "function",
         "function": {"name": "book", "arguments": '{"city":"Bern","nights":1}'}}]}
    index.record_chat(SCOPE, request, answer, "t-window")
    echo = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "id": "call_9",
         "function": {"name": "book", "arguments": '{"city": "Bern", "nights": 1}'}}]}
    result = {"role": "tool", "tool_call_id": "call_9", "content": "booked"}
    decision = chat(index, [SYSTEM, request[1], echo, result])
    assert decision.source == PREFIX and decision.trajectory_id == "t-window"
    decision = chat(index, [{"role": "system", "content": "budget: 3"}, request[1], echo,
                            result])
    assert decision.source == WINDOW and decision.trajectory_id == "t-window"


def test_two_windowed_conversations_of_one_agent_stay_apart():
    index = TrajectoryIndex()
    first = _windowed_session(index, "acme", calls=8, keep=4)
    second = _windowed_session(index, "globex", calls=8, keep=4)
    assert len({d.trajectory_id for d in first}) == 1
    assert len({d.trajectory_id for d in second}) == 1
    assert first[0].trajectory_id != second[0].trajectory_id


def test_a_window_needs_something_after_the_answer_and_looks_at_recent_answers_only():
    index = TrajectoryIndex()
    request = [SYSTEM, {"role": "user", "content": "hello"}]
    answer, result = _tool_turn("x", 0)
    index.record_chat(SCOPE, request, answer, "t-window")
    # The exchange re-sent without the system prompt, ending at the answer: nothing new
    # after it, so not a continuation.
    assert chat(index, [{"role": "user", "content": "hello"}, answer]).source == NEW
    assert chat(index, [{"role": "user", "content": "hello"}, answer, result]).trajectory_id \
        == "t-window"
    # Behind more than WINDOW_LOOKBACK newer answers nobody recorded, it is not looked for.
    later: list[dict] = []
    for k in range(1, WINDOW_LOOKBACK + 1):
        later += list(_tool_turn("y", k))
    assert chat(index, [request[1], answer, result, *later]).source == NEW
    assert chat(index, [request[1], answer, result, *later[2:]]).trajectory_id == "t-window"


# --- rule 3b: Responses API agents that resend their input (decision 54) ---------------------

def responses(index, body, scope=SCOPE):
    return decide(index, scope, "responses", body, None)


def _stateless_responses_session(index, conversation: str, calls: int,
                                 echo: Callable[[dict], dict | None] = lambda item: item,
                                 keep: int = 0):
    """An agent on the Responses API without previous_response_id (the Agents SDK's default,
    `store: false`): each call resends the input so far plus what the model output (passed
    through `echo`, as the agent re-serialises it) and a tool result; with `keep`, only its
    last `keep` items once it has more (a sliding window, the first message dropped too).
    Returns the decisions."""
    items: list[dict] = [{"role": "user", "content": [
        {"type": "input_text", "text": f"Summarise the notes of {conversation}"}]}]
    decisions = []
    for k in range(calls):
        sent = items[-keep:] if keep else items
        body = {"model": "m", "input": [dict(i) for i in sent], "store": False}
        decision = responses(index, body)
        decisions.append(decision)
        call_id = f"call_{conversation}_{k}"
        output = [
            {"type": "reasoning", "id": f"rs_{k}", "summary": [],
             "encrypted_content": f"opaque-{conversation}-{k}"},
            {"type": "message", "id": f"msg_{k}", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": f"Reading page {k}.",
                          "annotations": []}]},
            {"type": "function_call", "id": f"fc_{k}", "status": "completed",
             "call_id": call_id, "name": "lookup", "arguments": f'{{"page": {k}}}'},
        ]
        index.record_items(SCOPE, responses_items(body), output, decision.trajectory_id)
        items += [e for e in map(echo, output) if e is not None]
        items.append({"type": "function_call_output", "call_id": call_id,
                      "output": f"page {k} of notes"})
    return decisions


def test_a_stateless_responses_session_stays_one_trajectory():
    index = TrajectoryIndex()
    decisions = _stateless_responses_session(index, "acme", calls=6)
    assert {d.trajectory_id for d in decisions} == {decisions[0].trajectory_id}
    assert [d.source for d in decisions] == [NEW] + [PREFIX] * 5


def test_a_responses_sliding_window_stays_one_trajectory():
    """Rule 4 over Responses input: past the window no earlier input is a prefix, and the
    request is recognised by the previous call's last item and the start of its answer."""
    index = TrajectoryIndex()
    # Each call adds 4 items (reasoning, message, function_call, its output): the first three
    # calls send 1, 5 and 9 items whole, then 9 of 13, 17, ...
    decisions = _stateless_responses_session(index, "acme", calls=10, keep=9)
    assert {d.trajectory_id for d in decisions} == {decisions[0].trajectory_id}
    assert [d.source for d in decisions] == [NEW, PREFIX, PREFIX] + [WINDOW] * 7
    other = _stateless_responses_session(index, "globex", calls=6, keep=9)
    assert len({d.trajectory_id for d in other}) == 1
    assert other[0].trajectory_id != decisions[0].trajectory_id


def test_an_echo_without_reasoning_ids_or_status_still_continues():
    """Without encrypted reasoning an agent cannot send reasoning items back, and some clients
    drop the output items' ids and status, or send text parts as a plain string."""
    def bare(item: dict) -> dict | None:
        if item["type"] == "reasoning":
            return None
        kept = {k: v for k, v in item.items() if k not in ("id", "status")}
        if item["type"] == "message":
            kept["content"] = item["content"][0]["text"]
        return kept

    index = TrajectoryIndex()
    decisions = _stateless_responses_session(index, "acme", calls=4, echo=bare)
    assert [d.source for d in decisions] == [NEW, PREFIX, PREFIX, PREFIX]
    assert len({d.trajectory_id for d in decisions}) == 1


def test_responses_sessions_of_one_agent_stay_apart_and_a_retry_is_new():
    index = TrajectoryIndex()
    first = _stateless_responses_session(index, "acme", calls=3)
    second = _stateless_responses_session(index, "globex", calls=3)
    assert len({d.trajectory_id for d in first}) == len({d.trajectory_id for d in second}) == 1
    assert first[0].trajectory_id != second[0].trajectory_id
    # The same first request again (a retry, or another conversation with that opening).
    opening = {"input": [{"role": "user", "content": "Summarise the notes of acme"}]}
    assert responses(index, opening).source == NEW
    # Another scope sees nothing of it.
    follow = {"input": opening["input"] + [{"role": "assistant", "content": "Reading page 0."}]}
    assert decide(index, (9, 9), "responses", follow, None).source == NEW


def test_a_string_input_opens_a_conversation_that_a_list_continues():
    index = TrajectoryIndex()
    first = responses(index, {"input": "what is 3*3?"})
    index.record_items(SCOPE, responses_items({"input": "what is 3*3?"}),
                       [{"type": "message", "role": "assistant",
                         "content": [{"type": "output_text", "text": "9"}]}],
                       first.trajectory_id)
    follow = {"input": [{"role": "user", "content": "what is 3*3?"},
                        {"role": "assistant", "content": "9"},
                        {"role": "user", "content": "and 4*4?"}]}
    assert responses(index, follow) == Decision(first.trajectory_id, PREFIX)


def test_state_held_upstream_is_left_to_rule_2():
    """A request chained by previous_response_id (or a stored conversation) sends only its new
    items: they are no history, so rule 3b neither reads nor records them."""
    assert responses_items({"previous_response_id": "resp_1", "input": [USER]}) is None
    assert responses_items({"conversation": "conv_1", "input": [USER]}) is None
    assert responses_items({"input": ""}) is None and responses_items({"input": 3}) is None
    assert responses_items({"input": [{"type": "reasoning", "summary": []}]}) is None
    # Items of any shape hash without raising.
    odd = [{"type": ["x"]}, "text", {"type": "web_search_call", "id": "ws_1", "action": {}},
           {"type": "item_reference", "id": "msg_1"}, {"type": "function_call_output",
                                                       "output": [{"type": "input_text"}]}]
    assert len(set(prefix_hashes(odd, canonical_item))) == len(odd)
    assert canonical_item({"type": "item_reference", "id": "a"}) != canonical_item(
        {"type": "item_reference", "id": "b"})


def test_responses_answer_from_json_and_stream():
    output = [{"type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": "9"}]}]
    assert responses_answer(orjson.dumps({"id": "resp_1", "output": output}), False) == (
        "resp_1", output)
    assert responses_answer(b"not json", False) == (None, None)
    assert responses_answer(b"[1]", False) == (None, None)
    created = {"type": "response.created", "response": {"id": "resp_1", "output": []}}
    done = {"type": "response.completed", "response": {"id": "resp_1", "output": output}}
    assert responses_answer(sse(created, done), True) == ("resp_1", output)
    # A stream cut before response.completed: the items rebuilt from its events.
    cut = sse(created,
              {"type": "response.output_item.added", "output_index": 0,
               "item": {"type": "message", "role": "assistant", "content": []}},
              {"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
               "delta": "9"})
    rid, rebuilt = responses_answer(cut, True)
    assert rid == "resp_1" and canonical_item(rebuilt[0]) == canonical_item(output[0])
    # The id alone (rule 2) reads the same from either.
    assert response_id(sse(created, done), True) == "resp_1"


def test_legacy_function_call_answers_keep_their_conversations_apart():
    """The pre-tool_calls `functions` API: an answer is a `function_call` and no text. Two
    conversations with the same opening answered with different calls stay apart, and each
    follow-up continues its own."""
    index = TrajectoryIndex()
    opening = [SYSTEM, {"role": "user", "content": "What is the weather where I am?"}]
    trajectories = {}
    for city in ("Paris", "Rome"):
        decision = chat(index, opening)
        answer = {"role": "assistant", "content": None,
                  "function_call": {"name": "weather", "arguments": f'{{"city": "{city}"}}'}}
        index.record_chat(SCOPE, opening, answer, decision.trajectory_id)
        trajectories[city] = (decision.trajectory_id, answer)
    assert trajectories["Paris"][0] != trajectories["Rome"][0]
    for city, (trajectory_id, answer) in trajectories.items():
        follow_up = [*opening, answer, {"role": "function", "name": "weather",
                                        "content": f"Sunny in {city}"}]
        assert chat(index, follow_up) == Decision(trajectory_id, PREFIX)
    # A function_call of any shape hashes without raising.
    for odd in ("x", ["a"], {"name": ["n"]}):
        canonical_message({"role": "assistant", "function_call": odd})
