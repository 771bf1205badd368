"""Retention priorities (issue 28): eviction by (priority, LRU) in the device
and host tiers, the highest-holder rule for shared blocks, per-prefix
priorities, rollback, snapshots and the log form; with exact block ids."""

import json

import pytest

from blockd.core import (
    BLOCK_REMOVED,
    DEFAULT_PRIORITY,
    Allocate,
    Append,
    Commit,
    Free,
    InvalidArgument,
    Pool,
    PoolConfig,
    WrongState,
    check_invariants,
)
from blockd.core.state import dump_pool, load_pool, op_from_json, op_to_json
from blockd.core.types import OFFLOAD, TierOp


def make_pool(num_blocks=4, block_size=2, num_host_blocks=0) -> Pool:
    return Pool(PoolConfig("p", num_blocks=num_blocks, block_size=block_size, num_host_blocks=num_host_blocks))


def snapshot(pool) -> str:
    return json.dumps(dump_pool(pool), sort_keys=True)


def cache(pool, seq_id, prompt, priority=DEFAULT_PRIORITY):
    """Allocate, commit and free ``prompt`` at ``priority``: its full blocks become evictable."""
    pool.step([Allocate(seq_id, prompt, priority=priority), Commit(seq_id, len(prompt)), Free(seq_id)])
    check_invariants(pool)


def levels(lru) -> dict[int, list[int]]:
    return {p: list(lru.at(p)) for p in range(8) if list(lru.at(p))}


def test_a_full_pool_evicts_a_newer_low_priority_prefix_before_an_older_default_one():
    pool = make_pool()
    cache(pool, "a", [1, 2, 3, 4, 5])  # blocks 0 1 cached at 4 (LRU 1, 0: tail first); 2 free
    cache(pool, "b", [7, 7, 8, 8], priority=0)  # blocks 3 2 cached at 0, released 2 then 3
    assert levels(pool.blocks.lru) == {0: [2, 3], 4: [1, 0]} and list(pool.blocks.lru) == [2, 3, 1, 0]
    result = pool.step([Allocate("c", [9] * 3)])
    assert result.results[0].new_block_ids == (2, 3)  # b's, though a was released earlier
    assert pool.lookup_prefix([1, 2, 3, 4, 5]) == 4 and pool.lookup_prefix([7, 7, 8, 8]) == 0
    check_invariants(pool)


def test_the_host_tier_keeps_priorities_drops_the_lowest_first_and_a_restore_brings_it_back():
    pool = make_pool(num_blocks=2, num_host_blocks=2)
    cache(pool, "a", [1, 2, 3], priority=6)  # block 0 cached at 6
    cache(pool, "b", [5, 6, 7], priority=0)  # evicts a's block 0 -> host block 0; b's block 1 cached at 0
    cache(pool, "c", [8, 9, 10])  # evicts b's block 1 -> host block 1; c's block 0 cached at 4
    host = pool.blocks.host
    assert host.priority == [6, 0] and levels(host.lru) == {0: [1], 6: [0]}
    pool.take_events()
    result = pool.step([Allocate("d", [11] * 4)])  # free block 1, then evict c: the host tier drops b, newer
    assert result.tier_ops == (TierOp(OFFLOAD, 0, 1),)
    assert [(e.kind, e.block_id, e.medium) for e in pool.take_events()] == [(BLOCK_REMOVED, 1, "host")]
    assert (pool.lookup_prefix([1, 2, 3]), pool.lookup_prefix([5, 6, 7]), pool.lookup_prefix([8, 9, 10])) == (2, 0, 2)
    assert host.priority == [6, 4] and levels(host.lru) == {4: [1], 6: [0]}
    check_invariants(pool)
    pool.step([Free("d")])
    result = pool.step([Allocate("e", [1, 2, 3], priority=0)])  # a restored from host block 0
    block = pool.seqs["e"].table[0]
    assert result.results[0].num_restored_tokens == 2 and pool.blocks.priority[block] == 6
    pool.step([Free("e")])  # released at 0: a keeps 6
    assert block in list(pool.blocks.lru.at(6))
    check_invariants(pool)


@pytest.mark.parametrize(("first", "last"), [(7, 0), (0, 7)])
def test_a_shared_block_keeps_the_highest_priority_of_its_holders(first, last):
    pool = make_pool(num_blocks=8)
    pool.step([Allocate("x", [1, 2, 3], priority=first), Commit("x", 3)])
    pool.step([Allocate("y", [1, 2, 3], priority=last)])  # hits block 0
    assert pool.seqs["y"].table[0] == 0
    pool.step([Free("x")])
    pool.step([Free("y")])
    assert levels(pool.blocks.lru) == {7: [0]}
    cache(pool, "z", [1, 2, 3], priority=0)  # revived and let go by a lower holder: still 7
    assert levels(pool.blocks.lru) == {7: [0]}


