"""The host tier (issue 28): offloads on eviction, restores on a prefix hit,
the host LRU, atomic batches, ordering within a batch, snapshots, validation;
with exact block ids and tier ops."""

import json

import pytest

from blockd.core import (
    BLOCK_REMOVED,
    BLOCK_STORED,
    Allocate,
    Append,
    Commit,
    Fork,
    Free,
    InvalidArgument,
    Pool,
    PoolConfig,
    check_invariants,
)
from blockd.core.blocks import BlockSpace
from blockd.core.state import dump_pool, load_pool
from blockd.core.types import MAX_NUM_BLOCKS, OFFLOAD, RESTORE, TierOp


def make_pool(num_blocks=4, block_size=2, num_host_blocks=2, **kw) -> Pool:
    return Pool(PoolConfig("p", num_blocks=num_blocks, block_size=block_size, num_host_blocks=num_host_blocks,
                           **kw))


def snapshot(pool) -> str:
    return json.dumps(dump_pool(pool), sort_keys=True)


def cache(pool, seq_id, prompt):
    """Allocate, commit and free ``prompt``: its full blocks become evictable."""
    pool.step([Allocate(seq_id, prompt), Commit(seq_id, len(prompt)), Free(seq_id)])


def test_eviction_offloads_the_hash_to_the_host_tier_without_an_event():
    pool = make_pool()
    cache(pool, "a", [1, 2, 3, 4, 5])  # blocks 0, 1 cached; LRU 1, 0 (tail first)
    pool.take_events()
    result = pool.step([Allocate("b", [9] * 7)])  # 4 blocks: fresh 3, free 2, then evict 1, 0
    assert result.results[0].new_block_ids == (3, 2, 1, 0)
    assert result.tier_ops == (TierOp(OFFLOAD, 1, 0), TierOp(OFFLOAD, 0, 1))
    assert pool.deltas[-1].tier_ops == result.tier_ops
    assert [e.kind for e in pool.take_events()] == []  # still cached: no BlockRemoved
    s = pool.stats()
    assert (s.num_offloads, s.num_host_cached_blocks, s.num_host_blocks, s.num_evictions) == (2, 2, 2, 0)
    assert pool.lookup_prefix([1, 2, 3, 4, 5]) == 4
    check_invariants(pool)


def test_a_host_hit_restores_into_fresh_device_blocks_and_counts_as_cached():
    pool = make_pool()
    cache(pool, "a", [1, 2, 3, 4, 5])
    pool.step([Allocate("b", [9] * 7)])
    pool.step([Free("b")])  # unhashed, released tail first: the free list is 0 1 2 3
    result = pool.step([Allocate("c", [1, 2, 3, 4, 5])])
    r = result.results[0]
    assert (r.num_cached_tokens, r.num_restored_tokens, r.slot_start, r.new_block_ids) == (4, 4, 4, (2,))
    # the head's hash went to host block 1 (offloaded second): the chain restores in order
    assert result.tier_ops == (TierOp(RESTORE, 0, 1), TierOp(RESTORE, 1, 0))
    assert pool.block_table("c") == [0, 1, 2]
    s = pool.stats()
    assert (s.num_restores, s.num_host_cached_blocks, s.prefix_hit_tokens) == (2, 0, 4)
    check_invariants(pool)
    # the restored blocks are device-cached again: a second prompt shares them
    r2 = pool.step([Allocate("d", [1, 2, 3, 4, 7])]).results[0]
    assert (r2.num_cached_tokens, r2.num_restored_tokens) == (4, 0)
    assert pool.block_table("d")[:2] == [0, 1]


def test_a_full_host_tier_drops_its_oldest_hash_with_a_host_event():
    pool = make_pool(num_host_blocks=1)
    cache(pool, "a", [1, 2, 3, 4, 5])
    stored = {e.block_id: e.block_hash for e in pool.take_events() if e.kind == BLOCK_STORED}
    result = pool.step([Allocate("b", [9] * 7)])
    assert result.tier_ops == (TierOp(OFFLOAD, 1, 0), TierOp(OFFLOAD, 0, 0))
    (removed,) = pool.take_events()
    assert (removed.kind, removed.medium, removed.block_id, removed.block_hash) == (BLOCK_REMOVED, "host", 0,
                                                                                     stored[1])
    assert pool.stats().num_evictions == 1
    assert pool.lookup_prefix([1, 2, 3, 4, 5]) == 2  # the head is kept, the tail was dropped
    check_invariants(pool)


