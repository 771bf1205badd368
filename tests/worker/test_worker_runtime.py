"""The worker's in-process API on real tensors: a core Pool drives the replica
through its deltas; attention at each version equals dense attention."""

import threading
import time

import pytest
import torch

from blockd.core import Allocate, Append, BlockdError, Commit, Fork, Free, NotFound, Pool, PoolConfig
from blockd.core.errors import InvalidArgument
from blockd.core.incarnations import KVNotWritten, PoolIncarnationMismatch, PoolIncarnationUnavailable, TermNotSeen
from tests.support.dense import dense_attention
from worker.runtime import ShardSpec, WorkerRuntime
from worker.tables import StaleVersion, TableMirror, VersionUnavailable

HEADS, Q_HEADS, DIM = 2, 4, 16


class Harness:
    """A pool, a runtime following it, and the full K/V history per sequence."""

    def __init__(self, dtype="float32"):
        self.config = PoolConfig("p", num_blocks=32, block_size=4, num_layers=2, num_kv_heads=HEADS,
                                 head_dim=DIM, dtype=dtype)
        self.pool = Pool(self.config)
        self.runtime = WorkerRuntime(self.config, device="cpu", version_timeout_s=0.2,
                                     latest_committed=lambda: self.pool.version)
        self.history: dict[str, list[torch.Tensor]] = {}  # seq -> per layer [T, H, 2, D]
        self.gen = torch.Generator().manual_seed(0)

    def step(self, ops):
        result = self.pool.step(ops)
        for delta in self.pool.deltas_since(self.runtime.mirror.received_version):
            self.runtime.mirror.push(delta)
        return result

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.runtime.dtype)

    def run(self, version, seq_ids, new_counts, slots, prepared=False):
        """Write new K/V for each sequence and check attention on every layer
        (``prepared``: as a model step does, the batch prepared once)."""
        total = sum(new_counts)
        ctx = [len(self.history.get(s, [torch.empty(0, HEADS, 2, DIM)])[0]) + n
               for s, n in zip(seq_ids, new_counts)]
        step = self.runtime.prepare_step(version, seq_ids, new_counts, ctx, torch.tensor(slots)) if prepared else None
        for layer in range(2):
            kv = self.rand(total, HEADS, 2, DIM)
            query = self.rand(total, Q_HEADS, DIM)
            key, value = kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()
            if step is not None:
                out = self.runtime.step_attention(step, layer, query, key, value)
                if layer == 1:
                    self.runtime.finish_step(step)
            else:
                out = self.runtime.attention(version, layer, seq_ids, new_counts, ctx, query, key=key, value=value,
                                             slot_mapping=slots)
            row = 0
            for s, n in zip(seq_ids, new_counts):
                hist = self.history.setdefault(s, [torch.empty(0, HEADS, 2, DIM, dtype=kv.dtype)] * 2)
                hist[layer] = torch.cat([hist[layer], kv[row : row + n]])
                want = dense_attention(query[row : row + n], hist[layer][:, :, 0], hist[layer][:, :, 1])
                tol = 1e-4 if kv.dtype == torch.float32 else 3e-2
                torch.testing.assert_close(out[row : row + n].float(), want, atol=tol, rtol=tol)
                row += n


