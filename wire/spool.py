"""The spool's file format, shared by its writer (proxy/spool.py, inside the proxy) and its
readers (the shipper, governance/capture/shipper.py; erasure's check of unshipped segments).

A record is one line: base64 of AES-256-GCM(key derived from the master key, the record's JSON,
associated data `steward-spool-v1`). Layout of the spool directory (0700; every file 0600: the
records are encrypted, but their sizes and timing are nobody else's business either):
    seg-<unix_ms>-<pid>-<n>.open    the segment being written (one per proxy process)
    seg-<unix_ms>-<pid>-<n>.log     a closed segment (renamed when it reaches `segment_bytes`
                                    or `segment_seconds`, or when the proxy stops)
    seg-<unix_ms>-<pid>-<n>.offset  the shipper's committed byte offset into that segment,
                                    whichever suffix it has (the rename keeps the offset)

Offset files whose segment is gone are deleted by the shipper's pass (`read_batches`). Older
spools named offsets `<segment>.offset` (suffix included); they are read and cleaned up too.

The shipper reads complete lines from both kinds, commits them to PostgreSQL idempotently (flow
id is unique), then writes the offset; a closed segment whose offset reached its size is
deleted. Spool files therefore hold raw payloads only encrypted, and only until shipped.
"""

from __future__ import annotations

import base64
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from wire.crypto import derive_key, open_sealed, seal

log = logging.getLogger("steward.spool")

RECORD_VERSION = 1


SEGMENT_NAME = re.compile(r"^(seg-\d+-(\d+)-\d+)\.(open|log)$")
FILE_MODE = 0o600
DIR_MODE = 0o700


def spool_key(master: bytes) -> bytes:
    return derive_key(master, "spool")


def encode_line(key: bytes | AESGCM, record: dict[str, Any]) -> bytes:
    return base64.b64encode(seal(key, orjson.dumps(record), b"steward-spool-v1")) + b"\n"


def decode_line(key: bytes, line: bytes) -> dict[str, Any]:
    return orjson.loads(open_sealed(key, base64.b64decode(line.rstrip(b"\n")),
                                    b"steward-spool-v1"))


def spool_bytes(spool_dir: Path) -> int:
    total = 0
    for entry in os.scandir(spool_dir):
        if entry.name.startswith("seg-"):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
    return total


@dataclass
class SegmentBatch:
    segment: Path
    start: int  # byte offset of the first record
    end: int  # byte offset after the last complete line
    records: list[dict[str, Any]]
    bad_lines: int


def _offset_path(segment: Path) -> Path:
    # One name per segment whatever its suffix, so the .open -> .log rename keeps the offset.
    return segment.with_suffix(".offset")


def _legacy_offset_path(segment: Path) -> Path:
    return segment.with_name(segment.name + ".offset")


def read_offset(segment: Path) -> int:
    for path in (_offset_path(segment), _legacy_offset_path(segment)):
        try:
            return int(path.read_text())
        except (FileNotFoundError, ValueError):
            continue
    return 0


def commit_offset(segment: Path, offset: int) -> None:
    tmp = segment.with_suffix(".offset-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(str(offset))
    os.replace(tmp, _offset_path(segment))
    _legacy_offset_path(segment).unlink(missing_ok=True)


def remove_stale_offsets(spool_dir: Path) -> int:
    """Delete offset files whose segment no longer exists, and move an older version's
    `<segment>.open.offset` / `.log.offset` to the segment's one name (the `.open` name's file
    stayed behind forever once the segment was closed). Returns how many were deleted."""
    removed = 0
    for entry in os.scandir(spool_dir):
        name = entry.name
        if not name.startswith("seg-"):
            continue
        legacy = name.endswith((".open.offset", ".log.offset"))
        if legacy:
            stem = name.rsplit(".", 2)[0]
        elif name.endswith((".offset", ".offset-tmp")):
            stem = name.rsplit(".", 1)[0]
        else:
            continue
        base = Path(spool_dir) / stem
        # .open before .log: the writer renames .open -> .log, so a live segment is found
        # under one of the two names whatever happens between the two checks.
        alive = base.with_suffix(".open").exists() or base.with_suffix(".log").exists()
        try:
            if alive and legacy and not base.with_suffix(".offset").exists():
                os.replace(entry.path, base.with_suffix(".offset"))
            elif not alive or legacy:
                os.unlink(entry.path)
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def segments(spool_dir: Path) -> list[Path]:
    """Segments in write order (closed and open)."""
    names = [p for p in Path(spool_dir).glob("seg-*") if p.suffix in (".open", ".log")]
    return sorted(names, key=lambda p: (int(p.name.split("-")[1]), p.name))


def read_batches(spool_dir: Path, master_key: bytes, max_records: int = 500
                 ) -> Iterator[SegmentBatch]:
    """Unshipped complete records, segment by segment, at most `max_records` per batch.
    A line that fails to decrypt or parse is counted in `bad_lines` (and logged), never
    silently skipped: the shipper copies it to the dead-letter file before moving past it."""
    key = spool_key(master_key)
    try:
        remove_stale_offsets(Path(spool_dir))
    except OSError:
        log.exception("spool: cleaning stale offset files failed")
    for segment in segments(spool_dir):
        offset = read_offset(segment)
        try:
            with open(segment, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            continue
        if not data and segment.suffix == ".log":
            # Shipped to the end while it was still .open, closed since: nothing to read,
            # so no batch would ever get the shipper to delete it.
            finish_segment_if_done(segment)
            continue
        pos = 0
        records: list[dict[str, Any]] = []
        bad = 0
        start = offset
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break  # an incomplete last line is still being written
            line = data[pos:nl + 1]
            pos = nl + 1
            try:
                records.append(decode_line(key, line))
            except Exception:
                bad += 1
                log.error("spool: undecodable line in %s at byte %d", segment.name,
                          offset + pos - len(line))
            if len(records) >= max_records:
                yield SegmentBatch(segment, start, offset + pos, records, bad)
                start, records, bad = offset + pos, [], 0
        if records or bad or start != offset + pos:
            yield SegmentBatch(segment, start, offset + pos, records, bad)


def finish_segment_if_done(segment: Path) -> bool:
    """Delete a closed segment whose every byte is shipped. Returns True when deleted."""
    if segment.suffix != ".log":
        return False
    try:
        size = segment.stat().st_size
    except FileNotFoundError:
        return False
    if read_offset(segment) >= size:
        segment.unlink(missing_ok=True)
        _offset_path(segment).unlink(missing_ok=True)
        _legacy_offset_path(segment).unlink(missing_ok=True)
        return True
    return False
