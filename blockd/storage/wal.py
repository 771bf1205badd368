"""Durability: the on-disk format of a data directory, and its writers.

Layout of a data directory::

    snapshot-000000000042.snap   full engine state after log record 42
    wal-000000000043.log         records 43, 44, ... (a segment)
    wal-000000000101.log         records 101, ... (segments are contiguous)
    compact.lock                 held by a compaction (one at a time; see blockd.offline.compact)
    blockd.lock                  held by the daemon serving the directory

Format 3 (written since replication, ``docs/ha.md``):

* a segment starts with a 24-byte header ``[8s "BLKDWAL\\0"][u32 version]
  [u64 first lsn][u32 crc32 of the 20 bytes before]``, then frames
  ``[u32 length][u64 lsn][u64 term][u32 crc32(body)][u32 crc32 of the 24
  bytes before][body: the record as JSON]``. The header check means a
  flipped length, LSN or term is caught as damage instead of passing for a
  record cut short. ``term`` is the leader term that wrote the record (0 for
  a daemon without ``--etcd``); terms never go down along the log.
* a snapshot is ``[8s "BLKDSNAP"][u32 version 2][u32 crc32(body)][u64 length]``
  then the state as JSON: its ``lsn`` equals the one in the file name, its
  ``terms`` is the term history up to that record (``[[term, first lsn],
  ...]``, :class:`blockd.core.terms.TermHistory`; absent: all term 0). The
  snapshot header keeps version 2: its body only gained a field that older
  readers ignore.

Format 2 segments (the same without the term in the frame header: ``[u32
length][u64 lsn][u32 crc32(body)][u32 crc32 of the 16 bytes before]``) and
format 1 (data directories written before format versions: headerless
segments of ``[u32 length][u32 crc32][JSON with "lsn"]`` and plain-JSON
``snapshot-N.json`` files) are read, never written; their records have term
0. A directory may hold segments of several formats (an upgrade writes its
next segment in format 3); the first compaction after an upgrade replaces
the old ones. Format 1 has no header check, so in its last segment a flipped
length that points past the end still passes for a torn tail.
:mod:`blockd.storage.reader` reads and verifies them all; a blockd that predates
format 3 refuses a format-3 segment by name rather than misreading it.

Appending: a frame goes out in one ``os.pwrite`` at the end of the records
and, under fsync policy ``always``, is fsynced before the caller
acknowledges the batch. The live segment is zero-filled ahead of its records
(:data:`PREALLOCATE` at a time, written zeros, not ``fallocate``'s unwritten
extents), so that a record's fdatasync flushes its page and no metadata: the
file's size and blocks do not change, and ext4 commits no journal
transaction for it (a 4.3 kB record's write and fdatasync: 117-151 us and
48-63 us of CPU here, against 183-335 and 72-123 appended). The zeros left
after the last record are what the reader already takes as a torn tail of
the last segment (a crash's); a segment is cut to its records when it is
closed or rotated, so a closed one never ends in zeros. A caller
may defer that fsync (``append(defer_sync=True)``) and wait for it later,
outside its own locks (:meth:`WriteAheadLog.sync_to`): that is group
commit, one fsync for every record written while the previous one ran, so
steps of unrelated pools do not queue behind each other's disk writes and
durable throughput grows with the writers. A caller that polls rather than
waits hands the fsync to a :class:`blockd.storage.fsyncer.Fsyncer`
(:meth:`WriteAheadLog.sync_behind`) and reports what it said
(:meth:`WriteAheadLog.synced_behind`). ``interval``
fsyncs from a background thread every ``fsync_interval_s``; ``never`` leaves
it to the OS. Snapshots are built by :mod:`blockd.offline.compact` (another process)
from the closed segments; the daemon only rotates the log. Imports only the
standard library.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable

from blockd.storage.fsyncer import Fsyncer

FSYNC_POLICIES = ("always", "interval", "never")
FORMAT = 3
#: what a snapshot's header says (its body only gained ``terms``, see the module docstring)
SNAPSHOT_FORMAT = 2
#: segment formats this blockd reads
READABLE_FORMATS = (1, 2, 3)

SEGMENT_MAGIC = b"BLKDWAL\x00"
SEGMENT_HEADER = struct.Struct("<8sIQI")
FRAME = struct.Struct("<IQQII")
FRAME_V2 = struct.Struct("<IQII")
LEGACY_FRAME = struct.Struct("<II")
SNAPSHOT_MAGIC = b"BLKDSNAP"
SNAPSHOT_HEADER = struct.Struct("<8sIIQ")
_SYNC_CHUNK = 4 << 20
#: how far the live segment is zero-filled ahead of its records, at a time
PREALLOCATE = 1 << 20
_ZEROS = memoryview(bytes(PREALLOCATE))  # sliced without a copy
#: a frame body larger than this is damage, not a record (a step of 1M tokens is ~8 MB)
MAX_RECORD_BYTES = 1 << 30

SEGMENT_SUFFIX, SNAPSHOT_SUFFIX, LEGACY_SNAPSHOT_SUFFIX, TMP_SUFFIX = ".log", ".snap", ".json", ".tmp"
COMPACT_LOCK = "compact.lock"


def segment_name(first_lsn: int) -> str:
    return f"wal-{first_lsn:012d}{SEGMENT_SUFFIX}"


def snapshot_name(lsn: int) -> str:
    return f"snapshot-{lsn:012d}{SNAPSHOT_SUFFIX}"


def parse_name(name: str) -> tuple[str, int] | None:
    """``("segment" | "snapshot", lsn)`` for a data file's name, else None."""
    for prefix, suffixes, kind in (("wal-", (SEGMENT_SUFFIX,), "segment"),
                                   ("snapshot-", (SNAPSHOT_SUFFIX, LEGACY_SNAPSHOT_SUFFIX), "snapshot")):
        for suffix in suffixes:
            digits = name[len(prefix):-len(suffix)]
            if name.startswith(prefix) and name.endswith(suffix) and len(digits) == 12 and digits.isdigit():
                return kind, int(digits)
    return None