@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runtime_follows_versions_and_matches_dense(dtype, prepared):
    """Per-layer calls, and a model step's path (the batch prepared once, then
    ``step_attention`` per layer): the same pool contents and results."""
    h = Harness(dtype)
    r = h.step([Allocate("a", list(range(7))), Allocate("b", list(range(100, 105)))])
    h.run(r.version, ["a", "b"], [7, 5], list(r.results[0].slot_mapping + r.results[1].slot_mapping), prepared)
    r = h.step([Fork("a", "c")])
    h.history["c"] = [t.clone() for t in h.history["a"]]
    r = h.step([Append("a", [1]), Append("c", [2])])  # a copies the shared half-full block on write
    assert r.copy_ops
    h.run(r.version, ["a", "c"], [1, 1], [r.results[0].slot_mapping[0], r.results[1].slot_mapping[0]], prepared)
    r = h.step([Free("b"), Allocate("d", list(range(200, 209)))])  # reuses b's blocks
    h.run(r.version, ["d"], [9], list(r.results[1].slot_mapping), prepared)
    assert h.runtime.mirror.num_copy_ops == 1
    assert h.runtime.mirror.tables == h.pool.tables()
    # either way the written-slot record covers exactly the written tokens
    tables = h.runtime.mirror.tables_of(["a", "c", "d"], r.version, h.runtime.mirror.incarnation)
    h.runtime.check_written(["a", "c", "d"], tables, [8, 8, 9])
    with pytest.raises(KVNotWritten):
        h.runtime.check_written(["d"], tables[2:], [10])  # d's 10th slot is allocated, not written


def test_prepared_step_refuses_bad_input():
    h = Harness()
    r = h.step([Allocate("a", list(range(5)))])
    slots = torch.tensor(r.results[0].slot_mapping)
    with pytest.raises(InvalidArgument, match="no padding"):
        h.runtime.prepare_step(r.version, ["a"], [5], [5], torch.tensor([-1, *slots[1:].tolist()]))
    with pytest.raises(InvalidArgument, match="1 <= query_len <= context_len"):
        h.runtime.prepare_step(r.version, ["a"], [5], [4], slots)
    step = h.runtime.prepare_step(r.version, ["a"], [5], [5], slots)
    with pytest.raises(InvalidArgument, match="key must have shape"):
        h.runtime.step_attention(step, 0, h.rand(5, Q_HEADS, DIM), h.rand(4, HEADS, DIM), h.rand(5, HEADS, DIM))
    with pytest.raises(InvalidArgument, match="layer 2 is not held"):
        h.runtime.step_attention(step, 2, h.rand(5, Q_HEADS, DIM), h.rand(5, HEADS, DIM), h.rand(5, HEADS, DIM))


def test_versions_stale_future_and_bad_input():
    h = Harness()
    r1 = h.step([Allocate("a", [1, 2, 3])])
    h.run(r1.version, ["a"], [3], list(r1.results[0].slot_mapping))
    r2 = h.step([Append("a", [4])])
    q = h.rand(1, Q_HEADS, DIM)
    kv = {"key": h.rand(1, HEADS, DIM), "value": h.rand(1, HEADS, DIM),
          "slot_mapping": list(r2.results[0].slot_mapping)}
    h.runtime.attention(r2.version, 0, ["a"], [1], [4], q, **kv)
    with pytest.raises(StaleVersion) as err:
        h.runtime.attention(r1.version, 0, ["a"], [1], [4], q)
    assert err.value.code == "FAILED_PRECONDITION"
    with pytest.raises(VersionUnavailable, match="never committed"):
        h.runtime.attention(r2.version + 5, 0, ["a"], [1], [4], q)
    with pytest.raises(NotFound):
        h.runtime.attention(r2.version, 0, ["zz"], [1], [4], q)
    for bad in [{"layer": 5}, {"query": h.rand(1, 3, DIM)}, {"query": q.double()},
                {"context_lens": [99]}, {"query_lens": [0]}]:
        args = {"version": r2.version, "layer": 0, "seq_ids": ["a"], "query_lens": [1], "context_lens": [4],
                "query": q}
        args.update(bad)
        with pytest.raises(BlockdError) as err:
            h.runtime.attention(**args)
        assert err.value.code == "INVALID_ARGUMENT", bad
    with pytest.raises(InvalidArgument):
        h.runtime.write_kv(r2.version, 0, h.rand(1, HEADS, DIM), h.rand(1, HEADS, DIM), [10_000])


