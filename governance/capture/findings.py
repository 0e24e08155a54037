"""Sanitizer findings packed one row per place they were found (decision 37).

A PII-dense agent turn has dozens of findings (the long-session bench's 3 KB turns: ~60). One
row each cost ~265 bytes with their indexes — about half of everything stored per call. Every
reader wants them per place anyway: counts by entity type for a step, a trajectory or a dataset
version (the console, ATDP, the audit), and the whole detail only when someone inspects one
step. So each place — a conversation item, or a step's request or response outside its
history — is one Finding row with:

- `counts`: {entity type: n} (what the console and ATDP show; SQL sums it with jsonb_each_text),
- `total`: the number of findings,
- `spans`: every finding's detail (entity type, JSON path, value path, start, end, score,
  recognizer, operator), each distinct string named once.

Offsets, paths, recognizer and operator only, never a value — as before.

`spans` formats (`unpack` reads both; `pack` writes format 2):
- 1: zlib over {"v": 1, "s": [strings], "f": [[5 string indexes, start, end, score x 1000]]}
  (~16 bytes a finding on the long-session bench's turns).
- 2 (decision 40): MAGIC, then raw deflate, with the fixed preset dictionary ZDICT_V2 (entity
  types, recognizer names, operators and the JSON paths agents' requests have), of varints:
  n_strings, (length, utf-8)*, n_findings, then column by column — the five string indexes,
  each finding's start, its length (end - start) and its score x 1000 (zigzag: never
  negative in practice, but nothing is lost if one is). Columns put like next to like, which
  is what deflate finds: ~8 bytes a finding on the same turns. ZDICT_V2 is part of the format:
  never edit it; a new dictionary is a new format.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

import orjson

from governance.capture.presets import deflate, inflate
from governance.capture.varints import Reader, put

# The detail of one finding, in this order (what the sanitizer reports, governance.sanitizer).
FIELDS = ("entity_type", "path", "value_path", "start", "end", "score", "recognizer",
          "operator")
_STRINGS = ("entity_type", "path", "value_path", "recognizer", "operator")
# Stored field length limits (the old per-finding columns' widths).
_LIMITS = {"entity_type": 32, "path": 512, "value_path": 512, "recognizer": 64, "operator": 16}
FORMAT = 2
SCORE_SCALE = 1000  # scores are kept to 3 decimals (Presidio's are 2-decimal constants mostly)
# Format 1 is a zlib stream, whose first byte is 0x78 for every level zlib writes.
MAGIC = b"\x00fd2"
# Format 2's preset dictionary: deflate copies from it what a blob repeats of it. The strings
# most findings carry go last (the nearest, cheapest to refer to). Frozen with the format.
ZDICT_V2 = "\x00".join((
    "US_SSN", "UK_NINO", "UK_NHS", "IN_PAN", "IN_AADHAAR", "US_DRIVER_LICENSE", "US_PASSPORT",
    "US_ITIN", "US_BANK_NUMBER", "MEDICAL_LICENSE", "CRYPTO", "PASSPORT", "ACCOUNT_NUMBER",
    "ID_NUMBER", "SUBJECT_ID", "OPENAI_API_KEY", "AWS_ACCESS_KEY", "AWS_SECRET_KEY",
    "GITHUB_TOKEN", "SLACK_TOKEN", "STRIPE_KEY", "GOOGLE_API_KEY", "BEARER_TOKEN", "JWT",
    "PRIVATE_KEY", "URL_PASSWORD", "SECRET", "DENY_LIST", "named_id", "secrets", "name_list",
    "age", "AGE", "DATE_OF_BIRTH", "DATE_TIME", "URL", "IP_ADDRESS", "IBAN_CODE", "CREDIT_CARD",
    "COUNTRY", "place_cue", "LOCATION", "street_address", "redact", "hash", "keep",
    "$.instructions", "$.input", "].content[0].text", "$.output[0].content[0].text",
    "$.tools[", "].function.description", "$.choices[0].message.content",
    "$.choices[0].message.tool_calls[0].function.arguments", "].tool_calls[0].function.arguments",
    "$.customers[", "].name", "].email", "].phone", "].address", "].note", "$.email", "$.name",
    "$.to", "$.address", "$.phone", "name_context", "name_alias", "spacy_ner", "keyed_field",
    "person_key", "phone", "email", "STREET_ADDRESS", "PHONE_NUMBER", "EMAIL_ADDRESS", "PERSON",
    "$.messages[", "].content", "placeholder",
)).encode()


def clean(finding: dict[str, Any]) -> dict[str, Any]:
    """One finding as stored: the known fields, strings cut to their limits."""
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = finding.get(name)
        if name in _STRINGS:
            default = "$" if name == "path" else ""
            out[name] = str(value or default)[:_LIMITS[name]]
        elif name == "score":
            out[name] = round(float(value or 0.0), 3)
        else:
            out[name] = int(value or 0)
    return out


WHAT = "findings blob"


def _varint(n: int, out: bytearray) -> None:
    put(n, out, WHAT)


def _zigzag(n: int) -> int:
    return n * 2 if n >= 0 else -n * 2 - 1


def _unzigzag(n: int) -> int:
    return n // 2 if n % 2 == 0 else -(n + 1) // 2


def pack(findings: Iterable[dict[str, Any]]) -> bytes:
    """The findings' detail (as `clean` leaves them) in format 2 (see the module's doc)."""
    found = list(findings)
    strings: dict[str, int] = {}
    body = bytearray()
    _varint(len(found), body)
    for name in _STRINGS:
        for f in found:
            _varint(strings.setdefault(f[name], len(strings)), body)
    for f in found:
        _varint(_zigzag(f["start"]), body)
    for f in found:
        _varint(_zigzag(f["end"] - f["start"]), body)
    for f in found:
        _varint(_zigzag(round(f["score"] * SCORE_SCALE)), body)
    head = bytearray()
    _varint(len(strings), head)
    for text in strings:
        data = text.encode()
        _varint(len(data), head)
        head += data
    return MAGIC + deflate(bytes(head + body), ZDICT_V2)


def pack_v1(findings: Iterable[dict[str, Any]]) -> bytes:
    """Format 1 (what releases before decision 40 read): for migration 0029's reverse."""
    strings: dict[str, int] = {}

    def ref(text: str) -> int:
        return strings.setdefault(text, len(strings))

    rows = []
    for c in findings:
        rows.append([ref(c["entity_type"]), ref(c["path"]), ref(c["value_path"]),
                     ref(c["recognizer"]), ref(c["operator"]), c["start"], c["end"],
                     round(c["score"] * SCORE_SCALE)])
    doc = {"v": 1, "s": list(strings), "f": rows}
    return zlib.compress(orjson.dumps(doc), 6)


