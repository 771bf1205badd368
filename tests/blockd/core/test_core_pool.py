"""Allocator behaviour with exact block ids, eviction order and errors."""

import pytest

from blockd.core import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    Allocate,
    AlreadyExists,
    Append,
    Commit,
    ExtraKeys,
    Fork,
    Free,
    InvalidArgument,
    NoRoom,
    NotFound,
    Pool,
    PoolConfig,
    SnapshotRequired,
    WrongState,
    check_invariants,
)
from blockd.core.types import DecodeAppend


def make_pool(num_blocks=8, block_size=4, **kw) -> Pool:
    return Pool(PoolConfig("p", num_blocks=num_blocks, block_size=block_size, **kw))


def state(pool):
    s = pool.stats()
    return (pool.tables(), s.num_free_blocks, s.num_used_blocks, s.num_evictable_blocks, s.version,
            s.num_tokens, s.tail_waste_slots, list(pool.blocks.lru), list(pool.blocks.free),
            dict(pool.blocks.index), s.num_evictions, s.num_copies, s.prefix_hit_tokens)


def test_allocate_gives_ascending_fresh_blocks_and_slots():
    pool = make_pool()
    r = pool.step([Allocate("a", list(range(10)))]).results[0]
    assert r.new_block_ids == (0, 1, 2)
    assert r.slot_mapping == tuple(range(10))
    assert r.num_cached_tokens == 0
    assert pool.block_table("a") == [0, 1, 2]
    assert pool.stats().tail_waste_slots == 2
    check_invariants(pool)


def test_empty_sequence_has_no_blocks_and_no_waste():
    pool = make_pool()
    pool.step([Allocate("e", [])])
    assert pool.block_table("e") == []
    assert pool.stats().tail_waste_slots == 0
    r = pool.step([Append("e", [7])]).results[0]
    assert r.new_block_ids == (0,) and r.slot_mapping == (0,)
    check_invariants(pool)


def test_append_crosses_block_boundary_only_when_needed():
    pool = make_pool()
    pool.step([Allocate("a", [1, 2, 3])])
    r = pool.step([Append("a", [4])]).results[0]
    assert r.new_block_ids == () and r.slot_mapping == (3,)
    r = pool.step([Append("a", [5, 6, 7, 8, 9, 10])]).results[0]
    assert r.new_block_ids == (1, 2)
    assert r.slot_mapping == (4, 5, 6, 7, 8, 9)
    assert pool.block_table("a") == [0, 1, 2]


def test_fork_shares_and_append_copies_on_write():
    pool = make_pool()
    pool.step([Allocate("a", list(range(6)))])  # blocks 0, 1 (block 1 half full)
    pool.step([Fork("a", "b")])
    assert pool.block_table("b") == [0, 1]
    assert pool.blocks.ref[0] == 2 and pool.blocks.ref[1] == 2
    step = pool.step([Append("a", [99])])
    r = step.results[0]
    assert r.copy_ops == ((1, 2),) and step.copy_ops == ((1, 2),)
    assert pool.block_table("a") == [0, 2] and pool.block_table("b") == [0, 1]
    assert r.slot_mapping == (2 * 4 + 2,)
    assert pool.stats().num_copies == 1
    # b now owns block 1 alone: no copy
    r = pool.step([Append("b", [42])]).results[0]
    assert r.copy_ops == () and r.slot_mapping == (1 * 4 + 2,)
    check_invariants(pool)


def test_fork_of_full_last_block_needs_no_copy():
    pool = make_pool()
    pool.step([Allocate("a", list(range(8))), Fork("a", "b")])
    r = pool.step([Append("a", [1])]).results[0]
    assert r.copy_ops == () and r.new_block_ids == (2,)
    assert pool.block_table("b") == [0, 1]


def test_prefix_reuse_needs_committed_blocks_and_leaves_last_token():
    pool = make_pool(num_blocks=16)
    prompt = list(range(12))
    pool.step([Allocate("a", prompt)])
    # nothing committed yet: no hit, the KV is not written
    r = pool.step([Allocate("b", prompt)]).results[0]
    assert r.num_cached_tokens == 0
    pool.step([Commit("a", 12)])
    r = pool.step([Allocate("c", prompt)]).results[0]
    # a full hit still leaves the last token (block 2) to compute
    assert r.num_cached_tokens == 8
    assert pool.block_table("c")[:2] == [0, 1]
    assert r.slot_start == 8 and len(r.slot_mapping) == 4
    assert pool.lookup_prefix(prompt) == 12
    stats = pool.stats()
    assert stats.prefix_queried_tokens == 36 and stats.prefix_hit_tokens == 8
    check_invariants(pool)