def segment_header(first_lsn: int) -> bytes:
    head = SEGMENT_MAGIC + struct.pack("<IQ", FORMAT, first_lsn)
    return head + struct.pack("<I", zlib.crc32(head))


def encode_frame(lsn: int, body: bytes, term: int = 0) -> bytes:
    """A format-3 frame: record ``lsn`` of ``term`` holding ``body``."""
    head = struct.pack("<IQQI", len(body), lsn, term, zlib.crc32(body))
    return head + struct.pack("<I", zlib.crc32(head)) + body


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_snapshot(data_dir: str, state: dict, lsn: int, before_rename: Callable[[], None] | None = None) -> int:
    """Write ``state`` (as of ``lsn``) durably: temporary file, fsync, rename,
    directory fsync. Returns its size. Call with the compaction lock held."""
    state["lsn"] = lsn
    body = json.dumps(state, separators=(",", ":")).encode()
    final = os.path.join(data_dir, snapshot_name(lsn))
    tmp = final + TMP_SUFFIX
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = memoryview(SNAPSHOT_HEADER.pack(SNAPSHOT_MAGIC, SNAPSHOT_FORMAT, zlib.crc32(body), len(body)) + body)
        # synced a few MiB at a time: one fsync of 100 MB makes the daemon's
        # own per-record fsyncs queue behind it for hundreds of milliseconds
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:done + _SYNC_CHUNK])
            os.fdatasync(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    if before_rename is not None:
        before_rename()
    os.replace(tmp, final)
    fsync_dir(data_dir)
    return len(data)


def remove_replaced(data_dir: str, lsn: int) -> list[str]:
    """Delete the snapshots older than ``lsn`` and the segments whose records
    are all at or below it (a segment ends where the next one starts); returns
    the names. Call once snapshot ``lsn`` is durable, with the compaction lock."""
    names = sorted(os.listdir(data_dir))
    segments = sorted((parsed[1], n) for n in names if (parsed := parse_name(n)) and parsed[0] == "segment")
    doomed = [name for (_, name), (nxt, _) in itertools.pairwise(segments) if nxt <= lsn + 1]
    doomed += [n for n in names if (parsed := parse_name(n)) and parsed[0] == "snapshot" and parsed[1] < lsn]
    for name in doomed:
        with contextlib.suppress(FileNotFoundError):  # pruned already (an operator's `blockd compact`)
            os.unlink(os.path.join(data_dir, name))
    fsync_dir(data_dir)
    return doomed


class WriteAheadLog:
    """Appends records after a recovered LSN; rotates segments for compaction."""

    def __init__(self, data_dir: str, lsn: int, fsync: str = "always", fsync_interval_s: float = 0.05,
                 observe_sync: Callable[[float], None] | None = None) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.data_dir = data_dir
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.observe_sync = observe_sync
        self.lsn = lsn
        #: log bytes written since the last rotation, and the size of the last
        #: snapshot: the engine snapshots once the log outgrows the snapshot
        self.bytes_since_snapshot = 0
        self.last_snapshot_bytes = 0
        self._segment_first = 0
        #: the live segment's end of records, and of its zeros ahead of them
        self._end = 0
        self._zeroed = 0
        self._fd: int | None = None
        self._dirty = False
        self._io_lock = threading.Lock()
        #: one fsync at a time (_syncing: one runs now; waiters wait on the
        #: condition, all woken when it ends); taken before _io_lock
        self._sync_cond = threading.Condition(threading.Lock())
        self._syncing = False
        #: every record up to this LSN is on disk (fsynced), and written (set under _io_lock
        #: once its bytes are out: self.lsn counts up before the write)
        self.durable_lsn = lsn
        self._written_lsn = lsn
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None

    def open_for_append(self) -> None:
        """Start a fresh segment after the recovered records. A segment of that
        name can only be empty (or hold a torn header, already verified as
        such): any record in it would have a higher LSN than the last one."""
        os.makedirs(self.data_dir, exist_ok=True)
        stale = os.path.join(self.data_dir, segment_name(self.lsn + 1))
        if os.path.exists(stale):
            os.unlink(stale)
        self._open_segment(self.lsn + 1)
        if self.fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="blockd-wal-sync", daemon=True)
            self._syncer.start()

    def _open_segment(self, first_lsn: int) -> None:
        path = os.path.join(self.data_dir, segment_name(first_lsn))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        # the header needs no fsync of its own: a crash before the first
        # record's fsync leaves an empty or zeroed last segment, which
        # recovery recognises as torn; the name must be durable, though
        header = segment_header(first_lsn)
        os.write(fd, header)
        fsync_dir(self.data_dir)
        self._fd, self._segment_first = fd, first_lsn
        self._end = self._zeroed = len(header)

    def _write(self, data: bytes | bytearray) -> None:
        """Write ``data`` after the records (under ``_io_lock``), zero-filling ahead first where it runs out."""
        fd, end = self._open_fd, self._end
        if end + len(data) > self._zeroed:
            # the zeros go first: a crash between the two leaves zeros, a torn tail
            target = end + len(data) + PREALLOCATE
            while self._zeroed < target:
                self._zeroed += os.pwrite(fd, _ZEROS[:target - self._zeroed], self._zeroed)
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], end + done)
        self._end = end + len(data)

    def _cut_to_records(self) -> None:
        """Drop the zeros ahead of the records (under ``_io_lock``, before the segment's last fsync)."""
        if self._zeroed > self._end:
            os.ftruncate(self._open_fd, self._end)
            self._zeroed = self._end

    @property
    def _open_fd(self) -> int:
        assert self._fd is not None, "the log is not open"
        return self._fd

    def append(self, body: bytes, term: int = 0, written: Callable[[int], None] | None = None,
               defer_sync: bool = False) -> int:
        """Write one record of ``term`` (durable per the fsync policy) and
        return its LSN. ``written(lsn)`` runs once the record is written,
        before its fsync (replication sends it on meanwhile: a leader's and
        its followers' fsyncs overlap). ``defer_sync``: under ``always``, the
        caller waits for the fsync itself (:meth:`sync_to`) before it
        acknowledges the record."""
        self.lsn += 1
        frame = encode_frame(self.lsn, body, term)
        with self._io_lock:
            self._write(frame)
            self._written_lsn = self.lsn
            self.bytes_since_snapshot += len(frame)
            if written is not None:
                written(self.lsn)
            if self.fsync == "always" and not defer_sync:
                self._sync_locked()
            else:
                self._dirty = True
        return self.lsn

    def synced(self, lsn: int) -> bool:
        """Whether :meth:`sync_to` of ``lsn`` would return at once."""
        return self.fsync != "always" or self.durable_lsn >= lsn

    def sync_to(self, lsn: int) -> None:
        """Return once record ``lsn`` is fsynced (under ``always``; the other
        policies promise no fsync, so at once). Group commit: one caller
        fsyncs everything written so far while the others wait on
        ``_sync_cond``; when it is done all wake, and each finds its record
        covered or one of them fsyncs the next group. The fsync runs outside ``_io_lock``, so appends go on
        meanwhile. Raises the fsync's OSError (the caller fails stop)."""
        if self.synced(lsn):
            return
        with self._sync_cond:
            # every waiter wakes when an fsync ends: those it covered return
            # together (queueing one by one on a lock instead, each would find
            # out late and the next fsync would start before their next
            # records are written, covering one or two)
            while self._syncing:
                self._sync_cond.wait()
                if self.durable_lsn >= lsn:
                    return
            if self.durable_lsn >= lsn:
                return
            self._syncing = True
        target = self.durable_lsn
        try:
            with self._io_lock:
                target, fd = self._written_lsn, self._open_fd
            # rotate and close wait for _syncing to clear: fd stays open while this runs
            start = time.perf_counter()
            os.fdatasync(fd)  # why not fsync: _sync_locked
            if self.observe_sync is not None:
                self.observe_sync(time.perf_counter() - start)
        except BaseException:
            target = self.durable_lsn  # nothing new is durable
            raise
        finally:
            with self._sync_cond:
                self.durable_lsn = max(self.durable_lsn, target)
                self._syncing = False
                self._sync_cond.notify_all()

    def sync_behind(self, lsn: int, fsyncer: Fsyncer) -> bool:
        """Have ``fsyncer`` fsync everything written so far, so that record ``lsn``
        becomes durable without a wait here; its completion goes to
        :meth:`synced_behind`. False when ``lsn`` is durable already (nothing asked).
        The fsyncer syncs a dup of the segment's descriptor, taken under ``_io_lock``,
        so a rotation or close meanwhile never leaves it a closed or reused one."""
        if self.synced(lsn):
            return False
        with self._io_lock:
            fsyncer.request(self._open_fd, self._written_lsn)
        return True

    def synced_behind(self, lsn: int, seconds: float) -> None:
        """An fsync that :meth:`sync_behind` asked for succeeded: every record up
        to ``lsn`` is durable (it took ``seconds``)."""
        with self._sync_cond:
            self.durable_lsn = max(self.durable_lsn, lsn)
        if self.observe_sync is not None:
            self.observe_sync(seconds)

    @contextlib.contextmanager
    def _sync_excluded(self):
        """Hold off sync_to's fsync (rotate, flush and close fsync and may close the fd)."""
        with self._sync_cond:
            while self._syncing:
                self._sync_cond.wait()
            self._syncing = True
        try:
            yield
        finally:
            with self._sync_cond:
                self._syncing = False
                self._sync_cond.notify_all()

    def append_replicated(self, frames: list[tuple[int, int, bytes]]) -> int:
        """Write a leader's records ``(lsn, term, body)``, which must continue
        this log, in one write and one fsync whatever the policy (a follower's
        acknowledgement promises they are durable); returns the last LSN."""
        data = bytearray()
        for lsn, term, body in frames:
            if lsn != self.lsn + 1:
                raise ValueError(f"record lsn {lsn} does not follow lsn {self.lsn} of this log")
            data += encode_frame(lsn, body, term)
            self.lsn = lsn
        with self._io_lock:
            self._write(data)
            self._written_lsn = self.lsn
            self.bytes_since_snapshot += len(data)
            self._sync_locked()
        return self.lsn

    def _sync_locked(self) -> None:
        start = time.perf_counter()
        # fdatasync, as etcd and PostgreSQL sync their logs on Linux: it writes
        # the data and the metadata needed to read it back (the segment's
        # size), and skips only the timestamps an fsync would also flush (the
        # segment's directory entry was fsynced when it was created). A
        # record's sync takes about 200 us here against fsync's 300.
        os.fdatasync(self._open_fd)
        self._dirty = False
        self.durable_lsn = self._written_lsn
        if self.observe_sync is not None:
            self.observe_sync(time.perf_counter() - start)

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_interval_s):
            self.flush()

    def flush(self) -> None:
        with self._sync_excluded(), self._io_lock:
            if self._fd is not None and self._dirty:
                self._sync_locked()

    def rotate(self) -> int:
        """Close the current segment (fsynced) and start a new one; returns the
        LSN a snapshot built from the closed segments covers. A segment with
        no records yet is kept: every record up to the LSN is already closed."""
        with self._sync_excluded(), self._io_lock:
            self.bytes_since_snapshot = 0
            if self._segment_first > self.lsn:
                return self.lsn
            self._cut_to_records()  # a closed segment ends at its last record
            os.fsync(self._open_fd)
            self._dirty = False
            self.durable_lsn = self._written_lsn
            os.close(self._open_fd)
            self._open_segment(self.lsn + 1)
            return self.lsn

    def close(self) -> None:
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join()
        with self._sync_excluded(), self._io_lock:
            if self._fd is not None:
                self._cut_to_records()  # a clean restart finds no zeros to take for a torn tail
                os.fsync(self._fd)
                self.durable_lsn = self._written_lsn
                os.close(self._fd)
                self._fd = None
