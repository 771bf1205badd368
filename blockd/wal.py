"""Durability: the write-ahead log and snapshots of a data directory.

Layout of a data directory::

    snapshot-000000000042.json   full engine state after log record 42
    wal-000000000043.log         records 43, 44, ... (one segment per snapshot)

A record is ``[u32 length][u32 crc32][JSON payload]``. A record is written
(one ``os.write`` of the whole frame, so a killed process never leaves half a
record in the page cache) and, under fsync policy ``always``, fsynced before
the caller acknowledges the batch. ``interval`` fsyncs from a background
thread every ``fsync_interval_s``; ``never`` leaves it to the OS (a process
crash loses nothing acknowledged, a machine crash may). On recovery a torn or
corrupt tail -- a record cut short by a crash -- is truncated away: it was
never acknowledged.

Snapshots: the log is rotated at the LSN the captured state covers; the state
is then written to a temporary file (possibly from another thread while new
records go to the new segment), fsynced, and renamed; only then are older
segments and snapshots deleted. Imports only the standard library.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator

log = logging.getLogger("blockd.wal")

FSYNC_POLICIES = ("always", "interval", "never")
_HEADER = struct.Struct("<II")


def _name(prefix: str, lsn: int, suffix: str) -> str:
    return f"{prefix}-{lsn:012d}.{suffix}"


def _lsn_of(name: str) -> int:
    return int(name.split("-", 1)[1].split(".", 1)[0])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteAheadLog:
    """Appends records; recovers the last snapshot plus the records after it."""

    def __init__(self, data_dir: str, fsync: str = "always", fsync_interval_s: float = 0.05,
                 observe_sync: Callable[[float], None] | None = None) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.data_dir = data_dir
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.observe_sync = observe_sync
        os.makedirs(data_dir, exist_ok=True)
        self.lsn = 0
        #: log bytes written since the last rotation, and the size of the last
        #: snapshot: the engine snapshots once the log outgrows the snapshot
        self.bytes_since_snapshot = 0
        self.last_snapshot_bytes = 0
        self._fd: int | None = None
        self._dirty = False
        self._io_lock = threading.Lock()
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None

    # --- recovery -----------------------------------------------------------
    def recover(self) -> tuple[dict | None, Iterator[dict]]:
        """The newest snapshot (or None) and an iterator over later records.

        Exhaust the iterator before :meth:`open_for_append`.
        """
        names = sorted(os.listdir(self.data_dir))
        for name in names:
            if name.endswith(".tmp"):  # a snapshot cut short by a crash; the log still has it all
                os.unlink(os.path.join(self.data_dir, name))
        snaps = [n for n in names if n.startswith("snapshot-") and n.endswith(".json")]
        snapshot = None
        if snaps:
            path = os.path.join(self.data_dir, snaps[-1])
            with open(path, encoding="utf-8") as f:
                snapshot = json.load(f)
            self.lsn = snapshot["lsn"]
            self.last_snapshot_bytes = os.path.getsize(path)
        segments = [n for n in names if n.startswith("wal-") and n.endswith(".log")]
        return snapshot, self._replay(segments)

    def _replay(self, segments: list[str]) -> Iterator[dict]:
        for name in segments:
            path = os.path.join(self.data_dir, name)
            with open(path, "rb") as f:
                data = f.read()
            pos = 0
            while pos < len(data):
                if pos + _HEADER.size > len(data):
                    break
                length, crc = _HEADER.unpack_from(data, pos)
                body = data[pos + _HEADER.size : pos + _HEADER.size + length]
                if len(body) < length or zlib.crc32(body) != crc:
                    break
                record = json.loads(body)
                pos += _HEADER.size + length
                if record["lsn"] <= self.lsn:
                    continue
                self.lsn = record["lsn"]
                yield record
            if pos < len(data):
                log.warning("truncating a torn record at byte %d of %s (never acknowledged)", pos, name)
                with open(path, "r+b") as f:
                    f.truncate(pos)
                    os.fsync(f.fileno())

    # --- appending --------------------------------------------------------
    def open_for_append(self) -> None:
        """Start a fresh segment after the recovered records."""
        self._open_segment(self.lsn + 1)
        if self.fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="blockd-wal-sync", daemon=True)
            self._syncer.start()

    def _open_segment(self, first_lsn: int) -> None:
        path = os.path.join(self.data_dir, _name("wal", first_lsn, "log"))
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _fsync_dir(self.data_dir)

    def append(self, record: dict) -> int:
        """Write one record (durable per the fsync policy) and return its LSN."""
        self.lsn += 1
        record["lsn"] = self.lsn
        body = json.dumps(record, separators=(",", ":")).encode()
        frame = _HEADER.pack(len(body), zlib.crc32(body)) + body
        with self._io_lock:
            os.write(self._fd, frame)
            self.bytes_since_snapshot += len(frame)
            if self.fsync == "always":
                self._sync_locked()
            else:
                self._dirty = True
        return self.lsn

    def _sync_locked(self) -> None:
        start = time.perf_counter()
        os.fsync(self._fd)
        self._dirty = False
        if self.observe_sync is not None:
            self.observe_sync(time.perf_counter() - start)

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_interval_s):
            self.flush()

    def flush(self) -> None:
        with self._io_lock:
            if self._fd is not None and self._dirty:
                self._sync_locked()

    def rotate(self) -> int:
        """Start a new segment; returns the LSN a snapshot taken now covers.

        The caller captures the state at this LSN (under its own lock) and
        then may :meth:`persist_snapshot` it at leisure, in another thread:
        until that snapshot is durable, the old snapshot and every segment
        since it stay on disk, so recovery never depends on it.
        """
        with self._io_lock:
            os.fsync(self._fd)
            os.close(self._fd)
            self._open_segment(self.lsn + 1)
            self.bytes_since_snapshot = 0
            return self.lsn

    def persist_snapshot(self, state: dict, lsn: int) -> None:
        """Write ``state`` (as of ``lsn``) durably, then drop what it replaces."""
        state["lsn"] = lsn
        final = os.path.join(self.data_dir, _name("snapshot", lsn, "json"))
        tmp = final + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
            self.last_snapshot_bytes = f.tell()
        os.replace(tmp, final)
        _fsync_dir(self.data_dir)
        for name in os.listdir(self.data_dir):
            old = (name.startswith("snapshot-") and name.endswith(".json") and _lsn_of(name) < lsn) or (
                name.startswith("wal-") and _lsn_of(name) <= lsn)
            if old:
                os.unlink(os.path.join(self.data_dir, name))
        _fsync_dir(self.data_dir)

    def close(self) -> None:
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join()
        with self._io_lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