def test_an_append_implies_written_only_the_tokens_from_before_its_batch():
    """An Append or DecodeAppend says its sequence's earlier tokens are written,
    but the tokens an earlier operation of the same batch handed out are what
    this step computes: committing them published blocks with no K/V in them,
    and a Free in the batch then cached them for a later prompt (hypothesis's
    tier model found it: an offload of a block nobody wrote)."""
    pool = make_pool(num_blocks=16, block_size=2)
    pool.step([Allocate("a", [1, 2, 3, 4, 5, 6, 0, 0])])
    pool.step([DecodeAppend(["a"], [3])])  # the prompt's 8 tokens are written
    assert pool.seqs["a"].num_committed == 8
    pool.step([Append("a", [0, 0, 0, 0, 0]), Append("a", []), Free("a")])
    assert sorted(pool.blocks.index.values()) == [0, 1, 2, 3]  # not blocks 4-6: their K/V was never computed
    check_invariants(pool)

    pool = make_pool(num_blocks=16, block_size=2)
    pool.step([Allocate("b", [1, 2, 3, 4, 5]), DecodeAppend(["b"], [6])])  # the prompt is computed by this step
    assert pool.seqs["b"].num_committed == 0 and not pool.blocks.index
    pool.step([DecodeAppend(["b"], [7]), Append("b", [8]), Fork("b", "c"), DecodeAppend(["c"], [9])])
    # of b's 7 tokens only the 6 from before the batch are written; c's are b's
    assert pool.seqs["b"].num_committed == pool.seqs["c"].num_committed == 6
    assert len(pool.blocks.index) == 3
    check_invariants(pool)


def test_extra_keys_never_share():
    pool = make_pool(num_blocks=16)
    prompt = list(range(9))
    pool.step([Allocate("a", prompt, ExtraKeys(model_id="m", adapter_name="lora1", adapter_id=1)),
               Commit("a", 9)])
    for extra in (ExtraKeys(model_id="m"), ExtraKeys(model_id="m", adapter_name="lora2", adapter_id=2),
                  ExtraKeys(model_id="m", adapter_name="lora1", adapter_id=1, cache_salt="tenant-b"),
                  ExtraKeys(model_id="m", adapter_name="lora1", adapter_id=1, mm_hashes=("img",))):
        assert pool.lookup_prefix(prompt, extra) == 0
    same = ExtraKeys(model_id="m", adapter_name="lora1", adapter_id=1)
    assert pool.lookup_prefix(prompt, same) == 8


def test_eviction_is_lru_and_a_freed_sequence_loses_its_tail_first():
    pool = make_pool(num_blocks=6)
    pool.step([Allocate("a", list(range(12))), Commit("a", 12)])  # blocks 0,1,2 hashed
    pool.step([Allocate("b", list(range(100, 108))), Commit("b", 8)])  # blocks 3,4 hashed
    pool.step([Free("a")])
    pool.step([Free("b")])
    assert list(pool.blocks.lru) == [2, 1, 0, 4, 3]
    events = pool.take_events()
    assert [e.kind for e in events] == [BLOCK_STORED] * 5
    # 1 fresh block left (5); then evictions in LRU order: 2, then 1
    r = pool.step([Allocate("c", list(range(200, 212)))]).results[0]
    assert r.new_block_ids == (5, 2, 1)
    assert pool.stats().num_evictions == 2
    removed = [(e.kind, e.block_id) for e in pool.take_events()]
    assert removed == [(BLOCK_REMOVED, 2), (BLOCK_REMOVED, 1)]
    # a's head block 0 is still cached: hit revives it from the middle of the LRU
    # and its second block comes from evicting the next LRU block, 4
    r = pool.step([Allocate("d", list(range(5)))]).results[0]
    assert r.num_cached_tokens == 4 and pool.block_table("d") == [0, 4]
    assert list(pool.blocks.lru) == [3]
    check_invariants(pool)


def test_watermark_refuses_admission_but_allows_append():
    pool = make_pool(num_blocks=4, watermark_blocks=1)
    pool.step([Allocate("a", list(range(8)))])
    assert pool.can_allocate(list(range(4)))
    pool.step([Allocate("b", list(range(4)))])
    assert not pool.can_allocate([1])
    with pytest.raises(NoRoom) as err:
        pool.step([Allocate("c", [1])])
    assert "reserve" in str(err.value) and err.value.code == "RESOURCE_EXHAUSTED"
    assert pool.can_append("a", 1)
    pool.step([Append("a", [1])])
    assert not pool.can_append("a", 4)
    with pytest.raises(NoRoom):
        pool.step([Append("a", [1, 2, 3, 4])])


