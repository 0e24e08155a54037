"""The spool's file format, shared by its writer (proxy/spool.py, inside the proxy) and its
readers (the shipper, governance/capture/shipper.py; erasure's check of unshipped segments).

A record is one binary frame (format 2, written since the spool framed bodies in binary):

    0  4  magic  b"\xffSW\x02" (0xff is no base64 character: a frame never looks like a line)
    4  4  n      length of the sealed part, unsigned big-endian
    8  n  sealed AES-256-GCM(key derived from the master key, plaintext,
                 associated data b"steward-spool-v2" + the 8 header bytes)
    plaintext:  4-byte big-endian m | m bytes of the record's JSON | the byte fields, in order

Every top-level value of the record that is `bytes` (the request and response bodies) is
left out of the JSON and appended raw after it; the JSON names them, with their lengths, under
the reserved key `~bytes` ([[name, length], ...]). The reader puts them back as `bytes`, so a
body is neither base64'd nor JSON-escaped on its way through the spool. One seal per record.

Format 1 (older proxies; still read, and still written for the shipper's dead-letter file): one
line, base64 of AES-256-GCM(key, the record's JSON, associated data `steward-spool-v1`), bodies
inside the JSON as base64 text. A reader tells the two apart record by record by the first
byte, so a spool written by an older proxy ships after an upgrade, whatever it holds.

Crash safety, as with lines: a frame whose header or sealed part is not all there yet is the
tail of a segment being written and is read on a later pass — except in a closed (`.log`)
segment, where nobody will complete it (a crashed writer's segment closed by the next one):
there the tail is a bad record (its bytes dead-lettered) and the segment is finished. A frame
that does not open, or bytes that are neither a frame nor a line (e.g. a torn write followed by
whole records), are bad records too; reading resumes at the next frame magic or line.

Layout of the spool directory (0700; every file 0600: the records are encrypted, but their
sizes and timing are nobody else's business either):
    seg-<unix_ms>-<pid>-<n>.open    the segment being written (one per proxy process)
    seg-<unix_ms>-<pid>-<n>.log     a closed segment (renamed when it reaches `segment_bytes`
                                    or `segment_seconds`, or when the proxy stops)
    seg-<unix_ms>-<pid>-<n>.offset  the shipper's committed byte offset into that segment,
                                    whichever suffix it has (the rename keeps the offset)

Offset files whose segment is gone are deleted by the shipper's pass (`read_batches`). Older
spools named offsets `<segment>.offset` (suffix included); they are read and cleaned up too.

The shipper reads complete records from both kinds, commits them to PostgreSQL idempotently
(flow id is unique), then writes the offset; a closed segment whose offset reached its size is
deleted. Each record is read and decrypted once per pass that ships it (a bad record's bytes
travel in its batch, nothing is read again to find them). Spool files therefore hold raw
payloads only encrypted, and only until shipped.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
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


MAGIC = b"\xffSW\x02"
HEADER = struct.Struct(">4sI")  # magic, length of the sealed part
MAX_FRAME = 1 << 30  # a longer length is a corrupt header (bodies are capped far below)
BYTES_KEY = "~bytes"  # the JSON's list of the byte fields appended after it
_LINE_AAD = b"steward-spool-v1"
_FRAME_AAD = b"steward-spool-v2"
_U32 = struct.Struct(">I")


def encode_line(key: bytes | AESGCM, record: dict[str, Any]) -> bytes:
    """Format 1 (a base64 line); the shipper's dead-letter file is still written so."""
    return base64.b64encode(seal(key, orjson.dumps(record), _LINE_AAD)) + b"\n"


def decode_line(key: bytes | AESGCM, line: bytes) -> dict[str, Any]:
    return orjson.loads(open_sealed(key, base64.b64decode(line.rstrip(b"\n")), _LINE_AAD))


def encode_frame(key: bytes | AESGCM, record: dict[str, Any]) -> bytes:
    """Format 2: one binary frame; the record's top-level `bytes` values travel raw."""
    names: list[list[Any]] = []
    blobs: list[bytes] = []
    meta: dict[str, Any] = {}
    for name, value in record.items():
        if isinstance(value, (bytes, bytearray, memoryview)):
            value = bytes(value)
            names.append([name, len(value)])
            blobs.append(value)
        else:
            meta[name] = value
    if names:
        meta[BYTES_KEY] = names
    doc = orjson.dumps(meta)
    plaintext = b"".join((_U32.pack(len(doc)), doc, *blobs))
    # seal() prefixes a 12-byte nonce and AES-GCM appends a 16-byte tag: the length is known
    # before sealing, so the header can be authenticated with the record.
    header = HEADER.pack(MAGIC, len(plaintext) + 28)
    return header + seal(key, plaintext, _FRAME_AAD + header)