def test_replica_refuses_gaps_and_ignores_duplicates():
    pool = Pool(PoolConfig("p", num_blocks=8, block_size=2))
    copies = []
    replica = TableMirror(copies.extend)
    for i in range(3):
        pool.step([Allocate(f"s{i}", [i])])
    d1, d2, d3 = pool.deltas_since(0)
    replica.push(d1)
    replica.push(d1)
    with pytest.raises(BlockdError):
        replica.push(d3)
    replica.push(d2)
    replica.advance_to(2, 0.1)
    assert replica.tables == {"s0": [0], "s1": [1]}
    with pytest.raises(VersionUnavailable):
        replica.advance_to(3, 0.05)


def test_replica_refuses_a_deposed_leaders_term():
    replica = TableMirror(lambda copies: None)
    for term in (0, 5, 7):  # 0: not replicated, nothing to check
        replica.check_term(term)
        replica.note_term(term)
    with pytest.raises(BlockdError, match="term 5 after term 7: it comes from a deposed leader"):
        replica.check_term(5)
    replica.check_term(0)
    replica.note_term(5)  # never lowers it
    assert replica.term == 7


def test_a_call_planned_on_a_newer_term_waits_until_the_replica_is_served_in_it():
    """``wait_term``: a model step named with the new leader's term runs only once the
    replica's Watch has taken in a message of that term (a resync first, where one comes)."""
    replica = TableMirror(lambda copies: None)
    replica.note_term(3)
    replica.wait_term(0, 0.01)  # not replicated
    replica.wait_term(3, 0.01)
    replica.wait_term(2, 0.01)  # planned in an older term: its version is this replica's to check
    start = time.monotonic()
    with pytest.raises(TermNotSeen, match="planned on leader term 4, but this worker's tables were last served in "
                                          "term 3") as info:
        replica.wait_term(4, 0.1)
    assert info.value.reason == "TERM_NOT_SEEN" and time.monotonic() - start >= 0.09
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (replica.wait_term(4, 10.0), done.set()))
    waiter.start()
    assert not done.wait(0.2)
    replica.note_term(4)
    assert done.wait(5), "note_term(4) did not release the call waiting for term 4"
    waiter.join()


def test_shard_checks():
    config = PoolConfig("p", num_blocks=4, block_size=2, num_layers=2, num_kv_heads=4, head_dim=8)
    with pytest.raises(InvalidArgument):
        WorkerRuntime(config, ShardSpec(0, 3, 0, 4))
    with pytest.raises(InvalidArgument):
        WorkerRuntime(PoolConfig("q", num_blocks=4, block_size=2, dtype="int8"))
    rt = WorkerRuntime(config, ShardSpec(1, 2, 2, 4))
    assert rt.pool_bytes == 4 * 2 * 1 * 2 * 2 * 8 * 2


def test_attention_over_slots_not_written_in_this_incarnation_is_refused():
    h = Harness()
    r = h.step([Allocate("a", list(range(7)))])
    slots = list(r.results[0].slot_mapping)
    q = h.rand(1, Q_HEADS, DIM)
    # the first 4 tokens, in layer 0 only
    h.runtime.write_kv(r.version, 0, h.rand(4, HEADS, DIM), h.rand(4, HEADS, DIM), slots[:4])
    h.runtime.attention(r.version, 0, ["a"], [1], [4], q)
    with pytest.raises(KVNotWritten, match=r"sequence .a. reads .*positions 4..6 of its 7") as err:
        h.runtime.attention(r.version, 0, ["a"], [1], [7], q)
    assert err.value.code == "FAILED_PRECONDITION" and err.value.metadata["seq_ids"] == '["a"]'
    with pytest.raises(KVNotWritten, match=r"positions 0\.\.3 of"):  # written in layer 0 is not layer 1
        h.runtime.attention(r.version, 1, ["a"], [1], [4], q)
    # a write with a gap leaves the slots after it unwritten
    h.runtime.write_kv(r.version, 0, h.rand(2, HEADS, DIM), h.rand(2, HEADS, DIM), [slots[4], slots[6]])
    with pytest.raises(KVNotWritten, match="positions 5 of"):
        h.runtime.attention(r.version, 0, ["a"], [1], [7], q)
    h.runtime.write_kv(r.version, 0, h.rand(1, HEADS, DIM), h.rand(1, HEADS, DIM), [slots[5]])
    h.runtime.attention(r.version, 0, ["a"], [1], [7], q)
    # copy-on-write carries what was written: the fork's copy of the shared tail block holds a's 3 tokens
    r = h.step([Fork("a", "c"), Append("c", [9])])
    assert r.copy_ops
    kv = {"key": h.rand(1, HEADS, DIM), "value": h.rand(1, HEADS, DIM), "slot_mapping": list(r.results[1].slot_mapping)}
    h.runtime.attention(r.version, 0, ["c"], [1], [8], q, **kv)


