"""Cutting a data directory's log, the three ways blockd does it, safely.

* ``blockd repair-data --truncate-at-first-bad`` cuts at a damaged record
  (:mod:`blockd.offline.repair` finds where);
* a replica that follows a new leader cuts the records after the last one
  it shares with that leader (:func:`truncate_after`: the uncommitted tail
  of a deposed leader, ``docs/ha.md`` 2.5);
* a replica too far behind replaces its whole log with the leader's
  snapshot (:func:`replace_with_snapshot`).

Each keeps what it removes: a copy (or, for whole files, the file itself,
moved) goes to ``DIR/quarantine-<UTC time>[-reason]/`` with a README saying
why and how to undo it, and is durable before anything in the directory
changes. Each changes the directory in an order that leaves a readable log
after every step, should the process die half-way: later segments go first
(newest first), then the cut segment is truncated, so what remains is
always a prefix of the log that was there. Call with the daemon's lock
held and the log closed. Imports the formats (:mod:`blockd.storage.wal`) and the
reader (:mod:`blockd.storage.reader`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass

from blockd.storage.reader import Reader
from blockd.storage.wal import SEGMENT_HEADER, fsync_dir, parse_name

log = logging.getLogger("blockd.storage.reader")


@dataclass(frozen=True)
class Cut:
    """What a cut changes: ``truncate`` (a segment, or "") to ``offset``
    bytes, and ``move`` (whole segments) out of the directory."""

    truncate: str
    offset: int
    move: list[str]

    def describe(self) -> str:
        parts = [f"truncate {self.truncate} to {self.offset} bytes"] if self.truncate else []
        if self.move:
            parts.append(f"move away {', '.join(self.move)}")
        return " and ".join(parts) or "nothing"


class CannotTruncate(Exception):
    """The records to cut are inside the snapshot: only a new snapshot can replace them."""


def segments(data_dir: str) -> list[tuple[int, str]]:
    """``(first lsn, name)`` of every segment, in order."""
    return sorted((parsed[1], name) for name in os.listdir(data_dir)
                  if (parsed := parse_name(name)) and parsed[0] == "segment")


def plan_at(data_dir: str, segment: str, offset: int) -> Cut:
    """The cut that drops everything from byte ``offset`` of ``segment`` on."""
    listed = segments(data_dir)
    first = next(lsn for lsn, name in listed if name == segment)
    later = [name for lsn, name in listed if lsn > first]
    if offset <= SEGMENT_HEADER.size:
        # nothing of the segment stays: an empty husk would only be one more file
        return Cut("", 0, [segment, *later])
    return Cut(segment, offset, later)


def quarantine(data_dir: str, why: str, cut: Cut, label: str = "") -> str:
    """Copy what ``cut`` removes into a new quarantine directory (durably),
    then apply it (see the module docstring for the order); returns the
    quarantine directory."""
    qdir = _new_quarantine(data_dir, label)
    with open(os.path.join(qdir, "README.txt"), "w", encoding="utf-8") as f:
        f.write(f"blockd cut the log of {data_dir} because:\n  {why}\n")
        if cut.truncate:
            f.write(f"{cut.truncate} (a full copy is here) was truncated to {cut.offset} bytes.\n")
        if cut.move:
            f.write(f"Moved here whole: {', '.join(cut.move)}.\n")
        f.write("To undo: stop blockd, copy these files back over the data dir's own.\n")
    if cut.truncate:
        shutil.copy2(os.path.join(data_dir, cut.truncate), os.path.join(qdir, cut.truncate))
    for name in cut.move:
        shutil.copy2(os.path.join(data_dir, name), os.path.join(qdir, name))
    _sync_all(qdir)
    fsync_dir(data_dir)
    # only now that the copies are durable does anything in the data dir
    # change: later segments first, newest first, so every step leaves a prefix
    for name in sorted(cut.move, key=_removal_order):
        os.unlink(os.path.join(data_dir, name))
        fsync_dir(data_dir)
    if cut.truncate:
        with open(os.path.join(data_dir, cut.truncate), "r+b") as f:
            f.truncate(cut.offset)
            os.fsync(f.fileno())
    fsync_dir(data_dir)
    return qdir


def truncate_after(data_dir: str, lsn: int, why: str) -> Cut:
    """Cut every record after ``lsn`` (kept in quarantine); returns what was
    cut (nothing when the log ends at or before ``lsn``). Raises
    :class:`CannotTruncate` when the snapshot covers records after ``lsn``,
    and :class:`blockd.storage.reader.DataDirError` on damage (nothing changed)."""
    reader = Reader(data_dir)
    reader.load_snapshot()
    if reader.snapshot_lsn > lsn:
        raise CannotTruncate(f"the snapshot of {data_dir} covers lsn {reader.snapshot_lsn}, after lsn {lsn}")
    at: tuple[str, int] | None = None
    for record in reader.records():
        if record.lsn == lsn + 1:
            at = (record.segment, record.offset)
            break
    if at is None:
        return Cut("", 0, [])
    cut = plan_at(data_dir, *at)
    qdir = quarantine(data_dir, why, cut, "truncated")
    log.warning("%s: cut the log after lsn %d (%s); copies in %s", data_dir, lsn, cut.describe(), qdir)
    return cut


def replace_with_snapshot(data_dir: str, snapshot_path: str, snapshot_name: str, why: str) -> str:
    """Make the verified snapshot file at ``snapshot_path`` the whole
    directory: every segment and snapshot moves into quarantine (segments
    newest first, then snapshots newest first: a readable, shorter history
    at every step), then the new snapshot is renamed in. Returns the
    quarantine directory."""
    qdir = _new_quarantine(data_dir, "replaced")
    with open(os.path.join(qdir, "README.txt"), "w", encoding="utf-8") as f:
        f.write(f"blockd replaced the log of {data_dir} with the leader's {snapshot_name} because:\n  {why}\n"
                "These are the files it held before. To undo: stop blockd, move them back.\n")
    _sync_all(qdir)
    names = [n for n in os.listdir(data_dir) if parse_name(n) is not None]
    for name in sorted(names, key=_removal_order):
        os.rename(os.path.join(data_dir, name), os.path.join(qdir, name))
        fsync_dir(data_dir)
    fsync_dir(qdir)
    os.replace(snapshot_path, os.path.join(data_dir, snapshot_name))
    fsync_dir(data_dir)
    log.warning("%s: replaced the log with %s (%s); the old files are in %s", data_dir, snapshot_name, why, qdir)
    return qdir


def _removal_order(name: str) -> tuple[bool, int]:
    """Segments before snapshots, each newest first."""
    kind, lsn = parse_name(name) or ("", 0)
    return kind == "snapshot", -lsn


def _new_quarantine(data_dir: str, label: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    base = os.path.join(data_dir, f"quarantine-{stamp}{'-' + label if label else ''}")
    qdir, n = base, 1
    while os.path.exists(qdir):
        n += 1
        qdir = f"{base}-{n}"
    os.mkdir(qdir)
    return qdir


def _sync_all(qdir: str) -> None:
    for name in os.listdir(qdir):
        with open(os.path.join(qdir, name), "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(qdir)
