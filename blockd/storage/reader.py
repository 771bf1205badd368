"""Reading a data directory back, verifying every byte before anything is changed.

:class:`Reader` finds the newest snapshot and the segments after it, checks
the snapshot's checksum, every segment header, every frame's header and body
checksums and that LSNs run on without a gap from the snapshot to the end,
and yields the records in order. It changes nothing; what recovery changes
(removing the torn tail, stray temporary files) happens in :meth:`Reader.clean_up`,
which the caller runs only after every record has been replayed.

One kind of damage is accepted, because a crash produces it and nothing
acknowledged is in it: a *torn tail* at the end of the *last* segment --
trailing zero bytes, a frame cut short by the end of the file, or a final
frame whose checksum fails and ends in a zero byte (an unwritten page; a
JSON body ends in ``}``) with only zeros after it, or whose header fails with
only zeros after it (the live segment is zero-filled ahead of its records,
:mod:`blockd.storage.wal`, so a write that stopped part way is followed by
zeros rather than by the end of the file). Anything else
raises :class:`DataDirError` naming the file, the byte offset and the record.
Imports only the standard library (the formats are in :mod:`blockd.storage.wal`).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from blockd.core.terms import TermHistory
from blockd.storage import bodies
from blockd.storage.lock import DirLock
from blockd.storage.wal import (
    COMPACT_LOCK,
    FORMAT,
    FRAME,
    FRAME_V2,
    LEGACY_FRAME,
    MAX_RECORD_BYTES,
    READABLE_FORMATS,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    SNAPSHOT_HEADER,
    SNAPSHOT_MAGIC,
    TMP_SUFFIX,
    fsync_dir,
    parse_name,
)

log = logging.getLogger("blockd.storage.reader")

#: a torn tail of zeros only: what a stop without a close leaves of the live segment's zero-filled end
ZERO_TAIL = "trailing zero bytes"



class DataDirError(Exception):
    """Damage that recovery refuses to guess about.

    ``offset`` is where a repair could cut the log (the start of the bad
    record or segment), or None when cutting would not help (a snapshot)."""

    def __init__(self, data_dir: str, name: str, reason: str, offset: int | None = None,
                 record: str = "") -> None:
        self.data_dir, self.name, self.reason, self.offset, self.record = data_dir, name, reason, offset, record
        where = os.path.join(data_dir, name) + (f" at byte {offset}" if offset is not None else "")
        super().__init__(f"{where}{f' ({record})' if record else ''}: {reason}")

    @property
    def cuttable(self) -> bool:
        return self.offset is not None


def advice(err: DataDirError, checked: bool = False) -> str:
    """What an operator can do about ``err`` (``checked``: they ran check-data already)."""
    look = "" if checked else f"`blockd check-data {err.data_dir}` reports what is there; "
    if err.cuttable:
        return (f"{look}`blockd repair-data {err.data_dir} --truncate-at-first-bad` cuts the log at the first "
                "bad record, keeping a copy of what it cuts")
    return f"{look}the damage is not in the log, so cutting the log cannot help: restore the directory from a backup"


@dataclass
class Record:
    lsn: int
    body: dict
    segment: str
    offset: int
    index: int  #: 0-based position in its segment
    term: int = 0  #: the leader term that wrote it (0 before format 3, or without --etcd)
    raw: bytes = b""  #: the body as stored (what replication sends on)

    def where(self) -> str:
        return f"record lsn {self.lsn}, #{self.index} of the segment"


@dataclass
class SegmentInfo:
    name: str
    first_lsn: int
    format: int = 0  #: 0 while unread or empty
    records: int = 0
    last_lsn: int = 0
    terms: tuple[int, int] = (0, 0)  #: lowest and highest term of its records
    size: int = 0
    read: bool = False
    stale: bool = False  #: wholly covered by the snapshot (a compaction stopped before deleting it)


@dataclass
class TornTail:
    segment: str
    offset: int
    size: int
    why: str


@dataclass
class _Listing:
    snapshot: tuple[int, str] | None = None
    old_snapshots: list[str] = field(default_factory=list)
    segments: list[tuple[int, str]] = field(default_factory=list)
    tmp: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def _list(data_dir: str) -> _Listing:
    found = _Listing()
    if not os.path.isdir(data_dir):
        return found
    snapshots: list[tuple[int, str]] = []
    for name in sorted(os.listdir(data_dir)):
        parsed = parse_name(name)
        if parsed is not None:
            (snapshots if parsed[0] == "snapshot" else found.segments).append((parsed[1], name))
        elif name.endswith(TMP_SUFFIX):
            found.tmp.append(name)
        else:
            found.ignored.append(name)
    if snapshots:
        lsns = [lsn for lsn, _ in snapshots]
        if len(set(lsns)) != len(lsns):
            dup = max(lsn for lsn in lsns if lsns.count(lsn) > 1)
            raise DataDirError(data_dir, f"snapshot-{dup:012d}.*", "two snapshots of the same LSN "
                               "(.json and .snap); move the one you do not trust out of the directory")
        found.snapshot = max(snapshots)
        found.old_snapshots = [name for lsn, name in sorted(snapshots)[:-1]]
    found.segments.sort()
    return found


class Reader:
    """One pass over a data directory (see the module docstring).

    With ``upto_lsn`` it stops after that record, which must exist, and allows
    no torn tail (a compaction reads closed segments only)."""

    def __init__(self, data_dir: str, upto_lsn: int | None = None) -> None:
        self.data_dir, self.upto_lsn = data_dir, upto_lsn
        self.snapshot_lsn, self.snapshot_name, self.snapshot_format, self.snapshot_size = 0, "", 0, 0
        self.segments: list[SegmentInfo] = []
        self.torn: TornTail | None = None
        self.last_lsn = 0
        #: which term wrote which records: the snapshot's history, then the records'
        self.terms = TermHistory()
        #: what recovery replays: records and frame bytes after the snapshot
        self.records_after_snapshot = self.bytes_after_snapshot = 0
        self.listing = listing = _list(data_dir)
        base = listing.snapshot[0] if listing.snapshot else 0
        self.snapshot_lsn = self.last_lsn = base
        self.snapshot_name = listing.snapshot[1] if listing.snapshot else ""
        # a segment that ends where the snapshot begins is stale: a compaction
        # was stopped before its files were pruned
        nexts = [lsn for lsn, _ in listing.segments[1:]] + [None]
        self.segments = [SegmentInfo(name, lsn, stale=nxt is not None and nxt <= base + 1)
                         for (lsn, name), nxt in zip(listing.segments, nexts)]

    def _read(self, name: str) -> bytes:
        try:
            with open(os.path.join(self.data_dir, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise DataDirError(self.data_dir, name, "the file went away while being read; is another process "
                               "pruning this directory (a daemon serving it)? Run the check again") from None

    # --- snapshot ---------------------------------------------------------
    def load_snapshot(self) -> dict | None:
        """The newest snapshot's state (checksum and LSN verified), or None."""
        if not self.snapshot_name:
            return None
        name = self.snapshot_name
        data = self._read(name)
        self.snapshot_size = len(data)

        def fail(reason: str) -> DataDirError:
            return DataDirError(self.data_dir, name, reason)

        if name.endswith(".json"):
            self.snapshot_format, body = 1, data
        else:
            if len(data) < SNAPSHOT_HEADER.size:
                raise fail(f"snapshot is {len(data)} bytes, shorter than its header")
            magic, version, crc, length = SNAPSHOT_HEADER.unpack_from(data)
            if magic != SNAPSHOT_MAGIC or version != 2:
                raise fail(f"not a snapshot of a known format (magic {magic!r}, version {version})")
            body = data[SNAPSHOT_HEADER.size:]
            if len(body) != length:
                raise fail(f"snapshot body is {len(body)} bytes, its header says {length}")
            if zlib.crc32(body) != crc:
                raise fail("snapshot checksum mismatch: the file is damaged")
            self.snapshot_format = version
        try:
            state = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise fail(f"snapshot does not parse as JSON ({err})") from None
        if not isinstance(state, dict) or state.get("lsn") != self.snapshot_lsn:
            raise fail(f"snapshot says lsn {state.get('lsn') if isinstance(state, dict) else '?'}, "
                       f"its name says {self.snapshot_lsn}")
        try:
            self.terms = TermHistory.load(state.get("terms", []))
        except ValueError as err:
            raise fail(f"snapshot's term history is not one ({err})") from None
        return state

    # --- records ----------------------------------------------------------
    def records(self) -> Iterator[Record]:
        """Every record after the snapshot, in LSN order, verified."""
        live = [s for s in self.segments if not s.stale]
        for i, seg in enumerate(live):
            if self.upto_lsn is not None and self.last_lsn >= self.upto_lsn:
                break
            is_last = i == len(live) - 1 and self.upto_lsn is None
            yield from self._segment(seg, self._read(seg.name), is_last)
        if self.upto_lsn is not None and self.last_lsn < self.upto_lsn:
            raise DataDirError(self.data_dir, live[-1].name if live else ".",
                               f"the log ends at lsn {self.last_lsn}, before lsn {self.upto_lsn} "
                               "that the compaction was asked to cover")

    def _segment(self, seg: SegmentInfo, data: bytes, is_last: bool) -> Iterator[Record]:
        seg.size, seg.read = len(data), True
        pos, seg.format = self._segment_header(seg, data, is_last)
        expected = self.last_lsn + 1
        if seg.first_lsn > expected:
            raise DataDirError(self.data_dir, seg.name, f"lsn gap: the snapshot and the segments before it end at "
                               f"lsn {self.last_lsn}, this segment starts at lsn {seg.first_lsn}", 0)
        # records the snapshot already covers (a compaction run offline covers
        # the last segment too) are verified and skipped
        covered = seg.first_lsn
        frame = {3: FRAME, 2: FRAME_V2}.get(seg.format, LEGACY_FRAME)
        while pos < len(data):
            if self.upto_lsn is not None and self.last_lsn >= self.upto_lsn:
                return
            parsed = self._frame(seg, data, pos, frame, is_last)
            if parsed is None:  # a torn tail: nothing after it counts
                return
            lsn, term, size, body, raw = parsed
            if covered < expected and lsn == covered:
                covered += 1
                seg.records += 1
                pos += size
                continue
            if lsn != expected:
                raise DataDirError(self.data_dir, seg.name, f"lsn {lsn} where lsn {expected} was expected "
                                   "(records out of order or missing)", pos, f"record #{seg.records} of the segment")
            try:
                self.terms.observe(term, lsn)
            except ValueError as err:
                raise DataDirError(self.data_dir, seg.name, f"record of term {term} after one of term "
                                   f"{self.terms.last_term} ({err})", pos, f"lsn {lsn}") from None
            seg.terms = (min(seg.terms[0], term) if seg.records else term, max(seg.terms[1], term))
            yield Record(lsn, body, seg.name, pos, seg.records, term, raw)
            seg.records += 1
            seg.last_lsn = self.last_lsn = lsn
            self.records_after_snapshot += 1
            self.bytes_after_snapshot += size
            expected += 1
            pos += size

    def _segment_header(self, seg: SegmentInfo, data: bytes, is_last: bool) -> tuple[int, int]:
        """(offset of the first frame, format) of a segment; format 0 for one
        without records whose header a crash kept from being written."""
        if not data:
            return 0, 0
        size = SEGMENT_HEADER.size
        if is_last and (not any(data) or (len(data) < size and SEGMENT_MAGIC.startswith(data[:8]))):
            self.torn = TornTail(seg.name, 0, len(data), "a segment header never written out")
            return len(data), 0
        # format 1 has no header; a header with a byte or two flipped is still one
        if sum(a == b for a, b in zip(data[:8], SEGMENT_MAGIC)) < 6:
            return 0, 1
        if len(data) < size:
            raise DataDirError(self.data_dir, seg.name, "segment header cut short: the file is damaged", 0)
        magic, version, first, crc = SEGMENT_HEADER.unpack_from(data)
        if zlib.crc32(data[:size - 4]) != crc or magic != SEGMENT_MAGIC:
            raise DataDirError(self.data_dir, seg.name, "segment header checksum mismatch: the file is damaged", 0)
        if version not in READABLE_FORMATS[1:]:
            raise DataDirError(self.data_dir, seg.name, f"segment format {version} is newer than this blockd "
                               f"reads ({FORMAT}); run the blockd that wrote it", 0)
        if first != seg.first_lsn:
            raise DataDirError(self.data_dir, seg.name, f"segment header says it starts at lsn {first}", 0)
        return size, version

    def _frame(self, seg: SegmentInfo, data: bytes, pos: int, frame, is_last: bool):
        """(lsn, term, frame size, record, body bytes) of the frame at ``pos``;
        None for a torn tail (recorded in ``self.torn``); raises on damage."""
        rest = len(data) - pos
        index = f"record #{seg.records} of the segment"

        def torn_or(reason: str, lsn: int | None = None) -> None:
            if is_last:
                self.torn = TornTail(seg.name, pos, rest, reason)
                return
            raise DataDirError(self.data_dir, seg.name, reason, pos, f"lsn {lsn}" if lsn else index)

        # no valid frame header is all zeros, so the scan to the end runs once
        if is_last and not any(data[pos:pos + frame.size]) and not any(data[pos:]):
            return torn_or(ZERO_TAIL)
        if rest < frame.size:
            return torn_or(f"a frame header cut short ({rest} of {frame.size} bytes)")
        term = 0
        if frame is FRAME:
            length, lsn, term, crc, head_crc = FRAME.unpack_from(data, pos)
        elif frame is FRAME_V2:
            length, lsn, crc, head_crc = FRAME_V2.unpack_from(data, pos)
        else:
            (length, crc), lsn = LEGACY_FRAME.unpack_from(data, pos), 0
        if frame is not LEGACY_FRAME and (zlib.crc32(data[pos:pos + frame.size - 4]) != head_crc
                                          or length > MAX_RECORD_BYTES):
            # a body is never all zeros: zeros from the header to the end are a header whose write
            # stopped part way, in the live segment's zero-filled end (blockd.storage.wal)
            if is_last and not any(data[pos + frame.size:]):
                return torn_or("a record header cut short, only zeros after it")
            raise DataDirError(self.data_dir, seg.name, "record header checksum mismatch: the file is "
                               "damaged", pos, index)
        end = pos + frame.size + length
        if end > len(data):
            return torn_or(f"a record cut short (its header says {length} bytes, {rest - frame.size} remain)",
                           lsn)
        body = data[pos + frame.size:end]
        if zlib.crc32(body) != crc:
            # only zeros after it: the end of the file, or the live segment's zero-filled end
            if is_last and body[-1:] == b"\x00" and not any(data[end:]):
                return torn_or("the last record's checksum fails and it ends in zero bytes (an unwritten page)")
            raise DataDirError(self.data_dir, seg.name, "record checksum mismatch: the file is damaged", pos,
                               f"lsn {lsn}" if lsn else index)
        try:
            record = bodies.decode(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise DataDirError(self.data_dir, seg.name, f"record does not parse ({err})", pos,
                               f"lsn {lsn}" if lsn else index) from None
        if not isinstance(record, dict):
            raise DataDirError(self.data_dir, seg.name, "record is not a JSON object", pos,
                               f"lsn {lsn}" if lsn else index)
        if frame is LEGACY_FRAME:
            lsn = record.pop("lsn", None)
            if type(lsn) is not int:
                raise DataDirError(self.data_dir, seg.name, "format-1 record without an lsn", pos, index)
            # what a follower is sent must replay exactly as here: without the lsn
            body = json.dumps(record, separators=(",", ":")).encode()
        return lsn, term, end - pos, record, body

    # --- after a successful replay ------------------------------------------
    def error_at(self, record: Record, reason: str) -> DataDirError:
        return DataDirError(self.data_dir, record.segment, reason, record.offset, record.where())

    def clean_up(self) -> None:
        """Remove the torn tail and stray temporary files. Call only after
        every record was replayed: until then, nothing may change on disk."""
        if self.torn is not None:
            path = os.path.join(self.data_dir, self.torn.segment)
            # zeros alone are the live segment's zero-filled end (blockd.storage.wal) after a stop
            # without a close (a kill, a crash): expected, so not a warning
            level = logging.INFO if self.torn.why == ZERO_TAIL else logging.WARNING
            log.log(level, "%s: truncating a torn tail at byte %d (%d bytes: %s; never acknowledged)",
                    path, self.torn.offset, self.torn.size, self.torn.why)
            with open(path, "r+b") as f:
                f.truncate(self.torn.offset)
                os.fsync(f.fileno())
        elif self.segments and not self.segments[-1].stale:
            # a new segment follows this one: what it holds must be durable
            # first, or a machine crash could leave a torn tail mid-log
            with open(os.path.join(self.data_dir, self.segments[-1].name), "rb") as f:
                os.fsync(f.fileno())
        # files the snapshot replaces: a compaction stopped before pruning them
        stale = [s.name for s in self.segments if s.stale]
        stale += list(self.listing.old_snapshots)
        for name in stale:
            log.info("removing %s (replaced by %s)", os.path.join(self.data_dir, name), self.snapshot_name)
            os.unlink(os.path.join(self.data_dir, name))
        if self.listing.tmp:
            # temporary files belong to a compaction; one still running (left
            # by the previous daemon) holds the lock and cleans up after itself
            lock = DirLock(self.data_dir, COMPACT_LOCK)
            if lock.acquire(timeout_s=0):
                try:
                    remove_tmp(self.data_dir)
                finally:
                    lock.release()
        if stale:
            fsync_dir(self.data_dir)


def remove_tmp(data_dir: str) -> None:
    """Delete leftovers of an interrupted snapshot write (hold the compaction lock)."""
    removed = False
    for name in os.listdir(data_dir):
        if name.endswith(TMP_SUFFIX):
            log.info("removing %s (a snapshot write that did not finish)", os.path.join(data_dir, name))
            os.unlink(os.path.join(data_dir, name))
            removed = True
    if removed:
        fsync_dir(data_dir)
