"""governance/capture/steps.py: exact request/response bytes -> ATDP step fields (pure
functions)."""

from __future__ import annotations

import hashlib
import json

import pytest

from governance.capture.steps import CaptureError, build_step_fields, canonical_json
from wire.sse import iter_sse

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CHAT_REQ = {
    "model": "qwen-small",
    "messages": [{"role": "system", "content": "You are terse."},
                 {"role": "user", "content": "Weather in Paris?"}],
    "tools": TOOLS, "temperature": 0.2, "max_tokens": 64, "seed": 7,
}


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def sse(*chunks, done: bool = True, crlf: bool = False) -> bytes:
    nl = "\r\n" if crlf else "\n"
    out = "".join(f"data: {json.dumps(c)}{nl}{nl}" for c in chunks)
    if done:
        out += f"data: [DONE]{nl}{nl}"
    return out.encode()


def build(endpoint="chat.completions", req=CHAT_REQ, resp=None, status=200, stream=False,
          error=None, **kw):
    return build_step_fields(
        endpoint=endpoint, request_body=req if isinstance(req, bytes) else j(req),
        response_body=resp if (resp is None or isinstance(resp, bytes)) else j(resp),
        response_status=status, is_stream=stream, error=error,
        t_request=kw.pop("t_request", 1000.0), t_first_byte=kw.pop("t_first_byte", 1000.25),
        t_end=kw.pop("t_end", 1001.5), harness_version=kw.pop("harness_version", "h/1"))


def chunk(delta=None, finish=None, index=0, **extra):
    choice = {"index": index, "delta": delta or {}, "finish_reason": finish}
    choice.update(extra.pop("choice_extra", {}))
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": "qwen-small-0.5b",
            "created": 1, "choices": [choice], **extra}


# --- chat.completions --------------------------------------------------------------------------

def test_chat_plain_with_tool_calls_usage_versions_and_timings():
    resp = {"id": "chatcmpl-1", "model": "qwen-small-0.5b", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "reasoning_content": "Need weather.",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}}],
            "usage": {"prompt_tokens": 31, "completion_tokens": 12, "total_tokens": 43}}
    f = build(resp=resp)
    assert f["response_id"] == "chatcmpl-1"
    assert f["request_model"] == "qwen-small" and f["response_model"] == "qwen-small-0.5b"
    assert f["observation"]["messages"] == CHAT_REQ["messages"]
    assert f["observation"]["tools"] == TOOLS
    assert f["observation"]["params"] == {"temperature": 0.2, "max_tokens": 64, "seed": 7}
    msg = f["action"]["messages"][0]
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": "{\"city\": \"Paris\"}"}
    assert f["action"]["finish_reason"] == "tool_calls"
    assert f["hidden_state"] == {"reasoning_content": "Need weather."}
    assert f["usage"]["gen_ai.usage.input_tokens"] == 31
    assert f["usage"]["gen_ai.usage.output_tokens"] == 12
    assert f["timings"] == {"ttfb_ms": 250.0, "duration_ms": 1500.0}
    v = f["versions"]
    assert v["gen_ai.request.model"] == "qwen-small"
    assert v["gen_ai.response.model"] == "qwen-small-0.5b"
    assert v["system_prompt_hash"] == hashlib.sha256(b"You are terse.").hexdigest()
    assert v["tool_schema_hash"] == hashlib.sha256(canonical_json(TOOLS)).hexdigest()
    assert v["harness_version"] == "h/1"
    assert f["metadata"]["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert f["error"] is None
    assert f["tokens"] == {}


def test_tool_schema_hash_ignores_key_order():
    reordered = [{"function": {"parameters": TOOLS[0]["function"]["parameters"],
                               "name": "get_weather"}, "type": "function"}]
    a = build(resp={"choices": []})["versions"]["tool_schema_hash"]
    b = build(req={**CHAT_REQ, "tools": reordered}, resp={"choices": []})["versions"]
    assert a == b["tool_schema_hash"]


def test_chat_sse_reassembles_content_reasoning_and_tool_call_fragments():
    body = sse(
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "Think"}),
        chunk({"reasoning_content": "ing."}),
        chunk({"content": "Let me "}),
        chunk({"content": "check."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"ci"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "get_time", "arguments": "{}"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "ty\": \"Paris\"}"}}]}),
        chunk(finish="tool_calls"),
        {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}},
        crlf=True,
    )
    f = build(resp=body, stream=True)
    msg = f["action"]["messages"][0]
    assert msg["content"] == "Let me check."
    assert msg["tool_calls"] == [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time",
                                                          "arguments": "{}"}},
    ]
    assert f["hidden_state"]["reasoning_content"] == "Thinking."
    assert f["action"]["finish_reason"] == "tool_calls"
    assert f["usage"]["gen_ai.usage.input_tokens"] == 20
    assert f["usage"]["gen_ai.usage.output_tokens"] == 9
    assert f["response_id"] == "chatcmpl-abc"
    assert f["response_model"] == "qwen-small-0.5b"
    assert f["metadata"]["stream"] is True and f["metadata"]["steward.stream.done"] is True
    assert f["error"] is None


