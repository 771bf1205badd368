"""The engine: the daemon's one lock around its state, and what each change goes through.

:class:`Engine` is what the gRPC servicer wraps; it imports no gRPC. Its
:class:`~blockd.engine.state.State` holds the pools and applies records; the
engine runs each caller's change as a record through, in order: the leader
gate (replication, through :class:`~blockd.engine.config.Replication`: a
replica that does not lead refuses, NOT_LEADER), the request-id table (a
retried id returns its first answer, :mod:`blockd.engine.idempotency`), the
guardrails and tenants' quotas (:mod:`blockd.engine.tenancy`), the state, the
log (:mod:`blockd.engine.durability`: applied in memory, then logged and
fsynced per policy, then acknowledged; a batch that fails is never logged),
the watchers (:mod:`blockd.engine.watch`), and, with replication, the wait
until the records the answer depends on are committed. A follower's engine is
fed the leader's records (:meth:`Engine.apply_replicated`) and re-read from
disk when its log is cut (:meth:`Engine.reload`). Workers register in memory
(:mod:`blockd.engine.worker_registry`); a worker incarnation a pool has not
seen is a logged change (:mod:`blockd.engine.incarnations`).

Set up by one :class:`~blockd.engine.config.EngineConfig`. All public methods
are thread-safe (one engine lock: the GIL serialises the allocator anyway, and
one lock keeps the log in commit order).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TypeVar

from blockd.core import BlockdError, ExtraKeys, InvalidArgument, KVEvent, Op, Pool, PoolConfig, PoolStats, StepResult
from blockd.core.errors import WrongState, shown
from blockd.core.incarnations import new_incarnation
from blockd.core.terms import TermHistory
from blockd.core.types import SequenceInfo, Snapshot, VersionDelta, WorkerInfo, WorkerStatus
from blockd.core.validate import check_config, check_name
from blockd.engine import records
from blockd.engine.config import EngineConfig
from blockd.engine.durability import Acknowledgements, Durability, Held, recover
from blockd.engine.idempotency import MISSING, IdempotencyTable, IdempotencyUsage
from blockd.engine.pools import PoolEntry, PoolMoves
from blockd.engine.retention.pins import CacheCalls
from blockd.engine.state import State
from blockd.engine.step_checks import check_previous_term, refuse_malformed
from blockd.engine.tenancy import Tenancy, check_access, owner_of, visible, with_owner
from blockd.engine.transfers import check_sources, has_sources, located_tokens, plan_transfers
from blockd.engine.watch import Watchers
from blockd.engine.worker_registry import WorkerRegistry
from blockd.storage import bodies
from blockd.storage.reader import Reader

log = logging.getLogger("blockd.engine.machine")

T = TypeVar("T")


# the prefix cache's calls (retention.pins); a pool's move (pools); the wait before an answer (durability)
class Engine(CacheCalls, PoolMoves, Acknowledgements):
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config if config is not None else EngineConfig()
        self._lock = threading.RLock()
        self._gate, self._held = config.replication, Held()
        self._watchers = Watchers(self._lock, self._log_position, self._committed)
        self.workers = WorkerRegistry(config.clock, config.worker_timeout_s)
        self._state = State(IdempotencyTable(config.idempotency, config.wall_clock), self.workers)
        self._tenancy = Tenancy(config.quotas, config.clock)
        self._closed = False
        self._durability: Durability | None = None
        if config.data_dir is not None:
            durability = Durability(config.data_dir, config)
            durability.open(self)
            self._durability = durability

    @classmethod
    def replayed(cls, reader: Reader, config: EngineConfig | None = None) -> Engine:
        """An in-memory engine holding what ``reader`` reads (a data directory,
        up to its ``upto_lsn``), replayed as recovery does; changes nothing on
        disk. ``config.data_dir`` is ignored. Raises
        :class:`blockd.storage.reader.DataDirError` on damage."""
        engine = cls(replace(config, data_dir=None) if config is not None else EngineConfig())
        recover(reader, engine)
        return engine

    # --- recovery (blockd.engine.durability.Replayable) ---------------------------------------
    def load_snapshot(self, snapshot: dict) -> None:
        self._state.load_snapshot(snapshot)

    def apply_record(self, body: dict) -> None:
        self._state.apply_record(body)

    def num_pools(self) -> int:
        return len(self._state.pools)

    def capture(self) -> dict:
        """The whole state as plain data (what a snapshot holds)."""
        with self._lock:
            return self._state.capture()

    def snapshot(self) -> None:
        """Write a snapshot now and wait for it (no-op without a data directory)."""
        if self._durability is not None:
            self._durability.snapshot(self._lock)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for entry in self._state.pools.values():
                entry.deleted = True  # ends Watch/Events streams
            self._watchers.notify()
        if self._durability is not None:
            self._durability.wait()
            with self._lock:
                self._durability.close()

    # --- changes -----------------------------------------------------------------------
    def _mutate_in_term(self, record: records.Record, rid: str = "",
                        check: Callable[[], object] | None = None) -> tuple[object, int]:
        """Apply ``record`` for a caller, remember ``rid``'s answer, log it, wake
        the watchers; a retried ``rid`` gets the first answer. ``check`` runs
        first, under the lock (a refusal changes nothing). With replication
        the answer leaves once its record is committed. Returns the answer and
        the leader term it was acknowledged in (0 without replication)."""
        if rid:
            check_name(rid, "request_id")
        with self._lock:
            result, lsn = self._apply_and_log(record, rid, check)
        return result, self._committed(lsn)

    def _apply_and_log(self, record: records.Record, rid: str = "",
                       check: Callable[[], object] | None = None) -> tuple[object, int]:
        """:meth:`_mutate_in_term` under the lock: ``(answer, the LSN it depends on)``."""
        if self._closed:
            raise WrongState("blockd is shutting down; retry against the new instance")
        if self._durability is not None and self._durability.broken:
            raise WrongState(self._durability.broken)
        if self._gate is not None:
            self._gate.writable()
        state = self._state
        if rid:
            now = state.requests.stamp()
            if state.requests.holds(rid, now):
                found = state.requests.lookup(rid, state.fingerprint(record), now, state.scope(record.pool))
                if found is not MISSING:
                    # the first answer's record is at or before the last one logged
                    return found, self._log_position()
        if check is not None:
            check()
        result = state.apply(record)
        if rid:
            # fingerprinted only once applied: a batch that fails never pays for its hash
            state.requests.put(rid, state.fingerprint(record), now, result, state.block_size(record.pool),
                               state.scope(record.pool))
        lsn = 0
        if self._durability is not None:  # in memory the record's body is never built
            body = records.encode(record, rid, now) if rid else records.encode(record)
            term = self._gate.term if self._gate is not None else 0
            # fsynced in _committed, outside the lock, so concurrent steps share one fsync
            lsn = self._durability.log(body, term, defer_sync=True)
        self._watchers.notify()
        return result, lsn

    def _log_position(self) -> int:
        """The LSN of the last record logged (0 without a data dir)."""
        return self._durability.last_lsn if self._durability is not None else 0

    def term(self) -> int:
        """The leader term this replica serves in now (0: not replicated, or not leading)."""
        return self._gate.term if self._gate is not None else 0

    def check_min_term(self, min_term: int) -> None:
        """Refuse (NOT_LEADER) a caller that has seen a newer term than this replica serves in."""
        if self._gate is not None and min_term and self._gate.term < min_term:
            raise self._gate.not_leader(f"this replica serves term {self._gate.term}, older than term {min_term} "
                                        "the caller has seen")

    def _guard(self, name: object) -> None:
        """Refuse another tenant's caller before the request table is read (a
        retried request id must not hand another tenant the first answer)."""
        with self._lock:
            entry = self._state.pools.get(name) if type(name) is str else None
            if entry is not None:
                check_access(entry.pool.config)

    def idempotency_usage(self) -> IdempotencyUsage:
        """Request ids kept, how many still hold their answer, and their bytes."""
        with self._lock:
            return self._state.requests.usage()

    # --- pools ---------------------------------------------------------------------------
    def create_pool(self, config: PoolConfig, request_id: str = "") -> PoolStats:
        if not isinstance(config, PoolConfig):
            raise InvalidArgument("create_pool takes a PoolConfig")
        config = with_owner(config)

        def check() -> None:  # before the pool is built: a pool over quota costs no memory
            check_config(config)
            self.config.guardrails.check_pool(config)
            self._tenancy.check_create(config, [entry.pool.config for entry in self._state.pools.values()])

        stats = self._mutate_in_term(records.CreatePool(config, new_incarnation()), request_id, check)[0]
        assert isinstance(stats, PoolStats), "a create record answers with the pool's stats"
        return stats

    def delete_pool(self, name: str, request_id: str = "") -> None:
        self._guard(name)
        self._mutate_in_term(records.DeletePool(name), request_id)

    def _read(self, read: Callable[[], T]) -> T:
        """``read()`` under the lock; with replication, only on the leader and
        only once what it saw is committed."""
        with self._lock:
            if self._gate is not None:
                self._gate.writable()
            value, lsn = read(), self._log_position()
        self._committed(lsn)
        return value

    def get_pool(self, name: str) -> PoolStats:
        return self._read(lambda: self._state.entry(name).stats())

    def pool_config(self, name: str) -> PoolConfig:
        return self._read(lambda: self._state.entry(name).pool.config)

    def pool_incarnation(self, name: str) -> str:
        return self._read(lambda: self._state.entry(name).identity.incarnation)

    def list_pools(self, *, local: bool = False) -> list[PoolStats]:
        """``local``: this replica's own state, whatever its role (metrics, logs)."""
        if local:
            with self._lock:
                return [entry.stats() for entry in self._state.pools.values()]
        return self._read(lambda: [entry.stats() for entry in self._state.pools.values() if visible(entry.pool.config)])

    # --- steps ---------------------------------------------------------------------------
    def _checked_entry(self, pool: str, ops: list[Op], planned: str, dry_run: bool = False) -> PoolEntry:
        entry = self._state.entry(pool)
        if planned and planned != entry.identity.incarnation:
            refuse_malformed(entry.pool, ops)  # the caller's mistake comes before the pool's history
        entry.identity.check_planned(pool, planned)
        entry.identity.check_step(pool, ops)
        config = entry.pool.config
        self._tenancy.check_step(config, ops, lambda: self._state.live_seqs(owner_of(config)), consume=not dry_run)
        check_sources(self._state, config, ops)
        return entry

    def step(self, pool: str, ops: list[Op], request_id: str = "", *, dry_run: bool = False,
             incarnation: str = "", previous_term: int = 0) -> StepResult:
        """``incarnation``: the pool incarnation the caller planned against
        (refused when it is not the current one); empty: not checked.
        ``previous_term``: the term its previous step was acknowledged in
        (:func:`blockd.engine.step_checks.check_previous_term`); 0: not checked."""
        if dry_run:  # answers what the batch would do; nothing is remembered or logged
            def would() -> StepResult:
                self.config.guardrails.check_step(ops)
                check_previous_term(self._gate, previous_term)
                entry = self._checked_entry(pool, ops, incarnation, dry_run=True)
                return entry.identity.result(entry.pool.step(ops, dry_run=True))

            return self._read(would)
        start, outcome = time.perf_counter(), "ok"
        try:
            self._guard(pool)
            def check() -> PoolEntry:
                self.config.guardrails.check_step(ops)
                check_previous_term(self._gate, previous_term)
                return self._checked_entry(pool, ops, incarnation)

            result, term = self._mutate_in_term(records.Step(pool, ops), request_id, check)
            assert isinstance(result, StepResult), "a step record answers with a StepResult"
            self.retain_committed(pool)  # an Allocate's retain_ttl_s (blockd.engine.retention.retain)
            if has_sources(ops):
                with self._lock:  # reads the source pool as it is now (blockd.engine.transfers)
                    result = plan_transfers(self._state, self.workers, ops, result)
            return replace(result, term=term) if term else result
        except BlockdError as err:
            outcome = err.code.lower()
            raise
        except Exception:
            outcome = "internal"
            raise
        finally:
            observe = self.config.observe_step
            # unknown pool names stay out of the metric labels
            if observe is not None and type(pool) is str and pool in self._state.pools:
                observe(pool, ops if isinstance(ops, (list, tuple)) else [], outcome, time.perf_counter() - start)

    # --- reads ---------------------------------------------------------------------------
    def get_tables(self, pool: str, seq_ids: list[str]) -> tuple[int, dict[str, list[int]]]:
        def read() -> tuple[int, dict[str, list[int]]]:
            p = self._state.entry(pool).pool
            if not seq_ids:
                return p.version, dict(sorted(p.tables().items()))  # by seq_id, as the protocol says
            return p.version, {seq_id: p.block_table(seq_id) for seq_id in seq_ids}

        return self._read(read)

    def sequence_info(self, pool: str, seq_id: str) -> SequenceInfo:
        def read() -> SequenceInfo:
            entry = self._state.entry(pool)
            seq = entry.pool.get_seq(seq_id)
            return SequenceInfo(seq.seq_id, len(seq.token_ids), seq.num_committed, list(seq.table),
                                seq.seq_id in entry.identity.lost)

        return self._read(read)

    def lookup_prefix(self, token_ids: list[int], extra_keys: ExtraKeys, pools: list[str], tiers: bool = False) -> dict:
        """Cached tokens per pool; ``tiers``: ``(cached, of them in the host tier)`` per pool."""
        def read() -> dict:
            names = pools or [name for name, entry in self._state.pools.items() if visible(entry.pool.config)]
            look = located_tokens if tiers else Pool.lookup_prefix
            return {name: look(self._state.entry(name).pool, token_ids, extra_keys) for name in names}

        return self._read(read)

    def check_invariants(self) -> None:
        with self._lock:
            self._state.check_invariants()

    # --- watchers -----------------------------------------------------------------------
    def watch(self, pool: str, from_version: int, should_stop: Callable[[], bool],
              incarnation: str = "", min_term: int = 0) -> Iterator[Snapshot | VersionDelta]:
        """See :meth:`blockd.engine.watch.Watchers.watch`; NOT_FOUND at once for an unknown pool.
        ``min_term``: the newest leader term that served the caller. Where a
        failover may lose committed records (``async``), a caller holding
        versions served in another term may hold versions this leader never
        had: it gets a snapshot first, never deltas on top of them."""
        entry = self._read(lambda: self._state.entry(pool))
        gate = self._gate
        resync = (gate is not None and from_version > 0 and min_term != gate.term and not gate.keeps_committed)
        return self._watchers.watch(entry, from_version, should_stop, incarnation, resync=resync)

    def events(self, pool: str, from_seq_no: int, should_stop: Callable[[], bool]) -> Iterator[KVEvent]:
        """See :meth:`blockd.engine.watch.Watchers.events`."""
        if type(from_seq_no) is not int or from_seq_no < 0:
            raise InvalidArgument(f"from_seq_no must be a non-negative int, got {shown(from_seq_no)}")
        entry = self._read(lambda: self._state.entry(pool))
        return self._watchers.events(entry, pool, from_seq_no, should_stop)

    # --- workers -------------------------------------------------------------------------
    def register_worker(self, info: WorkerInfo) -> WorkerStatus:
        """A worker incarnation the pool has not seen is a logged change: the
        KV of every sequence of the pool is lost (:mod:`blockd.engine.incarnations`)."""
        with self._lock:
            if self._gate is not None:
                self._gate.writable()
            entry = self._state.entry(info.pool)
            self.workers.check(info, entry.pool.config)
            lsn = self._log_position()
            if not entry.identity.knows(info.incarnation):
                num_lost, lsn = self._apply_and_log(records.WorkerJoined(info.pool, info.worker_id, info.incarnation))
                if num_lost:
                    log.warning("pool %r: worker %r registered as a new incarnation (%s); the KV of %d "
                                "sequences is lost and the prefix cache is cleared: steps naming them fail "
                                "with KV_LOST until they are freed", info.pool, info.worker_id,
                                info.incarnation, num_lost)
            status = self.workers.register(info, entry.pool.config)
        self._committed(lsn)
        return status

    def heartbeat(self, worker_id: str, applied_version: int) -> WorkerStatus:
        with self._lock:
            pool = self.workers.pool_of(worker_id)
            if pool is not None and pool in self._state.pools:
                self._state.entry(pool)  # only the pool's tenant (or an admin) speaks for its workers
            return self.workers.heartbeat(worker_id, applied_version)

    def list_workers(self, pool: str | None = None, *, local: bool = False) -> list[WorkerStatus]:
        """``local``: as :meth:`list_pools`."""
        def read() -> list[WorkerStatus]:
            if pool:
                self._state.entry(pool)
            pools = self._state.pools
            return [status for status in self.workers.list(pool or None)
                    if status.info.pool not in pools or visible(pools[status.info.pool].pool.config)]

        if local:
            with self._lock:
                return read()
        return self._read(read)

    # --- replication (docs/ha.md) ----------------------------------------------------------
    def log_state(self) -> tuple[int, TermHistory, int]:
        """``(last LSN, term history, newest snapshot's LSN)`` of the log (a copy)."""
        with self._lock:
            d = self._durability
            if d is None:
                return 0, TermHistory(), 0
            return d.last_lsn, d.terms.copy(), d.snapshot_lsn

    def begin_term(self, term: int, previous_term: int, leader: str, may_begin: Callable[[], bool]) -> int:
        """Log a new leader's first record (:class:`blockd.engine.records.TermStart`)
        if ``may_begin()`` still holds under the lock; its LSN (0: it did not)."""
        with self._lock:
            if self._durability is None or not may_begin():
                return 0
            body = records.encode(records.TermStart(term, previous_term, leader))
            lsn = self._durability.log(body, term)
            self._watchers.notify()
            return lsn

    def apply_replicated(self, frames: list[tuple[int, int, bytes]], may_apply: Callable[[], bool],
                         persisted: Callable[[int], None] = lambda lsn: None) -> int:
        """A follower's part: append the leader's records ``(lsn, term, body)``
        to the log as they are (fsynced), call ``persisted(last LSN)`` (the
        acknowledgement: it waits for the disk, not the apply), then apply them
        as recovery does; returns the last LSN persisted. Only while
        ``may_apply()`` holds under the lock. Every record is decoded before
        anything is written; a log or a record that fails leaves memory behind
        the disk, and the caller must :meth:`reload` (which fails as recovery would)."""
        with self._lock:
            durability = self._durability
            if durability is None or not may_apply():
                raise WrongState("this replica does not follow a leader now")
            if frames and frames[0][0] != durability.last_lsn + 1:
                raise WrongState(f"records from lsn {frames[0][0]} do not follow this log (at lsn "
                                 f"{durability.last_lsn})")
            decoded = [bodies.decode(body) for _lsn, _term, body in frames]
            last = durability.log_replicated(frames)
            persisted(last)
            for body in decoded:
                self.apply_record(body)
            self._watchers.notify()
            return last

    def reload(self, change: Callable[[Durability], object] | None = None) -> None:
        """Drop the state, run ``change(durability)`` on the data dir (a cut,
        a new snapshot) and read the directory back: the state is then exactly
        what is on disk. Open streams end. Raises what recovery raises."""
        with self._lock:
            durability = self._durability
            if durability is None:
                raise WrongState("an engine without a data dir has nothing to reload")
            for entry in self._state.pools.values():
                entry.deleted = True
            self._watchers.notify()
            self._state = State(IdempotencyTable(self.config.idempotency, self.config.wall_clock), self.workers)
            durability.reopen(self, None if change is None else lambda: change(durability))
