"""When the daemon snapshots, and the compactor process that builds each snapshot.

The daemon never captures its state for a snapshot: :class:`Snapshots`
rotates the log at L (cheap, under the engine lock) and :func:`run_compactor`
runs ``blockd compact DIR --upto L`` (:mod:`blockd.offline.compact`) as a
child process, which replays the previous snapshot plus the segments up to L
with the same code recovery uses and writes snapshot L. No lock or GIL is
shared with the daemon, so steps keep flowing; the child runs at a lower CPU
priority. The daemon then prunes what L replaces. An explicit snapshot
(:meth:`Snapshots.take_now`, ``Engine.snapshot``) runs the same child and
waits for it, so there is one way a snapshot is made.

A compactor started by the daemon never deletes anything (``--no-prune``):
the daemon prunes once its child has exited, and recovery prunes what the
newest snapshot made stale. So a daemon restarting while its previous life's
compactor still runs reads a directory that only ever gains a snapshot.
A graceful shutdown waits for a running compaction. Crash safety of the
compaction itself: :mod:`blockd.offline.compact`.
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

from blockd.engine.idempotency import IdempotencyLimits
from blockd.storage.reader import DataDirError, Reader
from blockd.storage.wal import WriteAheadLog, remove_replaced

log = logging.getLogger("blockd.engine.snapshots")

#: the repository (or site-packages) root, put on the child's path so it imports this blockd
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CompactionFailed(Exception):
    pass


@dataclass(frozen=True)
class Compacted:
    lsn: int
    size: int  #: bytes of the snapshot written; 0 when one already covered ``lsn``
    seconds: float


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

    def _persist(self, lsn: int) -> None:
        """Snapshot ``lsn``, then prune what it replaces."""
        started = time.perf_counter()
        try:
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
        """A snapshot of everything logged so far (by the compactor process); returns when it is durable."""
        self.wait()
        with engine_lock:
            lsn = self.wal.rotate()
            self.since_snapshot = 0
        self._persist(lsn)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