def decode_frame(key: bytes | AESGCM, frame: bytes) -> dict[str, Any]:
    """A record from one whole frame (header included); ValueError/InvalidTag when bad."""
    magic, n = HEADER.unpack_from(frame)
    if magic != MAGIC or len(frame) != HEADER.size + n:
        raise ValueError("not a spool frame")
    plaintext = open_sealed(key, frame[HEADER.size:], _FRAME_AAD + frame[:HEADER.size])
    (m,) = _U32.unpack_from(plaintext)
    record = orjson.loads(plaintext[4:4 + m])
    if not isinstance(record, dict):
        raise ValueError("a spool frame holds a JSON object")
    names = record.pop(BYTES_KEY, None) or ()
    pos = 4 + m
    view = memoryview(plaintext)
    for name, length in names:
        record[name] = bytes(view[pos:pos + length])
        pos += length
    if pos != len(plaintext):
        raise ValueError("a spool frame's byte fields do not add up")
    return record


def decode_record(key: bytes | AESGCM, data: bytes) -> dict[str, Any]:
    """A record of either format (what `split_records` cut out)."""
    if data[:1] == MAGIC[:1]:
        return decode_frame(key, data)
    return decode_line(key, data)


def split_records(data: bytes, final: bool) -> Iterator[tuple[int, int, bool]]:
    """(start, end, whole) of each record in `data`: frames and lines, in any mix. `whole` is
    False for bytes that can be no record (garbage up to the next frame magic or line start,
    or, when `final`, an incomplete tail). Stops before an incomplete tail unless `final` (a
    closed segment: nobody will complete it)."""
    pos, size = 0, len(data)
    while pos < size:
        if data[pos] == 0xFF:
            if MAGIC.startswith(data[pos:pos + len(MAGIC)]):
                n = HEADER.unpack_from(data, pos)[1] if size - pos >= HEADER.size else 0
                end = pos + HEADER.size + n
                if n <= MAX_FRAME:  # else a corrupt length
                    if end <= size and n:
                        yield pos, end, True
                        pos = end
                        continue
                    if end > size or size - pos < HEADER.size:  # not all there yet
                        if final:
                            yield pos, size, False
                        return
            # A corrupt header: skip to where a record can start again.
            nxt = _resync(data, pos + 1)
            yield pos, nxt, False
            pos = nxt
            continue
        nl = data.find(b"\n", pos)
        frame = data.find(MAGIC, pos, nl if nl >= 0 else size)
        if frame >= 0:
            # A line cut by a frame (a torn write, then whole records): the bytes before the
            # frame are bad.
            yield pos, frame, False
            pos = frame
            continue
        if nl < 0:
            if final:
                yield pos, size, False
            return  # an incomplete last line is still being written
        yield pos, nl + 1, True
        pos = nl + 1


def _resync(data: bytes, start: int) -> int:
    """Where the next record can start at or after `start`: a frame magic, or after a
    newline (a format-1 line follows it); the end when neither."""
    frame = data.find(MAGIC, start)
    nl = data.find(b"\n", start)
    candidates = [i for i in (frame, nl + 1 if nl >= 0 else -1) if i >= 0]
    return min(candidates) if candidates else len(data)


def json_form(record: Any) -> Any:
    """A record as format 1 held it: top-level `bytes` values as base64 text. What the sealed
    raw payload and the dead letters store (their plaintext format is unchanged)."""
    if not isinstance(record, dict):
        return record
    return {k: base64.b64encode(v).decode("ascii") if isinstance(v, (bytes, bytearray))
            else v for k, v in record.items()}


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
    end: int  # byte offset after the last complete record
    records: list[dict[str, Any]]
    # (byte offset, bytes) of each record that did not decode, for the dead-letter file
    bad: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def bad_lines(self) -> int:
        return len(self.bad)


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
    A record that fails to decrypt or parse is kept in `bad` (and logged), never silently
    skipped: the shipper copies it to the dead-letter file before moving past it. Each
    segment's unshipped part is read with one read and each record decrypted once."""
    cipher = AESGCM(spool_key(master_key))
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
        records: list[dict[str, Any]] = []
        bad: list[tuple[int, bytes]] = []
        start = pos = offset
        # A closed segment is complete: an incomplete tail is a crashed writer's, final.
        for begin, end, whole in split_records(data, final=segment.suffix == ".log"):
            chunk = data[begin:end]
            pos = offset + end
            try:
                if not whole:
                    raise ValueError("not a whole record")
                records.append(decode_record(cipher, chunk))
            except Exception:
                bad.append((offset + begin, chunk))
                log.error("spool: undecodable record in %s at byte %d", segment.name,
                          offset + begin)
            if len(records) >= max_records:
                yield SegmentBatch(segment, start, pos, records, bad)
                start, records, bad = pos, [], []
        if records or bad or start != pos:
            yield SegmentBatch(segment, start, pos, records, bad)


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
