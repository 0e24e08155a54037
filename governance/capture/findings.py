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
  recognizer, operator), zlib over a small JSON document that names each distinct string once.

Offsets, paths, recognizer and operator only, never a value — as before.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

import orjson

# The detail of one finding, in this order (what the sanitizer reports, governance.sanitizer).
FIELDS = ("entity_type", "path", "value_path", "start", "end", "score", "recognizer",
          "operator")
_STRINGS = ("entity_type", "path", "value_path", "recognizer", "operator")
# Stored field length limits (the old per-finding columns' widths).
_LIMITS = {"entity_type": 32, "path": 512, "value_path": 512, "recognizer": 64, "operator": 16}
FORMAT = 1
SCORE_SCALE = 1000  # scores are kept to 3 decimals (Presidio's are 2-decimal constants mostly)


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


def pack(findings: Iterable[dict[str, Any]]) -> bytes:
    """The findings' detail (as `clean` leaves them) as bytes: zlib of {"v", "s": distinct
    strings, "f": per finding [entity type, path, value path, recognizer, operator as indexes
    into "s"; start; end; score x 1000]}."""
    strings: dict[str, int] = {}

    def ref(text: str) -> int:
        return strings.setdefault(text, len(strings))

    rows = []
    for c in findings:
        rows.append([ref(c["entity_type"]), ref(c["path"]), ref(c["value_path"]),
                     ref(c["recognizer"]), ref(c["operator"]), c["start"], c["end"],
                     round(c["score"] * SCORE_SCALE)])
    doc = {"v": FORMAT, "s": list(strings), "f": rows}
    return zlib.compress(orjson.dumps(doc), 6)


def unpack(blob: bytes | memoryview | None) -> list[dict[str, Any]]:
    """The findings `pack` packed, as dicts with FIELDS (in their original order)."""
    if not blob:
        return []
    doc = orjson.loads(zlib.decompress(bytes(blob)))
    if doc.get("v") != FORMAT:
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
