"""A worker's host tier (issue 28): blocks offloaded to host memory and restored
into other device blocks hold the very bytes they held, attention over them
equals attention over the originals bit for bit, and the written-slot record
vouches for a restored block exactly where its offloaded source was written.

Driven by hand-made VersionDeltas with TierOps, as the table mirror receives
them over Watch; the runtime, its mirror, its kernels and its record are the
real ones."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from blockd.core.incarnations import KVNotWritten
from blockd.core.types import OFFLOAD, RESTORE, PoolConfig, TableUpdate, TierOp, VersionDelta
from worker.kernels import move_blocks
from worker.layout import KVGeometry, allocate_host_pool
from worker.metrics import WorkerMetrics
from worker.runtime import WorkerRuntime
from worker.tables import MirrorBroken
from worker.tiers import batches

LAYERS, HEADS, Q_HEADS, DIM, B = 2, 2, 4, 16, 4


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA path: needs a GPU, torch.cuda.is_available() is False"))


def _runtime(num_host_blocks: int = 8, dtype: str = "float32", metrics=None, device: str = "cpu") -> WorkerRuntime:
    config = PoolConfig("p", num_blocks=8, block_size=B, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                        dtype=dtype, num_host_blocks=num_host_blocks)
    return WorkerRuntime(config, device=device, version_timeout_s=0.2, metrics=metrics)


class Feed:
    """Hand-made deltas into one runtime's mirror, numbered in order."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.gen = torch.Generator().manual_seed(0)

    def delta(self, *updates: TableUpdate, tier_ops=(), copy_ops=()) -> int:
        version = self.runtime.mirror.received_version + 1
        self.runtime.mirror.push(VersionDelta(version, tuple(updates), tuple(copy_ops), tier_ops=tuple(tier_ops)))
        return version

    def write(self, version: int, slots: list[int]) -> None:
        """Random K/V into ``slots`` of every layer."""
        for layer in range(LAYERS):
            key = torch.randn(len(slots), HEADS, DIM, generator=self.gen).to(self.runtime.device, self.runtime.dtype)
            value = torch.randn(len(slots), HEADS, DIM, generator=self.gen).to(self.runtime.device, self.runtime.dtype)
            self.runtime.write_kv(version, layer, key, value, slots)

    def attend(self, version: int, seq_id: str, length: int, query: torch.Tensor) -> list[torch.Tensor]:
        """Decode attention of ``query`` over the first ``length`` tokens of ``seq_id``, every layer."""
        return [self.runtime.attention(version, layer, [seq_id], [1], [length], query) for layer in range(LAYERS)]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_over_restored_blocks_equals_the_originals_bit_for_bit(dtype, device):
    """On CUDA the host tier is pinned memory and the moves cross PCIe; the bytes must still be equal."""
    runtime = _runtime(dtype=dtype, device=device)
    feed = Feed(runtime)
    v1 = feed.delta(TableUpdate("a", 0, (0, 1, 2)))
    feed.write(v1, list(range(10)))  # 10 tokens: two full blocks, 2 slots of the third
    query = torch.randn(1, Q_HEADS, DIM, generator=feed.gen).to(runtime.device, runtime.dtype)
    original = feed.attend(v1, "a", 10, query)
    blocks = runtime.kv[:, :, [0, 1, 2]].clone()

    # "a"'s blocks go to the host; other KV overwrites every device block they held
    feed.delta(TableUpdate("a", 0, (), freed=True),
               tier_ops=[TierOp(OFFLOAD, 0, 5), TierOp(OFFLOAD, 1, 2), TierOp(OFFLOAD, 2, 7)])
    v3 = feed.delta(TableUpdate("x", 0, (0, 1, 2)))
    feed.write(v3, list(range(12)))
    assert not torch.equal(runtime.kv[:, :, [0, 1, 2]], blocks)

    # back into other device blocks, in the same version as the table that reads them
    v4 = feed.delta(TableUpdate("b", 0, (6, 3, 4)),
                    tier_ops=[TierOp(RESTORE, 6, 5), TierOp(RESTORE, 3, 2), TierOp(RESTORE, 4, 7)])
    restored = feed.attend(v4, "b", 10, query)  # the written-slot check passes for restored blocks
    assert torch.equal(runtime.kv[:, :, [6, 3, 4]], blocks)
    for got, want in zip(restored, original):
        assert torch.equal(got, want)
    assert runtime.stats()["tier_ops_applied"] == 6 and runtime.host is not None
    assert (runtime.host.num_offloads, runtime.host.num_restores) == (3, 3)