def test_a_prompt_reads_blocks_another_prompt_of_the_same_step_writes():
    """Within-step prefix sharing (client.step_plan): ``a``'s first two blocks
    are committed in the batch that allocates it, so ``b`` takes them from the
    prefix cache and computes one token over them in the same model step. The
    pre-forward check counts the step's own slots as written (no others), and
    each layer writes every new token's K/V before its attention reads any:
    ``b``'s answer is dense attention over the K/V ``a`` writes in that layer."""
    h = Harness()
    shared = list(range(8))  # two full blocks of 4
    r = h.step([Allocate("a", [*shared, 50]), Commit("a", 8), Allocate("b", [*shared, 60])])
    a, b = r.results[0], r.results[2]
    assert b.num_cached_tokens == 8 and len(b.slot_mapping) == 1
    slots = list(a.slot_mapping) + list(b.slot_mapping)
    h.runtime.advance(r.version)
    tables = h.runtime.mirror.tables_of(["a", "b"], r.version, h.runtime.mirror.incarnation)
    with pytest.raises(KVNotWritten, match="sequence 'b'"):  # nothing written yet, and no step writes it
        h.runtime.check_written(["a", "b"], tables, [0, 8])
    with pytest.raises(KVNotWritten, match="sequence 'b'"):  # a step writing only a's first block
        h.runtime.check_written(["a", "b"], tables, [0, 8], torch.tensor(slots[:4]))
    h.runtime.check_written(["a", "b"], tables, [0, 8], torch.tensor(slots))
    step = h.runtime.prepare_step(r.version, ["a", "b"], [9, 1], [9, 9], torch.tensor(slots))
    for layer in range(2):
        kv, query = h.rand(10, HEADS, 2, DIM), h.rand(10, Q_HEADS, DIM)
        out = h.runtime.step_attention(step, layer, query, kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous())
        context = torch.cat([kv[:8], kv[9:]])  # a's first 8 tokens, then b's own
        want = dense_attention(query[9:], context[:, :, 0], context[:, :, 1])
        torch.testing.assert_close(out[9:].float(), want, atol=1e-4, rtol=1e-4)
    h.runtime.finish_step(step)
    h.runtime.check_written(["a", "b"], tables, [9, 9])


def test_a_new_pool_incarnation_forgets_every_written_slot():
    h = Harness()
    h.runtime.mirror.adopt("old")
    r = h.step([Allocate("a", [1, 2, 3])])
    h.run(r.version, ["a"], [3], list(r.results[0].slot_mapping))
    q = h.rand(1, Q_HEADS, DIM)
    h.runtime.attention(r.version, 0, ["a"], [1], [3], q, pool_incarnation="old")
    # the pool was re-created: its snapshot names block 0 again, for another sequence
    h.runtime.mirror.load_snapshot(1, {"x": [0]}, "new")
    with pytest.raises(PoolIncarnationMismatch, match="replaced"):
        h.runtime.attention(1, 0, ["a"], [1], [3], q, pool_incarnation="old")
    with pytest.raises(KVNotWritten, match="sequence 'x'"):
        h.runtime.attention(1, 0, ["x"], [1], [3], q, pool_incarnation="new")
    with pytest.raises(PoolIncarnationUnavailable, match="retry shortly"):
        h.runtime.attention(1, 0, ["x"], [1], [3], q, pool_incarnation="newer")
    assert h.runtime.stats()["pool_incarnation"] == "new" and h.runtime.stats()["worker_incarnation"]
