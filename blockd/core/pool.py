"""One KV pool: sequences, block tables, the prefix cache and atomic batches.

:class:`Pool` is the allocator the daemon wraps. A scheduler step is one
:meth:`Pool.step` call with a list of operations (:mod:`blockd.core.types`);
the batch applies entirely or not at all: every change goes through a
:class:`~blockd.core.batch.Batch`, whose undo journal is rolled back on the
first error, which is re-raised naming the failing operation.

Token bookkeeping of one sequence with block size 4 (``T`` tokens, ``C``
committed, i.e. their KV is written)::

    tokens     a b c d | e f g h | i j
    committed  ^^^^^^^^^^^^^^^^^  (C = 8: blocks 0 and 1 full and committed,
                                   so both are hashed and enter the index)
    table      [ 5 ]     [ 1 ]     [ 7 ]   fill of block 7 = 2 of 4

A successful mutating batch bumps ``version`` and records a
:class:`~blockd.core.types.VersionDelta` (tier ops, copy ops, table changes); the
last ``max_retained_versions`` deltas are kept for followers. Changes to the
prefix index are queued as :class:`~blockd.core.types.KVEvent` for
:meth:`take_events`.

A :class:`Pin` holds a prefix's full blocks cached in the device tier the way
a sequence's table does: one reference each, so a pinned block is used, never
evictable, and counts against the free room like any used block (no eviction
path knows of pins). Pins change no table, so not the version either; only
:meth:`reset_prefix_cache` (an operator's, or a worker's lost KV) drops them.
Imports only the standard library.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import islice

from blockd.core.batch import Batch
from blockd.core.blocks import DEVICE, HOST, BlockSpace
from blockd.core.errors import BlockdError, InvalidArgument, InvariantViolation, NotFound, WrongState, shown
from blockd.core.hashing import NO_EXTRA_DIGEST, ExtraKeys, hash_full_blocks, tenant_digest
from blockd.core.lru import MissLedger
from blockd.core.ops import IN_HOST, allocation_need, append_need, apply, cached_prefix, describe, located
from blockd.core.sequence import Sequence, find_seq
from blockd.core.types import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    KVEvent,
    Op,
    OpResult,
    PoolConfig,
    PoolStats,
    StepResult,
    VersionDelta,
)
from blockd.core.validate import check_config, check_name, check_priority

MAX_OPS_PER_STEP = 65536
#: freed sequence ids remembered, so a late append is told 'freed', not 'unknown'
MAX_TOMBSTONES = 65536
#: dropped hashes remembered per tier, per block of the pool (:class:`~blockd.core.lru.MissLedger`)
DROPPED_PER_BLOCK = 4
#: pins one pool holds at once (bounded state: each is in every snapshot)
MAX_PINS = 1024
#: a deadline past this (seconds since the epoch, year 2286) is refused
MAX_DEADLINE = 1e10


@dataclass(frozen=True)
class Pin:
    """A pinned prefix of pool ``pool`` (tenant ``tenant``): its leading full
    blocks cached in the device tier when it was made, ``block_ids`` in order
    (``num_tokens`` = their tokens), each holding one reference until it is
    unpinned. ``expires_at``: wall-clock seconds since the epoch after which
    the daemon unpins it (0: never); the core never reads a clock."""

    pin_id: str
    pool: str
    tenant: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float = 0.0


@dataclass(frozen=True)
class PrefixPriority:
    """What :meth:`Pool.set_prefix_priority` set: the leading full blocks of a
    prefix cached in pool ``pool`` (``num_tokens`` tokens: ``num_device_blocks``
    in the device tier, ``num_host_blocks`` in the host tier) now at ``priority``."""

    pool: str
    tenant: str
    priority: int
    num_tokens: int
    num_device_blocks: int
    num_host_blocks: int


class SnapshotRequired(WrongState):
    """The follower's version is older than the oldest retained delta."""


