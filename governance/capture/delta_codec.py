"""The binary form of a placeholder delta (PlaceholderDelta.data, decision 39).

A delta is what one step-builder batch numbered in a trajectory's placeholder state:
`labels` and `aliases` (keyed HMAC -> label such as `PERSON_3`) and the `counters` after it. PII-
dense sessions number ~40 of them a call, so the keys are most of the bytes. Format 1 was zlib
over the JSON, with 128-bit keys as 32 hex digits (~23 bytes an entry after zlib). Format 2 keeps
64 bits of each key as 8 raw bytes and a label as (its entity-type prefix's index in a per-delta
table, its number): ~10 bytes an entry, nothing left for zlib to find.

64 bits, not 128: a key only has to be unique among one trajectory's values. Two values whose
keys collide would share a placeholder within that trajectory (a wrong number, never a value
shown); at the ~8,000 keys of a 200-call PII-dense session the chance is ~2e-12, and it stays
under 1e-6 up to ~6 million keys in one trajectory. Older keys (32 hex digits) are read as their
first 16 (`short_key`): the same HMAC's first 64 bits, so numbering goes on unchanged.

Layout (all integers unsigned LEB128 varints):
    MAGIC, n_prefixes, (len, utf-8)*, n_counters, (prefix, value)*,
    n_labels, (key[8], prefix, number + 1)*, n_aliases, (key[8], prefix, number + 1)*
A label that is not `<prefix>_<number>` is stored as a bare prefix with number 0.
"""

from __future__ import annotations

import zlib
from typing import Any

import orjson

from governance.capture.varints import Reader, put

# Format 1 is a zlib stream, whose first byte is 0x78 for every level zlib writes.
MAGIC = b"\x00ph2"
KEY_BYTES = 8
KEY_HEX = 2 * KEY_BYTES


def short_key(key: str) -> str:
    """The key as the state holds it now: the first 64 bits of the HMAC, in hex."""
    return key[:KEY_HEX]


WHAT = "placeholder delta"


def _varint(n: int, out: bytearray) -> None:
    put(n, out, WHAT)


def _split_label(label: str) -> tuple[str, int]:
    """("PERSON", 4) for "PERSON_3" (number + 1; 0: no number part)."""
    prefix, sep, number = label.rpartition("_")
    if sep and number.isdigit() and str(int(number)) == number:
        return prefix, int(number) + 1
    return label, 0


def pack(delta: dict[str, Any]) -> bytes:
    """Format 2 of a delta {"labels", "aliases", "counters"} (any "v" is dropped)."""
    prefixes: dict[str, int] = {}

    def prefix_id(prefix: str) -> int:
        return prefixes.setdefault(prefix, len(prefixes))

    body = bytearray()
    # Entries in sorted order: the same delta packs to the same bytes in every process (the
    # builder fills it from sets, whose order changes with each process's string hashing).
    counters = delta.get("counters") or {}
    _varint(len(counters), body)
    for name, value in sorted(counters.items()):
        _varint(prefix_id(name), body)
        _varint(int(value), body)
    for part in ("labels", "aliases"):
        entries = delta.get(part) or {}
        _varint(len(entries), body)
        for key, label in sorted(entries.items()):
            raw = bytes.fromhex(short_key(key))
            if len(raw) != KEY_BYTES:
                raise ValueError(f"placeholder key {key!r} is shorter than {KEY_HEX} hex digits")
            prefix, number = _split_label(label)
            body += raw
            _varint(prefix_id(prefix), body)
            _varint(number, body)
    head = bytearray(MAGIC)
    _varint(len(prefixes), head)
    for prefix in prefixes:  # insertion order is the ids' order
        encoded = prefix.encode()
        _varint(len(encoded), head)
        head += encoded
    return bytes(head + body)


def unpack(data: bytes | memoryview) -> dict[str, Any]:
    """The delta {"v": 2, "counters", "labels", "aliases"}, whatever format it was packed in;
    keys always as `short_key`s."""
    data = bytes(data)
    if not data.startswith(MAGIC):
        old = orjson.loads(zlib.decompress(data))
        for part in ("labels", "aliases"):
            if part in old:
                old[part] = {short_key(k): v for k, v in old[part].items()}
        return {**old, "v": 2}
    reader = Reader(data, WHAT)
    reader.take(len(MAGIC))
    prefixes = [reader.take(reader.varint()).decode() for _ in range(reader.varint())]

    def prefix(i: int) -> str:
        if i >= len(prefixes):
            raise ValueError("placeholder delta names a prefix it does not hold")
        return prefixes[i]

    out: dict[str, Any] = {"v": 2}
    counters = {}
    for _ in range(reader.varint()):
        name = prefix(reader.varint())
        counters[name] = reader.varint()
    for part in ("labels", "aliases"):
        entries = {}
        for _ in range(reader.varint()):
            key = reader.take(KEY_BYTES).hex()
            name, number = prefix(reader.varint()), reader.varint()
            entries[key] = f"{name}_{number - 1}" if number else name
        if entries:
            out[part] = entries
    if counters:
        out["counters"] = counters
    reader.done()
    return out
