"""Compaction: snapshot L built from the previous snapshot and the closed log.

The daemon never captures its state for a snapshot: it rotates the log at L
(cheap, under its lock) and runs ``blockd compact DIR --upto L`` as a child
process, which replays the previous snapshot plus the segments up to L with
the same code recovery uses (:meth:`blockd.engine.Engine.replayed`), writes
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
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from blockd.datadir import DataDirError, Reader, remove_tmp
from blockd.idempotency import IdempotencyLimits
from blockd.wal import COMPACT_LOCK, DirLock, WriteAheadLog, remove_replaced, write_snapshot

log = logging.getLogger("blockd.compact")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CompactionFailed(Exception):
    pass


@dataclass(frozen=True)
class Compacted:
    lsn: int
    size: int  #: bytes of the snapshot written; 0 when one already covered ``lsn``
    seconds: float


def _nowhere(point: str) -> None:
    pass


def compact(data_dir: str, upto_lsn: int | None = None, *, prune: bool = True,
            limits: IdempotencyLimits | None = None, at: Callable[[str], None] = _nowhere) -> Compacted:
    """Write snapshot ``upto_lsn`` (default: the last record) into ``data_dir``.

    Raises :class:`blockd.datadir.DataDirError` if what it reads is damaged
    (nothing is written then). ``prune`` removes the files the snapshot
    replaces; the daemon passes False and prunes itself once this returns.
    ``limits``: the idempotency table's, which must be the daemon's (the
    table is part of the snapshot and replay trims it by them).
    ``at(point)`` is called as the compaction passes each point where a crash
    must leave a recoverable directory (``"written"``: the temporary file is
    durable, not renamed; ``"renamed"``: the snapshot is in place, nothing
    pruned): the seam through which the crash tests kill it there.
    """
    from blockd.engine import Engine  # the engine runs compactions: import it late
    from blockd.engine_config import EngineConfig

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


def run_compactor(data_dir: str, upto_lsn: int, limits: IdempotencyLimits, nice: int = 10) -> Compacted:
    """:func:`compact` in a child process (``blockd compact``); waits for it."""
    argv = [sys.executable, "-m", "blockd.cli", "compact", data_dir, "--upto", str(upto_lsn), "--no-prune",
            "--nice", str(nice)]
    argv += ["--max-request-ids", str(limits.max_entries), "--max-request-bytes", str(limits.max_bytes),
             "--request-ttl-s", repr(limits.ttl_s)]
    env = {**os.environ, "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise CompactionFailed(f"the compactor failed ({how}){': ' + tail if tail else ''}")
    try:
        done = json.loads(proc.stdout.strip().splitlines()[-1])
        return Compacted(done["lsn"], done["bytes"], done["seconds"])
    except (ValueError, IndexError, KeyError) as err:
        raise CompactionFailed(f"the compactor's report did not parse ({err}): {proc.stdout[-200:]!r}") from None


class Snapshots:
    """The daemon's side: when to snapshot, and one compactor at a time.

    A snapshot is due after ``every`` log records since the last one (those
    replayed at start-up included: a daemon killed every few hundred records
    must still snapshot), once the log since it is at least ``log_ratio``
    times its size, so the cost of snapshots stays proportional to what was
    logged: replaying a byte of log costs about 4x loading a byte of snapshot
    (measured on decode steps and on 100k-sequence allocations), so at the
    default 0.25 replay takes about as long as loading the snapshot and a
    restart stays within ~2x the time to load the state. Call :meth:`logged`
    under the engine lock after each append.
    """

    def __init__(self, wal: WriteAheadLog, every: int, log_ratio: float, limits: IdempotencyLimits,
                 on_snapshot: Callable[[int], None] | None = None) -> None:
        self.wal, self.every, self.log_ratio, self.limits = wal, every, log_ratio, limits
        #: told the LSN of each snapshot once it is durable (and what it replaces pruned)
        self.on_snapshot = on_snapshot
        self.since_snapshot = 0
        self._thread: threading.Thread | None = None

    def recovered(self, reader: Reader) -> None:
        """Count what recovery found in the log; snapshot now if it is due."""
        self.since_snapshot = reader.records_after_snapshot
        self.wal.bytes_since_snapshot = reader.bytes_after_snapshot
        self.wal.last_snapshot_bytes = reader.snapshot_size
        if self._due():
            log.info("the log holds %d records since the last snapshot; compacting", self.since_snapshot)
            self._start()

    def logged(self) -> None:
        self.since_snapshot += 1
        if self._due():
            self._start()

    def _due(self) -> bool:
        return (self.since_snapshot >= self.every and (self._thread is None or not self._thread.is_alive())
                and self.wal.bytes_since_snapshot >= self.wal.last_snapshot_bytes * self.log_ratio)

    def _start(self) -> None:
        """Rotate the log (the only work done under the engine lock) and let a
        compactor process build the snapshot from the closed segments."""
        lsn = self.wal.rotate()
        self.since_snapshot = 0
        self._thread = threading.Thread(target=self._persist, args=(lsn,), name="blockd-snapshot", daemon=True)
        self._thread.start()

    def _persist(self, lsn: int, in_process: bool = False) -> None:
        """Snapshot ``lsn``, then prune what it replaces."""
        started = time.perf_counter()
        try:
            if in_process:
                done = compact(self.wal.data_dir, lsn, prune=False, limits=self.limits)
            else:
                done = run_compactor(self.wal.data_dir, lsn, self.limits)
            pruned = remove_replaced(self.wal.data_dir, lsn)
        except (CompactionFailed, DataDirError, OSError) as err:  # the log still holds everything
            log.error("snapshot at lsn %d failed (%s); the write-ahead log still covers it", lsn, err)
            return
        if done.size:
            self.wal.last_snapshot_bytes = done.size
        if self.on_snapshot is not None:
            self.on_snapshot(lsn)
        log.info("snapshot at lsn %d written in %.2fs (%d bytes; %d files it replaces removed)", lsn,
                 time.perf_counter() - started, done.size, len(pruned))

    def take_now(self, engine_lock) -> None:
        """A snapshot of everything logged so far, built in this process; returns when it is durable."""
        self.wait()
        with engine_lock:
            lsn = self.wal.rotate()
            self.since_snapshot = 0
        self._persist(lsn, in_process=True)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


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
