"""blockd in this process: the daemon's engine behind the SDK's calls, without gRPC.

:class:`InProcessBlockd` is a :class:`client.backends.BlockdBackend` (and
offers the SDK's reads the simulations need) over an in-memory
:class:`blockd.engine.machine.Engine`, the very state machine ``blockd serve`` runs:
the same batches, incarnations, watermark and errors. A failed call raises
the exception the SDK would have raised for the same failure over the wire
(built from the one error mapping, :func:`blockd.rpc.errors.error_parts`), so
:class:`client.scheduler.Scheduler` runs on it unchanged. Results are the
SDK's too: slot mappings and block lists come back as tuples.

What it leaves out: the network (no deadlines, no retries, so no request
ids) and durability (state in memory). For simulations, benchmarks of the
scheduler and demos.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import grpc

from blockd.core.errors import BlockdError
from blockd.core.hashing import NO_EXTRA_KEYS, ExtraKeys, HashSpec, hash_spec
from blockd.core.types import Op, PoolConfig, PoolStats, StepResult
from blockd.engine.machine import Engine
from blockd.engine.tenancy import owner_of
from blockd.rpc.errors import error_parts
from client.errors import error_for
from client.messages import checked_hash_spec

T = TypeVar("T")


def _copied(result: StepResult) -> StepResult:
    """The result as the SDK reads it off the wire: tuples nobody else holds."""
    # replace(), not a field list: every field the core adds (tier ops, restored and missed tokens) comes along
    results = tuple(replace(r, new_block_ids=tuple(r.new_block_ids), copy_ops=tuple(r.copy_ops),
                            slot_mapping=tuple(r.slot_mapping)) for r in result.results)
    return replace(result, results=results, copy_ops=tuple(result.copy_ops), tier_ops=tuple(result.tier_ops))


class InProcessBlockd:
    """An in-memory engine answering like :class:`client.sdk.BlockdClient`."""

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine if engine is not None else Engine()

    def _call(self, rpc: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except BlockdError as err:
            code, message, details = error_parts(err, rpc)
            raise error_for(grpc.StatusCode[code], message, tuple(details)) from None

    def close(self) -> None:
        self.engine.close()

    def create_pool(self, config: PoolConfig, *, request_id: str | None = None) -> PoolStats:
        return self._call("CreatePool", lambda: self.engine.create_pool(config, request_id or ""))

    def get_pool(self, pool: str) -> PoolStats:
        return self._call("GetPool", lambda: self.engine.get_pool(pool))

    def get_tables(self, pool: str, seq_ids: Sequence[str] = ()) -> tuple[int, dict[str, list[int]]]:
        return self._call("GetTables", lambda: self.engine.get_tables(pool, list(seq_ids)))

    def lookup_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None,
                      pools: Sequence[str] = (), *, tiers: bool = False) -> dict:
        extra = extra_keys if extra_keys is not None else NO_EXTRA_KEYS
        return self._call("LookupPrefix", lambda: self.engine.lookup_prefix(list(token_ids), extra, list(pools),
                                                                            tiers=tiers))

    def get_hash_spec(self, pool: str | None = None) -> HashSpec:
        if not pool:
            return hash_spec()
        config = self._call("GetHashSpec", lambda: self.engine.pool_config(pool))
        return hash_spec(config.block_size, owner_of(config))

    def check_hash_spec(self) -> HashSpec:
        """As the SDK's (the engine here is this build's, so it always passes)."""
        return checked_hash_spec(self.get_hash_spec(), "in process")

    def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
             timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "",
             previous_term: int = 0) -> StepResult:
        """Like :meth:`client.sdk.BlockdClient.step` (``timeout_s`` is unused: nothing waits)."""
        return _copied(self._call("Step", lambda: self.engine.step(
            pool, list(ops), request_id or "", dry_run=dry_run, incarnation=incarnation,
            previous_term=previous_term)))

    def reset_prefix_cache(self, pool: str, *, request_id: str | None = None) -> None:
        self._call("ResetPrefixCache", lambda: self.engine.reset_prefix_cache(pool, request_id or ""))

    def check_invariants(self) -> None:
        """Every pool's invariants, checked from scratch (raises InvariantViolation)."""
        self.engine.check_invariants()