def test_a_restored_block_is_written_only_where_its_offloaded_source_was():
    runtime = _runtime()
    feed = Feed(runtime)
    v1 = feed.delta(TableUpdate("a", 0, (0, 1)))
    feed.write(v1, list(range(6)))  # block 0 full, block 1: slots 4 and 5 of 4..7
    feed.delta(TableUpdate("a", 0, (), freed=True), tier_ops=[TierOp(OFFLOAD, 0, 0), TierOp(OFFLOAD, 1, 1)])
    v3 = feed.delta(TableUpdate("b", 0, (2, 3)), TableUpdate("c", 0, (5,)),
                    tier_ops=[TierOp(RESTORE, 2, 0), TierOp(RESTORE, 3, 1), TierOp(RESTORE, 5, 6)])
    query = torch.zeros(1, Q_HEADS, DIM)
    feed.attend(v3, "b", 6, query)  # what was written comes back written
    with pytest.raises(KVNotWritten, match="positions 6 of its 7"):
        feed.attend(v3, "b", 7, query)  # slot 6 was never written before the offload
    with pytest.raises(KVNotWritten, match="'c'"):
        feed.attend(v3, "c", 1, query)  # host block 6 was never offloaded to


def test_a_snapshot_forgets_what_the_host_tier_held():
    """A snapshot skips the tier ops of the versions between: no host block is vouched for after it."""
    runtime = _runtime()
    feed = Feed(runtime)
    v1 = feed.delta(TableUpdate("a", 0, (0,)))
    feed.write(v1, list(range(4)))
    v2 = feed.delta(TableUpdate("a", 0, (), freed=True), tier_ops=[TierOp(OFFLOAD, 0, 3)])
    runtime.advance(v2)
    runtime.mirror.load_snapshot(v2 + 5, {})
    v = feed.delta(TableUpdate("b", 0, (1,)), tier_ops=[TierOp(RESTORE, 1, 3)])
    with pytest.raises(KVNotWritten):
        feed.attend(v, "b", 4, torch.zeros(1, Q_HEADS, DIM))


@pytest.mark.parametrize(("ops", "want"), [
    ([], []),
    ([TierOp(OFFLOAD, 1, 0), TierOp(OFFLOAD, 2, 1)], [(OFFLOAD, [1, 2], [0, 1])]),
    # a kind change cuts: the restore may read what the offload wrote
    ([TierOp(OFFLOAD, 1, 0), TierOp(RESTORE, 2, 0), TierOp(OFFLOAD, 3, 1)],
     [(OFFLOAD, [1], [0]), (RESTORE, [2], [0]), (OFFLOAD, [3], [1])]),
    # a repeated destination cuts: the later copy must land last
    ([TierOp(OFFLOAD, 1, 0), TierOp(OFFLOAD, 2, 0), TierOp(OFFLOAD, 3, 1)],
     [(OFFLOAD, [1], [0]), (OFFLOAD, [2, 3], [0, 1])]),
    ([TierOp(RESTORE, 4, 0), TierOp(RESTORE, 5, 0), TierOp(RESTORE, 4, 1)],
     [(RESTORE, [4, 5], [0, 0]), (RESTORE, [4], [1])]),
])
def test_tier_ops_run_as_few_batches_as_their_order_allows(ops, want):
    assert batches(ops) == want


def test_ops_are_run_in_order_across_kinds_and_repeated_destinations():
    """Reference: one block copy at a time, in list order."""
    runtime = _runtime(num_host_blocks=4)
    feed = Feed(runtime)
    v1 = feed.delta(TableUpdate("a", 0, tuple(range(8))))
    feed.write(v1, list(range(32)))
    ops = [TierOp(OFFLOAD, 0, 0), TierOp(OFFLOAD, 1, 0), TierOp(OFFLOAD, 2, 1), TierOp(RESTORE, 3, 0),
           TierOp(RESTORE, 4, 1), TierOp(OFFLOAD, 3, 2), TierOp(RESTORE, 5, 2), TierOp(RESTORE, 5, 1)]
    kv, host = runtime.kv.clone(), runtime.host.host_kv.clone()  # type: ignore[union-attr]
    for op in ops:
        if op.kind == OFFLOAD:
            host[:, :, op.host_block] = kv[:, :, op.device_block]
        else:
            kv[:, :, op.device_block] = host[:, :, op.host_block]
    runtime.advance(feed.delta(tier_ops=ops))
    assert torch.equal(runtime.kv, kv) and torch.equal(runtime.host.host_kv, host)  # type: ignore[union-attr]


