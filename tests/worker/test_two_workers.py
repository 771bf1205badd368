"""blockd, two workers (each half of the KV heads) and a scheduler, as real
processes over real gRPC on loopback: allocations, a fork with copy-on-write,
frees and block reuse; attention outputs equal dense attention computed from
the full K/V history the test keeps."""

import functools
import time

import pytest
import torch

from blockd.core import Allocate, Append, Fork, Free, PoolConfig
from client.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from client.sdk import BlockdClient
from client.worker import WorkerClient
from tests.support.dense import dense_attention
from tests.support.procs import running, start_blockd, start_worker

HEADS, Q_PER_KV, DIM, LAYERS = 4, 2, 16, 2


class Cluster:
    def __init__(self, blockd: BlockdClient, workers: list[WorkerClient]):
        self.blockd, self.workers = blockd, workers
        self.history: dict[str, list[torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, step, seq_ids, new_counts, slots):
        """One 'model step': per layer, send each worker its heads' K/V and query."""
        total = sum(new_counts)
        ctx = [(len(self.history[s][0]) if s in self.history else 0) + n for s, n in zip(seq_ids, new_counts)]
        for layer in range(LAYERS):
            kv = torch.randn(total, HEADS, 2, DIM, generator=self.gen)
            query = torch.randn(total, HEADS * Q_PER_KV, DIM, generator=self.gen)
            outs = []
            for w, worker in enumerate(self.workers):
                h = slice(w * 2, w * 2 + 2)
                q = query[:, w * 2 * Q_PER_KV : (w * 2 + 2) * Q_PER_KV].contiguous()
                outs.append(worker.attention("m", step.version, layer, seq_ids, new_counts, ctx, q,
                                             key=kv[:, h, 0].contiguous(), value=kv[:, h, 1].contiguous(),
                                             slot_mapping=slots, pool_incarnation=step.incarnation))
            out, row = torch.cat(outs, dim=1), 0
            for s, n in zip(seq_ids, new_counts):
                hist = self.history.setdefault(s, [torch.empty(0, HEADS, 2, DIM)] * LAYERS)
                hist[layer] = torch.cat([hist[layer], kv[row : row + n]])
                want = dense_attention(query[row : row + n], hist[layer][:, :, 0], hist[layer][:, :, 1])
                torch.testing.assert_close(out[row : row + n], want, atol=1e-4, rtol=1e-4)
                row += n


def test_two_tensor_parallel_workers_match_dense_attention():
    def blockd(_):
        return start_blockd()

    def worker(heads):
        return lambda procs: start_worker(procs[0].address, "m", "--kv-heads", heads, "--device", "cpu",
                                          "--worker-id", f"w{heads[0]}")

    with (running(blockd, lambda p: _create_pool(p[0].address), worker("0:2"), worker("2:4")) as procs,
          BlockdClient(procs[0].address, timeout_s=10) as sched,
          WorkerClient(procs[2].address, timeout_s=10) as w0,
          WorkerClient(procs[3].address, timeout_s=10) as w1):
        cluster = Cluster(sched, [w0, w1])
        listed = {s.info.worker_id: s for s in sched.list_workers("m")}
        assert set(listed) == {"w0", "w2"}
        assert all(s.is_up and s.info.pool_bytes == 6 * 4 * LAYERS * 2 * 2 * DIM * 4
                   for s in listed.values())
        r = sched.step("m", [Allocate("a", list(range(7))), Allocate("b", list(range(50, 55)))])
        cluster.forward(r, ["a", "b"], [7, 5],
                        list(r.results[0].slot_mapping) + list(r.results[1].slot_mapping))
        r = sched.step("m", [Fork("a", "c")])
        cluster.history["c"] = [t.clone() for t in cluster.history["a"]]
        r = sched.step("m", [Append("a", [1]), Append("c", [2])])
        assert r.copy_ops, "the shared half-full block must be copied on write"
        cluster.forward(r, ["a", "c"], [1, 1],
                        [r.results[0].slot_mapping[0], r.results[1].slot_mapping[0]])
        b_blocks = set(sched.get_tables("m", ["b"])[1]["b"])
        r = sched.step("m", [Free("b"), Allocate("d", list(range(90, 96)))])
        assert b_blocks & set(sched.get_tables("m", ["d"])[1]["d"]), "freed blocks are reused"
        cluster.forward(r, ["d"], [6], list(r.results[1].slot_mapping))
        _bad_requests(w0, r.version, r.incarnation)
        stats = w0.stats()
        assert stats.applied_version == r.version and stats.copy_ops_applied == 1


def _create_pool(address):
    with BlockdClient(address, timeout_s=10) as c:
        c.create_pool(PoolConfig("m", num_blocks=6, block_size=4, num_layers=LAYERS, num_kv_heads=HEADS,
                                 head_dim=DIM, dtype="float32"))

    class _Done:  # not a process: nothing to kill
        address = ""

        def kill(self):
            pass
    return _Done()


def _bad_requests(worker: WorkerClient, version: int, incarnation: str):
    q = torch.randn(1, 2 * Q_PER_KV, DIM)
    attention = functools.partial(worker.attention, pool_incarnation=incarnation)
    with pytest.raises(FailedPreconditionError, match="stale"):
        attention("m", version - 1, 0, ["a"], [1], [8], q)
    start = time.monotonic()
    with pytest.raises(FailedPreconditionError, match="never committed"):
        attention("m", version + 100, 0, ["a"], [1], [8], q)
    assert time.monotonic() - start < 3, "a version that can never arrive must fail fast"
    with pytest.raises(NotFoundError):
        attention("m", version, 0, ["ghost"], [1], [8], q)
    with pytest.raises(InvalidArgumentError):
        attention("m", version, 0, ["a"], [1], [8], q[:, :3])
    with pytest.raises(InvalidArgumentError):
        attention("m", version, 0, ["a"], [1], [8], q.to(torch.bfloat16))
    with pytest.raises(InvalidArgumentError):
        attention("m", version, 7, ["a"], [1], [8], q)
    assert worker.stats().pool == "m"  # and it keeps serving
