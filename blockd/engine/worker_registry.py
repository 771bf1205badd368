"""The worker registry: which worker holds which shard of which pool, and
whether it is alive.

Workers register with their shard (a layer range and a KV-head range, so a
tensor-parallel group shares one set of block ids) and heartbeat with the
version their table mirror has applied. A worker whose last heartbeat is
older than ``timeout_s`` is reported down. Kept in memory only: after a
daemon restart, a worker's heartbeat gets NOT_FOUND and it registers again.
(Which worker *incarnations* hold a pool's KV is durable pool state, kept by
:mod:`blockd.engine.incarnations`; this registry only says who is reachable now.)
The clock is injected so tests need not sleep.

A worker's address is what schedulers dial, so registration refuses one no
other host can reach (``0.0.0.0``, ``::``, port 0: see
:mod:`blockd.rpc.addresses`); an empty address registers a worker that serves
nothing (a follower only).
"""

from __future__ import annotations

from collections.abc import Callable

from blockd.core.errors import InvalidArgument, NotFound, shown
from blockd.core.types import MAX_DEVICE_LEN, PoolConfig, WorkerInfo, WorkerStatus
from blockd.core.validate import MAX_ID_LEN, check_int, check_name
from blockd.rpc.addresses import unroutable_reason


class WorkerRegistry:
    def __init__(self, clock: Callable[[], float], timeout_s: float) -> None:
        self._clock = clock
        self.timeout_s = timeout_s
        self._workers: dict[str, list] = {}  # id -> [info, last_heartbeat, applied_version]

    def check(self, info: WorkerInfo, config: PoolConfig) -> None:
        """Refuse a registration that does not fit the pool (changes nothing)."""
        check_name(info.worker_id, "worker_id")
        if type(info.incarnation) is not str or not info.incarnation:
            raise InvalidArgument("incarnation is required: a random id the worker process makes when it "
                                  "starts, so blockd can tell a restarted worker (whose KV is gone)")
        check_name(info.incarnation, "incarnation")
        if len(info.address) > MAX_ID_LEN or len(info.device) > MAX_DEVICE_LEN:
            raise InvalidArgument(f"worker address (at most {MAX_ID_LEN} characters) or device name "
                                  f"(at most {MAX_DEVICE_LEN}) is too long")
        reason = unroutable_reason(info.address) if info.address else None
        if reason is not None:
            raise InvalidArgument(f"worker {shown(info.worker_id)} registered address {shown(info.address)}, "
                                  f"which others cannot dial: {reason}; start the worker with --advertise-address "
                                  "HOST[:PORT] (env BLOCKD_WORKER_ADVERTISE_ADDRESS), e.g. its pod IP")
        check_int(info.layer_start, "layer_start", 0, config.num_layers - 1)
        check_int(info.layer_end, "layer_end", info.layer_start + 1, config.num_layers)
        check_int(info.kv_head_start, "kv_head_start", 0, config.num_kv_heads - 1)
        check_int(info.kv_head_end, "kv_head_end", info.kv_head_start + 1, config.num_kv_heads)
        check_int(info.pool_bytes, "pool_bytes", 0, 1 << 60)

    def register(self, info: WorkerInfo, config: PoolConfig) -> WorkerStatus:
        self.check(info, config)
        # re-registering (a restarted worker) replaces the old record
        self._workers[info.worker_id] = [info, self._clock(), 0]
        return self._status(info.worker_id)

    def heartbeat(self, worker_id: str, applied_version: int) -> WorkerStatus:
        record = self._workers.get(worker_id)
        if record is None:
            check_name(worker_id, "worker_id")
            raise NotFound(f"worker {shown(worker_id)} is not registered; register it again")
        check_int(applied_version, "applied_version", 0, 1 << 62)
        record[1] = self._clock()
        record[2] = applied_version
        return self._status(worker_id)

    def pool_of(self, worker_id: str) -> str | None:
        """The pool a registered worker serves; None for an unknown worker."""
        record = self._workers.get(worker_id)
        return record[0].pool if record is not None else None

    def _status(self, worker_id: str) -> WorkerStatus:
        info, last, applied = self._workers[worker_id]
        age = self._clock() - last
        return WorkerStatus(info, age <= self.timeout_s, age, applied)

    def list(self, pool: str | None = None) -> list[WorkerStatus]:
        return [self._status(w) for w, rec in self._workers.items() if pool is None or rec[0].pool == pool]

    def forget_pool(self, pool: str) -> None:
        for worker_id in [w for w, rec in self._workers.items() if rec[0].pool == pool]:
            del self._workers[worker_id]


__all__ = ["WorkerRegistry"]
