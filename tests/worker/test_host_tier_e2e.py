"""The host tier end to end (issue 28): blockd's engine decides, the wire
carries, a worker copies. A prefix evicted from a small device tier by other
sequences is offloaded to the host tier; allocated again, it is restored
(num_restored_tokens > 0), and attention over the new sequence equals
attention over the original, bit for bit.

The engine, the conversions and the worker runtime are the real ones; every
reply and Watch message crosses as protobuf bytes, as over gRPC (only the
sockets are left out)."""

from __future__ import annotations

import pytest
import torch

from blockd.core.types import OFFLOAD, RESTORE, Allocate, Commit, Free, PoolConfig, Snapshot, StepResult
from blockd.engine.machine import Engine
from blockd.rpc import convert
from blockd.v1 import blockd_pb2 as pb
from worker.runtime import WorkerRuntime

LAYERS, HEADS, Q_HEADS, DIM, B = 2, 2, 4, 16, 4


class Cluster:
    """One engine with one pool, one worker following its Watch stream."""

    def __init__(self, dtype: str) -> None:
        self.engine = Engine()
        config = PoolConfig("p", num_blocks=4, block_size=B, num_layers=LAYERS, num_kv_heads=HEADS,
                            head_dim=DIM, dtype=dtype, num_host_blocks=8)
        self.engine.create_pool(config)
        self.incarnation = self.engine.pool_incarnation("p")
        # the worker reads the config back as blockd-worker does
        reply = pb.PoolConfig.FromString(convert.pool_config_to_proto(self.engine.pool_config("p")).SerializeToString())
        self.runtime = WorkerRuntime(convert.pool_config_from_reply(reply), device="cpu", version_timeout_s=0.5)
        self.runtime.mirror.adopt(self.incarnation)
        self.gen = torch.Generator().manual_seed(1)

    def step(self, ops) -> StepResult:
        result = self.engine.step("p", ops)
        wire = convert.step_result_to_proto(result).SerializeToString()
        for item in self.engine.watch("p", self.runtime.mirror.received_version, lambda: True):
            assert not isinstance(item, Snapshot)
            msg = convert.watch_item_to_proto(item, self.incarnation).SerializeToString()
            self.runtime.mirror.push(convert.watch_item_from_proto(pb.WatchResponse.FromString(msg)))
        return convert.step_result_from_proto(pb.StepResponse.FromString(wire))

    def compute(self, result: StepResult, index: int = 0) -> None:
        """Random K/V into the slots an op's result says to compute, every layer."""
        slots = list(result.results[index].slot_mapping)
        for layer in range(LAYERS):
            key, value = (torch.randn(len(slots), HEADS, DIM, generator=self.gen).to(self.runtime.dtype)
                          for _ in range(2))
            self.runtime.write_kv(result.version, layer, key, value, slots, pool_incarnation=self.incarnation)

    def attend(self, version: int, seq_id: str, length: int, query: torch.Tensor) -> list[torch.Tensor]:
        return [self.runtime.attention(version, layer, [seq_id], [1], [length], query,
                                       pool_incarnation=self.incarnation) for layer in range(LAYERS)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefix_evicted_to_the_host_tier_comes_back_bit_for_bit(dtype):
    cluster = Cluster(dtype)
    prompt = list(range(1, 14))  # 13 tokens: three full blocks cached, the last token computed again
    made = cluster.step([Allocate("a", prompt)])
    cluster.compute(made)
    query = torch.randn(1, Q_HEADS, DIM, generator=cluster.gen).to(cluster.runtime.dtype)
    original = cluster.attend(made.version, "a", 12, query)
    cluster.step([Commit("a", len(prompt)), Free("a")])

    # another sequence needs every device block: a's cached blocks go to the host
    other = cluster.step([Allocate("b", [100 + t for t in range(16)])])
    assert {op.kind for op in other.tier_ops} == {OFFLOAD} and len(other.tier_ops) == 3
    cluster.compute(other)  # b's KV overwrites every device block a's prefix was in
    cluster.runtime.advance(other.version)
    cluster.step([Free("b")])

    again = cluster.step([Allocate("c", prompt)])
    r = again.results[0]
    assert (r.num_cached_tokens, r.num_restored_tokens) == (12, 12)
    assert [op.kind for op in again.tier_ops] == [RESTORE] * 3
    cluster.compute(again)  # the one token past the cached prefix
    restored = cluster.attend(again.version, "c", 12, query)  # the written-slot check passes
    for got, want in zip(restored, original):
        assert torch.equal(got, want)
    assert cluster.runtime.host is not None
    assert (cluster.runtime.host.num_offloads, cluster.runtime.host.num_restores) == (3, 3)
    stats = cluster.engine.get_pool("p")
    assert (stats.num_offloads, stats.num_restores, stats.num_host_blocks) == (3, 3, 8)
