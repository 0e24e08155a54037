"""Reward functions by name: fn(completion_text, reference) -> float.

`reference` is the task's ground truth as a plain dict, resolved before training starts (for a
late-bound reward: only once the reward row is final). A completion the function cannot parse
scores 0.0 — that is the model's mistake; a malformed `reference` raises ValueError — that is
the task builder's.

    @register("my_check")
    def my_check(completion: str, reference: dict) -> float: ...

    fn = get_reward_fn("exact_match"); fn("Paris", {"answer": "paris"})  # 1.0
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import jsonschema

RewardFn = Callable[[str, dict[str, Any]], float]
_REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward function {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return deco


def get_reward_fn(name: str) -> RewardFn:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown reward function {name!r}; "
                         f"registered: {', '.join(available())}") from None


def available() -> list[str]:
    return sorted(_REGISTRY)


def _need(reference: dict[str, Any], key: str, fn: str) -> Any:
    if key not in reference:
        raise ValueError(f"reward {fn!r} needs reference[{key!r}]")
    return reference[key]


def normalize_text(text: str) -> str:
    """Case, surrounding whitespace and trailing sentence punctuation do not count."""
    return " ".join(text.strip().lower().split()).rstrip(".!")


@register("exact_match")
def exact_match(completion: str, reference: dict[str, Any]) -> float:
    """1.0 when the completion is the answer (normalized unless reference["normalize"] is
    false). reference: {"answer": str | [str, ...]}"""
    answers = _need(reference, "answer", "exact_match")
    answers = answers if isinstance(answers, list) else [answers]
    if reference.get("normalize", True):
        return float(normalize_text(completion) in {normalize_text(str(a)) for a in answers})
    return float(completion in {str(a) for a in answers})


@register("regex")
def regex(completion: str, reference: dict[str, Any]) -> float:
    """1.0 when the pattern matches (re.search; reference["fullmatch"] for the whole text).
    reference: {"pattern": str, "fullmatch": bool = False, "ignorecase": bool = False}"""
    pattern = _need(reference, "pattern", "regex")
    flags = re.IGNORECASE if reference.get("ignorecase") else 0
    try:
        rx = re.compile(pattern, flags)
    except re.error as e:
        raise ValueError(f"reward 'regex': bad pattern {pattern!r}: {e}") from None
    if reference.get("fullmatch"):
        match = rx.fullmatch(completion.strip())
    else:
        match = rx.search(completion)
    return float(match is not None)


_TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _first_json_object(text: str) -> Any:
    """The tool call in a completion: inside <tool_call>...</tool_call> (Qwen/Hermes), else the
    first JSON value that parses from a '{' onward."""
    tagged = _TOOL_CALL_TAG.search(text)
    candidates = [tagged.group(1)] if tagged else []
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        candidates.append(text[m.start():])
    for cand in candidates:
        try:
            return decoder.raw_decode(cand)[0]
        except ValueError:
            continue
    return None


def extract_tool_call(completion: str) -> tuple[str | None, Any]:
    """(function name or None, arguments) from a completion that emits a tool call as
    {"name": ..., "arguments": {...} | "json string"}, OpenAI's {"tool_calls": [{"function":
    {...}}]}, or bare arguments {...}. (None, None) when there is no JSON at all."""
    obj = _first_json_object(completion)
    if not isinstance(obj, dict):
        return None, None
    if isinstance(obj.get("tool_calls"), list) and obj["tool_calls"]:
        obj = obj["tool_calls"][0]
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if "arguments" in obj or "parameters" in obj:
        args = obj.get("arguments", obj.get("parameters"))
        if isinstance(args, str):  # OpenAI sends arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return obj.get("name"), None
        return obj.get("name"), args
    return None, obj


@register("json_schema")
def json_schema(completion: str, reference: dict[str, Any]) -> float:
    """1.0 when the completion's tool-call arguments validate against the JSON Schema (and the
    function name is reference["name"] when given). reference: {"schema": {...}, "name": str?}"""
    schema = _need(reference, "schema", "json_schema")
    try:
        validator_cls = jsonschema.validators.validator_for(schema)
        validator_cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"reward 'json_schema': invalid schema: {e.message}") from None
    name, args = extract_tool_call(completion)
    if args is None:
        return 0.0
    if reference.get("name") is not None and name != reference["name"]:
        return 0.0
    return float(validator_cls(schema).is_valid(args))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(.+)", re.IGNORECASE)


def extract_final_answer(completion: str) -> str:
    """The final answer of a worked completion: \\boxed{...}, else what follows the last
    'answer is' / 'answer:', else the last non-empty line."""
    boxed = _BOXED.findall(completion)
    if boxed:
        return boxed[-1].strip()
    said = _ANSWER_IS.findall(completion)
    if said:
        return said[-1].strip()
    lines = [ln for ln in completion.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def _as_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


@register("reference_answer")
def reference_answer(completion: str, reference: dict[str, Any]) -> float:
    """Verifier against a reference answer (a late-bound ground truth): numeric answers compare
    as numbers within reference["tolerance"] (default 1e-6, relative to max(1, |answer|)),
    others as normalized text, on the completion's final answer (extract_final_answer).
    reference: {"answer": str | number, "tolerance": float?}"""
    answer = _need(reference, "answer", "reference_answer")
    final = extract_final_answer(completion)
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        expected: float | None = float(answer)
    else:
        text = str(answer).strip().replace(",", "")
        expected = float(text) if _NUMBER.fullmatch(text) else None
    if expected is not None:
        got = _as_number(final)
        if got is None or not math.isfinite(got):
            return 0.0
        tol = float(reference.get("tolerance", 1e-6)) * max(1.0, abs(expected))
        return float(abs(got - expected) <= tol)
    return float(normalize_text(final) == normalize_text(str(answer)))


@register("logged")
def logged(completion: str, reference: dict[str, Any]) -> float:
    """The reward logged for this task in production. When several trajectories share a task,
    reference["logged"] lists their final completions and rewards; a sampled completion that
    reproduces one (normalized) earns its reward, any other earns reference["default"]
    (0.0). A single {"reward": r} scores every completion r — only useful as a baseline.
    reference: {"logged": [{"completion": str, "reward": float}, ...], "default": float?}
               | {"reward": float}"""
    if "logged" not in reference:
        return float(_need(reference, "reward", "logged"))
    table = {normalize_text(str(e["completion"])): float(e["reward"])
             for e in reference["logged"]}
    return table.get(normalize_text(completion), float(reference.get("default", 0.0)))