def test_can_queries_change_nothing():
    pool = make_pool()
    pool.step([Allocate("a", list(range(9))), Commit("a", 9)])
    before = state(pool)
    pool.can_allocate(list(range(9)))
    pool.can_append("a", 3)
    pool.lookup_prefix(list(range(9)))
    assert state(pool) == before


def test_failed_batch_leaves_no_trace_and_names_the_op():
    pool = make_pool(num_blocks=6)
    pool.step([Allocate("a", list(range(6))), Commit("a", 6), Fork("a", "b")])
    pool.step([Allocate("x", list(range(50, 54))), Commit("x", 4), Free("x")])  # block 2 evictable
    pool.take_events()
    before = state(pool)
    with pytest.raises(NoRoom) as err:
        # CoW, an eviction, a new sequence... then one op too many
        pool.step([Append("a", [1]), Allocate("c", list(range(60, 68))), Free("b"),
                   Append("c", list(range(12)))])
    assert err.value.op_index == 3 and "operation 3 (append 'c')" in str(err.value)
    assert state(pool) == before
    assert pool.take_events() == []
    check_invariants(pool)
    with pytest.raises(WrongState) as err:
        pool.step([Free("a"), Free("a")])
    assert err.value.op_index == 1
    assert state(pool) == before


@pytest.mark.parametrize(("op", "exc"), [
    (Allocate("", [1]), InvalidArgument),
    (Allocate("a", [-1]), InvalidArgument),
    (Allocate("a", [2**32]), InvalidArgument),
    (Allocate("a", "abc"), InvalidArgument),
    (Allocate("s", [1]), AlreadyExists),
    (Append("nope", [1]), NotFound),
    (Append("s", [1.5]), InvalidArgument),
    (Append("s", ["7"]), InvalidArgument),
    (Commit("s", 5), InvalidArgument),
    (Commit("s", -1), InvalidArgument),
    (Fork("s", "s"), AlreadyExists),
    (Fork("nope", "t"), NotFound),
    (Free("nope"), NotFound),
    (DecodeAppend(["s"], [1, 2]), InvalidArgument),
    (DecodeAppend(["nope"], [1]), NotFound),
])
def test_bad_input_is_refused_without_change(op, exc):
    pool = make_pool()
    pool.step([Allocate("s", [1, 2, 3])])
    before = state(pool)
    with pytest.raises(exc) as err:
        pool.step([op])
    assert err.value.message
    assert state(pool) == before


def test_bad_configs_are_refused():
    for kw in ({"block_size": 0}, {"block_size": -4}, {"num_blocks": 0}, {"watermark_blocks": 99},
               {"dtype": "float64"}, {"name": ""}):
        args = {"name": "p", "num_blocks": 8, "block_size": 4, **kw}
        with pytest.raises(InvalidArgument):
            Pool(PoolConfig(**args))


def test_decode_append_matches_single_appends():
    a, b = make_pool(num_blocks=32), make_pool(num_blocks=32)
    for pool in (a, b):
        pool.step([Allocate("x", list(range(7))), Allocate("y", list(range(4))), Fork("x", "z")])
    for step in range(6):
        ra = a.step([DecodeAppend(["x", "y", "z"], [step, step + 1, step + 2])]).results[0]
        rb = b.step([Append("x", [step]), Append("y", [step + 1]), Append("z", [step + 2])]).results
        assert ra.slot_mapping == tuple(r.slot_mapping[0] for r in rb)
        assert ra.copy_ops == tuple(c for r in rb for c in r.copy_ops)
        assert state(a) == state(b)
        check_invariants(a)


def test_versions_and_deltas_replay_to_the_same_tables():
    pool = make_pool(num_blocks=16, max_retained_versions=4)
    replica: dict[str, list[int]] = {}
    seen = 0
    steps = [[Allocate("a", list(range(6)))], [Fork("a", "b")], [Append("a", [1, 2, 3])],
             [Free("b"), Allocate("c", [1])], [Commit("a", 9)]]
    for ops in steps:
        pool.step(ops)
        for delta in pool.deltas_since(seen):
            for update in delta.updates:
                if update.freed:
                    del replica[update.seq_id]
                else:
                    replica[update.seq_id] = replica.get(update.seq_id, [])[: update.keep] + list(update.block_ids)
            seen = delta.version
        assert replica == pool.tables()
    assert pool.version == 5
    assert pool.deltas_since(5) == []
    with pytest.raises(SnapshotRequired):
        pool.deltas_since(0)
    with pytest.raises(WrongState):
        pool.deltas_since(6)
    assert [d.version for d in pool.deltas_since(1)] == [2, 3, 4, 5]


