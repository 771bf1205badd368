"""The invariant checker: the invariants of docs/protocol.md, recomputed from scratch.

:func:`check_invariants` walks every block and every table (O(blocks +
table entries)), so it is for tests and debugging, never the hot path. It
raises :class:`~blockd.core.errors.InvariantViolation` naming the first broken
invariant:

* each block is exactly one of free, evictable, used;
* a block's ref count equals the number of tables and pins that hold it;
* the pins: each holds full blocks carrying an indexed hash (so used, never
  evictable), as many tokens as those blocks hold, and the pool's
  block -> pins count is exactly what the pins give;
* ``len(table) == ceil(T / b)`` for every sequence;
* the prefix index maps each hash to one block carrying that hash, and every
  hashed block is indexed; evictable blocks are hashed, free ones are not;
* free + evictable + used == num_blocks;
* retention priorities, in each tier: each priority's LRU list is a well
  linked circle holding only blocks of that priority, so each evictable block
  is in exactly one; the lists add up to the LRU's length; the mask of
  non-empty priorities is exact; every block's and sequence's priority is in
  range;
* every holder of a block agrees on how many of its slots hold tokens, and the
  O(1) counters (used blocks, filled slots, tokens) equal their recomputation;
* the host tier: each host block is free (never used, or once in its free
  list) xor holds exactly one hash and is in its LRU; its index maps each hash
  to the host block holding it; no hash is in both tiers; and the stats'
  host counts agree;
* the miss ledger: every tokens-only entry is of a cached hash, the
  tokens-only index is exactly what those entries give, no dropped record
  is of a cached hash, each tier's records are within their bound, and the
  missed tokens by reason never exceed the queried tokens minus the hits
  (equal from a pool's start; a snapshot from before the ledger counts 0).

Imports only the standard library.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from blockd.core.arith import num_blocks_for
from blockd.core.errors import InvariantViolation
from blockd.core.lru import NUM_PRIORITIES

if TYPE_CHECKING:
    from blockd.core.lru import BlockLRU
    from blockd.core.pool import Pool


def _fail(pool: Pool, message: str) -> None:
    raise InvariantViolation(f"pool {pool.config.name!r}: {message}")


def check_invariants(pool: Pool) -> None:
    blocks, b = pool.blocks, pool.block_size
    holders: Counter[int] = Counter()
    fill_seen: dict[int, int] = {}
    num_tokens = 0
    for seq_id, seq in pool.seqs.items():
        count = len(seq.token_ids)
        num_tokens += count
        if len(seq.table) != num_blocks_for(count, b):
            _fail(pool, f"sequence {seq_id!r} has {count} tokens but {len(seq.table)} blocks")
        if not 0 <= seq.num_committed <= count or len(seq.hashes) != seq.num_committed // b:
            _fail(pool, f"sequence {seq_id!r}: committed {seq.num_committed} of {count}, "
                        f"{len(seq.hashes)} hashes")
        for logical, block in enumerate(seq.table):
            holders[block] += 1
            fill = min(b, count - logical * b)
            if fill_seen.setdefault(block, fill) != fill:
                _fail(pool, f"holders of block {block} disagree on its fill")
    _check_pins(pool, holders, fill_seen)
    free_list = set(blocks.free)
    if len(free_list) != len(blocks.free):
        _fail(pool, "a block is twice in the free list")
    evictable = set(blocks.lru)
    used = filled = 0
    for block in range(blocks.num_blocks):
        ref = blocks.ref[block]
        is_free = block >= blocks.next_fresh or block in free_list
        states = (is_free, block in evictable, ref > 0)
        if sum(states) != 1:
            _fail(pool, f"block {block} is free/evictable/used = {states}")
        if ref != holders.get(block, 0):
            _fail(pool, f"block {block} has ref count {ref} but {holders.get(block, 0)} tables and pins hold it")
        h = blocks.hash[block]
        if h is not None and blocks.index.get(h) != block:
            _fail(pool, f"block {block} carries a hash the index maps elsewhere")
        if (block in evictable and h is None) or (is_free and h is not None):
            _fail(pool, f"block {block}: evictable blocks must be hashed, free ones not")
        if ref:
            used += 1
            filled += fill_seen[block]
            if blocks.fill[block] != fill_seen[block]:
                _fail(pool, f"block {block} fill {blocks.fill[block]} != {fill_seen[block]}")
    for h, block in blocks.index.items():
        if blocks.hash[block] != h:
            _fail(pool, f"index maps a hash to block {block}, which carries another")
    if blocks.num_free + len(evictable) + used != blocks.num_blocks:
        _fail(pool, "free + evictable + used != num_blocks")
    if (used, filled, num_tokens) != (blocks.num_used, blocks.filled_slots, pool.num_tokens):
        _fail(pool, f"counters (used, filled, tokens) = {(blocks.num_used, blocks.filled_slots, pool.num_tokens)}"
                    f", recomputed {(used, filled, num_tokens)}")
    _check_host(pool)
    _check_priorities(pool)
    _check_misses(pool)


def _check_levels(pool: Pool, tier: str, lru: BlockLRU, priority: list[int]) -> None:
    """One tier's LRU lists against its blocks' priorities (see the module docstring)."""
    if not all(0 <= p < NUM_PRIORITIES for p in priority):
        _fail(pool, f"a {tier} block's priority is outside [0, {NUM_PRIORITIES})")
    total = mask = 0
    for level in range(NUM_PRIORITIES):
        count = 0
        for block in lru.at(level):
            count += 1
            if count > len(lru) or priority[block] != level:
                _fail(pool, f"the {tier} LRU's priority {level} holds block {block} of priority {priority[block]}"
                            " (or its list does not close)")
        total += count
        mask |= (count > 0) << level
    if total != len(lru) or mask != lru.priorities_in_use():
        _fail(pool, f"the {tier} LRU's priorities hold {total} blocks (mask {mask:b}) but it counts {len(lru)}"
                    f" (mask {lru.priorities_in_use():b})")


def _check_priorities(pool: Pool) -> None:
    blocks = pool.blocks
    _check_levels(pool, "device", blocks.lru, blocks.priority)
    if blocks.host is not None:
        _check_levels(pool, "host", blocks.host.lru, blocks.host.priority)
    for seq_id, seq in pool.seqs.items():
        if type(seq.priority) is not int or not 0 <= seq.priority < NUM_PRIORITIES:
            _fail(pool, f"sequence {seq_id!r} has priority {seq.priority!r}")


def _check_pins(pool: Pool, holders: Counter[int], fill_seen: dict[int, int]) -> None:
    blocks, b = pool.blocks, pool.block_size
    pinned: Counter[int] = Counter()
    for pin_id, pin in pool.pins.items():
        if pin.pin_id != pin_id or not pin.block_ids or pin.num_tokens != len(pin.block_ids) * b:
            _fail(pool, f"pin {pin_id!r} holds {len(pin.block_ids)} blocks and {pin.num_tokens} tokens")
        for block in pin.block_ids:
            h = blocks.hash[block]
            if h is None or blocks.index.get(h) != block or fill_seen.setdefault(block, b) != b:
                _fail(pool, f"pin {pin_id!r} holds block {block}, which is not a full, indexed block")
            holders[block] += 1
            pinned[block] += 1
    if pinned != Counter(pool.pinned):
        _fail(pool, "the pool's count of pins per block does not match its pins")


def _check_misses(pool: Pool) -> None:
    misses, blocks = pool.misses, pool.blocks
    cached = set(blocks.index) | (set(blocks.host.index) if blocks.host is not None else set())
    if not cached.issuperset(misses.plain_of):
        _fail(pool, "the miss ledger holds a tokens-only hash of a hash that is not cached")
    variants: dict[bytes, set[bytes]] = {}
    for h, plain in misses.plain_of.items():
        if plain == h:
            _fail(pool, "the miss ledger holds a hash without extra keys (its own tokens-only hash)")
        variants.setdefault(plain, set()).add(h)
    if variants != misses.variants:
        _fail(pool, "the tokens-only index does not match the cached hashes' tokens-only hashes")
    for name, records in (("device", misses.dropped_device), ("host", misses.dropped_host)):
        if len(records) > misses.limit or not cached.isdisjoint(records):
            _fail(pool, f"the {name} tier's dropped-hash records exceed {misses.limit} or hold a cached hash")
    missed = pool.prefix_miss_tokens
    if min(missed) < 0 or sum(missed) > pool.prefix_queried_tokens - pool.prefix_hit_tokens:
        _fail(pool, f"missed tokens {missed} exceed the queried tokens less the hits")


def _check_host(pool: Pool) -> None:
    host, stats = pool.blocks.host, pool.stats()
    if host is None:
        if (stats.num_host_blocks, stats.num_host_cached_blocks) != (0, 0) or pool.blocks.tier_ops:
            _fail(pool, "a pool without a host tier reports one")
        return
    free_list = set(host.free)
    if len(free_list) != len(host.free):
        _fail(pool, "a host block is twice in the host free list")
    cached = set(host.lru)
    for hb in range(host.num_blocks):
        is_free = hb >= host.next_fresh or hb in free_list
        h = host.hash[hb]
        if is_free == (hb in cached) or is_free != (h is None):
            _fail(pool, f"host block {hb}: free {is_free}, in the host LRU {hb in cached}, hash {h is not None}")
        if h is not None and host.index.get(h) != hb:
            _fail(pool, f"host block {hb} carries a hash the host index maps elsewhere")
        if h is not None and h in pool.blocks.index:
            _fail(pool, f"host block {hb}'s hash is also on device block {pool.blocks.index[h]}")
    if len(host.index) != len(cached) or host.num_free + len(cached) != host.num_blocks:
        _fail(pool, "host index, host LRU and host free blocks do not add up to num_host_blocks")
    if (stats.num_host_blocks, stats.num_host_cached_blocks) != (host.num_blocks, len(cached)):
        _fail(pool, f"stats give {stats.num_host_cached_blocks} of {stats.num_host_blocks} host blocks cached, "
                    f"recomputed {len(cached)} of {host.num_blocks}")
    if pool.blocks.tier_ops:
        _fail(pool, "tier ops are left over from a batch")
