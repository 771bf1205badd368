"""``blockd compact``: snapshot L built from the previous snapshot and the closed log, in its own process.

The daemon never captures its state for a snapshot: it rotates the log at L
(cheap, under its lock) and runs ``blockd compact DIR --upto L`` as a child
process, which replays the previous snapshot plus the segments up to L with
the same code recovery uses (:meth:`blockd.engine.machine.Engine.replayed`), writes
snapshot L (temporary file, fsync, rename, directory fsync) and exits. No
lock or GIL is shared with the daemon, so steps keep flowing; the child runs
at a lower CPU priority. The daemon then prunes what L replaces.

Crash safety, at any point: before the rename, the previous snapshot and
every segment are still there (a stray ``.tmp`` is removed later by whoever
holds the compaction lock); after it, recovery takes snapshot L and treats
the segments it covers as stale until they are pruned. Two compactions
never run at once: each holds ``compact.lock`` (an ``flock``, released by
the kernel if the holder dies) from listing the directory to the rename.

A compactor started by the daemon never deletes anything (``--no-prune``):
the daemon prunes once its child has exited, and recovery prunes what the
newest snapshot made stale. So a daemon restarting while its previous life's
compactor still runs reads a directory that only ever gains a snapshot.
A graceful shutdown waits for a running compaction.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from blockd.engine.config import EngineConfig
from blockd.engine.idempotency import IdempotencyLimits
from blockd.engine.machine import Engine
from blockd.engine.snapshots import Compacted
from blockd.storage.lock import DirLock
from blockd.storage.reader import DataDirError, Reader, remove_tmp
from blockd.storage.wal import COMPACT_LOCK, remove_replaced, write_snapshot


def _nowhere(point: str) -> None:
    pass


def compact(data_dir: str, upto_lsn: int | None = None, *, prune: bool = True,
            limits: IdempotencyLimits | None = None, at: Callable[[str], None] = _nowhere) -> Compacted:
    """Write snapshot ``upto_lsn`` (default: the last record) into ``data_dir``.

    Raises :class:`blockd.storage.reader.DataDirError` if what it reads is damaged
    (nothing is written then). ``prune`` removes the files the snapshot
    replaces; the daemon passes False and prunes itself once this returns.
    ``limits``: the idempotency table's, which must be the daemon's (the
    table is part of the snapshot and replay trims it by them).
    ``at(point)`` is called as the compaction passes each point where a crash
    must leave a recoverable directory (``"written"``: the temporary file is
    durable, not renamed; ``"renamed"``: the snapshot is in place, nothing
    pruned): the seam through which the crash tests kill it there.
    """
    started = time.perf_counter()
    lock = DirLock(data_dir, COMPACT_LOCK)
    lock.acquire()
    try:
        remove_tmp(data_dir)
        covered = Reader(data_dir).snapshot_lsn
        if upto_lsn is not None and upto_lsn <= covered:
            return Compacted(upto_lsn, 0, time.perf_counter() - started)
        reader = Reader(data_dir, upto_lsn)
        engine = Engine.replayed(reader, EngineConfig(idempotency=limits or IdempotencyLimits()))
        lsn = reader.last_lsn
        if lsn <= covered:
            return Compacted(lsn, 0, time.perf_counter() - started)
        state = engine.capture()
        state["terms"] = reader.terms.dump()  # so a snapshot still tells which term wrote what
        size = write_snapshot(data_dir, state, lsn, before_rename=lambda: at("written"))
        at("renamed")
        if prune:
            remove_replaced(data_dir, lsn)
        return Compacted(lsn, size, time.perf_counter() - started)
    finally:
        lock.release()



def main(args) -> int:
    """``blockd compact``: prints one JSON line (lsn, bytes, seconds) on success."""
    if not os.path.isdir(args.data_dir):
        print(f"blockd compact: {args.data_dir}: no such directory", file=sys.stderr)
        return 2
    if args.nice:
        os.nice(args.nice)
    try:
        limits = IdempotencyLimits(args.max_request_ids, args.max_request_bytes, args.request_ttl_s)
        done = compact(args.data_dir, args.upto, prune=not args.no_prune, limits=limits)
    except DataDirError as err:
        print(f"blockd compact: cannot compact: {err}", file=sys.stderr)
        return 1
    print(json.dumps({"lsn": done.lsn, "bytes": done.size, "seconds": round(done.seconds, 3)}), flush=True)
    return 0