def test_without_a_host_tier_eviction_drops_the_hash_as_before():
    pool = make_pool(num_host_blocks=0)
    cache(pool, "a", [1, 2, 3, 4, 5])
    pool.take_events()
    result = pool.step([Allocate("b", [9] * 7)])
    assert result.tier_ops == () and pool.deltas[-1].tier_ops == ()
    assert [(e.kind, e.block_id, e.medium) for e in pool.take_events()] == [
        (BLOCK_REMOVED, 1, "device"), (BLOCK_REMOVED, 0, "device")]
    s = pool.stats()
    assert (s.num_host_blocks, s.num_host_cached_blocks, s.num_offloads, s.num_restores) == (0, 0, 0, 0)


def _offload_by_hand(pool, block):
    """Move evictable device ``block``'s hash to the host tier as an eviction
    would (no public op evicts a chain's head before its tail)."""
    blocks, host = pool.blocks, pool.blocks.host
    h = blocks.hash[block]
    blocks.lru.remove(block)
    del blocks.index[h]
    blocks.hash[block] = None
    blocks.free.append(block)
    hb, dropped = host.take(None)
    assert dropped is None
    host.store(None, hb, h, blocks.priority[block])
    return hb


def test_the_chain_continues_device_host_device():
    pool = make_pool(num_blocks=8)
    cache(pool, "a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0 1 2 cached
    hb = _offload_by_hand(pool, 1)
    check_invariants(pool)
    assert pool.lookup_prefix([1, 2, 3, 4, 5, 6, 7]) == 6
    result = pool.step([Allocate("c", [1, 2, 3, 4, 5, 6, 7])])
    r = result.results[0]
    assert (r.num_cached_tokens, r.num_restored_tokens) == (6, 2)
    table = pool.block_table("c")
    assert table[0] == 0 and table[2] == 2
    assert result.tier_ops == (TierOp(RESTORE, table[1], hb),)
    check_invariants(pool)


def test_a_failed_batch_leaves_no_tier_op_host_change_event_or_counter():
    pool = make_pool()
    cache(pool, "a", [1, 2, 3, 4, 5])
    pool.step([Allocate("b", [9] * 7)])
    pool.step([Free("b")])
    pool.take_events()
    before, stats = snapshot(pool), pool.stats()
    with pytest.raises(Exception, match="missing"):
        # a restore, then offloads of the restored blocks, then a failure
        pool.step([Allocate("c", [1, 2, 3, 4, 5]), Free("c"), Allocate("d", [8] * 8), Append("missing", [1])])
    assert snapshot(pool) == before and pool.stats() == stats
    assert pool.take_events() == [] and pool.blocks.tier_ops == []
    check_invariants(pool)


def test_a_dry_run_reports_the_tier_ops_and_changes_nothing():
    pool = make_pool()
    cache(pool, "a", [1, 2, 3, 4, 5])
    before = snapshot(pool)
    dry = pool.step([Allocate("b", [9] * 7)], dry_run=True)
    assert dry.tier_ops == (TierOp(OFFLOAD, 1, 0), TierOp(OFFLOAD, 0, 1))
    assert snapshot(pool) == before
    assert pool.step([Allocate("b", [9] * 7)]).tier_ops == dry.tier_ops


def test_a_host_block_restored_from_is_reused_only_after_its_restore():
    """Within one batch: RESTORE(d, h) is queued before the OFFLOAD(x, h) that
    reuses host block h, so run in order each reads what it should."""
    pool = make_pool(num_blocks=4, num_host_blocks=1)
    cache(pool, "a", [1, 2, 3])  # block 0 cached; free 1
    cache(pool, "x", [5, 6, 7])  # block 2 cached; LRU 0, 2; free 1, 3
    pool.step([Allocate("b", [9] * 5)])  # free 1, 3, then evicts 0 -> host 0
    pool.step([Free("b")])  # free 0, 3, 1
    # c restores [1, 2] from host 0 into block 0; y's second block evicts 2 (x's [5, 6]) into host 0
    result = pool.step([Allocate("c", [1, 2, 3]), Allocate("y", [8] * 4)])
    assert result.tier_ops == (TierOp(RESTORE, 0, 0), TierOp(OFFLOAD, 2, 0))
    assert pool.block_table("c") == [0, 3] and pool.block_table("y") == [1, 2]
    assert pool.lookup_prefix([5, 6, 7]) == 2 and pool.lookup_prefix([1, 2, 3]) == 2
    check_invariants(pool)


def test_a_restore_never_targets_a_block_of_the_batch_copy_ops():
    space = BlockSpace(4, 2)
    for _ in range(4):
        space.take(2)
    for block in (3, 1):
        space.release(block)  # free list: 3, 1
    journal = []
    space.begin(journal)
    assert space.take_clean(2, dirty={3}) == 1
    assert list(space.free) == [3]
    for entry in reversed(journal):
        entry.undo()
    space.end()
    assert list(space.free) == [3, 1] and space.ref[1] == 0
    space.begin([])
    assert space.take_clean(2, dirty={3, 1}) is None  # nothing clean, nothing evictable
    space.end()


def test_restore_after_copy_on_write_in_one_batch_skips_the_copy_blocks():
    """Copies run after every tier op, so a block that a copy of the batch
    reads or writes is never a restore's target, even when it is free again."""
    pool = make_pool(num_blocks=5, num_host_blocks=2)
    cache(pool, "a", [1, 2, 3])  # block 0 cached; free 1
    cache(pool, "e", [5, 6, 7])  # block 2 cached; LRU 0, 2; free 1, 3
    pool.step([Allocate("g", [5]), Fork("g", "h")])  # g, h share partial block 4
    pool.step([Allocate("z", [7] * 3)])  # free 1, 3
    pool.step([Allocate("y", [8])])  # evicts 0 -> host 0
    pool.step([Free("y")])  # free 0
    # g copies 4 -> 0; g, h freed: free 0, 4 (both a copy's); the restore evicts 2 instead
    result = pool.step([Append("g", [6]), Free("g"), Free("h"), Allocate("c", [1, 2, 3])])
    assert result.copy_ops == ((4, 0),)
    assert result.tier_ops == (TierOp(OFFLOAD, 2, 1), TierOp(RESTORE, 2, 0))
    assert pool.block_table("c") == [2, 0]
    check_invariants(pool)


def test_a_device_commit_supersedes_the_host_copy():
    pool = make_pool(num_blocks=4, num_host_blocks=2)
    pool.step([Allocate("a", [1, 2, 3]), Allocate("b", [1, 2, 3])])  # neither is cached yet
    pool.step([Commit("a", 3), Free("a")])  # a's block 0 cached
    pool.take_events()
    pool.step([Allocate("f", [9] * 4)])  # evicts a's block 0 -> host 0
    assert len(pool.blocks.host.index) == 1
    pool.step([Commit("b", 3)])  # b's block 0 holds the same hash: it takes it over
    assert pool.blocks.host.index == {} and pool.take_events() == []
    assert pool.blocks.hash[pool.block_table("b")[0]] is not None
    check_invariants(pool)


def test_snapshots_keep_the_host_tier_exactly_and_old_ones_load_empty():
    pool = make_pool()
    cache(pool, "a", [1, 2, 3, 4, 5])
    pool.step([Allocate("b", [9] * 7)])
    data = json.loads(json.dumps(dump_pool(pool)))
    restored = load_pool(data)
    assert snapshot(restored) == snapshot(pool) and restored.stats() == pool.stats()
    assert restored.deltas[-1].tier_ops == pool.deltas[-1].tier_ops
    check_invariants(restored)
    assert (restored.step([Free("b"), Allocate("c", [1, 2, 3, 4, 5])]) ==
            pool.step([Free("b"), Allocate("c", [1, 2, 3, 4, 5])]))
    del data["host"]
    old = load_pool(data)
    assert old.blocks.host is not None and old.blocks.host.index == {}
    assert old.stats().num_host_cached_blocks == 0


def test_reset_prefix_cache_empties_the_host_tier():
    pool = make_pool()
    cache(pool, "a", [1, 2, 3, 4, 5])
    pool.step([Allocate("b", [9] * 7)])
    pool.reset_prefix_cache()
    assert pool.stats().num_host_cached_blocks == 0 and pool.lookup_prefix([1, 2, 3, 4, 5]) == 0
    check_invariants(pool)


@pytest.mark.parametrize("value", [-1, 1.5, "2", MAX_NUM_BLOCKS + 1, None])
def test_num_host_blocks_must_be_an_int_in_range(value):
    with pytest.raises(InvalidArgument, match="num_host_blocks"):
        make_pool(num_host_blocks=value)


def test_num_host_blocks_at_the_limits_is_accepted():
    assert make_pool(num_host_blocks=0).blocks.host is None
    assert make_pool(num_host_blocks=1).stats().num_host_blocks == 1