def test_events_are_numbered_and_reset_clears_cache():
    pool = make_pool()
    pool.step([Allocate("a", list(range(8))), Commit("a", 8)])
    pool.step([Free("a")])
    pool.reset_prefix_cache()
    events = pool.take_events()
    assert [e.seq_no for e in events] == [1, 2, 3]
    assert [e.kind for e in events] == [BLOCK_STORED, BLOCK_STORED, ALL_BLOCKS_CLEARED]
    assert events[1].parent_hash == events[0].block_hash
    assert pool.stats().num_evictable_blocks == 0 and pool.lookup_prefix(list(range(8))) == 0
    check_invariants(pool)


def test_using_a_freed_sequence_is_wrong_state_until_reallocated():
    pool = make_pool()
    pool.step([Allocate("a", [1, 2, 3]), Free("a")])
    for op in (Append("a", [1]), Commit("a", 1), Fork("a", "b"), Free("a"), DecodeAppend(["a"], [1])):
        with pytest.raises(WrongState, match="freed at version 1"):
            pool.step([op])
    with pytest.raises(NotFound):
        pool.step([Append("never", [1])])
    pool.step([Allocate("a", [4])])
    pool.step([Append("a", [5])])
    assert pool.seqs["a"].token_ids == [4, 5]


def test_dry_run_answers_like_the_real_step_and_changes_nothing():
    pool = make_pool(num_blocks=6)
    pool.step([Allocate("a", list(range(6))), Commit("a", 6), Fork("a", "b")])
    pool.take_events()
    before = state(pool)
    ops = [Append("a", [1]), Allocate("c", list(range(4))), Free("b")]
    dry = pool.step(ops, dry_run=True)
    assert state(pool) == before and pool.take_events() == []
    with pytest.raises(NoRoom) as err:
        pool.step([*ops, Allocate("d", list(range(40)))], dry_run=True)
    assert err.value.op_index == 3 and state(pool) == before
    real = pool.step(ops)
    assert dry.results == real.results and dry.copy_ops == real.copy_ops
    assert dry.version == real.version - 1


def test_rollback_keeps_the_tombstones_and_their_order():
    """Tombstones change only when a batch commits, so a failed batch that
    re-allocated and re-freed ids leaves them exactly as they were."""
    pool = make_pool()
    pool.step([Allocate("a", [1]), Allocate("b", [2]), Allocate("c", [3])])
    pool.step([Free("a")])
    pool.step([Free("b")])
    before = list(pool.freed.items())
    assert before == [("a", 2), ("b", 3)]
    with pytest.raises(NotFound):
        pool.step([Allocate("a", [1]), Free("c"), Free("a"), Append("missing", [1])])
    assert list(pool.freed.items()) == before
    with pytest.raises(WrongState, match="freed at version 4"):  # the batch sees its own frees
        pool.step([Free("c"), Append("c", [1])])
    pool.step([Allocate("a", [1]), Free("c")])
    assert list(pool.freed.items()) == [("b", 3), ("c", 4)]


def test_a_failed_batch_announces_none_of_its_evictions():
    pool = make_pool(num_blocks=3)
    pool.step([Allocate("a", list(range(8))), Commit("a", 8), Free("a")])  # blocks 0, 1 cached
    pool.take_events()
    with pytest.raises(NotFound):  # takes fresh block 2, evicts block 1, then fails
        pool.step([Allocate("b", list(range(50, 58))), Append("missing", [1])])
    assert pool.lookup_prefix(list(range(8))) == 8 and pool.stats().num_evictions == 0
    r = pool.step([Allocate("c", [9])])  # takes block 2: no eviction
    assert r.results[0].new_block_ids == (2,)
    assert pool.take_events() == []
    check_invariants(pool)


