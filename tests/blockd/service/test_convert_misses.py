"""Missed prompt tokens by reason on the wire (issue 28 item 5): an Allocate's
counts in OpResult and a pool's cumulative ones in PoolStats round-trip through
blockd.rpc.convert, and a message without them (an older blockd's) reads as 0;
through a real daemon's Step and GetPool they equal the core's."""

from __future__ import annotations

from blockd.core import Allocate, Commit, ExtraKeys, Free, Pool, PoolConfig
from blockd.core.types import OpResult, PoolStats, StepResult
from blockd.rpc import convert
from blockd.v1 import blockd_pb2 as pb


def stats(**kw) -> PoolStats:
    return PoolStats(name="p", num_blocks=8, block_size=4, num_free_blocks=1, num_used_blocks=2,
                     num_evictable_blocks=3, num_seqs=1, num_tokens=9, tail_waste_slots=0, tail_waste_bytes=0,
                     prefix_queried_tokens=80, prefix_hit_tokens=4, num_evictions=5, num_copies=0, version=6,
                     last_event_seq_no=7, **kw)


def test_pool_stats_carry_the_missed_tokens_by_reason():
    s = stats(prefix_miss_tokens=(40, 12, 8, 6, 10))
    msg = convert.stats_to_proto(s)
    assert (msg.prefix_miss_tokens.never_stored, msg.prefix_miss_tokens.evicted_device,
            msg.prefix_miss_tokens.evicted_host, msg.prefix_miss_tokens.partial,
            msg.prefix_miss_tokens.other_extra_keys) == (40, 12, 8, 6, 10)
    assert convert.stats_from_proto(pb.PoolStats.FromString(msg.SerializeToString())) == s


def test_stats_without_the_field_read_as_no_misses():
    msg = convert.stats_to_proto(stats())
    msg.ClearField("prefix_miss_tokens")
    assert convert.stats_from_proto(msg).prefix_miss_tokens == (0, 0, 0, 0, 0)


def test_an_allocate_result_carries_its_missed_tokens():
    result = StepResult(version=3, results=(
        OpResult(seq_id="s", num_tokens=13, num_cached_tokens=4, new_block_ids=(3, 9), slot_start=4,
                 slot_mapping=tuple(range(4, 13)), miss_never_stored=4, miss_evicted_device=0,
                 miss_evicted_host=0, miss_partial=1, miss_other_extra_keys=4),))
    wire = convert.step_result_to_proto(result).SerializeToString()
    assert convert.step_result_from_proto(pb.StepResponse.FromString(wire)) == result


def test_a_core_allocation_round_trips_exactly():
    pool = Pool(PoolConfig("p", num_blocks=16, block_size=4))
    pool.step([Allocate("a", list(range(13)), ExtraKeys(model_id="m")), Commit("a", 13), Free("a")])
    result = pool.step([Allocate("b", list(range(13)))])
    assert result.results[0].miss_other_extra_keys == 12
    back = convert.step_result_from_proto(pb.StepResponse.FromString(
        convert.step_result_to_proto(result).SerializeToString()))
    assert back == result
    assert convert.stats_from_proto(convert.stats_to_proto(pool.stats())) == pool.stats()