def _unpack_v2(blob: bytes) -> list[dict[str, Any]]:
    data = inflate(blob[len(MAGIC):], ZDICT_V2, WHAT)
    r = Reader(data, WHAT)
    strings = [r.take(r.varint()).decode() for _ in range(r.varint())]
    n = r.varint()
    refs = {}
    for name in _STRINGS:
        column = [r.varint() for _ in range(n)]
        if any(i >= len(strings) for i in column):
            raise ValueError("findings blob refers to a string it does not have")
        refs[name] = [strings[i] for i in column]
    starts = [_unzigzag(r.varint()) for _ in range(n)]
    lengths = [_unzigzag(r.varint()) for _ in range(n)]
    scores = [_unzigzag(r.varint()) for _ in range(n)]
    r.done()
    return [{"entity_type": refs["entity_type"][i], "path": refs["path"][i],
             "value_path": refs["value_path"][i], "start": starts[i],
             "end": starts[i] + lengths[i], "score": scores[i] / SCORE_SCALE,
             "recognizer": refs["recognizer"][i], "operator": refs["operator"][i]}
            for i in range(n)]


def unpack(blob: bytes | memoryview | None) -> list[dict[str, Any]]:
    """The findings `pack` (either format) packed, as dicts with FIELDS (in their original
    order). A blob in neither format raises ValueError (or zlib.error)."""
    if not blob:
        return []
    blob = bytes(blob)
    if blob.startswith(MAGIC):
        return _unpack_v2(blob)
    doc = orjson.loads(zlib.decompress(blob))
    if doc.get("v") != 1:
        raise ValueError(f"unknown findings format {doc.get('v')!r}")
    s = doc["s"]
    return [{"entity_type": s[t], "path": s[p], "value_path": s[vp], "start": start,
             "end": end, "score": score / SCORE_SCALE, "recognizer": s[r], "operator": s[o]}
            for t, p, vp, r, o, start, end, score in doc["f"]]


def counts(findings: Iterable[dict[str, Any]]) -> dict[str, int]:
    """{entity type: n} of findings as `clean` leaves them, sorted by entity type."""
    return dict(sorted(Counter(f["entity_type"] for f in findings).items()))


def packed_rows(tenant_id: int, step_id: Any, findings: list[dict[str, Any]], version: str,
                item_id: int | None = None) -> list[Any]:
    """The Finding rows (unsaved) of one place's findings: one per side (an item's are all
    on the request side; a step's split into request and response). [] when none."""
    from governance.models import Finding

    by_side: dict[str, list[dict[str, Any]]] = {}
    for f in findings:  # cleaned once: pack and counts read the same cut values
        by_side.setdefault(str(f.get("side") or Finding.Side.REQUEST), []).append(clean(f))
    return [Finding(tenant_id=tenant_id, step_id=step_id, item_id=item_id, side=side,
                    counts=counts(group), total=len(group), spans=pack(group),
                    sanitizer_version=version)
            for side, group in sorted(by_side.items())]
