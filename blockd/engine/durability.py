"""The engine's data directory: its lock, recovery, the log and the snapshot policy.

:class:`Durability` is what an engine with a data dir holds besides its
state. Opening it locks the directory (:mod:`blockd.storage.lock`: one
daemon per directory), reads it back through :class:`blockd.storage.reader.Reader`
(which verifies every byte: damage other than a torn tail of the last segment
raises :class:`~blockd.storage.reader.DataDirError` and nothing on disk changes),
replays it into the engine (:func:`recover`), then opens the write-ahead log
for appending and starts the snapshot policy (:class:`blockd.engine.snapshots.Snapshots`:
snapshots are built from the log by a compactor process, the engine only
rotates the log).

:meth:`Durability.log` appends one record of a term; a log that fails to
write stops the engine taking writes (fail-stop): memory would hold a batch
the disk does not, so every later mutation is refused until a restart
recovers the last durable state. It keeps the log's term history
(:class:`blockd.core.terms.TermHistory`) and tells an optional
:class:`LogObserver` (replication's in-memory tail of recent records) about
every record, replayed or appended.

For a replica that follows a leader (``docs/ha.md``):
:meth:`Durability.log_replicated` appends the leader's records as they are
(same LSN, term and bytes, one fsync per batch); :meth:`Durability.reopen`
re-reads the directory into a fresh state after the log was cut
(:meth:`truncate_after`) or replaced by the leader's snapshot
(:meth:`install_snapshot`), both through :mod:`blockd.storage.cut`, which keeps
a copy of what it removes. Not thread-safe: the engine calls it under its lock,
except :meth:`Durability.durable` (the wait for a record's fsync), which it
calls outside it so that concurrent steps share one fsync (group commit).

:class:`Acknowledgements` is the engine's last stage, the wait before an
answer leaves: for one record at a time, or for a batch of them that one
thread held back (:meth:`Acknowledgements.hold`: the step lane's loop,
:mod:`blockd.service.lane`, serves every lane connection on one thread and
acknowledges what one round of them changed with one fsync). That thread
may also hand the wait to a :class:`blockd.storage.fsyncer.Fsyncer` and poll
for its answer (:meth:`Acknowledgements.acknowledge_behind`), where no
replication commit has to be waited for.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

from blockd.core import InvariantViolation
from blockd.core.terms import TermHistory
from blockd.engine.config import EngineConfig, LogObserver, Replication
from blockd.engine.snapshots import Snapshots
from blockd.storage import bodies
from blockd.storage import cut as log_cut
from blockd.storage.fsyncer import Fsyncer
from blockd.storage.lock import DataDirLock
from blockd.storage.reader import DataDirError, Reader, Record
from blockd.storage.wal import WriteAheadLog

log = logging.getLogger("blockd.engine.machine")


class Held(threading.local):
    """Per thread: the highest LSN its held-back answers depend on (None: it holds none back)."""

    def __init__(self) -> None:
        self.lsn: int | None = None

    def release(self) -> int:
        """Stop holding back; the highest LSN of what was answered meanwhile (0: none)."""
        lsn, self.lsn = self.lsn, None
        return lsn or 0


class Acknowledgements:
    """The engine's wait before an answer leaves (a mixin of
    :class:`blockd.engine.machine.Engine`, which sets the three fields)."""

    _durability: Durability | None
    _gate: Replication | None
    _held: Held

    def _committed(self, lsn: int) -> int:
        """Return once ``lsn`` is fsynced here (group commit) and committed, with the leader
        term it is acknowledged in (0 without replication): every answer and Watch delta waits here.
        While this thread holds its answers back (:meth:`hold`), only remembers ``lsn``."""
        held = self._held
        if held.lsn is not None:
            held.lsn = max(held.lsn, lsn)
            return 0
        if self._durability is not None and lsn:
            self._durability.durable(lsn)
        if self._gate is not None:
            return self._gate.committed(lsn)
        return 0

    def hold(self) -> Held | None:
        """From now until :meth:`Held.release`, this thread's changes are answered
        at once, without the wait (their answers say term 0), and nothing they
        answer may leave until :meth:`acknowledge` of the LSN ``release`` returns.
        None, and nothing held, where no answer ever waits (no log, no replication)."""
        if self._durability is None and self._gate is None:
            return None
        held = self._held
        assert held.lsn is None, "hold() before the last one was released"
        held.lsn = 0
        return held

    def waits(self, lsn: int) -> bool:
        """Whether :meth:`acknowledge` of ``lsn`` may wait (an fsync, a replication ack) or raise."""
        durability = self._durability
        return self._gate is not None or (durability is not None and lsn > 0 and not durability.is_durable(lsn))

    def acknowledge(self, lsn: int) -> int:
        """The wait :meth:`_committed` skipped for a held batch whose last LSN is ``lsn``:
        the term its answers are acknowledged in (0 without replication). Raises as
        :meth:`_committed` does (a failed fsync, NOT_LEADER), and then none of them may leave."""
        assert self._held.lsn is None, "acknowledge() once the hold is released"
        return self._committed(lsn)

    @property
    def syncs_behind(self) -> bool:
        """Whether :meth:`acknowledge_behind` can stand in for :meth:`acknowledge`:
        a log and no replication (whose commit is a wait for the followers, on a thread)."""
        return self._durability is not None and self._gate is None

    def acknowledge_behind(self, lsn: int, fsyncer: Fsyncer) -> bool:
        """:meth:`acknowledge` of ``lsn`` without the wait (only where
        :attr:`syncs_behind`): ``fsyncer`` fsyncs, and its answers may leave once
        :meth:`acknowledged_behind` of an LSN at or past ``lsn`` returned (their
        term is 0). False when ``lsn`` is durable already: they may leave now.
        Raises as :meth:`acknowledge` does (a broken log)."""
        assert self._held.lsn is None, "acknowledge_behind() once the hold is released"
        assert self._durability is not None and self._gate is None, "acknowledge_behind() where syncs_behind"
        return self._durability.durable_behind(lsn, fsyncer)

    def acknowledged_behind(self, lsn: int, error: int, seconds: float) -> None:
        """What the fsyncer of :meth:`acknowledge_behind` said (:meth:`blockd.storage.fsyncer.Fsyncer.done`):
        returns when every answer up to ``lsn`` may leave, raises when none may."""
        assert self._durability is not None, "acknowledged_behind() where syncs_behind"
        self._durability.synced_behind(lsn, error, seconds)


class Replayable(Protocol):
    """What recovery replays into (the engine)."""

    def load_snapshot(self, snapshot: dict) -> None: ...

    def apply_record(self, body: dict) -> None: ...

    def num_pools(self) -> int: ...


def recover(reader: Reader, state: Replayable, observe: Callable[[Record], None] | None = None) -> None:
    """Load the newest snapshot and replay the later records into ``state``
    through the same code paths as live requests, so pools, tables, ref
    counts, the prefix index and its LRU order, versions, event numbers and
    the idempotency table come back exactly. Raises DataDirError on damage,
    including a snapshot that does not load or a record that does not apply.
    ``observe`` sees each record once it applied; ``reader.terms`` is the
    term history afterwards."""
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
        if observe is not None:
            observe(record)
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
        #: which term wrote which records (the snapshot's history, then every record's)
        self.terms = TermHistory()
        #: the newest snapshot's LSN when the directory was last read
        self.snapshot_lsn = 0
        self._observer: LogObserver | None = config.log_observer
        self._lock: DataDirLock | None = None
        self._wal: WriteAheadLog | None = None
        self._snapshots: Snapshots | None = None

    @property
    def last_lsn(self) -> int:
        return self._wal.lsn if self._wal is not None else 0

    def open(self, state: Replayable) -> None:
        """Lock the directory, recover it into ``state``, open the log. On any
        failure the lock is released (so the same process may try again) and
        nothing on disk has changed."""
        # one daemon per data dir, locked before anything in it is read
        self._lock = DataDirLock(self.data_dir)
        try:
            self._load(state)
        except BaseException:
            self._lock.release()
            raise

    def _load(self, state: Replayable) -> None:
        reader = Reader(self.data_dir)
        observer = self._observer
        if observer is not None:
            observer.reset(reader.snapshot_lsn)
        recover(reader, state, None if observer is None else lambda r: observer.record(r.lsn, r.term, r.raw))
        reader.clean_up()  # only after everything replayed: a refusal changes nothing on disk
        self.terms, self.snapshot_lsn = reader.terms, reader.snapshot_lsn
        cfg = self.config
        self._wal = WriteAheadLog(self.data_dir, reader.last_lsn, cfg.fsync, cfg.fsync_interval_s,
                                  cfg.observe_wal_sync)
        self._wal.open_for_append()
        # snapshot policy: see Snapshots; the compactor must replay as this engine does
        self._snapshots = Snapshots(self._wal, cfg.snapshot_every, cfg.snapshot_log_ratio, cfg.idempotency,
                                    on_snapshot=self._snapshotted)
        self._snapshots.recovered(reader)  # a crash loop must not outrun the snapshots

    def _snapshotted(self, lsn: int) -> None:
        self.snapshot_lsn = max(self.snapshot_lsn, lsn)
        if self._observer is not None:
            self._observer.snapshotted(lsn)

    def log(self, body: dict, term: int = 0, defer_sync: bool = False) -> int:
        """Append one record of ``term`` (durable per the fsync policy when
        this returns, or with ``defer_sync`` once :meth:`durable` returns for
        it: the engine waits there, outside its lock, so steps share an
        fsync); its LSN."""
        assert self._wal is not None and self._snapshots is not None, "log() before open()"
        data = bodies.encode(body)
        observer = self._observer
        # followers get the record while this log fsyncs it: nothing is
        # acknowledged before both are durable (a step waits for this call,
        # then for the commit), and a record only the followers kept is one
        # a crash of this leader left unacknowledged, retried by request id
        written = None if observer is None else lambda lsn: observer.record(lsn, term, data)
        try:
            lsn = self._wal.append(data, term, written, defer_sync)
        except OSError as err:
            raise self._break(err) from err
        self.terms.observe(term, lsn)
        self._snapshots.logged()
        return lsn

    def log_replicated(self, frames: list[tuple[int, int, bytes]]) -> int:
        """Append a leader's records ``(lsn, term, body)`` as they are, fsynced
        whatever the policy; the last LSN."""
        assert self._wal is not None and self._snapshots is not None, "log_replicated() before open()"
        if not frames:
            return self._wal.lsn
        terms = self.terms.copy()
        for lsn, term, _ in frames:
            terms.observe(term, lsn)  # ValueError before anything is written: terms never go down
        try:
            last = self._wal.append_replicated(frames)
        except OSError as err:
            raise self._break(err) from err
        self.terms = terms
        for lsn, term, body in frames:
            if self._observer is not None:
                self._observer.record(lsn, term, body)
            self._snapshots.logged()
        return last

    def is_durable(self, lsn: int) -> bool:
        """Whether record ``lsn`` is already as durable as the policy makes it (:meth:`durable` returns at once)."""
        wal = self._wal
        return not self.broken and (wal is None or wal.synced(lsn))

    def durable(self, lsn: int) -> None:
        """Return once record ``lsn`` is as durable as the fsync policy makes it
        (group commit: :meth:`blockd.storage.wal.WriteAheadLog.sync_to`). A
        failed fsync breaks the log (fail-stop) and raises."""
        self._sync(lsn, lambda wal: wal.sync_to(lsn))

    def durable_behind(self, lsn: int, fsyncer: Fsyncer) -> bool:
        """:meth:`durable` without the wait: ``fsyncer`` syncs, and what it says goes
        to :meth:`synced_behind`. False when ``lsn`` is durable already."""
        return self._sync(lsn, lambda wal: wal.sync_behind(lsn, fsyncer))

    def _sync(self, lsn: int, sync: Callable[[WriteAheadLog], bool | None]) -> bool:
        """``sync`` the log for ``lsn`` unless it is durable already (False); a
        broken log refuses, and a failed fsync breaks it (fail-stop)."""
        wal = self._wal
        if wal is None or wal.durable_lsn >= lsn:
            return False
        if self.broken:
            raise InvariantViolation(self.broken)
        try:
            return sync(wal) is not False
        except OSError as err:
            raise self._break(err) from err

    def synced_behind(self, lsn: int, error: int, seconds: float) -> None:
        """What an fsyncer asked by :meth:`durable_behind` said: records up to ``lsn``
        are durable (``error`` 0), or its fsync failed, which breaks the log
        (fail-stop) and raises. A log broken meanwhile raises too: after a failed
        fsync a later one that succeeds does not vouch for the pages the first lost."""
        if error:
            raise self._break(OSError(error, f"fdatasync: {os.strerror(error)}"))
        if self.broken:
            raise InvariantViolation(self.broken)
        if self._wal is not None:
            self._wal.synced_behind(lsn, seconds)

    def _break(self, err: OSError) -> InvariantViolation:
        self.broken = f"the write-ahead log failed ({err}); restart blockd to recover"
        log.critical(self.broken)
        return InvariantViolation(self.broken)

    def sync(self) -> None:
        """Make every record logged so far durable (whatever the policy)."""
        if self._wal is not None:
            self._wal.flush()

    def snapshot(self, engine_lock: threading.RLock) -> None:
        """Write a snapshot of everything logged so far and wait for it."""
        if self._snapshots is not None:
            self._snapshots.take_now(engine_lock)

    def wait(self) -> None:
        """Wait for a compaction under way (a graceful shutdown lets it finish)."""
        if self._snapshots is not None:
            self._snapshots.wait()

    # --- a follower's log, cut or replaced (docs/ha.md) ----------------------------------
    def reopen(self, state: Replayable, change: Callable[[], object] | None = None) -> None:
        """Close the log, run ``change`` on the directory (the lock stays
        held), and read it back into ``state`` (which must be empty) -- also
        when ``change`` raises, which is then re-raised."""
        self.wait()
        if self._wal is not None:
            self._wal.close()
            self._wal = None
        try:
            if change is not None:
                change()
        finally:
            self.broken = ""
            self._load(state)

    def cut_after(self, lsn: int, why: str) -> None:
        """For :meth:`reopen`: cut the records after ``lsn`` (kept in
        quarantine); :class:`blockd.storage.cut.CannotTruncate` when the snapshot
        covers them (nothing changed)."""
        assert self._wal is None, "cut the log only while it is closed (reopen)"
        log_cut.truncate_after(self.data_dir, lsn, why)

    def replace_with_snapshot(self, path: str, name: str, why: str) -> None:
        """For :meth:`reopen`: make the verified snapshot file at ``path``
        (to be called ``name``) the whole log (the old files go to quarantine)."""
        assert self._wal is None, "replace the log only while it is closed (reopen)"
        log_cut.replace_with_snapshot(self.data_dir, path, name, why)

    def close(self) -> None:
        """Flush and close the log, then unlock the directory."""
        try:
            if self._wal is not None:
                self._wal.close()
        finally:
            if self._lock is not None:
                self._lock.release()
