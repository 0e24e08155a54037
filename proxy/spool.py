"""The spool writer: an append-only, encrypted, fsync'd journal of finished exchanges (the
file format and its readers are in wire/spool.py).

The proxy's hooks call `SpoolWriter.append(record)`, which only puts the record on a queue; a
writer thread turns it into its spool form (`prepare`, e.g. the addon's decoding of the header
fields, kept off the event loop), encrypts each record (AES-256-GCM under a key derived from the
master key), appends it as one binary frame (wire/spool.py: the bodies stay raw bytes, no
base64) to the active segment and fsyncs every `batch_size` records or `batch_ms`
milliseconds, whichever comes first. So the event loop never waits for the disk, and a crash
loses at most one unsynced batch.

A writer that starts closes the `.open` segments of writers that are no longer running (a
crashed proxy's), so they can be shipped to the end and deleted.
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from wire.spool import DIR_MODE, FILE_MODE, SEGMENT_NAME, encode_frame, spool_bytes, spool_key

log = logging.getLogger("steward.spool")

_STOP = object()


class SpoolWriter:
    def __init__(self, spool_dir: Path, master_key: bytes, *, batch_size: int = 64,
                 batch_ms: float = 20.0, segment_bytes: int = 16 * 1024 * 1024,
                 segment_seconds: float = 60.0, max_bytes: int = 1024**3,
                 prepare: Callable[[Any], dict[str, Any]] | None = None) -> None:
        self.dir = Path(spool_dir)
        # Runs on the writer thread: an appended item -> its record (JSON values, and bytes
        # at the top level: encode_frame).
        self.prepare = prepare
        self.dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(self.dir, DIR_MODE)
        close_orphan_segments(self.dir)
        self.key = spool_key(master_key)
        self._cipher = AESGCM(self.key)  # one cipher object for every record (see seal)
        self.batch_size = batch_size
        self.batch_s = batch_ms / 1000
        self.segment_bytes = segment_bytes
        self.segment_seconds = segment_seconds
        self.max_bytes = max_bytes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._segment_no = 0
        self._file = None
        self._path: Path | None = None
        self._opened_at = 0.0
        self._written = 0
        # Approximate bytes on disk (ours + others' unshipped); refreshed by the writer thread.
        self.used_bytes = spool_bytes(self.dir)
        self._last_scan = time.monotonic()
        self.records_written = 0
        self._thread = threading.Thread(target=self._run, name="steward-spool-writer",
                                        daemon=True)
        self._thread.start()

    # -- called from the event loop: must not block ------------------------------------
    def append(self, record: dict[str, Any]) -> None:
        self._queue.put(record)

    def is_full(self) -> bool:
        return self.used_bytes >= self.max_bytes

    # -- writer thread ------------------------------------------------------------------
    def _open_segment(self) -> None:
        self._segment_no += 1
        name = f"seg-{int(time.time() * 1000)}-{os.getpid()}-{self._segment_no}.open"
        self._path = self.dir / name
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        self._file = os.fdopen(fd, "ab", buffering=0)
        self._opened_at = time.monotonic()
        self._written = 0

    def _close_segment(self) -> None:
        if self._file is None:
            return
        os.fsync(self._file.fileno())
        self._file.close()
        assert self._path is not None
        os.rename(self._path, self._path.with_suffix(".log"))
        self._file = None
        self._path = None

    def _run(self) -> None:
        pending: list[bytes] = []
        stopping = False
        while not stopping:
            try:
                item = self._queue.get(timeout=self.batch_s)
            except queue.Empty:
                item = None
            deadline = time.monotonic() + self.batch_s
            while item is not None:
                if item is _STOP:
                    stopping = True
                    break
                line = self._encode(item)
                if line is not None:
                    pending.append(line)
                if len(pending) >= self.batch_size or time.monotonic() >= deadline:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if pending:
                self._flush(pending)
                pending = []
            if self._file is not None and (
                self._written >= self.segment_bytes
                or time.monotonic() - self._opened_at >= self.segment_seconds
            ):
                self._close_segment()
            if time.monotonic() - self._last_scan > 1.0:
                self.used_bytes = spool_bytes(self.dir)
                self._last_scan = time.monotonic()
        self._close_segment()

    def _encode(self, item: Any) -> bytes | None:
        try:
            record = self.prepare(item) if self.prepare is not None else item
            return encode_frame(self._cipher, record)
        except Exception as e:  # noqa: BLE001 - a record must not kill the writer ...
            exc = e
            flow_id = item.get("flow_id") if isinstance(item, dict) else "?"
        # ... nor be lost: keep what can be kept, marked (text made valid UTF-8, bytes base64).
        try:
            record = salvage(item, f"{type(exc).__name__}: {exc}")
            line = encode_frame(self._cipher, record)
        except Exception:
            log.exception("spool: record %s could not be serialised, even salvaged: dropped",
                          flow_id)
            return None
        log.error("spool: record %s was not serialisable (%s); spooled salvaged", flow_id, exc)
        return line

    def _flush(self, lines: list[bytes]) -> None:
        if self._file is None:
            self._open_segment()
        data = b"".join(lines)
        while True:
            try:
                self._file.write(data)
                os.fsync(self._file.fileno())
                break
            except OSError:
                # Disk full or I/O error: keep the records, retry; is_full() makes the proxy
                # answer 503 meanwhile (or pass through, per STEWARD_SPOOL_FULL_POLICY).
                log.exception("spool: write failed, retrying in 1 s")
                try:  # drop a partly written burst, so the retry does not follow a torn frame
                    os.ftruncate(self._file.fileno(), self._written)
                except OSError:
                    pass
                self.used_bytes = self.max_bytes
                time.sleep(1)
        self._written += len(data)
        self.used_bytes += len(data)
        self.records_written += len(lines)

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)


def salvage(item: Any, reason: str) -> Any:
    """A JSON-serialisable copy of a record that was not: strings with lone surrogates get them
    replaced, bytes become base64 text, other objects their repr; `salvaged` says why."""
    def fix(value: Any) -> Any:
        if isinstance(value, str):
            return value.encode("utf-8", "replace").decode("utf-8")
        if isinstance(value, (bytes, bytearray, memoryview)):
            return base64.b64encode(bytes(value)).decode("ascii")
        if isinstance(value, dict):
            return {fix(k) if isinstance(k, str) else str(k): fix(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [fix(v) for v in value]
        if value is None or isinstance(value, (bool, int, float)):
            return value
        return repr(value)

    record = fix(item)
    if isinstance(record, dict):
        record["salvaged"] = reason
    return record


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    return True


def close_orphan_segments(spool_dir: Path) -> list[Path]:
    """Rename the `.open` segments of writer processes that are gone to `.log`: nobody will
    close them, and only a closed segment is deleted once shipped. Returns the new names."""
    closed = []
    me = os.getpid()
    for entry in os.scandir(spool_dir):
        m = SEGMENT_NAME.match(entry.name)
        if m is None or m.group(3) != "open":
            continue
        pid = int(m.group(2))
        if pid == me or _pid_running(pid):
            continue
        path = Path(entry.path)
        target = path.with_suffix(".log")
        try:
            os.rename(path, target)
        except FileNotFoundError:
            continue
        log.warning("spool: closed orphan segment %s (writer pid %d is gone)", entry.name, pid)
        closed.append(target)
    return closed
