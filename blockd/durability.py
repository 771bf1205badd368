"""The engine's data directory: its lock, recovery, the log and the snapshot policy.

:class:`Durability` is what an engine with a data dir holds besides its
state. Opening it locks the directory (:mod:`blockd.datadir_lock`: one
daemon per directory), reads it back through :class:`blockd.datadir.Reader`
(which verifies every byte: damage other than a torn tail of the last segment
raises :class:`~blockd.datadir.DataDirError` and nothing on disk changes),
replays it into the engine (:func:`recover`), then opens the write-ahead log
for appending and starts the snapshot policy (:class:`blockd.compact.Snapshots`:
snapshots are built from the log by a compactor process, the engine only
rotates the log).

:meth:`Durability.log` appends one record; a log that fails to write stops
the engine taking writes (fail-stop): memory would hold a batch the disk does
not, so every later mutation is refused until a restart recovers the last
durable state. Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from blockd.compact import Snapshots
from blockd.core import InvariantViolation
from blockd.datadir import DataDirError, Reader
from blockd.datadir_lock import DataDirLock
from blockd.engine_config import EngineConfig
from blockd.wal import WriteAheadLog

log = logging.getLogger("blockd.engine")


class Replayable(Protocol):
    """What recovery replays into (the engine)."""

    def load_snapshot(self, snapshot: dict) -> None: ...

    def apply_record(self, body: dict) -> None: ...

    def num_pools(self) -> int: ...


def recover(reader: Reader, state: Replayable) -> None:
    """Load the newest snapshot and replay the later records into ``state``
    through the same code paths as live requests, so pools, tables, ref
    counts, the prefix index and its LRU order, versions, event numbers and
    the idempotency table come back exactly. Raises DataDirError on damage,
    including a snapshot that does not load or a record that does not apply."""
    start = time.perf_counter()
    snapshot = reader.load_snapshot()
    if snapshot is not None:
        try:
            state.load_snapshot(snapshot)
        # a checksummed snapshot that does not load is damage all the same
        except Exception as err:  # noqa: BLE001
            raise DataDirError(reader.data_dir, reader.snapshot_name,
                               f"snapshot does not load ({type(err).__name__}: {err})") from None
    replayed = 0
    for record in reader.records():
        try:
            state.apply_record(record.body)
        # whatever a record breaks (a KeyError, a core error), it is not the
        # state that was acknowledged: refuse rather than start from it
        except Exception as err:  # noqa: BLE001
            raise reader.error_at(record, f"record does not apply ({type(err).__name__}: {err})") from None
        replayed += 1
    log.info("recovered %d pools from %s (snapshot lsn %s, %d log records replayed, last lsn %d) in %.2fs",
             state.num_pools(), reader.data_dir, reader.snapshot_lsn if snapshot else "none",
             replayed, reader.last_lsn, time.perf_counter() - start)


class Durability:
    """One engine's data directory (see the module docstring)."""

    def __init__(self, data_dir: str, config: EngineConfig) -> None:
        self.data_dir = data_dir
        self.config = config
        #: why the engine takes no more writes ("" while it does)
        self.broken = ""
        self._lock: DataDirLock | None = None
        self._wal: WriteAheadLog | None = None
        self._snapshots: Snapshots | None = None

    def open(self, state: Replayable) -> None:
        """Lock the directory, recover it into ``state``, open the log. On any
        failure the lock is released (so the same process may try again) and
        nothing on disk has changed."""
        # one daemon per data dir, locked before anything in it is read
        self._lock = DataDirLock(self.data_dir)
        try:
            reader = Reader(self.data_dir)
            recover(reader, state)  # verifies everything first: a refusal changes nothing on disk
            reader.clean_up()
            cfg = self.config
            self._wal = WriteAheadLog(self.data_dir, reader.last_lsn, cfg.fsync, cfg.fsync_interval_s,
                                      cfg.observe_wal_sync)
            self._wal.open_for_append()
            # snapshot policy: see Snapshots; the compactor must replay as this engine does
            self._snapshots = Snapshots(self._wal, cfg.snapshot_every, cfg.snapshot_log_ratio, cfg.idempotency)
            self._snapshots.recovered(reader)  # a crash loop must not outrun the snapshots
        except BaseException:
            self._lock.release()
            raise

    def log(self, body: dict) -> None:
        """Append one record (durable per the fsync policy when this returns)."""
        assert self._wal is not None and self._snapshots is not None, "log() before open()"
        try:
            self._wal.append(body)
        except OSError as err:
            self.broken = f"the write-ahead log failed ({err}); restart blockd to recover"
            log.critical(self.broken)
            raise InvariantViolation(self.broken) from err
        self._snapshots.logged()

    def snapshot(self, engine_lock: threading.RLock) -> None:
        """Write a snapshot of everything logged so far and wait for it."""
        if self._snapshots is not None:
            self._snapshots.take_now(engine_lock)

    def wait(self) -> None:
        """Wait for a compaction under way (a graceful shutdown lets it finish)."""
        if self._snapshots is not None:
            self._snapshots.wait()

    def close(self) -> None:
        """Flush and close the log, then unlock the directory."""
        try:
            if self._wal is not None:
                self._wal.close()
        finally:
            if self._lock is not None:
                self._lock.release()
