"""Sanitization policy, operators, placeholder state and identifier normalisation."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from governance import recognizers as R

SANITIZER_VERSION = "steward-sanitizer/1.0.0"

OPERATORS = ("redact", "placeholder", "hash", "keep")

DEFAULT_OPERATORS: dict[str, str] = {
    **{t: "redact" for t in R.SECRET_TYPES},
    **{t: "placeholder" for t in R.IDENTIFIER_TYPES},
    "DENY_LIST": "redact",
    # What a bank would sign: every place finer than a country (cities, regions, streets),
    # street addresses, dates of birth and ages are replaced. A country alone, a date that is
    # not a date of birth and a URL without credentials are reported and kept (agents talk
    # about them constantly and they name nobody); a tenant policy may replace them too.
    "LOCATION": "placeholder",
    "STREET_ADDRESS": "placeholder",
    "DATE_OF_BIRTH": "placeholder",
    "AGE": "placeholder",
    "COUNTRY": "keep",
    "DATE_TIME": "keep",
    "URL": "keep",
}


# --- policy ------------------------------------------------------------------------------------

@dataclass
class Policy:
    """Per-tenant sanitization policy. `secret` keys the `hash` operator and the placeholder
    state (HMAC-SHA256); without one, a random per-process secret is used, so hashes from the
    CLI without --tenant are not linkable across runs."""

    operators: dict[str, str] = field(default_factory=dict)
    allow_list: list[str] = field(default_factory=list)
    deny_list: list[str] = field(default_factory=list)
    score_threshold: float = 0.5
    detect_organizations: bool = False
    secret: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        for entity, op in self.operators.items():
            if op not in OPERATORS:
                raise ValueError(f"unknown operator {op!r} for {entity}; use one of {OPERATORS}")
        if not self.secret:
            self.secret = os.urandom(32)
        self._allow = frozenset(v.strip().casefold() for v in self.allow_list if v.strip())
        terms = sorted({t.strip() for t in self.deny_list if t.strip()}, key=len, reverse=True)
        self._deny = (re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, terms)) + r")(?!\w)",
                                 re.I) if terms else None)

    def operator_for(self, entity_type: str) -> str:
        return self.operators.get(entity_type) or DEFAULT_OPERATORS.get(entity_type, "placeholder")

    def allowed(self, value: str) -> bool:
        return value.strip().casefold() in self._allow

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, secret: bytes = b"") -> Policy:
        data = data or {}
        return cls(operators=dict(data.get("operators", {})),
                   allow_list=list(data.get("allow_list", [])),
                   deny_list=list(data.get("deny_list", [])),
                   score_threshold=float(data.get("score_threshold", 0.5)),
                   detect_organizations=bool(data.get("detect_organizations", False)),
                   secret=secret)

    @cached_property
    def version(self) -> str:
        """SANITIZER_VERSION, plus a fingerprint of the policy when it is not the default one:
        what a step and a stored conversation item were sanitized with (an item stored under
        another version is sanitized again, not reused: governance/capture/conversation.py)."""
        data = self.to_dict()
        if data == Policy.from_dict({}, secret=b"-").to_dict():
            return SANITIZER_VERSION
        blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        return f"{SANITIZER_VERSION}+p.{hashlib.sha256(blob).hexdigest()[:12]}"

    def to_dict(self) -> dict[str, Any]:
        """The policy without its secret (safe to store or show)."""
        return {"operators": dict(self.operators), "allow_list": list(self.allow_list),
                "deny_list": list(self.deny_list), "score_threshold": self.score_threshold,
                "detect_organizations": self.detect_organizations}


# How much of a found value each operator lets through, least to most: `redact` nothing but the
# type; `placeholder` a label numbered within one trajectory; `hash` a keyed hash that is the
# same wherever the value appears (linkable across trajectories); `keep` the value itself.
OPERATOR_EXPOSURE = {"redact": 0, "placeholder": 1, "hash": 2, "keep": 3}


def weakenings(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    """What `new` lets through that `old` did not (empty: `new` is as strict or stricter).
    Effective operators are compared (defaults included), so dropping an override that was
    stricter than the default counts too. Lists are compared by size and content without
    naming their entries (they may name people)."""
    before, after = Policy.from_dict(old, secret=b"compare"), Policy.from_dict(new,
                                                                                secret=b"compare")
    found = []
    entities = sorted(set(DEFAULT_OPERATORS) | set(before.operators) | set(after.operators))
    for entity in entities:
        was, now = before.operator_for(entity), after.operator_for(entity)
        if OPERATOR_EXPOSURE[now] > OPERATOR_EXPOSURE[was]:
            found.append(f"{entity}: {was} -> {now}")
    if after.score_threshold > before.score_threshold:
        found.append(f"score threshold {before.score_threshold} -> {after.score_threshold} "
                     "(fewer findings)")
    if before.detect_organizations and not after.detect_organizations:
        found.append("organizations no longer detected")
    added = {v.strip().casefold() for v in after.allow_list if v.strip()} - {
        v.strip().casefold() for v in before.allow_list if v.strip()}
    if added:
        found.append(f"allow list: {len(added)} new entr{'y' if len(added) == 1 else 'ies'}")
    removed = {v.strip().casefold() for v in before.deny_list if v.strip()} - {
        v.strip().casefold() for v in after.deny_list if v.strip()}
    if removed:
        found.append(f"deny list: {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} "
                     "removed")
    return found


def _mac(secret: bytes, purpose: str, value: str) -> str:
    return hmac.new(secret, f"{purpose}\x00{value}".encode(), hashlib.sha256).hexdigest()


# --- placeholder state -------------------------------------------------------------------------

# Capitalised words that are also common English words: never used as a name alias alone.
_COMMON_WORDS = frozenset("""
will may june april august mark bill grace hope joy rose summer autumn winter dawn faith
chance page lane rich young brown white black green king price long hill wood ford cook
monday tuesday wednesday thursday friday saturday sunday january february march july
september october november december
""".split())


class PlaceholderState:
    """Numbering of placeholders within one trajectory: the same value is the same `<PERSON_1>`
    in every step. Stored as JSON keyed by an HMAC of the value (under the tenant's secret) —
    never the value itself. `aliases` maps name parts (first name, surname) to the label of the
    full name so a later step that says only "Garcia" still gets `<PERSON_1>`.

    Keys are the HMAC's first 64 bits (KEY_HEX hex digits; why 64 is enough:
    governance/capture/delta_codec.py). States and deltas written with 128-bit keys read as
    their first 64 bits, so a trajectory's numbering goes on across the change."""

    VERSION = 2
    KEY_HEX = 16

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.labels: dict[str, str] = {}
        self.aliases: dict[str, str] = {}

    def label(self, entity_type: str, normalized: str, secret: bytes) -> str:
        key = _mac(secret, "ph:" + entity_type, normalized)[:self.KEY_HEX]
        found = self.labels.get(key)
        if found is None:
            if entity_type == "PERSON":
                # A name part already seen as a longer name: the same person.
                found = self.aliases.get(_mac(secret, "alias", normalized)[:self.KEY_HEX])
            if found is None:
                n = self.counters.get(entity_type, 0) + 1
                self.counters[entity_type] = n
                found = f"{entity_type}_{n}"
            self.labels[key] = found
        return found

    def add_person_aliases(self, name: str, label: str, secret: bytes) -> None:
        name = " ".join(name.split()).casefold()
        for part in {name, *name.split()}:
            # "Terence Vassiliev's": the later "Vassiliev" is the same person.
            part = part.strip(".,").removesuffix("'s").removesuffix("’s")
            if len(part) >= 3 and part not in _COMMON_WORDS:
                self.aliases.setdefault(_mac(secret, "alias", part)[:self.KEY_HEX], label)

    def alias_label(self, candidate: str, secret: bytes) -> str | None:
        if not self.aliases:
            return None
        return self.aliases.get(
            _mac(secret, "alias", _normalize("PERSON", candidate))[:self.KEY_HEX])

    def to_json(self) -> dict[str, Any]:
        return {"v": self.VERSION, "counters": dict(self.counters), "labels": dict(self.labels),
                "aliases": dict(self.aliases)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | str | None) -> PlaceholderState:
        state = cls()
        if not data:
            return state
        if isinstance(data, str):
            data = json.loads(data)
        state.counters = dict(data.get("counters", {}))
        state.labels = {k[:cls.KEY_HEX]: v for k, v in (data.get("labels") or {}).items()}
        state.aliases = {k[:cls.KEY_HEX]: v for k, v in (data.get("aliases") or {}).items()}
        return state