class Pool:
    """Allocation state of one pool. Not thread-safe: one writer per pool."""

    def __init__(self, config: PoolConfig) -> None:
        check_config(config)
        self.config = config
        self.block_size = config.block_size
        self.blocks = BlockSpace(config.num_blocks, config.block_size, config.num_host_blocks)
        self.seqs: dict[str, Sequence] = {}
        #: recently freed sequence id -> the version that freed it
        self.freed: OrderedDict[str, int] = OrderedDict()
        self.version = 0
        self.num_tokens = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_miss_tokens = [0, 0, 0, 0, 0]
        self.misses = MissLedger(DROPPED_PER_BLOCK * config.num_blocks, tenant_digest(NO_EXTRA_DIGEST, config.tenant))
        self.num_copies = 0
        self.deltas: deque[VersionDelta] = deque(maxlen=config.max_retained_versions)
        self.last_event_seq_no = 0
        self._events: list[KVEvent] = []
        #: pins by id, in the order they were made; block id -> how many pins hold it
        self.pins: dict[str, Pin] = {}
        self.pinned: dict[int, int] = {}
        #: pins ever made (a pin's id is ``pin-<n>``: never reused in the pool)
        self.num_pins_made = 0

    # --- batches --------------------------------------------------------
    def step(self, ops: list[Op] | tuple[Op, ...], *, dry_run: bool = False) -> StepResult:
        """Apply a batch atomically; on error nothing changes and the raised
        :class:`~blockd.core.errors.BlockdError` names the failing operation.

        ``dry_run`` runs the batch and rolls it back whatever happens: the
        answer (results, or the error) is what the batch would do now, and the
        pool, its version and its events stay as they were."""
        if not isinstance(ops, (list, tuple)):
            raise InvalidArgument("a step takes a list of operations")
        if len(ops) > MAX_OPS_PER_STEP:
            raise InvalidArgument(f"a step holds at most {MAX_OPS_PER_STEP} operations, got {len(ops)}")
        if not ops:
            return StepResult(version=self.version, results=())
        batch = Batch(self.config, self.blocks, self.seqs, self.freed, self.version, self.misses)
        batch.begin()
        results = []
        index = 0
        try:
            for index, op in enumerate(ops):  # noqa: B007 - the except clauses name the failing op
                results.append(apply(batch, op))
        except BlockdError as err:
            batch.rollback()
            raise err.at_op(index, describe(ops[index])) from None
        except Exception as err:  # a bug: still leave the pool as it was
            batch.rollback()
            raise InvariantViolation(f"operation {index} failed unexpectedly: {err!r}") from err
        if dry_run:
            tier_ops = tuple(self.blocks.tier_ops)  # the rollback drops them
            batch.rollback()
            return StepResult(version=self.version, results=tuple(results), copy_ops=tuple(batch.copy_ops),
                              tier_ops=tier_ops)
        batch.commit()
        return self._finish(batch, tuple(results))

    def _finish(self, batch: Batch, results: tuple[OpResult, ...]) -> StepResult:
        """Publish a committed batch: counters, version, tombstones, delta, events."""
        self.num_tokens += batch.num_tokens
        self.prefix_queried_tokens += batch.prefix_queried_tokens
        self.prefix_hit_tokens += batch.prefix_hit_tokens
        if batch.prefix_queried_tokens:
            self.prefix_miss_tokens = [a + b for a, b in zip(self.prefix_miss_tokens, batch.prefix_miss_tokens)]
        self.num_copies += batch.num_copies
        self.version = batch.version
        for seq_id, freed_at in batch.tombstones:
            self.freed.pop(seq_id, None)  # a re-allocated id loses its tombstone; a freed one moves last
            if freed_at is not None:
                self.freed[seq_id] = freed_at
        while len(self.freed) > MAX_TOMBSTONES:
            self.freed.popitem(last=False)
        copy_ops = tuple(batch.copy_ops)
        tier_ops = tuple(self.blocks.tier_ops) if self.blocks.tier_ops else ()
        self.blocks.tier_ops.clear()
        self.deltas.append(VersionDelta(version=self.version, updates=tuple(batch.updates), copy_ops=copy_ops,
                                        tier_ops=tier_ops))
        self._publish_events(batch)
        return StepResult(version=self.version, results=results, copy_ops=copy_ops, tier_ops=tier_ops)

    def _publish_events(self, batch: Batch) -> None:
        """Turn the batch's evictions and stores into numbered events in the
        order they happened: a block the batch commits may be evicted later in
        the batch (its BlockRemoved follows its BlockStored), and an evicted
        hash may be stored again (the other way round). The miss ledger
        follows the same order."""
        evicted, misses = self.blocks.evicted, self.misses
        done = 0
        for before, block, h, parent, tokens, seq, logical in batch.stored:
            for e_block, e_hash, medium in evicted[done:before]:
                misses.dropped(e_hash, medium == HOST)
                self._emit(BLOCK_REMOVED, block_hash=e_hash, block_id=e_block, medium=medium)
            done = max(done, before)
            if seq.extra_digest == misses.plain_digest:  # its own tokens-only hash: cheap
                if misses.dropped_device or misses.dropped_host:
                    misses.stored(h, h)
            else:
                misses.stored(h, self._plain_hash(parent, seq, logical))
            self._emit(BLOCK_STORED, block_hash=h, parent_hash=parent, block_id=block, token_ids=tokens)
        for e_block, e_hash, medium in evicted[done:]:
            misses.dropped(e_hash, medium == HOST)
            self._emit(BLOCK_REMOVED, block_hash=e_hash, block_id=e_block, medium=medium)
        evicted.clear()

    def _plain_hash(self, parent: bytes, seq: Sequence, logical: int) -> bytes:
        """The tokens-only hash of block ``logical`` of ``seq``, which has extra
        keys: chained on its parent's, which is known while the parent is
        cached; otherwise the chain is rehashed."""
        plain_digest = self.misses.plain_digest
        b = self.block_size
        plain_parent = self.misses.plain_of.get(parent) if parent else None
        if parent and plain_parent is None:
            return hash_full_blocks(seq.token_ids[: (logical + 1) * b], b, plain_digest)[-1]
        return hash_full_blocks(seq.token_ids[logical * b : (logical + 1) * b], b, plain_digest,
                                parent=plain_parent)[-1]

    def _emit(self, kind: str, *, block_hash: bytes = b"", parent_hash: bytes = b"", block_id: int = -1,
              token_ids: tuple[int, ...] = (), medium: str = DEVICE) -> None:
        self.last_event_seq_no += 1
        # positional: a step whose sequences fill blocks emits one per block, and keywords cost a third more
        self._events.append(KVEvent(self.last_event_seq_no, kind, block_hash, parent_hash, block_id, token_ids,
                                    medium))

    def get_seq(self, seq_id: str) -> Sequence:
        seq = self.seqs.get(seq_id) if type(seq_id) is str else None
        if seq is not None:
            return seq
        check_name(seq_id, "seq_id")  # an id no sequence can have is the caller's mistake
        return find_seq(self.seqs, seq_id, self.config.name, self.freed.get)

    # --- queries (never change state) -------------------------------------
    def can_allocate(self, prompt_token_ids: object, extra_keys: ExtraKeys | None = None) -> bool:
        """Whether :class:`Allocate` of this prompt would be admitted now."""
        return allocation_need(self.blocks, self.config.watermark_blocks, prompt_token_ids, extra_keys,
                               self.config.tenant) is not None

    def can_append(self, seq_id: str, num_new_tokens: int) -> bool:
        """Whether appending ``num_new_tokens`` tokens to ``seq_id`` would fit."""
        if type(num_new_tokens) is not int or num_new_tokens < 0:
            raise InvalidArgument(f"num_new_tokens must be a non-negative int, got {shown(num_new_tokens)}")
        return append_need(self.blocks, self.get_seq(seq_id), num_new_tokens) <= self.blocks.num_available

    def lookup_prefix(self, token_ids: list[int] | tuple[int, ...], extra_keys: ExtraKeys | None = None) -> int:
        """Tokens of ``token_ids`` whose full blocks are cached, in either tier (no allocation)."""
        hits = cached_prefix(self.blocks, token_ids, extra_keys, len(token_ids), self.config.tenant)[0]
        return len(hits) * self.block_size

    def locate_blocks(self, token_ids: list[int] | tuple[int, ...], extra_keys: ExtraKeys | None,
                      first_block: int, max_blocks: int) -> list[tuple[str, int]]:
        """Where full blocks ``first_block ..`` of ``token_ids`` (at most
        ``max_blocks``) are cached, as ``(tier, block)``: the run up to the first
        that is not (another pool copies them; :class:`~blockd.core.types.TransferPlan`)."""
        return located(self.blocks, token_ids, extra_keys, first_block, max_blocks, self.config.tenant)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self.get_seq(seq_id).table)

    def tables(self) -> dict[str, list[int]]:
        """Every sequence's table at the current version (a snapshot)."""
        return {seq_id: list(seq.table) for seq_id, seq in self.seqs.items()}

    def deltas_since(self, version: int) -> list[VersionDelta]:
        """Deltas ``version + 1 .. current``; :class:`SnapshotRequired` when the
        first of them is no longer retained."""
        if type(version) is not int or version < 0:
            raise InvalidArgument(f"version must be a non-negative int, got {shown(version)}")
        if version > self.version:
            raise WrongState(
                f"version {version} is ahead of pool {shown(self.config.name)} (at {self.version})")
        if version == self.version:
            return []
        oldest = self.deltas[0].version if self.deltas else self.version + 1
        if version + 1 < oldest:
            raise SnapshotRequired(
                f"version {version} is no longer retained (oldest delta is {oldest}); take a snapshot")
        return list(islice(self.deltas, version + 1 - oldest, None))

    def take_events(self) -> list[KVEvent]:
        """Drain the queued KV events (ordered by ``seq_no``)."""
        events, self._events = self._events, []
        return events

    def stats(self) -> PoolStats:
        blocks, cfg = self.blocks, self.config
        waste = blocks.num_used * cfg.block_size - blocks.filled_slots
        return PoolStats(
            name=cfg.name, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
            num_free_blocks=blocks.num_free, num_used_blocks=blocks.num_used,
            num_evictable_blocks=len(blocks.lru), num_seqs=len(self.seqs),
            num_tokens=self.num_tokens, tail_waste_slots=waste,
            tail_waste_bytes=waste * cfg.bytes_per_slot,
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens, num_evictions=blocks.num_evictions,
            num_copies=self.num_copies, version=self.version,
            last_event_seq_no=self.last_event_seq_no, tenant=cfg.tenant,
            num_host_blocks=cfg.num_host_blocks,
            num_host_cached_blocks=len(blocks.host.index) if blocks.host is not None else 0,
            num_offloads=blocks.num_offloads, num_restores=blocks.num_restores,
            prefix_miss_tokens=tuple(self.prefix_miss_tokens),
            num_pinned_blocks=len(self.pinned), num_pins=len(self.pins),
        )

    # --- pins -------------------------------------------------------------------
    def pinnable(self, token_ids: list[int] | tuple[int, ...], extra_keys: ExtraKeys | None = None) -> list[int]:
        """The device blocks a pin of this prefix would hold now: its leading
        full blocks cached in the device tier, up to the first that is not
        (one in the host tier ends the run too: a pin moves no block)."""
        max_blocks = len(token_ids) if isinstance(token_ids, (list, tuple)) else 0
        hits = cached_prefix(self.blocks, token_ids, extra_keys, max_blocks, self.config.tenant)[0]
        return hits[: hits.index(IN_HOST)] if IN_HOST in hits else hits

    def pin_prefix(self, token_ids: list[int] | tuple[int, ...], extra_keys: ExtraKeys | None = None,
                   expires_at: float = 0.0) -> Pin:
        """Pin what :meth:`pinnable` gives; FAILED_PRECONDITION when that is
        nothing or the pool holds :data:`MAX_PINS` pins (nothing changes)."""
        if type(expires_at) not in (int, float) or not 0 <= expires_at <= MAX_DEADLINE:
            raise InvalidArgument(f"expires_at must be seconds since the epoch in [0, {MAX_DEADLINE:g}] "
                                  f"(0: never), got {shown(expires_at)}")
        block_ids = self.pinnable(token_ids, extra_keys)
        name = shown(self.config.name)
        if not block_ids:
            raise WrongState(f"no full block of this prefix is cached in the device tier of pool {name} "
                             f"(host-tier blocks are not pinned): commit it first, or check the extra keys")
        if len(self.pins) >= MAX_PINS:
            raise WrongState(f"pool {name} holds {MAX_PINS} pins, the most it may; unpin some first")
        self.num_pins_made += 1
        pin = Pin(f"pin-{self.num_pins_made}", self.config.name, self.config.tenant, tuple(block_ids),
                  len(block_ids) * self.block_size, float(expires_at))
        self.pins[pin.pin_id] = pin
        for block in pin.block_ids:
            self.blocks.acquire(block)
            self.pinned[block] = self.pinned.get(block, 0) + 1
        return pin

    def unpin(self, pin_id: str) -> Pin:
        """Let go of pin ``pin_id``: a block no table or pin holds any more
        becomes evictable (the back of the LRU). NOT_FOUND for an unknown id."""
        pin = self.pins.get(pin_id) if type(pin_id) is str else None
        if pin is None:
            check_name(pin_id, "pin_id")
            raise NotFound(f"pool {shown(self.config.name)} has no pin {shown(pin_id)}; list its pins to see "
                           "which it holds (an expired pin is gone)")
        del self.pins[pin_id]
        for block in pin.block_ids:
            self.blocks.release(block)
            left = self.pinned[block] - 1
            if left:
                self.pinned[block] = left
            else:
                del self.pinned[block]
        return pin

    # --- retention priorities ----------------------------------------------------
    def set_prefix_priority(self, token_ids: list[int] | tuple[int, ...], extra_keys: ExtraKeys | None,
                            priority: int) -> PrefixPriority:
        """Keep the prompt's leading full blocks cached in either tier (the
        chain a prefix hit would follow) at ``priority`` from now on: an
        evictable one moves to the back of that priority's LRU in its tier
        (tail first, as a Free releases them), a used one enters it when let go (its holders raise it to theirs if
        higher). FAILED_PRECONDITION when none is cached (nothing changes)."""
        priority = check_priority(priority)
        max_blocks = len(token_ids) if isinstance(token_ids, (list, tuple)) else 0
        hits, hashes = cached_prefix(self.blocks, token_ids, extra_keys, max_blocks, self.config.tenant)
        if not hits:
            raise WrongState(f"no full block of this prefix is cached in pool {shown(self.config.name)}: commit it "
                             "first, or check the extra keys")
        blocks, host = self.blocks, self.blocks.host
        for block, h in zip(reversed(hits), reversed(hashes)):  # tail first, as a Free releases
            if block == IN_HOST:
                assert host is not None, "a host-tier hit needs a host tier"
                host.set_priority(host.index[h], priority)
            else:
                blocks.set_priority(block, priority)
        in_host = hits.count(IN_HOST)
        return PrefixPriority(self.config.name, self.config.tenant, priority, len(hits) * self.block_size,
                              len(hits) - in_host, in_host)

    # --- operator actions ---------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Drop every cached hash, in both tiers (evictable blocks become free) and emit
        ``AllBlocksCleared``. Tables are unchanged, so the version is too.
        Running sequences keep their hash chains, so blocks they fill later
        are cached again; blocks already full stay uncached. Every pin is
        dropped first: what it held is no longer a cached prefix."""
        for pin_id in list(self.pins):
            self.unpin(pin_id)
        self.blocks.clear_index()
        self.misses.clear_cached()
        self._emit(ALL_BLOCKS_CLEARED)
