"""The spool's files on disk (proxy/spool.py writes, wire/spool.py reads): private
modes, offsets that survive the
segment's .open -> .log rename, stale offset files and orphaned segments cleaned, and records
that are not serialisable kept (salvaged) instead of dropped. The real writer thread and the
reader the shipper uses; the shipper's database side is in test_shipper.py."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from proxy.spool import SpoolWriter
from wire.spool import (
    BYTES_KEY,
    MAGIC,
    commit_offset,
    decode_record,
    encode_frame,
    encode_line,
    finish_segment_if_done,
    read_batches,
    read_offset,
    segments,
    spool_key,
)

MASTER = os.urandom(32)


def ship_all(spool: Path) -> list[dict]:
    """What the shipper does per pass, minus the database: read, commit the offset, delete a
    closed segment that is done."""
    shipped = []
    for batch in read_batches(spool, MASTER):
        shipped.extend(batch.records)
        commit_offset(batch.segment, batch.end)
        finish_segment_if_done(batch.segment)
    return shipped


def wait_written(writer: SpoolWriter, count: int) -> None:
    deadline = time.monotonic() + 10
    while writer.records_written < count:
        assert time.monotonic() < deadline, "the writer thread did not write"
        time.sleep(0.01)


def test_files_are_private(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    writer = SpoolWriter(spool, MASTER)
    writer.append({"flow_id": "f1"})
    wait_written(writer, 1)
    ship_all(spool)  # writes an offset file too
    writer.close()
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700
    files = list(spool.iterdir())
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), [
        (p.name, oct(p.stat().st_mode)) for p in files]


def test_shipped_while_open_then_closed_leaves_nothing_behind(tmp_path):
    spool = tmp_path / "spool"
    writer = SpoolWriter(spool, MASTER)
    for i in range(3):
        writer.append({"flow_id": f"f{i}"})
    wait_written(writer, 3)
    assert [r["flow_id"] for r in ship_all(spool)] == ["f0", "f1", "f2"]  # from the .open
    writer.close()  # renames the segment to .log
    (segment,) = segments(spool)
    assert segment.suffix == ".log"
    assert read_offset(segment) == segment.stat().st_size  # the offset followed the rename
    assert ship_all(spool) == []  # nothing read twice
    assert list(spool.iterdir()) == []  # segment and offset deleted


def test_stale_and_old_style_offsets_are_cleaned(tmp_path):
    spool = tmp_path / "spool"
    writer = SpoolWriter(spool, MASTER)
    writer.append({"flow_id": "kept"})
    wait_written(writer, 1)
    writer.close()
    (segment,) = segments(spool)
    # An older version's offset under the .open name, for this (now closed) segment: it is
    # taken over, so the segment is not read again.
    legacy = spool / (segment.with_suffix(".open").name + ".offset")
    legacy.write_text(str(segment.stat().st_size))
    # Offsets of segments that are gone.
    for name in ["seg-1-1-1.offset", "seg-1-1-2.open.offset", "seg-1-1-3.log.offset",
                 "seg-1-1-4.offset-tmp"]:
        (spool / name).write_text("10")
    assert ship_all(spool) == []
    assert list(spool.iterdir()) == []


def test_orphan_open_segments_of_dead_writers_are_closed(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    # What a crashed writer leaves: an .open segment (complete lines) nobody will close.
    orphan = spool / f"seg-{int(time.time() * 1000)}-{dead_pid}-1.open"
    orphan.write_bytes(encode_line(spool_key(MASTER), {"flow_id": "orphaned"}))
    second = SpoolWriter(spool, MASTER)  # a new proxy starts
    try:
        assert [p.suffix for p in segments(spool)] == [".log"]
        assert [r["flow_id"] for r in ship_all(spool)] == ["orphaned"]
        assert list(spool.iterdir()) == []  # shipped to the end and deleted
    finally:
        second.close()


def test_a_record_that_cannot_be_serialised_is_salvaged_not_dropped(tmp_path):
    spool = tmp_path / "spool"
    writer = SpoolWriter(spool, MASTER)
    writer.append({"flow_id": "bad", "path": "/v1/x?\udcff", "body": b"\xff\x00",
                   "other": object()})
    writer.append({"flow_id": "good"})
    wait_written(writer, 2)
    writer.close()
    bad, good = ship_all(spool)
    assert good == {"flow_id": "good"}
    assert bad["flow_id"] == "bad" and bad["path"] == "/v1/x??"
    assert base64.b64decode(bad["body"]) == b"\xff\x00"
    assert bad["other"].startswith("<object") and "surrogates" in bad["salvaged"]


# -- the binary frame format (format 2) and format-1 lines ---------------------------------


def _record(i: int, body: bytes = b"{}", response: bytes | None = None) -> dict:
    return {"v": 1, "flow_id": f"f{i}", "request_body": body, "response_body": response,
            "request_headers": [["content-type", "application/json"]]}


def _spool_with(spool: Path, data: bytes, suffix: str = ".log") -> Path:
    spool.mkdir(exist_ok=True)
    segment = spool / f"seg-{int(time.time() * 1000)}-{os.getpid()}-9{suffix}"
    segment.write_bytes(data)
    return segment


def test_bodies_are_framed_raw_and_come_back_as_bytes(tmp_path):
    spool = tmp_path / "spool"
    body = os.urandom(30_000)  # incompressible: base64 would show as 4/3 of it, twice nested
    writer = SpoolWriter(spool, MASTER)
    writer.append(_record(0, body, b"data: {}\n\n"))
    writer.append(_record(1, b"", None))
    wait_written(writer, 2)
    writer.close()
    (segment,) = segments(spool)
    assert segment.read_bytes().startswith(MAGIC)
    # One frame: the body plus a few hundred bytes of header, JSON, nonce and tag.
    assert len(body) < segment.stat().st_size < len(body) + 600
    first, second = ship_all(spool)
    assert first == _record(0, body, b"data: {}\n\n")
    assert second == _record(1, b"", None)
    assert BYTES_KEY not in first


def test_a_spool_written_by_an_older_proxy_is_read_after_the_upgrade(tmp_path):
    """Format-1 lines (bodies base64 in the JSON), alone in a segment and followed by frames
    in the same one: every record is read, each in the form it was written."""
    spool = tmp_path / "spool"
    key = spool_key(MASTER)
    old = {"v": 1, "flow_id": "old", "request_body": base64.b64encode(b"{}").decode(),
           "response_body": None}
    _spool_with(spool, encode_line(key, old) + encode_line(key, {**old, "flow_id": "old2"}))
    time.sleep(0.002)  # a later segment name: write order
    _spool_with(spool, encode_line(key, {**old, "flow_id": "mixed-old"})
                + encode_frame(key, _record(7, b"\x00raw")), suffix=".log").rename(
        spool / f"seg-{int(time.time() * 1000)}-{os.getpid()}-10.log")
    shipped = ship_all(spool)
    assert [r["flow_id"] for r in shipped] == ["old", "old2", "mixed-old", "f7"]
    assert shipped[0] == old and shipped[3]["request_body"] == b"\x00raw"
    assert list(spool.iterdir()) == []


def test_an_incomplete_last_frame_waits_in_an_open_segment_and_is_final_in_a_closed_one(
        tmp_path):
    key = spool_key(MASTER)
    whole, torn = encode_frame(key, _record(1)), encode_frame(key, _record(2, b"x" * 100))
    for cut in (3, 7, len(torn) - 1):  # inside the magic, inside the length, inside the seal
        spool = tmp_path / f"open-{cut}"
        segment = _spool_with(spool, whole + torn[:cut], suffix=".open")
        (batch,) = read_batches(spool, MASTER)
        assert [r["flow_id"] for r in batch.records] == ["f1"] and batch.bad == []
        assert batch.end == len(whole)  # the tail is not committed: read on a later pass
        commit_offset(segment, batch.end)
        with open(segment, "ab") as f:  # the writer completes it
            f.write(torn[cut:])
        (batch,) = read_batches(spool, MASTER)
        assert [r["flow_id"] for r in batch.records] == ["f2"] and batch.bad == []

        # The same tail in a closed segment (a crashed writer's, closed by the next one):
        # nobody will complete it, so it is a bad record and the segment is finished.
        spool = tmp_path / f"closed-{cut}"
        segment = _spool_with(spool, whole + torn[:cut])
        (batch,) = read_batches(spool, MASTER)
        assert [r["flow_id"] for r in batch.records] == ["f1"]
        assert batch.bad == [(len(whole), torn[:cut])]
        assert batch.end == segment.stat().st_size
        commit_offset(segment, batch.end)
        assert finish_segment_if_done(segment)


def test_bad_records_are_kept_and_reading_resumes_after_them(tmp_path):
    key = spool_key(MASTER)
    frames = [encode_frame(key, _record(i, bytes([i]) * 50)) for i in range(4)]
    tampered = bytearray(frames[1])
    tampered[-1] ^= 1  # the tag no longer matches
    corrupt_header = b"\xff" + frames[2][1:4] + b"\xff\xff\xff\xff" + frames[2][8:]
    foreign = encode_line(os.urandom(32), {"flow_id": "foreign key"})
    data = frames[0] + bytes(tampered) + corrupt_header + foreign + b"\x00garbage" + frames[3]
    spool = tmp_path / "spool"
    _spool_with(spool, data)
    (batch,) = read_batches(spool, MASTER)
    assert [r["flow_id"] for r in batch.records] == ["f0", "f3"]
    assert b"".join(chunk for _, chunk in batch.bad) == data[len(frames[0]):-len(frames[3])]
    assert [offset for offset, _ in batch.bad][0] == len(frames[0])
    assert batch.bad_lines == len(batch.bad) >= 3


def test_a_finished_segment_is_read_and_decrypted_once(tmp_path, monkeypatch):
    """The shipper's passes over a segment that was shipped while open, then renamed: each
    record is decrypted by exactly one pass, and the closed segment costs no decryption."""
    import wire.spool

    opened = []
    real = wire.spool.open_sealed

    def counting(key, sealed, aad=None):
        opened.append(len(sealed))
        return real(key, sealed, aad)

    monkeypatch.setattr(wire.spool, "open_sealed", counting)
    spool = tmp_path / "spool"
    writer = SpoolWriter(spool, MASTER, segment_seconds=3600)
    for i in range(5):
        writer.append(_record(i, b"a" * 1000))
    wait_written(writer, 5)
    assert len(ship_all(spool)) == 5 and len(opened) == 5
    for i in range(5, 8):
        writer.append(_record(i, b"b" * 1000))
    wait_written(writer, 8)
    writer.close()  # renamed .log with three unshipped records
    assert [r["flow_id"] for r in ship_all(spool)] == ["f5", "f6", "f7"]
    assert len(opened) == 8  # the five shipped earlier were not decrypted again
    assert list(spool.iterdir()) == []
    assert ship_all(spool) == [] and len(opened) == 8


def test_records_and_bad_bytes_tile_any_mix_of_frames_lines_and_damage():
    """Whatever a segment holds, the records and bad chunks the reader cuts are contiguous
    from its first byte, every undamaged record in between comes back in order, and only an
    open segment's tail is left for later."""
    import random

    from wire.spool import split_records

    key = spool_key(MASTER)
    rng = random.Random(16)
    for _ in range(300):
        parts, expected, framed, garbage = [], [], [], False
        for i in range(rng.randint(1, 8)):
            rec = _record(i, rng.randbytes(rng.randint(0, 300)))
            kind = rng.choice(["frame", "frame", "line", "garbage", "flip"])
            if kind == "frame":
                parts.append(encode_frame(key, rec))
                expected.append(rec)
                framed.append(rec)
            elif kind == "line":
                rec["request_body"] = "eA=="
                parts.append(encode_line(key, rec))
                expected.append(rec)
            elif kind == "garbage":
                parts.append(rng.randbytes(rng.randint(1, 40)).replace(b"\n", b"."))
                garbage = True
            else:  # damage after the header: the frame's own length still skips it
                frame = bytearray(encode_frame(key, rec))
                frame[rng.randrange(8, len(frame))] ^= 0x40
                parts.append(bytes(frame))
        data = b"".join(parts)
        for final in (True, False):
            pos, got = 0, []
            for start, end, whole in split_records(data, final):
                assert start == pos and end > start
                pos = end
                if whole:
                    try:
                        got.append(decode_record(key, data[start:end]))
                    except Exception:  # noqa: BLE001 - damaged: a bad record
                        pass
            if final:
                assert pos == len(data)
            if not garbage:
                assert got == expected
            else:  # garbage may swallow the line after it, never a frame
                assert [r for r in got if r in framed] == framed
                assert [r for r in expected if r in got] == got
