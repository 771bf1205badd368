"""Offline tools for a data directory: ``blockd check-data`` and ``blockd repair-data``.

``check-data`` replays the directory exactly as ``blockd serve`` would (the
same :class:`blockd.storage.reader.Reader` and engine replay), changes nothing, and
prints what it found: the snapshot, each segment with its record count and
LSNs, the torn tail if any, the pools. It exits 0 if the daemon would start,
1 with the daemon's own error if it would refuse. For a replica's directory
(``blockd serve --etcd``) it also shows the leader terms that wrote the log
(:mod:`blockd.core.terms`).

``repair-data --truncate-at-first-bad`` is the explicit, opt-in way past
damage: it cuts the log at the first bad record (the whole segment when its
header is bad, and every later segment), moving or copying everything it
cuts into ``DIR/quarantine-<UTC time>/`` with a note saying how to undo it.
It refuses while a daemon holds the directory, refuses without the flag
(printing what it would cut), and cannot help with a damaged snapshot (the
log it summarised is gone): that needs a backup.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, TextIO

from blockd.storage import cut as log_cut
from blockd.storage.lock import LOCK_NAME, DataDirLock, DataDirLocked, DirLock
from blockd.storage.reader import DataDirError, Reader, advice
from blockd.storage.wal import COMPACT_LOCK

if TYPE_CHECKING:
    from blockd.engine.machine import Engine

_LOCKS = (COMPACT_LOCK, LOCK_NAME)


def _replay(data_dir: str) -> tuple[Reader, Engine | None, DataDirError | None]:
    from blockd.engine.machine import Engine

    reader = Reader(data_dir)
    try:
        return reader, Engine.replayed(reader), None
    except DataDirError as err:
        return reader, None, err


def _describe(reader: Reader, out: TextIO) -> None:
    if reader.snapshot_name:
        size = f", {reader.snapshot_size} bytes" if reader.snapshot_format else ""
        fmt = f"format {reader.snapshot_format}, " if reader.snapshot_format else ""
        print(f"snapshot {reader.snapshot_name}: {fmt}lsn {reader.snapshot_lsn}{size}", file=out)
    else:
        print("snapshot: none (the log starts at lsn 1)", file=out)
    for seg in reader.segments:
        if seg.stale:
            print(f"segment {seg.name}: stale, replaced by the snapshot (blockd removes it on start)", file=out)
            continue
        if not seg.read:
            print(f"segment {seg.name}: not read (after the damage)", file=out)
            continue
        lsns = f", lsn {seg.first_lsn}-{seg.last_lsn}" if seg.last_lsn else ""
        low, high = seg.terms
        terms = "" if not high else f", term {high}" if low == high else f", terms {low}-{high}"
        line = (f"segment {seg.name}: format {seg.format or '-'}, {seg.records} records{lsns}{terms}, "
                f"{seg.size} bytes")
        torn = reader.torn
        if torn is not None and torn.segment == seg.name:
            line += (f"; torn tail at byte {torn.offset} ({torn.size} bytes: {torn.why}), never acknowledged: "
                     "blockd truncates it on start")
        print(line, file=out)
    for name in reader.listing.tmp:
        print(f"leftover {name}: an interrupted snapshot write (removed on start)", file=out)
    for name in reader.listing.old_snapshots:
        print(f"old snapshot {name}: replaced by the newest (removed on start)", file=out)
    for name in reader.listing.ignored:
        if name not in _LOCKS:
            print(f"ignored {name}: not a blockd data file", file=out)


def check(data_dir: str, out: TextIO) -> int:
    if not os.path.isdir(data_dir):
        print(f"{data_dir}: no such directory", file=out)
        return 2
    reader, engine, err = _replay(data_dir)
    print(f"data dir {data_dir}", file=out)
    _describe(reader, out)
    if err is not None:
        print(f"error: {err}", file=out)
        print(f"blockd would refuse to start with this error (nothing was changed): {advice(err, checked=True)}",
              file=out)
        return 1
    assert engine is not None, "a replay without an error gives an engine"
    print(f"last lsn {reader.last_lsn}; {reader.records_after_snapshot} records after the snapshot "
          f"({reader.bytes_after_snapshot} bytes) to replay", file=out)
    if reader.terms.runs():
        runs = ", ".join(f"term {term} from lsn {first}" for term, first in reader.terms.runs())
        print(f"leader terms (replication): {runs}; last term {reader.terms.last_term}", file=out)
    for stats in sorted(engine.list_pools(), key=lambda s: s.name):
        print(f"pool {stats.name}: version {stats.version}, {stats.num_seqs} sequences, "
              f"{stats.num_blocks - stats.num_free_blocks}/{stats.num_blocks} blocks not free", file=out)
    print("OK: blockd would start from this data dir", file=out)
    return 0


def repair(data_dir: str, truncate_at_first_bad: bool, out: TextIO) -> int:
    if not os.path.isdir(data_dir):
        print(f"{data_dir}: no such directory", file=out)
        return 2
    try:
        daemon = DataDirLock(data_dir, wait_s=0)
    except DataDirLocked as err:
        print(f"{err}; stop it before repairing", file=out)
        return 1
    compaction = DirLock(data_dir, COMPACT_LOCK)
    try:
        if not compaction.acquire(timeout_s=60):
            print(f"a compaction of {data_dir} is still running after 60 s; try again later", file=out)
            return 1
        return _repair_locked(data_dir, truncate_at_first_bad, out)
    finally:
        compaction.release()
        daemon.release()


def _repair_locked(data_dir: str, truncate_at_first_bad: bool, out: TextIO) -> int:
    cut = False
    for _ in range(3):
        reader, _engine, err = _replay(data_dir)
        if err is None:
            verb = "repaired" if cut else "nothing to repair"
            print(f"{verb}: blockd will start from {data_dir} at lsn {reader.last_lsn}", file=out)
            return 0
        print(f"error: {err}", file=out)
        if not err.cuttable:
            print("cutting the log cannot fix this (the damage is not in a log segment); restore the data "
                  "dir from a backup", file=out)
            return 1
        assert err.offset is not None, "only damage at an offset is cut"
        plan = log_cut.plan_at(data_dir, err.name, err.offset)
        if not truncate_at_first_bad:
            print(f"repair-data would {plan.describe()} (records from lsn {reader.last_lsn + 1} on), keeping "
                  "copies; pass --truncate-at-first-bad to do it", file=out)
            return 2
        qdir = log_cut.quarantine(data_dir, str(err), plan)
        print(f"cut: {plan.describe()}; copies of everything cut are in {qdir}", file=out)
        cut = True
    print("the data dir is still damaged after cutting the log; restore it from a backup", file=out)
    return 1
