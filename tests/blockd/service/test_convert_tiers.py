"""The host tier's fields on the wire (issue 28): each round-trips through
blockd.rpc.convert, what the wire types cannot check is refused with the field
named, and a message without them (an older blockd's) reads as "no tier"."""

from __future__ import annotations

import pytest

from blockd.core.types import (
    BLOCK_REMOVED,
    BLOCK_STORED,
    OFFLOAD,
    RESTORE,
    KVEvent,
    OpResult,
    PoolConfig,
    PoolStats,
    StepResult,
    TableUpdate,
    TierOp,
    VersionDelta,
)
from blockd.rpc import convert
from blockd.rpc.errors import BadField
from blockd.v1 import blockd_pb2 as pb

TIER_OPS = (TierOp(OFFLOAD, 3, 0), TierOp(OFFLOAD, 4, 7), TierOp(RESTORE, 3, 5))


def test_pool_config_carries_num_host_blocks_both_ways():
    config = PoolConfig(name="p", num_blocks=8, block_size=4, num_host_blocks=32)
    msg = convert.pool_config_to_proto(config)
    assert msg.num_host_blocks == 32
    assert convert.pool_config_from_proto(msg) == config
    assert convert.pool_config_from_reply(pb.PoolConfig.FromString(msg.SerializeToString())) == config


def test_a_config_without_the_field_has_no_host_tier():
    msg = pb.PoolConfig(name="p", num_blocks=8, block_size=4)
    assert convert.pool_config_from_proto(msg).num_host_blocks == 0
    assert convert.pool_config_from_reply(msg).num_host_blocks == 0


def test_pool_stats_carry_the_host_counts():
    stats = PoolStats(name="p", num_blocks=8, block_size=4, num_free_blocks=1, num_used_blocks=2,
                      num_evictable_blocks=3, num_seqs=1, num_tokens=9, tail_waste_slots=0, tail_waste_bytes=0,
                      prefix_queried_tokens=8, prefix_hit_tokens=4, num_evictions=5, num_copies=0, version=6,
                      last_event_seq_no=7, num_host_blocks=32, num_host_cached_blocks=5, num_offloads=11,
                      num_restores=4)
    wire = convert.stats_to_proto(stats).SerializeToString()
    assert convert.stats_from_proto(pb.PoolStats.FromString(wire)) == stats


def test_step_result_carries_tier_ops_in_order_and_restored_tokens():
    result = StepResult(version=9, results=(
        OpResult(seq_id="s", num_tokens=12, num_cached_tokens=8, new_block_ids=(3, 9, 2), slot_start=8,
                 slot_mapping=(8, 9, 10, 11), num_restored_tokens=4),), copy_ops=((1, 2),),
        incarnation="inc", term=2, tier_ops=TIER_OPS)
    wire = convert.step_result_to_proto(result).SerializeToString()
    back = convert.step_result_from_proto(pb.StepResponse.FromString(wire))
    assert back == result
    assert back.tier_ops == TIER_OPS and back.results[0].num_restored_tokens == 4


def test_watch_delta_carries_tier_ops_before_copy_ops():
    delta = VersionDelta(version=5, updates=(TableUpdate("s", 0, (3, 4)),), copy_ops=((3, 6),), term=0,
                         tier_ops=TIER_OPS)
    msg = convert.watch_item_to_proto(delta, "inc")
    assert [op.kind for op in msg.delta.tier_ops] == [pb.TIER_OP_KIND_OFFLOAD, pb.TIER_OP_KIND_OFFLOAD,
                                                       pb.TIER_OP_KIND_RESTORE]
    assert convert.watch_item_from_proto(pb.WatchResponse.FromString(msg.SerializeToString())) == delta


def test_a_delta_without_tier_ops_reads_as_none():
    msg = pb.WatchResponse(delta=pb.VersionDelta(version=1, copy_ops=[pb.CopyOp(src_block_id=1, dst_block_id=2)]))
    delta = convert.watch_item_from_proto(msg)
    assert isinstance(delta, VersionDelta) and delta.tier_ops == () and delta.copy_ops == ((1, 2),)


@pytest.mark.parametrize(("op", "words"), [
    (TierOp("evict", 1, 2), "tier_ops[0].kind is 'evict'"),
    (TierOp(OFFLOAD, -1, 2), "both must be integers >= 0"),
    (TierOp(RESTORE, 1, -2), "both must be integers >= 0"),
    (TierOp(RESTORE, 1, True), "both must be integers >= 0"),
])
def test_a_tier_op_the_wire_cannot_hold_is_refused_naming_it(op, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        convert.tier_ops_to_proto([op])


@pytest.mark.parametrize("kind", [pb.TIER_OP_KIND_UNSPECIFIED, 7])
def test_an_unknown_tier_op_kind_is_refused_not_skipped(kind):
    # a worker that skipped it would hold other KV than blockd's tables say
    msg = pb.WatchResponse(delta=pb.VersionDelta(version=1, tier_ops=[
        pb.TierOp(kind=pb.TIER_OP_KIND_OFFLOAD, device_block_id=1, host_block_id=1),
        pb.TierOp(kind=kind, device_block_id=1, host_block_id=1)]))
    with pytest.raises(BadField) as err:
        convert.watch_item_from_proto(msg)
    assert err.value.field == "delta.tier_ops[1].kind"


@pytest.mark.parametrize("medium", ["device", "host"])
def test_events_carry_their_medium(medium):
    event = KVEvent(4, BLOCK_REMOVED, b"h" * 16, b"", 3, (), medium=medium)
    wire = convert.event_to_proto(event).SerializeToString()
    assert convert.event_from_proto(pb.KVEvent.FromString(wire)) == event


def test_an_event_without_a_medium_is_on_the_device_and_a_bad_one_is_refused():
    assert convert.event_from_proto(pb.KVEvent(seq_no=1, kind=pb.EVENT_KIND_BLOCK_STORED)).medium == "device"
    with pytest.raises(ValueError, match="medium"):
        convert.event_to_proto(KVEvent(1, BLOCK_STORED, b"", b"", 1, (), medium="disk"))
