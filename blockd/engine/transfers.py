"""Prefixes shared across pools: checking an ``Allocate``'s ``source_pool``, and
planning which of that pool's cached blocks stand in for the allocation's
missed prompt blocks (a :class:`~blockd.core.types.TransferPlan` on its result).

A transfer changes no state of either pool, so nothing about it is logged but
the ``Allocate`` that names its source, and it is planned after the step from
the state then:

* the source's blocks are only read. Its workers refuse to serve a block that
  a version after the planned one reassigned (``worker.transfer``), so a fetch
  never reads KV other than the planned block's;
* the destination blocks are the allocation's own fresh blocks. Their tokens
  stay uncached for blockd until the caller commits them, after its workers
  fetched them (or computed them, where a fetch failed), as it commits tokens
  it computed. So no other sequence can hit a block whose transfer has not
  completed.

A retried request (same request id) gets its remembered step result with a
plan made again, from the state at the retry.

Sources are checked before the step, so a bad one changes nothing: the pool
must exist and be the caller's (``SOURCE_POOL_NOT_FOUND``, a NOT_FOUND of its
own, naming the op; PERMISSION_DENIED), another pool
than the allocating one, of the same tenant (block hashes fold the tenant in:
tenants never share blocks) and of the same geometry (block size, layers, KV
heads, head size, dtype), else INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from blockd.core import ExtraKeys, Op, Pool, PoolConfig, StepResult
from blockd.core.blocks import HOST
from blockd.core.errors import InvalidArgument, NotFound, shown
from blockd.core.types import Allocate, TransferPlan
from blockd.core.validate import check_name
from blockd.engine.state import State
from blockd.engine.tenancy import owner_of
from blockd.engine.worker_registry import WorkerRegistry

#: what two pools must agree on for one's blocks to hold the other's KV
GEOMETRY = ("block_size", "num_layers", "num_kv_heads", "head_dim", "dtype")


class SourcePoolNotFound(NotFound):
    """An ``Allocate``'s ``source_pool`` names no pool of this daemon: one deleted
    (or never made) since the caller chose it, or another group's pool in a
    cluster. A reason of its own, so a caller tells it from its own pool gone
    (the scheduler steps on without the source and computes the tokens)."""

    reason = "SOURCE_POOL_NOT_FOUND"


def _sources(ops: Sequence[Op]) -> list[tuple[int, Allocate]]:
    return [(i, op) for i, op in enumerate(ops) if isinstance(op, Allocate) and op.source_pool]


def has_sources(ops: Sequence[Op]) -> bool:
    """Whether some ``Allocate`` of ``ops`` names a source pool."""
    return any(isinstance(op, Allocate) and op.source_pool for op in ops)


def check_sources(state: State, config: PoolConfig, ops: Sequence[Op]) -> None:
    """Refuse an ``Allocate`` whose ``source_pool`` cannot share with ``config``'s pool."""
    for i, op in _sources(ops):
        name = op.source_pool
        if type(name) is not str:
            raise InvalidArgument(f"op {i}: source_pool must be a pool name, got {shown(name)}")
        if name == config.name:
            raise InvalidArgument(f"op {i}: source_pool {name!r} is the allocating pool itself; name another "
                                  f"pool, or leave it empty")
        if name not in state.pools:
            check_name(name, "pool")  # a name no pool can have is the caller's mistake (INVALID_ARGUMENT)
            raise SourcePoolNotFound(
                f"op {i}: source_pool {shown(name)} names no pool of this daemon (deleted or never created, or "
                f"served by another group of the cluster); nothing was applied: send the allocation without it "
                f"(its prompt is then computed), or name a pool of this daemon", op_index=i)
        source = state.entry(name).pool.config
        if owner_of(source) != owner_of(config):
            raise InvalidArgument(f"op {i}: pool {name!r} belongs to another tenant than {config.name!r}; "
                                  f"tenants never share blocks")
        differ = [f"{key} {getattr(source, key)} != {getattr(config, key)}" for key in GEOMETRY
                  if getattr(source, key) != getattr(config, key)]
        if differ:
            raise InvalidArgument(f"op {i}: pool {name!r} cannot hold {config.name!r}'s KV ({', '.join(differ)})")


def located_tokens(pool: Pool, token_ids: list[int], extra_keys: ExtraKeys | None) -> tuple[int, int]:
    """``(cached tokens, of them in the host tier)`` of ``token_ids``'s prefix in ``pool`` (LookupPrefix)."""
    found = pool.locate_blocks(token_ids, extra_keys, 0, len(token_ids))
    return len(found) * pool.block_size, sum(tier == HOST for tier, _ in found) * pool.block_size


def plan_transfers(state: State, workers: WorkerRegistry, ops: Sequence[Op], result: StepResult) -> StepResult:
    """``result`` with a :class:`TransferPlan` on each ``Allocate`` whose source
    pool caches some of its missed full blocks, in a run from the first missed
    block, and has workers up to serve them."""
    sources = _sources(ops)
    if not sources:
        return result
    results = list(result.results)
    for i, op in sources:
        entry = state.pools.get(op.source_pool)
        allocated = results[i]
        if entry is None or not allocated.new_block_ids:
            continue
        block_size = entry.pool.block_size
        first = allocated.num_cached_tokens // block_size
        # the last prompt token is always computed, as for a hit in the pool itself
        limit = (len(op.prompt_token_ids) - 1) // block_size - first
        found = entry.pool.locate_blocks(op.prompt_token_ids, op.extra_keys, first, limit) if limit > 0 else []
        up = sorted((s.info.kv_head_start, s.info.layer_start, s.info.address, s.info.incarnation)
                    for s in workers.list(op.source_pool) if s.is_up and s.info.address)
        if not found or not up:
            continue
        results[i] = replace(allocated, transfer=TransferPlan(
            source_pool=op.source_pool, source_incarnation=entry.identity.incarnation,
            source_version=entry.pool.version, first_token=first * block_size,
            num_tokens=len(found) * block_size,
            src_tiers=tuple(tier for tier, _ in found), src_blocks=tuple(block for _, block in found),
            dst_blocks=tuple(allocated.new_block_ids[: len(found)]),
            source_workers=tuple((rank, address, incarnation)
                                 for rank, (_, _, address, incarnation) in enumerate(up))))
    return replace(result, results=tuple(results))


__all__ = ["GEOMETRY", "check_sources", "has_sources", "located_tokens", "plan_transfers"]