def test_failed_decode_restores_fills_when_a_sequence_repeats_across_a_block():
    """A sequence decoded twice in one batch fills its last block and then
    takes a new one; the failed batch must give every block back its fill,
    free ones included."""
    from blockd.core.state import dump_pool

    pool = make_pool(num_blocks=8)
    pool.step([Allocate("a", list(range(3))), Allocate("x", [1]), Free("x")])  # block 1 on the free list
    pool.step([Allocate("s", [1, 2]), Fork("s", "t")])  # s, t share block 2, half full
    before = dump_pool(pool)
    with pytest.raises(NotFound) as err:
        pool.step([DecodeAppend(["a", "s"], [7, 9]), DecodeAppend(["a"], [8]), DecodeAppend(["a"], [10]),
                   Append("missing", [1])])
    assert err.value.op_index == 3
    assert dump_pool(pool) == before
    check_invariants(pool)


def test_a_decode_that_runs_out_of_blocks_midway_changes_nothing():
    """The step stops on a sequence after others crossed a block, copied a
    shared block on write and committed a full one: every one of them, and
    the one it stopped on (whose earlier tokens it had committed), comes back
    exactly, block fills and hashes included (decode's columnar undo)."""
    from blockd.core.state import dump_pool

    pool = make_pool(num_blocks=5)  # block size 4
    pool.step([Allocate("full", [1, 2, 3, 4]), Allocate("shared", [5, 6]), Fork("shared", "twin"),
               Allocate("last", [9, 9, 9, 8])])  # 3 blocks used, 2 free; no block committed yet
    before = dump_pool(pool)
    # full commits and crosses (takes a block), shared copies on write (takes the other),
    # last commits its full block, then finds none to cross into
    with pytest.raises(NoRoom) as err:
        pool.step([DecodeAppend(["full", "shared", "last"], [7, 8, 10])])
    assert err.value.op_index == 0 and "last" in str(err.value)
    assert dump_pool(pool) == before
    check_invariants(pool)
    result = pool.step([DecodeAppend(["full", "shared"], [7, 8])])  # and the same step without it works
    assert len(result.copy_ops) == 1 and len(result.results[0].new_block_ids) == 1
    check_invariants(pool)


def test_copy_on_write_is_the_same_for_append_and_decode():
    a, b = make_pool(), make_pool()
    for pool in (a, b):
        pool.step([Allocate("s", [1, 2, 3, 4, 5]), Fork("s", "t")])
    ra = a.step([Append("t", [6])])
    rb = b.step([DecodeAppend(["t"], [6])])
    assert ra.copy_ops == rb.copy_ops == ((1, 2),)
    assert ra.results[0].slot_mapping == rb.results[0].slot_mapping == (2 * 4 + 1,)
    assert a.deltas_since(1) == b.deltas_since(1)
    assert state(a) == state(b)


def test_a_decode_naming_a_sequence_twice_is_refused_and_changes_nothing():
    from blockd.core.state import dump_pool

    pool = make_pool(num_blocks=8)
    pool.step([Allocate("e", [1, 2, 3])])
    before = dump_pool(pool)
    with pytest.raises(InvalidArgument, match=r"names sequence 'e' twice \(again at seq_ids\[1\]\)") as err:
        pool.step([DecodeAppend(["e", "e"], [1, 2])])
    assert err.value.op_index == 0
    assert dump_pool(pool) == before
    check_invariants(pool)


def test_an_id_allocated_twice_in_one_batch_is_called_a_duplicate_not_an_existing_sequence():
    pool = make_pool(num_blocks=8)
    with pytest.raises(InvalidArgument, match="'d' is created twice in this batch") as err:
        pool.step([Allocate("d", [1]), Allocate("d", [2])])
    assert err.value.op_index == 1
    with pytest.raises(InvalidArgument, match="created twice in this batch"):
        pool.step([Allocate("p", [1]), Fork("p", "p2"), Allocate("p2", [2])])
    assert not pool.seqs
    pool.step([Allocate("d", [1])])
    with pytest.raises(AlreadyExists, match="'d' already exists"):
        pool.step([Allocate("d", [2])])
    pool.step([Free("d"), Allocate("d", [3])])  # freed then allocated again in one batch: fine
    check_invariants(pool)


def test_events_follow_the_batch_order_when_a_block_is_stored_then_evicted():
    pool = make_pool(num_blocks=2, block_size=2)
    pool.step([Allocate("a", [1, 2, 3])])
    pool.step([Commit("a", 2), Free("a"), Allocate("b", [9, 9, 9])])  # a's block 0 is cached, then evicted
    assert [(e.kind, e.block_id) for e in pool.take_events()] == [(BLOCK_STORED, 0), (BLOCK_REMOVED, 0)]
    assert pool.blocks.index == {}
