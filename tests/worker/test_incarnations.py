"""Integrity under worker and pool faults, as real processes over real gRPC.

* A worker killed with SIGKILL and restarted under a running scheduler: blockd
  marks the KV it held lost, the scheduler recomputes, and the greedy outputs
  still equal transformers' own ``generate``.
* A restarted worker refuses calls planned against its previous life and
  attention over slots it has not written since; blockd names the lost
  sequences and drops their blocks from the prefix cache.
* A pool deleted and re-created (or an in-memory blockd restarted) under a
  running worker: the worker's tables become the new pool's, and calls naming
  the old incarnation, a deleted sequence or the old pool's KV are refused.
* The lost-KV state survives a restart of blockd with a data directory.

Before incarnations, each of these answered OK: with zeros, with the old
pool's tables, or with the old pool's KV.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from blockd.cluster.local import ClusterSpec, LocalCluster
from blockd.core import ALL_BLOCKS_CLEARED, BLOCK_STORED, Allocate, Append, Commit, Free, PoolConfig
from blockd.core.types import WorkerInfo
from client.errors import BlockdClientError, FailedPreconditionError, NotFoundError
from client.model_group import WorkerGroup
from client.scheduler import Scheduler, SchedulerConfig
from client.sdk import BlockdClient
from client.worker import WorkerClient
from tests.blockd.test_cluster import workload
from tests.support.dense import dense_attention
from tests.support.procs import free_port, start_blockd, start_worker
from worker.attachment import Attachment
from worker.model.reference import ContiguousReference
from worker.runtime import WorkerRuntime
from worker.service import WorkerServer

HEADS, DIM = 2, 8
CONFIG = PoolConfig("m", num_blocks=8, block_size=4, num_layers=1, num_kv_heads=HEADS, head_dim=DIM,
                    dtype="float32")


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, HEADS, DIM, generator=gen) for _ in range(3))


def refused(call, reason: str) -> BlockdClientError:
    with pytest.raises(FailedPreconditionError) as err:
        call()
    assert err.value.reason == reason, err.value
    return err.value


# --- a worker restarted under a running scheduler ------------------------------------------
def test_worker_sigkill_and_restart_under_a_running_scheduler():
    requests = workload(7)
    spec = ClusterSpec("tiny-llama", 1, "m", num_blocks=64, block_size=8)
    faults = {3: "restart", 9: "kill"}
    restarts: list[threading.Thread] = []
    with LocalCluster(spec) as cluster, BlockdClient(cluster.blockd_address) as client, \
            WorkerGroup("m", cluster.worker_addresses) as group:
        sched = Scheduler(client, "m", group, SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=16))
        for req in requests:
            sched.add_request(req)

        def on_step(s: Scheduler) -> None:
            fault = faults.pop(s.counters.num_steps, None)
            if fault == "restart":  # back before the next step: it names the old incarnation
                cluster.restart_worker(0)
            elif fault == "kill":  # the next steps find nobody there until it is back
                cluster.workers[0].kill()
                restarts.append(threading.Thread(target=cluster.restart_worker, args=(0,)))
                restarts[-1].start()

        outputs = sched.run(on_step)
        for thread in restarts:
            thread.join()
        stats = client.get_pool("m")
        events = [e.kind for e in _events(client)]
    assert faults == {}, "both faults struck while requests ran"
    assert ContiguousReference("tiny-llama").mismatches(requests, outputs) == []
    c = sched.counters
    assert c.num_kv_loss_preemptions > 0, "the lost KV was recomputed"
    assert c.num_worker_faults >= 2, "the old incarnation and the unreachable worker were both met"
    assert events.count(ALL_BLOCKS_CLEARED) == 2, "each restart dropped the prefix cache"
    assert stats.num_kv_lost_seqs == 0 and stats.num_seqs == 0


def _events(client: BlockdClient) -> list:
    last = client.get_pool("m").last_event_seq_no
    stream = client.events("m", 0)
    try:
        return [next(stream) for _ in range(last)]
    finally:
        stream.close()


# --- a restarted worker refuses what it lost ----------------------------------------------
def test_a_restarted_worker_refuses_kv_it_lost_and_blockd_names_the_sequences():
    blockd = start_blockd()
    workers = []
    try:
        client = BlockdClient(blockd.address, timeout_s=10)
        client.create_pool(CONFIG)
        workers.append(start_worker(blockd.address, "m", "--device", "cpu", "--worker-id", "w0"))
        wc = WorkerClient(workers[0].address, timeout_s=10)
        r = client.step("m", [Allocate("a", list(range(7)))])
        slots = list(r.results[0].slot_mapping)
        q, k, v = kv(7, 0)
        wc.attention("m", r.version, 0, ["a"], [7], [7], q, key=k, value=v, slot_mapping=slots,
                     pool_incarnation=r.incarnation)
        r = client.step("m", [Commit("a", 7)])  # the full first block enters the prefix cache
        before = wc.incarnation

        workers[0].kill()
        workers.append(start_worker(blockd.address, "m", "--device", "cpu", "--worker-id", "w0",
                                    "--listen", workers[0].address))
        err = refused(lambda: wc.attention("m", r.version, 0, ["a"], [1], [7], q[:1],
                                           pool_incarnation=r.incarnation), "WORKER_INCARNATION_MISMATCH")
        assert "restarted" in err.message and err.metadata["worker_incarnation"] != before
        err = refused(lambda: client.step("m", [Append("a", [7])]), "KV_LOST")
        assert err.seq_ids == ["a"] and "'w0' registered as a new incarnation" in err.message
        assert client.get_sequence("m", "a").kv_lost and client.get_pool("m").num_kv_lost_seqs == 1
        assert [e.kind for e in _events(client)] == [BLOCK_STORED, ALL_BLOCKS_CLEARED]
        assert client.lookup_prefix(list(range(7)), pools=["m"]) == {"m": 0}
        assert [w.info.incarnation for w in client.list_workers("m")] == [wc.refresh()] != [before]

        err = refused(lambda: wc.attention("m", r.version, 0, ["a"], [1], [7], q[:1],
                                           pool_incarnation=r.incarnation), "KV_NOT_WRITTEN")
        assert err.seq_ids == ["a"] and "positions 0..6" in err.message
        # writing the newest token again does not bring back the ones before it
        err = refused(lambda: wc.attention("m", r.version, 0, ["a"], [1], [7], q[6:], key=k[6:], value=v[6:],
                                           slot_mapping=slots[6:], pool_incarnation=r.incarnation),
                      "KV_NOT_WRITTEN")
        assert "positions 0..5" in err.message
        client.step("m", [Free("a")])
        assert client.get_pool("m").num_kv_lost_seqs == 0
        wc.close()
        client.close()
    finally:
        for proc in [*workers, blockd]:
            proc.kill()


# --- a pool re-created under a running worker ------------------------------------------------
class InProcessWorker:
    """A worker as ``blockd-worker`` wires it, in this process, so the test can
    read its tables; calls still go over gRPC."""

    def __init__(self, target: str) -> None:
        self.client = BlockdClient(target, timeout_s=5)
        self.runtime = WorkerRuntime(CONFIG, device="cpu", version_timeout_s=2.0)
        self.server = WorkerServer(self.runtime, "w", "127.0.0.1:0")
        info = WorkerInfo("w", "m", self.server.address, 0, 1, 0, HEADS, incarnation=self.runtime.incarnation)
        self.follower = Attachment(self.client, self.runtime, info, heartbeat_interval_s=0.1)
        self.runtime.latest_committed = self.follower.latest_committed
        self.follower.start()
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)
        self.follower.stop()
        self.client.close()


def _registered(client: BlockdClient) -> bool:
    try:
        return [w.info.worker_id for w in client.list_workers("m")] == ["w"]
    except BlockdClientError:
        return False


@pytest.mark.parametrize("how", ["delete", "restart"])
def test_a_pool_recreated_under_a_running_worker_replaces_its_replica(how):
    listen = f"127.0.0.1:{free_port()}"  # a fixed port, so a restarted daemon takes it again
    blockd = start_blockd("--listen", listen)
    client = BlockdClient(listen, timeout_s=5)
    client.create_pool(CONFIG)
    worker = InProcessWorker(listen)
    try:
        wc = WorkerClient(worker.server.address, timeout_s=10)
        r = client.step("m", [Allocate("a", list(range(6))), Allocate("b", list(range(3)))])
        q, k, v = kv(9, 1)
        wc.attention("m", r.version, 0, ["a", "b"], [6, 3], [6, 3], q, key=k, value=v,
                     slot_mapping=[*r.results[0].slot_mapping, *r.results[1].slot_mapping],
                     pool_incarnation=r.incarnation)
        client.step("m", [Free("b")])  # the old pool has moved on past the new one's versions

        if how == "delete":
            client.delete_pool("m")
        else:  # in memory: the restarted daemon knows nothing of the old pool
            blockd.kill()
            blockd = start_blockd("--listen", listen)
        assert wait_for(lambda: _create(client)), "blockd does not answer"
        assert wait_for(lambda: _registered(client)), "the worker did not register with the new pool"
        new = client.step("m", [Allocate("x", list(range(5))), Allocate("y", [1])])
        assert new.incarnation != r.incarnation and new.version == 1
        replica = worker.runtime.mirror
        assert wait_for(lambda: replica.incarnation == new.incarnation and replica.received_version == 1)
        replica.advance_to(1, 1.0)
        assert replica.tables == client.get_tables("m")[1] == {"x": [0, 1], "y": [2]}
        assert wc.stats().pool_incarnation == new.incarnation and wc.stats().num_sequences == 2

        one = q[:1]
        err = refused(lambda: wc.attention("m", r.version, 0, ["a"], [1], [6], one,
                                           pool_incarnation=r.incarnation), "POOL_INCARNATION_MISMATCH")
        assert "replaced" in err.message
        with pytest.raises(NotFoundError, match="'a'"):  # deleted with the old pool
            wc.attention("m", 1, 0, ["a"], [1], [6], one, pool_incarnation=new.incarnation)
        # x's blocks hold a's KV from the old pool: garbage for x
        err = refused(lambda: wc.attention("m", 1, 0, ["x"], [1], [5], one, pool_incarnation=new.incarnation),
                      "KV_NOT_WRITTEN")
        assert err.seq_ids == ["x"]
        qx, kx, vx = kv(5, 2)
        out = wc.attention("m", 1, 0, ["x"], [5], [5], qx, key=kx, value=vx,
                           slot_mapping=list(new.results[0].slot_mapping), pool_incarnation=new.incarnation)
        torch.testing.assert_close(out, dense_attention(qx, kx, vx), atol=1e-4, rtol=1e-4)
        wc.close()
    finally:
        worker.stop()
        client.close()
        blockd.kill()


def _create(client: BlockdClient) -> bool:
    try:
        client.create_pool(CONFIG)
        return True
    except BlockdClientError:
        return False


# --- lost KV is durable -------------------------------------------------------------------
def test_lost_kv_survives_a_blockd_restart_with_a_data_dir(tmp_path):
    listen = f"127.0.0.1:{free_port()}"
    args = ("--data-dir", str(tmp_path), "--listen", listen)
    blockd = start_blockd(*args)
    try:
        client = BlockdClient(listen, timeout_s=5)
        incarnation = client.create_pool(CONFIG).incarnation
        client.register_worker(WorkerInfo("w", "m", "", 0, 1, 0, HEADS, incarnation="life-1"))
        client.step("m", [Allocate("a", list(range(5))), Commit("a", 5)])
        client.register_worker(WorkerInfo("w", "m", "", 0, 1, 0, HEADS, incarnation="life-2"))
        blockd.kill()
        blockd = start_blockd(*args)
        assert wait_for(lambda: _reachable(client))
        stats = client.get_pool("m")
        assert stats.incarnation == incarnation and stats.num_kv_lost_seqs == 1
        refused(lambda: client.step("m", [Append("a", [5])]), "KV_LOST")
        # the worker re-registers with the restarted daemon: the same life, nothing more lost
        client.register_worker(WorkerInfo("w", "m", "", 0, 1, 0, HEADS, incarnation="life-2"))
        client.step("m", [Allocate("b", [1]), Free("a")])
        assert client.get_pool("m").num_kv_lost_seqs == 0
        client.close()
    finally:
        blockd.kill()


def _reachable(client: BlockdClient) -> bool:
    try:
        client.get_pool("m")
        return True
    except BlockdClientError:
        return False