def test_a_failed_batch_puts_every_priority_and_lru_list_back():
    pool = make_pool(num_blocks=6)
    cache(pool, "a", [1, 2, 3, 4, 5], priority=2)
    cache(pool, "b", [6, 6, 7, 7, 8])
    pool.step([Allocate("s", [9, 9, 9], priority=1), Commit("s", 3)])
    before = snapshot(pool)
    with pytest.raises(Exception, match="missing"):
        pool.step([Allocate("c", [1, 2, 3, 4, 9], priority=7), Free("c"), Free("s"),
                   Allocate("d", [5] * 9, priority=0), Append("missing", [1])])
    assert snapshot(pool) == before
    check_invariants(pool)


def test_set_prefix_priority_moves_cached_blocks_in_both_tiers():
    pool = make_pool(num_blocks=6, num_host_blocks=2)
    cache(pool, "a", [1, 2, 3, 4, 5])  # blocks 0 1 cached at 4, released tail first
    cache(pool, "b", [6, 6, 7, 7, 8])  # blocks 3 4 (5 freed)
    assert levels(pool.blocks.lru) == {4: [1, 0, 4, 3]}
    done = pool.set_prefix_priority([6, 6, 7, 7, 8], None, 0)  # b goes first now, its tail before its head
    assert (done.priority, done.num_tokens, done.num_device_blocks, done.num_host_blocks) == (0, 4, 2, 0)
    assert levels(pool.blocks.lru) == {0: [4, 3], 4: [1, 0]}
    pool.set_prefix_priority([1, 2], None, 7)  # a's head only
    assert levels(pool.blocks.lru) == {0: [4, 3], 4: [1], 7: [0]}
    result = pool.step([Allocate("c", [9] * 9)])  # 5 blocks: the free 2 and 5, then evict 4 3 1
    assert result.results[0].new_block_ids == (2, 5, 4, 3, 1)
    assert result.tier_ops == (TierOp(OFFLOAD, 4, 0), TierOp(OFFLOAD, 3, 1), TierOp(OFFLOAD, 1, 0))
    host = pool.blocks.host
    assert levels(host.lru) == {0: [1], 4: [0]}  # a's tail took b's tail's host block, at a's priority
    done = pool.set_prefix_priority([1, 2, 3, 4], None, 5)  # a's head on the device, its tail in the host tier
    assert (done.num_device_blocks, done.num_host_blocks) == (1, 1)
    assert levels(pool.blocks.lru) == {5: [0]} and levels(host.lru) == {0: [1], 5: [0]}
    check_invariants(pool)


@pytest.mark.parametrize("priority", [8, -1, True, "4", 2.0, None])
def test_a_priority_out_of_range_is_refused_and_changes_nothing(priority):
    pool = make_pool()
    cache(pool, "a", [1, 2, 3])
    before = snapshot(pool)
    with pytest.raises(InvalidArgument, match=r"priority must be an integer in \[0, 7\]"):
        pool.set_prefix_priority([1, 2], None, priority)
    with pytest.raises(InvalidArgument, match="priority") as err:
        pool.step([Allocate("b", [4]), Allocate("c", [5], priority=priority)])
    assert err.value.op_index == 1 and snapshot(pool) == before


def test_set_prefix_priority_of_a_prefix_not_cached_is_failed_precondition():
    pool = make_pool()
    cache(pool, "a", [1, 2, 3])
    before = snapshot(pool)
    with pytest.raises(WrongState, match="no full block of this prefix is cached"):
        pool.set_prefix_priority([9, 9, 9], None, 1)
    assert snapshot(pool) == before


def test_snapshots_keep_every_priority_and_older_ones_load_at_the_default():
    pool = make_pool(num_blocks=4, num_host_blocks=2)
    cache(pool, "a", [1, 2, 3, 4, 5], priority=1)
    cache(pool, "b", [6, 6, 7, 7, 8], priority=6)
    pool.step([Allocate("c", [9] * 3, priority=3)])  # evicts a's blocks to the host tier
    data = json.loads(json.dumps(dump_pool(pool)))
    restored = load_pool(data)
    assert snapshot(restored) == snapshot(pool) and restored.seqs["c"].priority == 3
    assert levels(restored.blocks.lru) == levels(pool.blocks.lru) == {6: [2, 3]}
    assert levels(restored.blocks.host.lru) == levels(pool.blocks.host.lru) == {1: [0, 1]}
    for part in (data, data["host"], data["seqs"]):
        del part["priority"]
    old = load_pool(data)
    check_invariants(old)
    assert list(old.blocks.lru) == list(pool.blocks.lru) and list(old.blocks.host.lru) == list(pool.blocks.host.lru)
    assert set(levels(old.blocks.lru)) == set(levels(old.blocks.host.lru)) == {DEFAULT_PRIORITY}
    assert old.seqs["c"].priority == DEFAULT_PRIORITY


def test_an_allocates_priority_travels_in_the_log_form_and_default_ones_are_unchanged():
    low, both, plain = Allocate("s", [1], priority=0), Allocate("s", [1], retain_ttl_s=9.0, priority=7), Allocate(
        "s", [1])
    for op in (low, both, plain):
        assert op_from_json(json.loads(json.dumps(op_to_json(op)))) == op
    assert len(op_to_json(plain)) == 4 and op_to_json(low)[4:] == [0.0, 0]