def _normalize(entity_type: str, value: str) -> str:
    """Canonical form of an identifier, so `+1 (415) 555-0100` and `415.555.0100` (and
    `Alice@X.com` / `alice@x.com`) index as the same subject."""
    v = value.strip()
    if entity_type == "EMAIL_ADDRESS":
        return v.casefold()
    if entity_type == "PHONE_NUMBER":
        main = re.split(r"\s?(?:x|ext\.?|extension)\s?(?=\d)", v)[0]
        digits = R.only_digits(main)
        if main.startswith("00"):
            digits = digits[2:]
        if digits.startswith("1") and len(digits) == 11:
            digits = digits[1:]
        return digits.lstrip("0")
    if entity_type in {"IBAN_CODE", "CREDIT_CARD", "US_SSN", "UK_NINO", "UK_NHS", "IN_PAN",
                       "IN_AADHAAR"}:
        return re.sub(r"[^0-9A-Za-z]", "", v).upper()
    return " ".join(v.split()).casefold()


def normalize_identifier(entity_type: str, value: str) -> str:
    """Public: the erasure side must normalise a looked-up identifier the same way."""
    return _normalize(entity_type, value)


# --- results -----------------------------------------------------------------------------------

@dataclass
class SanitizedResult:
    body: Any
    findings: list[dict[str, Any]]
    # (entity_type, normalized value) for the subject index; the caller hashes them.
    identifiers: list[tuple[str, str]]
    error: str | None = None


@dataclass
class TextResult:
    text: str
    findings: list[dict[str, Any]]
    identifiers: list[tuple[str, str]]


