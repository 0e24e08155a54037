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
    commit_offset,
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