def test_tier_ops_run_before_the_versions_copy_ops():
    runtime = _runtime()
    feed = Feed(runtime)
    v1 = feed.delta(TableUpdate("a", 0, (0,)))
    feed.write(v1, list(range(4)))
    feed.delta(TableUpdate("a", 0, (), freed=True), tier_ops=[TierOp(OFFLOAD, 0, 0)])
    feed.delta(tier_ops=[TierOp(RESTORE, 1, 0)], copy_ops=[(1, 2)])  # the copy reads the restored block
    runtime.advance(runtime.mirror.received_version)
    assert torch.equal(runtime.kv[:, :, 2], runtime.kv[:, :, 0])


def test_bad_tier_ops_change_nothing_and_break_the_mirror():
    runtime = _runtime(num_host_blocks=2)
    feed = Feed(runtime)
    v1 = feed.delta(TableUpdate("a", 0, (0,)))
    feed.write(v1, list(range(4)))
    host = runtime.host.host_kv.clone()  # type: ignore[union-attr]
    v2 = feed.delta(tier_ops=[TierOp(OFFLOAD, 0, 0), TierOp(OFFLOAD, 1, 2)])
    with pytest.raises(MirrorBroken, match="outside this worker's 8 device and 2 host blocks"):
        runtime.advance(v2)
    assert torch.equal(runtime.host.host_kv, host)  # type: ignore[union-attr]
    with pytest.raises(MirrorBroken, match="restart the worker"):  # and every later call
        runtime.advance(v2)


def test_a_worker_without_a_host_tier_refuses_tier_ops():
    runtime = _runtime(num_host_blocks=0)
    assert runtime.host is None and runtime.host_pool_bytes == 0
    feed = Feed(runtime)
    with pytest.raises(MirrorBroken, match="no host tier"):
        runtime.advance(feed.delta(tier_ops=[TierOp(OFFLOAD, 0, 0)]))


def test_the_host_pool_has_the_device_shards_layout_and_is_counted():
    registry = CollectorRegistry()
    runtime = _runtime(num_host_blocks=5, metrics=WorkerMetrics("p", registry))
    assert runtime.host is not None
    assert runtime.host.host_kv.shape == (LAYERS, 2, 5, HEADS, B, DIM)
    assert runtime.host_pool_bytes == runtime.pool_bytes // 8 * 5 == runtime.stats()["host_pool_bytes"]
    assert not runtime.host.host_kv.is_pinned()  # a CPU worker: plain memory
    feed = Feed(runtime)
    runtime.advance(feed.delta(tier_ops=[TierOp(OFFLOAD, 0, 0), TierOp(OFFLOAD, 1, 1), TierOp(RESTORE, 2, 0)]))
    value = registry.get_sample_value
    assert value("blockd_worker_tier_ops_total", {"pool": "p", "kind": "offload"}) == 2
    assert value("blockd_worker_tier_ops_total", {"pool": "p", "kind": "restore"}) == 1
    assert value("blockd_worker_kernel_duration_seconds_count", {"pool": "p", "kernel": "offload_blocks"}) == 1


def test_allocate_host_pool():
    geometry = KVGeometry(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    assert allocate_host_pool(geometry, 0, torch.float16) is None
    host = allocate_host_pool(geometry, 3, torch.float16)
    assert host is not None and host.shape == (2, 2, 3, 2, 4, 8) and not host.any()
    with pytest.raises(ValueError, match=">= 0"):
        allocate_host_pool(geometry, -1, torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_beside_a_cuda_pool_the_host_tier_is_pinned_and_round_trips():
    geometry = KVGeometry(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    host = allocate_host_pool(geometry, 4, torch.bfloat16, "cuda")
    assert host is not None and host.is_pinned()
    kv = torch.randn(geometry.shape, device="cuda").to(torch.bfloat16)
    want = kv[:, :, [1, 6]].clone()
    move_blocks(kv, host, torch.tensor([1, 6]), torch.tensor([3, 0]))
    kv.zero_()
    move_blocks(host, kv, torch.tensor([3, 0]), torch.tensor([2, 5]))
    assert torch.equal(kv[:, :, [2, 5]], want)


def test_move_blocks_refuses_what_does_not_fit():
    kv = torch.zeros(1, 2, 4, 1, 2, 2)
    host = torch.zeros(1, 2, 3, 1, 2, 2)
    with pytest.raises(ValueError, match="distinct"):
        move_blocks(kv, host, torch.tensor([0, 1]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"dst_blocks must be in \[0, 3\)"):
        move_blocks(kv, host, torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="differ in more"):
        move_blocks(kv, torch.zeros(1, 2, 3, 1, 2, 4), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        move_blocks(kv, host, torch.tensor([0, 1]), torch.tensor([0]))