def test_chat_sse_keeps_logprobs_and_token_ids_in_several_shapes():
    lp = lambda tok, tid: {"token": tok, "logprob": -0.5, "bytes": list(tok.encode()),  # noqa: E731
                           "top_logprobs": [], "token_id": tid}
    body = sse(
        chunk({"content": "Hi"}, choice_extra={"logprobs": {"content": [lp("Hi", 13)]}}),
        chunk({"content": " there"}, choice_extra={"logprobs": {"content": [lp(" there", 99)]}}),
        chunk(finish="stop"),
    )
    f = build(resp=body, stream=True)
    assert f["tokens"]["token_ids"] == [13, 99]
    assert [e["token"] for e in f["tokens"]["logprobs"]] == ["Hi", " there"]

    # vLLM-style token_ids per chunk plus prompt_token_ids; SGLang-style output_token_ids.
    body = sse(
        {**chunk({"content": "a"}, choice_extra={"token_ids": [5]}), "prompt_token_ids": [1, 2]},
        chunk({"content": "b"}, choice_extra={"token_ids": [6]}),
        chunk(finish="stop"),
    )
    f = build(resp=body, stream=True)
    assert f["tokens"]["token_ids"] == [5, 6]
    assert f["tokens"]["prompt_token_ids"] == [1, 2]

    resp = {"id": "x", "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "ok"}, "output_token_ids": [7, 8],
            "meta_info": {"output_token_logprobs": [[-0.1, 7, "o"], [-0.2, 8, "k"]]}}]}
    f = build(resp=resp)
    assert f["tokens"]["token_ids"] == [7, 8]
    assert f["tokens"]["logprobs"][1] == {"logprob": -0.2, "token_id": 8, "token": "k"}


def test_chat_n_greater_than_one_keeps_every_choice():
    body = sse(chunk({"content": "A"}, index=0), chunk({"content": "B"}, index=1),
               chunk(finish="stop", index=0), chunk(finish="length", index=1))
    f = build(resp=body, stream=True)
    assert [m["content"] for m in f["action"]["messages"]] == ["A", "B"]
    assert f["action"]["finish_reasons"] == ["stop", "length"]


def test_chat_stream_cut_off_by_client_disconnect_keeps_partial_output():
    body = sse(chunk({"content": "partial "}), chunk({"content": "answ"}), done=False)[:-1]
    f = build(resp=body, stream=True,
              error={"kind": "client_disconnected", "message": "agent went away"})
    assert f["action"]["messages"][0]["content"] == "partial answ"
    assert f["error"]["kind"] == "client_disconnected"
    assert f["metadata"]["steward.stream.done"] is False
    assert f["metadata"]["steward.client_disconnected"] is True


def test_a_client_that_closes_after_the_last_event_is_not_an_error():
    """openai-python closes the response at `[DONE]`; when that close reaches the proxy
    before the upstream's end of the body, mitmproxy reports a client disconnect. The answer
    was whole: no error (the step stays training-eligible), the close kept as metadata."""
    body = sse(chunk({"content": "whole "}), chunk({"content": "answer"}), chunk(finish="stop"))
    gone = {"kind": "client_disconnected", "message": "Client disconnected."}
    f = build(resp=body, stream=True, error=gone)
    assert f["action"]["messages"][0]["content"] == "whole answer"
    assert f["error"] is None and f["metadata"]["steward.stream.done"] is True
    assert f["metadata"]["steward.client_closed_after_end"] is True
    assert "steward.client_disconnected" not in f["metadata"]
    # The Responses API: its completed event ends the answer.
    f = build("responses", RESP_REQ, _responses_events(True), stream=True, error=gone)
    assert f["error"] is None and f["action"]["status"] == "completed"
    # Another transport error after [DONE] is still one.
    f = build(resp=body, stream=True, error={"kind": "upstream_error", "message": "reset"})
    assert f["error"]["kind"] == "upstream_error"


def test_error_event_inside_stream():
    body = sse(chunk({"content": "x"}), {"error": {"message": "CUDA OOM", "code": 500}},
               done=False)
    f = build(resp=body, stream=True)
    assert f["error"]["kind"] == "stream_error"
    assert f["error"]["message"] == "CUDA OOM"
    assert f["action"]["messages"][0]["content"] == "x"


