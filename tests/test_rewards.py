"""Reward registry: each registered verifier on completions it must accept and reject."""

from __future__ import annotations

import json

import pytest

from trainer.rewards import available, extract_tool_call, get_reward_fn, register


def test_registry():
    assert {"exact_match", "regex", "json_schema", "reference_answer", "logged"} <= \
        set(available())
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        get_reward_fn("nope")

    @register("test_len")
    def test_len(completion: str, reference: dict) -> float:
        return float(len(completion))

    assert get_reward_fn("test_len")("abc", {}) == 3.0
    with pytest.raises(ValueError, match="already registered"):
        register("test_len")(lambda c, r: 0.0)


def test_exact_match():
    fn = get_reward_fn("exact_match")
    assert fn("  Paris. ", {"answer": "paris"}) == 1.0
    assert fn("Paris is the capital", {"answer": "paris"}) == 0.0
    assert fn("Lyon", {"answer": ["paris", "lyon"]}) == 1.0
    assert fn("Paris", {"answer": "paris", "normalize": False}) == 0.0
    with pytest.raises(ValueError, match="needs reference\\['answer'\\]"):
        fn("x", {})


def test_regex():
    fn = get_reward_fn("regex")
    assert fn("call refund(42)", {"pattern": r"refund\(\d+\)"}) == 1.0
    assert fn("call refund(42) now", {"pattern": r"refund\(\d+\)", "fullmatch": True}) == 0.0
    assert fn("REFUND", {"pattern": "refund", "ignorecase": True}) == 1.0
    with pytest.raises(ValueError, match="bad pattern"):
        fn("x", {"pattern": "("})


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                          "days": {"type": "integer", "minimum": 1}},
          "required": ["city"], "additionalProperties": False}


def test_json_schema_on_tool_calls():
    fn = get_reward_fn("json_schema")
    ref = {"schema": SCHEMA, "name": "get_weather"}
    qwen = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n' \
           '</tool_call>'
    openai = json.dumps({"tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]})
    assert fn(qwen, ref) == 1.0
    assert fn(openai, ref) == 1.0
    assert fn('Sure: {"city": "Oslo"}', {"schema": SCHEMA}) == 1.0       # bare arguments
    assert fn(qwen.replace("get_weather", "get_time"), ref) == 0.0      # wrong function
    assert fn(qwen.replace('"days": 2', '"days": 0'), ref) == 0.0       # minimum violated
    assert fn('{"name": "get_weather", "arguments": "{not json"}', ref) == 0.0
    assert fn("no tool call at all", ref) == 0.0
    with pytest.raises(ValueError, match="invalid schema"):
        fn("{}", {"schema": {"type": "no-such-type"}})
    assert extract_tool_call('{"name": "f", "parameters": {"a": 1}}') == ("f", {"a": 1})


def test_reference_answer_verifier():
    fn = get_reward_fn("reference_answer")
    assert fn("3 + 4 is 7", {"answer": "7"}) == 1.0                        # last number
    assert fn("so the answer is 1,234.", {"answer": 1234}) == 1.0
    assert fn("\\boxed{0.3333}", {"answer": "0.33333", "tolerance": 1e-3}) == 1.0
    assert fn("\\boxed{0.3}", {"answer": "0.33333", "tolerance": 1e-3}) == 0.0
    assert fn("first 7\nthen 8", {"answer": "7"}) == 0.0                   # final line counts
    assert fn("The answer: Paris", {"answer": "paris"}) == 1.0
    assert fn("no number here", {"answer": 3}) == 0.0


def test_logged_rewards():
    fn = get_reward_fn("logged")
    ref = {"logged": [{"completion": "Refund issued.", "reward": 1.0},
                      {"completion": "Please call support", "reward": 0.2}],
           "default": -1.0}
    assert fn("refund issued", ref) == 1.0
    assert fn("Please call support", ref) == 0.2
    assert fn("something else", ref) == -1.0
    assert fn("anything", {"reward": 0.5}) == 0.5
