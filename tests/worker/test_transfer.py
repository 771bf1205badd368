"""Blocks shared across pools, worker to worker (issue 28 item 3): blocks read
from one pool's worker (``ReadBlocks``) and fetched into another's
(``FetchBlocks``) hold the very bytes they held, attention over them equals
attention over the originals bit for bit, and every way a read could hand out
other KV is refused: a block reassigned after the planned version, a block
not fully written, another worker or pool incarnation, another shard's
geometry, a corrupted chunk.

Two real runtimes behind two real gRPC worker servers; their mirrors are fed
hand-made VersionDeltas as Watch would feed them (tests/worker/test_host_tier.py's Feed).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from prometheus_client import CollectorRegistry

from blockd.core.errors import WrongState
from blockd.core.types import OFFLOAD, TableUpdate, TierOp, TransferPlan
from client.errors import FailedPreconditionError, InvalidArgumentError
from client.worker import WorkerClient
from tests.worker.test_host_tier import DIM, HEADS, LAYERS, Q_HEADS, Feed, _runtime
from worker import transfer
from worker.metrics import WorkerMetrics
from worker.service import WorkerServer


@pytest.fixture
def pair():
    """(source runtime, its feed, destination runtime, its feed, a client of the destination,
    the source's address); each runtime counts into its own registry (``runtime.registry``)."""
    registries = [CollectorRegistry(), CollectorRegistry()]
    src, dst = (_runtime(metrics=WorkerMetrics("p", registry)) for registry in registries)
    src.registry, dst.registry = registries
    servers = [WorkerServer(src, "src"), WorkerServer(dst, "dst")]
    for server in servers:
        server.start()
    src.mirror.adopt("inc-a")
    dst.mirror.adopt("inc-b")
    client = WorkerClient(servers[1].address)
    yield src, Feed(src), dst, Feed(dst), client, servers[0].address
    client.close()
    for server in servers:
        server.stop(0)


def _plan(address: str, src, version: int, tiers, blocks, dst_blocks, first: int = 0) -> TransferPlan:
    return TransferPlan("p", "inc-a", version, first, len(blocks) * 4, tuple(tiers), tuple(blocks),
                        tuple(dst_blocks), ((0, address, src.incarnation),))


@pytest.mark.parametrize("tier", ["device", "host"])
def test_fetched_blocks_hold_the_same_bytes_and_attention_is_bit_for_bit(pair, tier):
    src, feed_a, dst, feed_b, client, address = pair
    v1 = feed_a.delta(TableUpdate("a", 0, (0, 1, 2)))
    feed_a.write(v1, list(range(10)))  # two full blocks and 2 slots of a third
    query = torch.randn(1, Q_HEADS, DIM, generator=feed_a.gen)
    original = feed_a.attend(v1, "a", 10, query)
    blocks = src.kv[:, :, [0, 1]].clone()
    version, src_blocks = v1, [0, 1]
    if tier == "host":  # the full blocks went to the source's host tier, the device blocks were reused
        version = feed_a.delta(TableUpdate("a", 0, (), freed=True),
                               tier_ops=[TierOp(OFFLOAD, 0, 6), TierOp(OFFLOAD, 1, 3)])
        src_blocks = [6, 3]
    # the destination allocates fresh blocks 5, 7 for the two full blocks and 2 for the tail
    w1 = feed_b.delta(TableUpdate("b", 0, (5, 7, 2)))
    got = client.fetch_blocks("p", w1, _plan(address, src, version, [tier] * 2, src_blocks, [5, 7]), 0,
                              pool_incarnation="inc-b")
    assert got == 2
    assert torch.equal(dst.kv[:, :, [5, 7]], blocks)
    # the tail is computed as usual; then attention over transferred + computed equals the original
    tail_k = [src.kv[layer, 0, 2, :, :2].transpose(0, 1).clone() for layer in range(LAYERS)]
    tail_v = [src.kv[layer, 1, 2, :, :2].transpose(0, 1).clone() for layer in range(LAYERS)]
    for layer in range(LAYERS):
        dst.write_kv(w1, layer, tail_k[layer], tail_v[layer], [8, 9])
    fetched = feed_b.attend(w1, "b", 10, query)
    for a, b in zip(fetched, original, strict=True):
        assert torch.equal(a, b)
    assert _transfer_blocks(src, "served") == 2 and _transfer_blocks(dst, "fetched") == 2
    assert dst.registry.get_sample_value("blockd_worker_kernel_duration_seconds_count",
                                         {"pool": "p", "kernel": "fetch_blocks"}) == 1


def _transfer_blocks(runtime, result: str) -> float:
    return runtime.registry.get_sample_value("blockd_worker_transfer_blocks_total", {"pool": "p", "result": result})


def test_a_block_reassigned_after_the_planned_version_is_refused(pair):
    src, feed_a, dst, feed_b, client, address = pair
    v1 = feed_a.delta(TableUpdate("a", 0, (0, 1)))
    feed_a.write(v1, list(range(8)))
    v2 = feed_a.delta(TableUpdate("a", 0, (), freed=True))
    v3 = feed_a.delta(TableUpdate("x", 0, (1,)))  # block 1 taken by another sequence
    feed_a.write(v3, [4])  # the source's mirror applied v3: block 1 holds other KV now
    w1 = feed_b.delta(TableUpdate("b", 0, (5, 6)))
    with pytest.raises(FailedPreconditionError, match="got other contents at version 3, after the planned 2"):
        client.fetch_blocks("p", w1, _plan(address, src, v2, ["device"] * 2, [0, 1], [5, 6]), 0,
                            pool_incarnation="inc-b")
    # nothing was written: a fetch is all or nothing, counted as failed
    assert not bool(dst.written.lead[:, [5, 6]].any())
    assert _transfer_blocks(dst, "failed") == 2 and _transfer_blocks(dst, "fetched") == 0


def test_refusals_name_what_to_do_and_write_nothing(pair):
    src, feed_a, dst, feed_b, client, address = pair
    v1 = feed_a.delta(TableUpdate("a", 0, (0, 1)))
    feed_a.write(v1, list(range(6)))  # block 1 only half written
    w1 = feed_b.delta(TableUpdate("b", 0, (5, 6)))

    def fetch(plan):
        return client.fetch_blocks("p", w1, plan, 0, pool_incarnation="inc-b")

    with pytest.raises(FailedPreconditionError, match="not fully written"):
        fetch(_plan(address, src, v1, ["device"] * 2, [0, 1], [5, 6]))
    stale = dataclasses.replace(_plan(address, src, v1, ["device"], [0], [5]),
                                source_workers=((0, address, "an-old-incarnation"),))
    with pytest.raises(FailedPreconditionError, match="restarted since you planned"):
        fetch(stale)
    src.mirror.load_snapshot(v1 + 1, {}, "inc-a2")  # the source pool was re-created
    with pytest.raises(FailedPreconditionError, match="was replaced by"):
        fetch(_plan(address, src, v1, ["device"], [0], [5]))
    with pytest.raises(InvalidArgumentError, match="one source block and tier per destination"):
        fetch(dataclasses.replace(_plan(address, src, v1, ["device"], [0], [5]), dst_blocks=(5, 6)))
    assert not bool(dst.written.lead[:, [5, 6]].any())


def test_another_shard_geometry_and_a_corrupted_chunk_are_refused(pair):
    src, feed_a, dst, *_ = pair
    v1 = feed_a.delta(TableUpdate("a", 0, (0,)))
    feed_a.write(v1, list(range(4)))
    with pytest.raises(WrongState, match="pair ranks of equal shards"):
        transfer.read_blocks(src, v1, "inc-a", ["device"], [0], (0, LAYERS, 0, HEADS - 1, 4, DIM, "float32"))
    blocks = transfer.read_blocks(src, v1, "inc-a", ["device"], [0], (0, LAYERS, 0, HEADS, 4, DIM, "float32"))

    class Chunk:
        def __init__(self, index, offset, data, crc, size):
            self.index, self.offset, self.data, self.crc32, self.block_bytes = index, offset, data, crc, size

    chunks = [Chunk(*c) for c in transfer.chunks(blocks)]
    assert transfer.assemble(dst, chunks, 1).shape == (1, chunks[0].block_bytes)
    bad = bytearray(chunks[0].data)
    bad[0] ^= 1
    chunks[0].data = bytes(bad)
    with pytest.raises(WrongState, match="CRC-32"):
        transfer.assemble(dst, chunks, 1)
    with pytest.raises(WrongState, match="ended before block 0 was whole"):
        transfer.assemble(dst, [], 1)
