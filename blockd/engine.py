"""The daemon's state machine: every pool, idempotency, durability, followers.

:class:`Engine` is what the gRPC servicer wraps; it imports no gRPC. It owns

* the pools by name (each a :class:`blockd.core.Pool`),
* the idempotency table (:mod:`blockd.idempotency`): a mutating request's id
  maps to its fingerprint and first result, so a retried request returns
  that result and changes nothing; bounded by count, bytes and age, with the
  age measured by the wall-clock time written into each log record,
* the write-ahead log (:mod:`blockd.wal`): a batch is applied in memory, then
  logged (and fsynced per policy), then acknowledged; a batch that fails is
  never logged, so it leaves no trace,
* the retained KV events and the condition that wakes Watch/Events streams,
* the worker registry (:mod:`blockd.workers`; in memory: workers re-register),
* each pool's identity (:mod:`blockd.identity`): its incarnation, the worker
  incarnations holding its KV and the sequences whose KV a worker restart lost
  (durable: the create and ``worker_joined`` records and the snapshots hold it).

Recovery loads the newest snapshot and replays the later records through the
same code paths, so pools, tables, ref counts, the prefix index and its LRU
order, versions, event numbers and the idempotency table come back exactly.
It reads through :class:`blockd.datadir.Reader`, which verifies every byte:
damage other than a torn tail of the last segment raises ``DataDirError`` and
nothing on disk changes. Snapshots are built from the log by a compactor
process (:mod:`blockd.compact`); the engine only rotates the log, so a
snapshot never holds the engine lock or the GIL for long.
All public methods are thread-safe (one engine lock: the GIL serialises the
allocator anyway, and one lock keeps the log in commit order).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice

from blockd.compact import Snapshots
from blockd.core import (
    AlreadyExists,
    BlockdError,
    ExtraKeys,
    InvalidArgument,
    InvariantViolation,
    KVEvent,
    NotFound,
    Op,
    Pool,
    PoolConfig,
    PoolStats,
    SnapshotRequired,
    StepResult,
    VersionDelta,
    WrongState,
)
from blockd.core.errors import shown
from blockd.core.incarnations import new_incarnation
from blockd.core.state import config_to_json, dump_pool, load_pool, op_from_json, op_to_json
from blockd.core.types import SequenceInfo, Snapshot, WorkerInfo, WorkerStatus
from blockd.core.validate import check_config, check_name
from blockd.datadir import DataDirError, Reader
from blockd.datadir_lock import DataDirLock
from blockd.idempotency import MISSING, IdempotencyLimits, IdempotencyTable, IdempotencyUsage, fingerprint
from blockd.identity import PoolIdentity, legacy_incarnation
from blockd.wal import WriteAheadLog
from blockd.workers import WorkerRegistry

log = logging.getLogger("blockd.engine")

#: KV events kept per pool for Events streams that resume
MAX_RETAINED_EVENTS = 65536
_WAIT_S = 0.25


class _PoolEntry:
    __slots__ = ("deleted", "events", "identity", "pool")

    def __init__(self, pool: Pool, identity: PoolIdentity) -> None:
        self.pool = pool
        self.identity = identity
        self.events: deque[KVEvent] = deque(maxlen=MAX_RETAINED_EVENTS)
        self.deleted = False

    def snapshot(self) -> Snapshot:
        return Snapshot(self.pool.version, self.pool.tables(), self.identity.incarnation)


class Engine:
    def __init__(self, data_dir: str | None = None, fsync: str = "always", fsync_interval_s: float = 0.05,
                 snapshot_every: int = 10000, snapshot_log_ratio: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 worker_timeout_s: float = 10.0, idempotency: IdempotencyLimits | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 observe_wal_sync: Callable[[float], None] | None = None,
                 observe_step: Callable[[str, list, str, float], None] | None = None) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._pools: dict[str, _PoolEntry] = {}
        #: request ids are stamped with ``wall_clock`` (seconds since the epoch:
        #: the times are logged and must mean something after a restart)
        self._requests = IdempotencyTable(idempotency, wall_clock)
        #: called as (pool, ops, outcome, seconds) after every step; outcome is
        #: "ok" or the lowercase status code name
        self.observe_step = observe_step
        self.workers = WorkerRegistry(clock, worker_timeout_s)
        self._closed = False
        self._broken = ""
        self._wal: WriteAheadLog | None = None
        self._snapshots: Snapshots | None = None
        # one daemon per data dir, locked before anything in it is read (and
        # unlocked if opening fails, so the same process may try again)
        self._datadir_lock = DataDirLock(data_dir) if data_dir is not None else None
        try:
            if data_dir is not None:
                reader = Reader(data_dir)
                self._recover(reader)  # verifies everything first: a refusal changes nothing on disk
                reader.clean_up()
                self._wal = WriteAheadLog(data_dir, reader.last_lsn, fsync, fsync_interval_s, observe_wal_sync)
                self._wal.open_for_append()
                # snapshot policy: see Snapshots; the compactor must replay as this engine does
                self._snapshots = Snapshots(self._wal, snapshot_every, snapshot_log_ratio, self._requests.limits)
                self._snapshots.recovered(reader)  # a crash loop must not outrun the snapshots
        except BaseException:
            if self._datadir_lock is not None:
                self._datadir_lock.release()
            raise

    @classmethod
    def replayed(cls, reader: Reader, **kwargs) -> Engine:
        """An in-memory engine holding what ``reader`` reads (a data directory,
        up to its ``upto_lsn``), replayed as recovery does; changes nothing on disk.
        Raises :class:`blockd.datadir.DataDirError` on damage."""
        engine = cls(**kwargs)
        engine._recover(reader)
        return engine

    # --- durability -------------------------------------------------------
    def _recover(self, reader: Reader) -> None:
        start = time.perf_counter()
        snapshot = reader.load_snapshot()
        if snapshot is not None:
            try:
                self._load_snapshot(snapshot)
            # a checksummed snapshot that does not load is damage all the same
            except Exception as err:  # noqa: BLE001
                raise DataDirError(reader.data_dir, reader.snapshot_name,
                                   f"snapshot does not load ({type(err).__name__}: {err})") from None
        replayed = 0
        for record in reader.records():
            try:
                self._apply_record(record.body)
            # whatever a record breaks (a KeyError, a core error), it is not the
            # state that was acknowledged: refuse rather than start from it
            except Exception as err:  # noqa: BLE001
                raise reader.error_at(record, f"record does not apply ({type(err).__name__}: {err})") from None
            replayed += 1
        log.info("recovered %d pools from %s (snapshot lsn %s, %d log records replayed, last lsn %d) in %.2fs",
                 len(self._pools), reader.data_dir, reader.snapshot_lsn if snapshot else "none",
                 replayed, reader.last_lsn, time.perf_counter() - start)

    def _load_snapshot(self, snapshot: dict) -> None:
        for data in snapshot["pools"]:
            name = data["config"]["name"]
            entry = _PoolEntry(load_pool(data), PoolIdentity.load(data["identity"]) if "identity" in data
                               else PoolIdentity(legacy_incarnation(name, snapshot["lsn"])))
            entry.events.extend(KVEvent(*e[:2], bytes.fromhex(e[2]), bytes.fromhex(e[3]), e[4],
                                        tuple(e[5])) for e in data.get("events", []))
            self._pools[entry.pool.config.name] = entry
        self._requests.load(snapshot["requests"])

    def _apply_record(self, record: dict) -> None:
        kind, rid = record["kind"], record.get("rid", "")
        subject = None  # what the request's fingerprint covers besides kind and pool
        if kind == "create_pool":
            subject = PoolConfig(**record["config"])
            result = self._create_pool(subject, record.get("incarnation")
                                       or legacy_incarnation(subject.name, record.get("lsn", 0)))
        elif kind == "delete_pool":
            result = self._delete_pool(record["pool"])
        elif kind == "step":
            subject = [op_from_json(o) for o in record["ops"]]
            result = self._run_step(self._pools[record["pool"]], subject)
        elif kind == "reset_prefix_cache":
            result = self._reset(record["pool"])
        elif kind == "worker_joined":
            result = self._worker_joined(record["pool"], record["worker_id"], record["incarnation"])
        else:
            raise ValueError(f"unknown log record kind {kind!r}")
        if rid:
            pool = subject.name if kind == "create_pool" else record["pool"]
            # the record's own time, never the clock now: replay rebuilds the same table
            self._requests.put(rid, self._fingerprint(kind, pool, subject), record.get("t", 0.0), result,
                               self._block_size(pool))

    def _log(self, record: dict) -> None:
        if self._wal is None:
            return
        try:
            self._wal.append(record)
        except OSError as err:
            # memory already holds a batch the disk does not: stop taking
            # writes (fail-stop); a restart recovers the last durable state
            self._broken = f"the write-ahead log failed ({err}); restart blockd to recover"
            log.critical(self._broken)
            raise InvariantViolation(self._broken) from err
        self._snapshots.logged()

    def _capture(self) -> dict:
        """The whole state as plain data (what a snapshot holds)."""
        pools = []
        for entry in self._pools.values():
            data = dump_pool(entry.pool)
            data["identity"] = entry.identity.dump()
            data["events"] = [[e.seq_no, e.kind, e.block_hash.hex(), e.parent_hash.hex(), e.block_id,
                               list(e.token_ids)] for e in entry.events]
            pools.append(data)
        return {"pools": pools, "requests": self._requests.dump()}

    def snapshot(self) -> None:
        """Write a snapshot now and wait for it (no-op without a data directory)."""
        if self._snapshots is not None:
            self._snapshots.take_now(self._lock)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for entry in self._pools.values():
                entry.deleted = True  # ends Watch/Events streams
            self._changed.notify_all()
        if self._snapshots is not None:
            self._snapshots.wait()
        with self._lock:
            try:
                if self._wal is not None:
                    self._wal.close()
            finally:
                if self._datadir_lock is not None:
                    self._datadir_lock.release()

    # --- idempotency ----------------------------------------------------------
    @staticmethod
    def _fingerprint(kind: str, pool: str, subject: object = None) -> str:
        """Kind, pool and a hash of the content (``subject``: a step's ops or a
        pool's config), computed alike for a live request and a replayed record."""
        return fingerprint(kind, pool, subject)

    def _idempotent(self, rid: str, kind: str, pool: str, run: Callable[[], object], record: Callable[[], dict],
                    subject: object = None):
        if rid:
            check_name(rid, "request_id")
        with self._lock:
            if self._closed:
                raise WrongState("blockd is shutting down; retry against the new instance")
            if self._broken:
                raise WrongState(self._broken)
            if rid:
                fp, now = self._fingerprint(kind, pool, subject), self._requests.stamp()
                found = self._requests.lookup(rid, fp, now)
                if found is not MISSING:
                    return found
            result = run()
            body = record()
            body["kind"] = kind
            if rid:
                body["rid"], body["t"] = rid, now
                self._requests.put(rid, fp, now, result, self._block_size(pool))
            self._log(body)
            self._changed.notify_all()
            return result

    def _block_size(self, name: str) -> int:
        entry = self._pools.get(name) if type(name) is str else None
        return entry.pool.block_size if entry is not None else 0

    def idempotency_usage(self) -> IdempotencyUsage:
        """Request ids kept, how many still hold their answer, and their bytes."""
        with self._lock:
            return self._requests.usage()

    # --- pools ------------------------------------------------------------------
    def _entry(self, name: str) -> _PoolEntry:
        entry = self._pools.get(name) if type(name) is str else None
        if entry is None:
            check_name(name, "pool")  # a name no pool can have is the caller's mistake
            raise NotFound(f"no pool named {shown(name)}; list pools to see which exist")
        return entry

    def _create_pool(self, config: PoolConfig, incarnation: str) -> PoolStats:
        check_config(config)  # a malformed config is INVALID_ARGUMENT whether or not the name is taken
        if config.name in self._pools:
            raise AlreadyExists(f"pool {shown(config.name)} already exists")
        entry = _PoolEntry(Pool(config), PoolIdentity(incarnation))
        self._pools[config.name] = entry
        return entry.identity.stats(entry.pool.stats())

    def create_pool(self, config: PoolConfig, request_id: str = "") -> PoolStats:
        if not isinstance(config, PoolConfig):
            raise InvalidArgument("create_pool takes a PoolConfig")
        incarnation = new_incarnation()
        return self._idempotent(request_id, "create_pool", config.name,
                                lambda: self._create_pool(config, incarnation),
                                lambda: {"config": config_to_json(config), "incarnation": incarnation}, config)

    def _delete_pool(self, name: str) -> None:
        entry = self._entry(name)
        entry.deleted = True
        del self._pools[name]
        self.workers.forget_pool(name)

    def delete_pool(self, name: str, request_id: str = "") -> None:
        self._idempotent(request_id, "delete_pool", name, lambda: self._delete_pool(name),
                         lambda: {"pool": name})

    def get_pool(self, name: str) -> PoolStats:
        with self._lock:
            entry = self._entry(name)
            return entry.identity.stats(entry.pool.stats())

    def pool_config(self, name: str) -> PoolConfig:
        with self._lock:
            return self._entry(name).pool.config

    def list_pools(self) -> list[PoolStats]:
        with self._lock:
            return [entry.identity.stats(entry.pool.stats()) for entry in self._pools.values()]

    # --- steps -----------------------------------------------------------------
    def _drain_events(self, entry: _PoolEntry) -> None:
        entry.events.extend(entry.pool.take_events())

    def _run_step(self, entry: _PoolEntry, ops: list[Op]) -> StepResult:
        result = entry.pool.step(ops)
        entry.identity.after_step(ops)
        self._drain_events(entry)
        return entry.identity.result(result)

    def _checked_entry(self, pool: str, ops: list[Op], planned: str) -> _PoolEntry:
        entry = self._entry(pool)
        entry.identity.check_planned(pool, planned)
        entry.identity.check_step(pool, ops)
        return entry

    def step(self, pool: str, ops: list[Op], request_id: str = "", *, dry_run: bool = False,
             incarnation: str = "") -> StepResult:
        """``incarnation``: the pool incarnation the caller planned against
        (refused when it is not the current one); empty: not checked."""
        if dry_run:  # answers what the batch would do; nothing is remembered or logged
            with self._lock:
                entry = self._checked_entry(pool, ops, incarnation)
                return entry.identity.result(entry.pool.step(ops, dry_run=True))

        def run() -> StepResult:
            return self._run_step(self._checked_entry(pool, ops, incarnation), ops)

        start, outcome = time.perf_counter(), "ok"
        try:
            return self._idempotent(request_id, "step", pool, run,
                                    lambda: {"pool": pool, "ops": [op_to_json(o) for o in ops]}, ops)
        except BlockdError as err:
            outcome = err.code.lower()
            raise
        except Exception:
            outcome = "internal"
            raise
        finally:
            # unknown pool names stay out of the metric labels
            if self.observe_step is not None and type(pool) is str and pool in self._pools:
                self.observe_step(pool, ops if isinstance(ops, (list, tuple)) else [], outcome,
                                  time.perf_counter() - start)

    def _reset(self, pool: str) -> None:
        entry = self._entry(pool)
        entry.pool.reset_prefix_cache()
        self._drain_events(entry)

    def reset_prefix_cache(self, pool: str, request_id: str = "") -> None:
        self._idempotent(request_id, "reset_prefix_cache", pool, lambda: self._reset(pool),
                         lambda: {"pool": pool})

    # --- reads -------------------------------------------------------------------
    def get_tables(self, pool: str, seq_ids: list[str]) -> tuple[int, dict[str, list[int]]]:
        with self._lock:
            p = self._entry(pool).pool
            if not seq_ids:
                return p.version, p.tables()
            return p.version, {seq_id: p.block_table(seq_id) for seq_id in seq_ids}

    def sequence_info(self, pool: str, seq_id: str) -> SequenceInfo:
        with self._lock:
            entry = self._entry(pool)
            seq = entry.pool.get_seq(seq_id)
            return SequenceInfo(seq.seq_id, len(seq.token_ids), seq.num_committed, list(seq.table),
                                seq.seq_id in entry.identity.lost)

    def lookup_prefix(self, token_ids: list[int], extra_keys: ExtraKeys, pools: list[str]) -> dict[str, int]:
        with self._lock:
            names = pools or list(self._pools)
            return {name: self._entry(name).pool.lookup_prefix(token_ids, extra_keys) for name in names}

    def check_invariants(self) -> None:
        from blockd.core import check_invariants

        with self._lock:
            for entry in self._pools.values():
                check_invariants(entry.pool)

    # --- followers ------------------------------------------------------------
    def watch(self, pool: str, from_version: int, should_stop: Callable[[], bool],
              incarnation: str = "") -> Iterator[Snapshot | VersionDelta]:
        """Deltas after ``from_version`` in order (a snapshot first when they are
        no longer retained, or when ``incarnation``, the follower's, is set and
        is not the pool's), then new ones as they commit."""
        with self._lock:
            entry = self._entry(pool)
            version = from_version
            if incarnation and incarnation != entry.identity.incarnation:
                pending: list = [entry.snapshot()]
            else:
                try:
                    pending = entry.pool.deltas_since(version)
                except SnapshotRequired:
                    pending = [entry.snapshot()]
        while True:
            for item in pending:
                yield item
                version = item.version
            with self._lock:
                while entry.pool.version == version and not entry.deleted and not should_stop():
                    self._changed.wait(_WAIT_S)
                if entry.deleted or should_stop():
                    return
                try:
                    pending = entry.pool.deltas_since(version)
                except SnapshotRequired:
                    pending = [entry.snapshot()]

    def events(self, pool: str, from_seq_no: int, should_stop: Callable[[], bool]) -> Iterator[KVEvent]:
        """KV events with ``seq_no > from_seq_no``, in order, waiting for new ones."""
        if type(from_seq_no) is not int or from_seq_no < 0:
            raise InvalidArgument(f"from_seq_no must be a non-negative int, got {shown(from_seq_no)}")
        with self._lock:
            entry = self._entry(pool)
            last = entry.pool.last_event_seq_no
            if from_seq_no > last:
                raise WrongState(f"event {from_seq_no} is ahead of pool {shown(pool)} (last is {last})")
            oldest = entry.events[0].seq_no if entry.events else last + 1
            if from_seq_no + 1 < oldest:
                raise WrongState(f"events after {from_seq_no} are no longer retained (oldest is {oldest}); "
                                 "rebuild from a table snapshot and resume from the latest event")
        seen = from_seq_no
        while True:
            with self._lock:
                while entry.pool.last_event_seq_no == seen and not entry.deleted and not should_stop():
                    self._changed.wait(_WAIT_S)
                if entry.deleted or should_stop():
                    return
                first = entry.events[0].seq_no if entry.events else seen + 1
                if seen + 1 < first:
                    raise WrongState(f"events after {seen} fell out of the retained window while the "
                                     "reader was slow; rebuild from a table snapshot and resume")
                batch = list(islice(entry.events, seen + 1 - first, None))
            for event in batch:
                yield event
                seen = event.seq_no

    # --- workers ----------------------------------------------------------------
    def pool_incarnation(self, name: str) -> str:
        with self._lock:
            return self._entry(name).identity.incarnation

    def _worker_joined(self, pool: str, worker_id: str, incarnation: str) -> int:
        entry = self._entry(pool)
        num_lost = entry.identity.join(entry.pool, worker_id, incarnation)
        self._drain_events(entry)
        return num_lost

    def register_worker(self, info: WorkerInfo) -> WorkerStatus:
        """A worker incarnation the pool has not seen is a logged mutation: the
        KV of every sequence of the pool is lost (:mod:`blockd.identity`)."""
        with self._lock:
            entry = self._entry(info.pool)
            self.workers.check(info, entry.pool.config)
            if not entry.identity.knows(info.incarnation):
                num_lost = self._idempotent(
                    "", "worker_joined", info.pool,
                    lambda: self._worker_joined(info.pool, info.worker_id, info.incarnation),
                    lambda: {"pool": info.pool, "worker_id": info.worker_id, "incarnation": info.incarnation})
                if num_lost:
                    log.warning("pool %r: worker %r registered as a new incarnation (%s); the KV of %d "
                                "sequences is lost and the prefix cache is cleared: steps naming them fail "
                                "with KV_LOST until they are freed", info.pool, info.worker_id,
                                info.incarnation, num_lost)
            return self.workers.register(info, entry.pool.config)

    def heartbeat(self, worker_id: str, applied_version: int) -> WorkerStatus:
        with self._lock:
            return self.workers.heartbeat(worker_id, applied_version)

    def list_workers(self, pool: str | None = None) -> list[WorkerStatus]:
        with self._lock:
            if pool:
                self._entry(pool)
            return self.workers.list(pool or None)
