"""Pins in the allocator: a pinned prefix holds its device blocks as a table
would, so pressure that evicts unpinned prefixes never takes it; what a pin
holds, refuses and gives back, exactly."""

import json

import pytest

from blockd.core import (
    Allocate,
    Commit,
    Free,
    InvalidArgument,
    NotFound,
    Pool,
    PoolConfig,
    WrongState,
    check_invariants,
)
from blockd.core.pool import MAX_PINS
from blockd.core.state import dump_pool, load_pool, op_from_json, op_to_json


def cached(pool: Pool, seq_id: str, prompt: list[int]) -> None:
    """``prompt`` allocated, committed and freed: its full blocks are evictable, cached."""
    pool.step([Allocate(seq_id, prompt)])
    pool.step([Commit(seq_id, len(prompt)), Free(seq_id)])


def test_a_pin_holds_the_cached_prefix_through_pressure_that_evicts_the_rest() -> None:
    pool = Pool(PoolConfig("p", num_blocks=6, block_size=2))
    cached(pool, "a", [1, 2, 3, 4, 5])  # blocks 0, 1 cached; 2 freed
    cached(pool, "b", [7, 8, 9, 9])  # blocks 3, 4 cached
    pin = pool.pin_prefix([1, 2, 3, 4, 5, 6])
    assert (pin.pin_id, pin.block_ids, pin.num_tokens) == ("pin-1", (0, 1), 4)
    stats = pool.stats()
    assert (stats.num_pinned_blocks, stats.num_pins, stats.num_used_blocks, stats.num_evictable_blocks) == (2, 1, 2, 2)
    assert not pool.can_allocate(list(range(20, 30)))  # 5 blocks: only 4 are free or evictable
    pool.step([Allocate("c", list(range(20, 28)))])  # takes every block but the pinned ones
    check_invariants(pool)
    assert pool.lookup_prefix([1, 2, 3, 4]) == 4 and pool.lookup_prefix([7, 8, 9, 9]) == 0
    pool.step([Free("c")])
    assert pool.unpin("pin-1") == pin
    check_invariants(pool)
    assert pool.stats().num_pinned_blocks == 0 and list(pool.blocks.lru)[-2:] == [0, 1]  # most recent


def test_what_is_not_cached_on_the_device_is_not_pinned_and_nothing_changes() -> None:
    pool = Pool(PoolConfig("p", num_blocks=4, block_size=2, num_host_blocks=4))
    cached(pool, "a", [1, 2, 3, 4, 5])
    before = json.dumps(dump_pool(pool), sort_keys=True)
    with pytest.raises(WrongState, match="no full block of this prefix is cached in the device tier"):
        pool.pin_prefix([9, 9, 9])
    with pytest.raises(InvalidArgument):
        pool.pin_prefix([1, 2, -1])
    with pytest.raises(InvalidArgument, match="expires_at"):
        pool.pin_prefix([1, 2], expires_at=-1)
    with pytest.raises(NotFound, match="no pin 'pin-7'"):
        pool.unpin("pin-7")
    assert json.dumps(dump_pool(pool), sort_keys=True) == before
    pool.step([Allocate("big", list(range(20, 28)))])  # offloads blocks 0 and 1 to the host tier
    assert pool.lookup_prefix([1, 2, 3, 4]) == 4 and pool.pinnable([1, 2, 3, 4]) == []
    pool.step([Free("big"), Allocate("a2", [1, 2, 3, 4, 5])])  # restored to the device
    pool.step([Commit("a2", 5)])
    assert pool.pin_prefix([1, 2, 3, 4]).num_tokens == 4
    check_invariants(pool)


def test_pins_share_blocks_and_count_each_block_once() -> None:
    pool = Pool(PoolConfig("p", num_blocks=4, block_size=2))
    cached(pool, "a", [1, 2, 3, 4])
    first, second = pool.pin_prefix([1, 2, 3, 4]), pool.pin_prefix([1, 2])
    assert (first.block_ids, second.block_ids, second.pin_id) == ((0, 1), (0,), "pin-2")
    assert pool.stats().num_pinned_blocks == 2 and pool.blocks.ref[0] == 2
    pool.unpin("pin-1")
    assert pool.stats().num_pinned_blocks == 1 and pool.pinned == {0: 1}
    check_invariants(pool)


def test_pins_survive_a_snapshot_and_a_reset_drops_them() -> None:
    pool = Pool(PoolConfig("p", num_blocks=4, block_size=2, tenant="acme"))
    cached(pool, "a", [1, 2, 3, 4])
    pin = pool.pin_prefix([1, 2, 3, 4], expires_at=1234.5)
    restored = load_pool(json.loads(json.dumps(dump_pool(pool))))
    check_invariants(restored)
    assert restored.pins == {"pin-1": pin} and pin.tenant == "acme" and restored.pinned == pool.pinned
    assert restored.pin_prefix([1, 2]).pin_id == "pin-2"  # ids are never reused
    unpinned = Pool(PoolConfig("q", num_blocks=4, block_size=2))
    cached(unpinned, "a", [1, 2, 3, 4])
    old = dump_pool(unpinned)
    del old["pins"]  # a snapshot from before pins
    older = load_pool(old)
    assert not older.pins and older.num_pins_made == 0
    check_invariants(older)
    restored.reset_prefix_cache()
    assert not restored.pins and restored.stats().num_free_blocks == 4
    check_invariants(restored)


def test_a_pool_holds_at_most_max_pins() -> None:
    pool = Pool(PoolConfig("p", num_blocks=2, block_size=1))
    cached(pool, "a", [1, 2])
    for _ in range(MAX_PINS):
        pool.pin_prefix([1])
    with pytest.raises(WrongState, match="unpin some first"):
        pool.pin_prefix([1])
    assert pool.blocks.ref[0] == MAX_PINS


def test_an_allocates_retain_ttl_s_travels_in_the_log_form_and_plain_ones_are_unchanged() -> None:
    retained, plain = Allocate("s", [1, 2], retain_ttl_s=30.0), Allocate("s", [1, 2])
    assert op_from_json(json.loads(json.dumps(op_to_json(retained)))) == retained
    assert op_to_json(plain) == ["A", "s", [1, 2], op_to_json(plain)[3]] and op_from_json(op_to_json(plain)) == plain