# --- errors -------------------------------------------------------------------------------

def test_upstream_http_error_keeps_json_error_body():
    body = {"error": {"message": "model not found", "type": "invalid_request_error",
                      "code": "model_not_found"}}
    f = build(resp=body, status=404)
    assert f["error"] == {"status": 404, "kind": "http_error", "message": "model not found",
                          "body": body}
    assert f["action"] == {} and f["observation"]["messages"] == CHAT_REQ["messages"]


def test_upstream_error_with_non_json_body():
    f = build(resp=b"<html>Bad gateway</html>", status=502)
    assert f["error"]["kind"] == "http_error"
    assert "Bad gateway" in f["error"]["message"] and f["error"]["body"] is None


@pytest.mark.parametrize("kind,status", [("upstream_unreachable", 502),
                                         ("upstream_timeout", 504)])
def test_transport_errors(kind, status):
    body = {"error": {"message": "upstream down", "type": "steward_error"}}
    f = build(resp=body, status=status, error={"kind": kind, "message": "connect refused"})
    assert f["error"]["kind"] == kind and f["error"]["message"] == "connect refused"
    assert f["error"]["status"] == status and f["error"]["body"] == body


def test_non_json_request_yields_flagged_step():
    f = build(req=b"not json at all \xff", resp={"error": {"message": "bad"}}, status=400)
    assert f["observation"] == {"non_json": True, "bytes": 17}
    assert f["metadata"]["steward.request.non_json"] is True
    assert f["error"]["kind"] == "http_error"
    f = build(req=b"[1, 2]", resp={"id": "x", "choices": []}, status=200)
    assert f["observation"]["non_json"] is True
    assert f["error"]["kind"] == "non_json_request"
    assert f["versions"]["system_prompt_hash"] is None


def test_unparseable_success_raises_capture_error():
    with pytest.raises(CaptureError):
        build(resp=b"this is not json", status=200)
    with pytest.raises(CaptureError):
        build(resp=b"data: nope\n\n", status=200, stream=True)
    with pytest.raises(CaptureError):
        build(endpoint="embeddings", resp={"data": []})
    with pytest.raises(CaptureError):
        build(resp=b"", status=200)


def test_odd_but_parseable_inputs_never_raise():
    for resp in ({}, {"choices": "nope"}, {"choices": [None, 3, {"message": "str"}]},
                 {"choices": [{"message": {"content": [{"type": "text", "text": "hi"}]}}]},
                 {"usage": "x", "model": 5, "id": None}):
        f = build(resp=resp)
        assert f["error"] is None
    f = build(req={"messages": "not a list"}, resp={"choices": []})
    assert f["versions"]["system_prompt_hash"] is None


# --- completions --------------------------------------------------------------------------

COMP_REQ = {"model": "m", "prompt": "2+2=", "max_tokens": 4, "logprobs": 1}


