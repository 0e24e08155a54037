"""Sanitizer evaluation: leak rate per entity, benign keep rate, shape failures, throughput —
Steward's sanitizer side by side with vanilla Presidio (default recognizers, same spaCy model,
`analyze` once per message string) and a naive walk (vanilla Presidio on every string value).

    .venv/bin/python -m tests.bench.sanitize_eval [--pairs 150] [--seed 7] [--skip-baselines]

A planted value leaks when it is still present verbatim, or digit-for-digit (its digits, 6 or
more, appear in the digits of one output string), anywhere in the output bodies of its
request/response pair, JSON strings inside strings included. A name leaks when the full name or
any of its parts (3+ letters) survives as a word.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from tests.bench.corpus import ENTITIES, Case, generate

SECRETS_AND_STRUCTURED = [e for e in ENTITIES if e != "PERSON"]
MESSAGE_KEYS = {"content", "text", "arguments", "output", "instructions", "prompt", "input"}


# --- checks ------------------------------------------------------------------------------------

def _strings(node: Any, out: list[str]) -> list[str]:
    if isinstance(node, dict):
        for v in node.values():
            _strings(v, out)
    elif isinstance(node, list):
        for v in node:
            _strings(v, out)
    elif isinstance(node, str):
        out.append(node)
        if node.lstrip()[:1] in "{[":
            try:
                _strings(json.loads(node), out)
            except ValueError:
                pass
    return out


def leaked(entity: str, value: str, strings: list[str], blob: str) -> bool:
    if value in blob:
        return True
    if entity == "PERSON":
        return any(re.search(rf"(?<!\w){re.escape(part)}(?!\w)", blob)
                   for part in value.split() if len(part) >= 3)
    if entity == "PRIVATE_KEY":
        return any(line in blob for line in value.splitlines()[1:-1])
    digits = re.sub(r"\D", "", value)
    if len(digits) >= 6 and entity in {"PHONE_NUMBER", "CREDIT_CARD", "US_SSN", "UK_NHS",
                                       "IN_AADHAAR", "IBAN_CODE", "UK_NINO"}:
        return any(digits in re.sub(r"\D", "", s) for s in strings)
    return False


def shape_ok(before: Any, after: Any, key: str = "") -> bool:
    if isinstance(before, dict):
        return (isinstance(after, dict) and before.keys() == after.keys()
                and all(shape_ok(before[k], after[k], k) for k in before))
    if isinstance(before, list):
        return (isinstance(after, list) and len(before) == len(after)
                and all(shape_ok(b, a, key) for b, a in zip(before, after, strict=True)))
    if isinstance(before, str):
        if not isinstance(after, str):
            return False
        if key in {"id", "model", "role", "type", "call_id", "tool_call_id", "object",
                   "finish_reason", "name", "previous_response_id", "status"}:
            return before == after or key == "name"
        if key == "arguments":
            try:
                json.loads(before)
            except ValueError:
                return True
            try:
                json.loads(after)
            except ValueError:
                return False
        return True
    return before == after


# --- engines -----------------------------------------------------------------------------------

def run_steward(cases: list[Case], batch: int = 64) -> tuple[list[Any], float, float]:
    from governance.sanitizer import PlaceholderState, Sanitizer

    t0 = time.perf_counter()
    s = Sanitizer()
    load = time.perf_counter() - t0
    s.sanitize_bodies([("request", {"messages": [{"role": "user", "content": "warm up"}]})])
    out: list[Any] = []
    t0 = time.perf_counter()
    for i in range(0, len(cases), batch):
        chunk = cases[i:i + batch]
        # One trajectory per request/response pair.
        states = []
        for j in range(len(chunk)):
            if (i + j) % 2 == 0:
                st = PlaceholderState()
            states.append(st)
        out.extend(r.body for r in s.sanitize_bodies([(c.kind, c.body) for c in chunk], states))
    return out, time.perf_counter() - t0, load


def vanilla_engine():
    from presidio_analyzer import AnalyzerEngine
    from presidio_analyzer.nlp_engine import SpacyNlpEngine
    from presidio_anonymizer import AnonymizerEngine

    from governance.recognizers import offline_tldextract
    from governance.sanitizer import spacy_model_path

    offline_tldextract()
    engine = SpacyNlpEngine(models=[{"lang_code": "en", "model_name": str(spacy_model_path())}])
    return AnalyzerEngine(nlp_engine=engine, supported_languages=["en"]), AnonymizerEngine()


def _replace_strings(node: Any, pick: Callable[[str], bool], fn: Callable[[str], str],
                     key: str = "") -> Any:
    if isinstance(node, dict):
        return {k: _replace_strings(v, pick, fn, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_replace_strings(v, pick, fn, key) for v in node]
    if isinstance(node, str) and pick(key):
        return fn(node)
    return node


def run_presidio(cases: list[Case], engines, every_string: bool) -> tuple[list[Any], float]:
    analyzer, anonymizer = engines

    def fn(text: str) -> str:
        results = analyzer.analyze(text=text, language="en")
        return anonymizer.anonymize(text=text, analyzer_results=results).text if results \
            else text

    def pick(key: str) -> bool:
        return every_string or key in MESSAGE_KEYS

    out = []
    t0 = time.perf_counter()
    for c in cases:
        out.append(_replace_strings(c.body, pick, fn))
    return out, time.perf_counter() - t0


# --- report ------------------------------------------------------------------------------------

def evaluate(cases: list[Case], outputs: list[Any]) -> dict[str, Any]:
    per = defaultdict(lambda: [0, 0])  # entity -> [leaks, total]
    benign_kept = benign_total = shape_fail = 0
    for k in range(0, len(cases), 2):
        pair_out = outputs[k:k + 2]
        strings = _strings(pair_out, [])
        blob = "\n".join(strings)
        for entity, value in cases[k].planted:
            per[entity][1] += 1
            if leaked(entity, value, strings, blob):
                per[entity][0] += 1
        for token in cases[k].benign:
            benign_total += 1
            benign_kept += token in blob
        for c, o in zip(cases[k:k + 2], pair_out, strict=True):
            shape_fail += not shape_ok(c.body, o)
    return {"per": dict(per), "benign": (benign_kept, benign_total), "shape": shape_fail}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=150)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--skip-baselines", action="store_true")
    args = ap.parse_args(argv)
    cases = generate(args.pairs, args.seed)
    n = len(cases)
    results: dict[str, tuple[dict, float]] = {}
    out, secs, load = run_steward(cases)
    results["steward"] = (evaluate(cases, out), secs)
    print(f"corpus: {args.pairs} request/response pairs = {n} bodies (seed {args.seed}); "
          f"steward load {load:.1f}s", file=sys.stderr)
    if not args.skip_baselines:
        engines = vanilla_engine()
        engines[0].analyze(text="warm up", language="en")
        out, secs = run_presidio(cases, engines, every_string=False)
        results["vanilla"] = (evaluate(cases, out), secs)
        out, secs = run_presidio(cases, engines, every_string=True)
        results["naive"] = (evaluate(cases, out), secs)
    names = list(results)
    print("| entity | n | " + " | ".join(f"{m} leak %" for m in names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for entity in ENTITIES:
        total = results["steward"][0]["per"].get(entity, [0, 0])[1]
        cells = []
        for m in names:
            leaks, tot = results[m][0]["per"].get(entity, [0, 0])
            cells.append(f"{100 * leaks / tot:.1f}" if tot else "-")
        print(f"| {entity} | {total} | " + " | ".join(cells) + " |")
    rows = {
        "benign kept %": lambda r, s: f"{100 * r['benign'][0] / max(1, r['benign'][1]):.1f}",
        "shape failures": lambda r, s: str(r["shape"]),
        "bodies/s": lambda r, s: f"{n / s:.1f}",
    }
    for label, fn in rows.items():
        print(f"| **{label}** | {n} | " + " | ".join(fn(*results[m]) for m in names) + " |")
    if "vanilla" in results:
        ours = n / results["steward"][1]
        print(f"\nspeed-up: {ours / (n / results['vanilla'][1]):.1f}x vanilla Presidio, "
              f"{ours / (n / results['naive'][1]):.1f}x naive walk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