def test_completions_plain_and_stream():
    resp = {"id": "cmpl-1", "model": "m", "choices": [{"index": 0, "text": " 4",
            "finish_reason": "stop", "logprobs": {"tokens": [" 4"], "token_logprobs": [-0.01],
                                                  "top_logprobs": None, "text_offset": [4]}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
    f = build("completions", COMP_REQ, resp)
    assert f["observation"]["prompt"] == "2+2=" and f["observation"]["params"]["logprobs"] == 1
    assert f["action"] == {"text": " 4", "finish_reason": "stop"}
    assert f["tokens"]["logprobs"]["tokens"] == [" 4"]
    assert f["usage"]["gen_ai.usage.output_tokens"] == 1

    def c(text, finish=None, lp=None):
        return {"id": "cmpl-2", "model": "m", "choices": [
            {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}]}
    body = sse(c(" 4", lp={"tokens": [" 4"], "token_logprobs": [-0.1]}),
               c(".", lp={"tokens": ["."], "token_logprobs": [-0.2]}), c("", "stop"),
               {"id": "cmpl-2", "choices": [], "usage": {"prompt_tokens": 4,
                                                         "completion_tokens": 2}})
    f = build("completions", COMP_REQ, body, stream=True)
    assert f["action"]["text"] == " 4." and f["action"]["finish_reason"] == "stop"
    assert f["tokens"]["logprobs"]["token_logprobs"] == [-0.1, -0.2]
    assert f["response_id"] == "cmpl-2"
    assert f["usage"]["gen_ai.usage.output_tokens"] == 2


# --- responses ----------------------------------------------------------------------------

RESP_REQ = {"model": "m", "instructions": "Be brief.", "input": [
    {"role": "user", "content": "hello"}], "tools": TOOLS, "reasoning": {"effort": "low"}}
RESPONSE_OBJ = {
    "id": "resp_1", "object": "response", "model": "m-2", "status": "completed",
    "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                         "text": "plan"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "content": [
            {"type": "output_text", "text": "Hi!", "annotations": [],
             "logprobs": [{"token": "Hi", "logprob": -0.3, "top_logprobs": []}]}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_9", "name": "get_weather",
         "arguments": "{\"city\":\"Oslo\"}"},
    ],
    "usage": {"input_tokens": 11, "output_tokens": 5, "total_tokens": 16,
              "output_tokens_details": {"reasoning_tokens": 2}},
}


def test_responses_plain():
    f = build("responses", RESP_REQ, RESPONSE_OBJ)
    assert f["observation"]["instructions"] == "Be brief."
    assert f["observation"]["input"] == RESP_REQ["input"]
    assert f["observation"]["params"] == {"reasoning": {"effort": "low"}}
    msg = f["action"]["messages"][0]
    assert msg["content"] == "Hi!"
    assert msg["tool_calls"][0] == {"id": "call_9", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}
    assert f["action"]["output"] == RESPONSE_OBJ["output"]
    assert f["action"]["finish_reason"] == "tool_calls"
    assert f["hidden_state"] == {"reasoning": ["plan"]}
    assert f["tokens"]["logprobs"][0]["token"] == "Hi"
    assert f["usage"]["gen_ai.usage.input_tokens"] == 11
    assert f["usage"]["gen_ai.usage.reasoning.output_tokens"] == 2
    assert f["response_id"] == "resp_1" and f["response_model"] == "m-2"
    assert f["versions"]["system_prompt_hash"] == hashlib.sha256(b"Be brief.").hexdigest()


def _responses_events(final: bool) -> bytes:
    evs = [
        ("response.created", {"type": "response.created", "response": {
            "id": "resp_2", "model": "m-2", "status": "in_progress", "output": []}}),
        ("response.output_item.added", {"type": "response.output_item.added",
                                        "output_index": 0, "item": {
                                            "type": "message", "id": "msg_2",
                                            "role": "assistant", "content": []}}),
        ("response.output_text.delta", {"type": "response.output_text.delta",
                                        "output_index": 0, "content_index": 0,
                                        "delta": "Hel"}),
        ("response.output_text.delta", {"type": "response.output_text.delta",
                                        "output_index": 0, "content_index": 0,
                                        "delta": "lo"}),
        ("response.output_item.added", {"type": "response.output_item.added",
                                        "output_index": 1, "item": {
                                            "type": "function_call", "id": "fc_2",
                                            "call_id": "call_2", "name": "get_weather",
                                            "arguments": ""}}),
        ("response.function_call_arguments.delta", {
            "type": "response.function_call_arguments.delta", "output_index": 1,
            "delta": "{\"city\":"}),
        ("response.function_call_arguments.delta", {
            "type": "response.function_call_arguments.delta", "output_index": 1,
            "delta": "\"Rome\"}"}),
    ]
    if final:
        evs.append(("response.completed", {"type": "response.completed", "response": {
            "id": "resp_2", "model": "m-2", "status": "completed", "output": [
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "Hello"}]},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                 "arguments": "{\"city\":\"Rome\"}"}],
            "usage": {"input_tokens": 3, "output_tokens": 4}}}))
    return "".join(f"event: {e}\ndata: {json.dumps(d)}\n\n" for e, d in evs).encode()


@pytest.mark.parametrize("final", [True, False])
def test_responses_stream_completed_and_fallback_to_deltas(final):
    f = build("responses", RESP_REQ, _responses_events(final), stream=True,
              error=None if final else {"kind": "client_disconnected", "message": "gone"})
    msg = f["action"]["messages"][0]
    assert msg["content"] == "Hello"
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": "{\"city\":\"Rome\"}"}
    assert msg["tool_calls"][0]["id"] == "call_2"
    assert f["response_id"] == "resp_2"
    if final:
        assert f["usage"]["gen_ai.usage.output_tokens"] == 4
        assert f["action"]["status"] == "completed"
    else:
        assert f["action"]["status"] == "in_progress"
        assert f["error"]["kind"] == "client_disconnected"


def test_iter_sse_joins_multiline_data_and_ignores_comments():
    body = b": keepalive\nevent: x\ndata: {\"a\":\ndata: 1}\n\ndata: last"
    assert iter_sse(body) == [("x", "{\"a\":\n1}"), (None, "last")]
