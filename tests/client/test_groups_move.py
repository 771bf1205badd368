"""A pool's move between daemon groups (``GroupService``), over real daemons and a real etcd.

A scheduler keeps stepping a pool while it moves: no step is lost or applied
twice (versions stay consecutive, the sequence holds every token), the
incarnation is kept, the real Scheduler (over the slot model) computes every
token as the reference does, and the old owner refuses late calls naming the new
one; a real model worker given the cluster target follows its pool to the new
group, and its greedy outputs equal transformers'. Every bad MovePool /
ImportPool is refused with its status and changes nothing. A tenant's pool,
block and byte quotas count the pools of every group.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time

import grpc
import pytest

from blockd.auth.tokens import add_token, read_for_edit, write_atomically
from blockd.core.types import Allocate, DecodeAppend, PoolConfig
from blockd.engine.machine import Engine
from blockd.v1 import groups_pb2 as gpb
from blockd.v1 import groups_pb2_grpc as gpb_grpc
from client.errors import FailedPreconditionError, ResourceExhaustedError
from client.groups import ClusterClient
from client.scheduler import SchedulerConfig
from client.sdk import BlockdClient
from client.serving import GenerationRequest
from tests.support.procs import start_blockd
from tests.support.slot_model import VOCAB, check_outputs, make

pytest_plugins = ["tests.support.etcd", "tests.support.groups"]

PROMPT = 6
STEPS = 300


def _wait(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_pool_moved_under_a_running_scheduler_loses_no_step(two_groups) -> None:
    client, (g1, g2) = two_groups
    client.create_pool(PoolConfig("m", num_blocks=256, block_size=4))
    assert client.group_of("m") == "g1"
    results: list = []
    failures: list = []

    def scheduler() -> None:
        try:
            with ClusterClient(client.target, timeout_s=30) as own:
                first = own.step("m", [Allocate("s", list(range(PROMPT)))])
                results.append(first)
                for n in range(STEPS):  # one at a time: the test watches the list grow
                    results.append(own.step("m", [DecodeAppend(["s"], [n])], incarnation=first.incarnation))  # noqa: PERF401
        except Exception as err:  # noqa: BLE001 - reported by the test below
            failures.append(err)

    thread = threading.Thread(target=scheduler)
    thread.start()
    _wait(lambda: len(results) >= 30 or failures, "the scheduler's first steps")
    moved = client.move_pool("m", "g2")
    thread.join(60)
    assert not failures, failures
    assert (moved.group, moved.epoch) == ("g2", 2) and 30 <= moved.version < STEPS + 1
    assert [r.version for r in results] == list(range(1, STEPS + 2))  # every step once, in order
    assert {r.incarnation for r in results} == {results[0].incarnation}
    assert client.group_of("m") == "g2"
    info = client.get_sequence("m", "s")
    assert info.num_tokens == PROMPT + STEPS
    with BlockdClient(g2.address) as new:
        assert new.get_pool("m").version == STEPS + 1
    with BlockdClient(g1.address, timeout_s=5) as old:  # a late call at the old owner
        with pytest.raises(FailedPreconditionError, match="served by group g2") as err:
            old.step("m", [DecodeAppend(["s"], [1])], incarnation=results[0].incarnation)
        assert err.value.reason == "WRONG_GROUP"
        assert (err.value.metadata["owner_address"], err.value.metadata["epoch"]) == (g2.address, "2")
        assert old.list_pools() == []
    assert client.get_pool("m").version == STEPS + 1  # the refused call changed nothing


def _code(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    return err.value.code(), err.value.details()


def test_bad_moves_and_imports_are_refused_and_change_nothing(two_groups) -> None:
    client, (g1, g2) = two_groups
    client.create_pool(PoolConfig("m", num_blocks=16, block_size=4))
    client.step("m", [Allocate("s", [1, 2, 3])])
    bad = grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(g1.address) as c1, grpc.insecure_channel(g2.address) as c2:
        owner, other = gpb_grpc.GroupServiceStub(c1), gpb_grpc.GroupServiceStub(c2)
        state = json.dumps({"config": {"name": "m"}}).encode()
        for stub, request, code, says in [
            (owner, gpb.MovePoolRequest(to_group="g2"), bad, "pool"),
            (owner, gpb.MovePoolRequest(pool="m"), bad, "to_group"),
            (owner, gpb.MovePoolRequest(pool="m", to_group="a/b"), bad, "group name must be"),
            (owner, gpb.MovePoolRequest(pool="m", to_group="g1"), bad, "is g1"),
            (owner, gpb.MovePoolRequest(pool="m", to_group="g9"), grpc.StatusCode.NOT_FOUND, "no live daemon"),
            (owner, gpb.MovePoolRequest(pool="nope", to_group="g2"), grpc.StatusCode.NOT_FOUND, "in no group"),
            (other, gpb.MovePoolRequest(pool="m", to_group="g1"), grpc.StatusCode.FAILED_PRECONDITION,
             "served by group g1"),
        ]:
            assert _code(stub.MovePool, request)[0] == code
            assert says in _code(stub.MovePool, request)[1]
        for stub, request, code, says in [
            (other, gpb.ImportPoolRequest(state=state, epoch=2), bad, "pool"),
            (other, gpb.ImportPoolRequest(pool="m", state=state, epoch=0), bad, "epoch"),
            (other, gpb.ImportPoolRequest(pool="m", state=b"{", epoch=2), bad, "not JSON"),
            (other, gpb.ImportPoolRequest(pool="m", state=b"[]", epoch=2), bad, "JSON object"),
            (other, gpb.ImportPoolRequest(pool="m", state=state, epoch=2), bad, "snapshot form"),
            (other, gpb.ImportPoolRequest(pool="m", state=state, epoch=5), grpc.StatusCode.FAILED_PRECONDITION,
             "does not follow"),
            (other, gpb.ImportPoolRequest(pool="nope", state=state, epoch=2), grpc.StatusCode.NOT_FOUND,
             "in no group"),
            (owner, gpb.ImportPoolRequest(pool="m", state=state, epoch=2), grpc.StatusCode.FAILED_PRECONDITION,
             "already belongs"),
        ]:
            got, details = _code(stub.ImportPool, request)
            assert (got, says in details) == (code, True), details
    client.refresh()
    assert client.group_of("m") == "g1" and client.get_pool("m").num_seqs == 1
    assert client.get_pool("m").version == 1
    # an import whose move never switched the directory (the owner failed after it) is never served
    elsewhere = Engine()
    elsewhere.create_pool(PoolConfig("m", num_blocks=16, block_size=4))
    elsewhere.step("m", [Allocate("x", [1, 2, 3, 4, 5])])
    leftover = json.dumps(elsewhere.export_pool("m")).encode()
    with grpc.insecure_channel(g2.address) as c2:
        gpb_grpc.GroupServiceStub(c2).ImportPool(gpb.ImportPoolRequest(pool="m", state=leftover, epoch=2), timeout=10)
    with BlockdClient(g2.address) as other_client:
        assert other_client.list_pools() == [] and other_client.lookup_prefix([1, 2, 3, 4, 5]) == {}
    # the move itself still works afterwards (replacing the leftover); a client that read the directory before
    # follows it
    with ClusterClient(client.target) as stale:
        assert stale.group_of("m") == "g1"
        assert client.move_pool("m", "g2").epoch == 2 and client.get_pool("m").num_seqs == 1
        assert client.get_sequence("m", "s").num_tokens == 3  # the real pool, not the leftover (sequence x)
        assert stale.lookup_prefix([1, 2, 3], pools=["m"]) == {"m": 0}
        assert stale.get_pool("m").num_seqs == 1 and stale.group_of("m") == "g2"


def test_a_tenants_pool_quotas_count_every_groups_pools(etcd_server, tmp_path) -> None:
    tokens = str(tmp_path / "identities.json")
    token = add_token(tokens, "ops", "t1", ["admin"])
    data = read_for_edit(tokens)
    data["quotas"] = {"t1": {"pools": 2, "blocks": 40}}
    write_atomically(tokens, data)
    peer = tmp_path / "peer-token"  # what one group calls another with (a move)
    peer.write_text(token)
    daemons = [start_blockd("--cluster", "quotas", "--group", g, "--cluster-etcd", etcd_server.url,
                            "--tokens-file", tokens, "--peer-token-file", str(peer)) for g in ("g1", "g2")]
    try:
        with ClusterClient(f"cluster://{etcd_server.url.split('://')[1]}/quotas", token=token) as client:
            client.create_pool(PoolConfig("p1", num_blocks=16, block_size=4))
            with pytest.raises(ResourceExhaustedError, match="46 blocks across the cluster's groups"):
                client.create_pool(PoolConfig("p2", num_blocks=30, block_size=4))  # g2 holds none itself
            client.create_pool(PoolConfig("p2", num_blocks=16, block_size=4))
            assert [client.group_of(p) for p in ("p1", "p2")] == ["g1", "g2"]
            with pytest.raises(ResourceExhaustedError, match="3 pools across the cluster's groups"):
                client.create_pool(PoolConfig("p3", num_blocks=1, block_size=4))
            assert [s.name for s in client.list_pools()] == ["p1", "p2"]
    finally:
        for daemon in daemons:
            daemon.kill()


@pytest.mark.parametrize("stream_steps", [True, False], ids=["streamed", "unary"])
def test_the_scheduler_serves_every_request_right_while_its_pool_moves(two_groups, stream_steps) -> None:
    """Streamed (the scheduler's default: a ClusterStepStream, a StepStream per group) and by unary Step."""
    client, _ = two_groups
    rng = random.Random(7)
    requests = [GenerationRequest(f"r{i}", tuple(rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))),
                                  rng.randint(4, 14)) for i in range(12)]
    sched, model = make(client, 64, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8,
                                                    stream_steps=stream_steps))
    for req in requests:
        sched.add_request(req)
    moved: list = []

    def mover() -> None:
        _wait(lambda: model.num_steps >= 5, "the scheduler's first steps")
        moved.append(client.move_pool("p", "g2"))

    thread = threading.Thread(target=mover)
    thread.start()
    outputs = sched.run()
    thread.join(30)
    check_outputs(outputs, requests)  # every token as the reference: no step lost, the KV where it was
    assert moved and moved[0].group == "g2" and moved[0].version < client.get_pool("p").version
    assert client.get_pool("p").num_seqs == 0


def test_a_cluster_step_stream_follows_its_pool_to_the_new_owner(two_groups) -> None:
    client, _ = two_groups
    client.create_pool(PoolConfig("s", num_blocks=16, block_size=4))
    with client.step_stream() as stream:
        first = stream.step("s", [Allocate("q", [1, 2, 3])])
        client.move_pool("s", "g2")
        # the old owner's stream refuses it in band (WRONG_GROUP, nothing applied); sent again at g2's
        second = stream.step("s", [DecodeAppend(["q"], [4])])
        assert second.version == first.version + 1 and second.incarnation == first.incarnation
        assert len(stream._streams) == 2  # one StepStream per group
        assert stream.step("s", [DecodeAppend(["q"], [5])], request_id="same").version == second.version + 1
        assert stream.step("s", [DecodeAppend(["q"], [5])], request_id="same").version == second.version + 1
    assert client.get_sequence("s", "q").num_tokens == 5
    with pytest.raises(ValueError, match="closed"):
        stream.step("s", [DecodeAppend(["q"], [6])])


def test_a_step_resent_after_a_move_under_its_request_id_is_answered_not_applied_again(two_groups) -> None:
    client, _ = two_groups
    client.create_pool(PoolConfig("m", num_blocks=16, block_size=4))
    first = client.step("m", [Allocate("s", [1, 2, 3])], request_id="rid-1")
    client.move_pool("m", "g2")
    again = client.step("m", [Allocate("s", [1, 2, 3])], request_id="rid-1")  # as if its answer had been lost
    assert (again.version, again.results[0].slot_mapping) == (first.version, first.results[0].slot_mapping)
    assert client.get_pool("m").version == first.version


def test_a_model_worker_serves_its_pool_right_while_the_pool_moves(two_groups) -> None:
    """A real ``blockd-worker --model tiny-llama`` given the cluster target: its
    tables and heartbeats follow the pool to its new group mid-run, and every
    greedy output equals transformers' ``generate``."""
    from blockd.cluster.local import model_config
    from client.model_group import WorkerGroup
    from client.scheduler import Scheduler
    from tests.support.procs import start_worker
    from worker.model import pool_config_for
    from worker.model.reference import ContiguousReference

    client, _ = two_groups
    config = model_config("tiny-llama")
    client.create_pool(pool_config_for(config, "w", 96, 4, dtype="float32"))
    rng = random.Random(11)
    requests = [GenerationRequest(f"r{i}", tuple(rng.randrange(config.vocab_size) for _ in range(rng.randint(5, 20))),
                                  rng.randint(6, 12)) for i in range(8)]
    worker = start_worker(client.target, "w", "--model", "tiny-llama", "--device", "cpu", "--worker-id", "w0")
    moved: list = []
    try:
        with WorkerGroup("w", [worker.address]) as group:
            sched = Scheduler(client, "w", group, SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4))
            for req in requests:
                sched.add_request(req)

            def step(s) -> None:  # the move runs in this thread, between two of the scheduler's steps
                if s.counters.num_steps == 6 and not moved:
                    moved.append(client.move_pool("w", "g2"))
            outputs = sched.run(step)
        assert moved and moved[0].group == "g2" and client.group_of("w") == "g2"
        assert client.get_pool("w").version > moved[0].version  # steps ran at the new owner after the move
        assert ContiguousReference("tiny-llama").mismatches(requests, outputs) == []
        assert [w.info.worker_id for w in client.list_workers("w")] == ["w0"]  # registered at the new owner
        # the worker said what its start cost, phase by phase (issue 31)
        assert re.search(r"worker w0 ready in [0-9.]+ s: model [0-9.]+ s \(load\), KV pool [0-9.]+ s, model "
                         r"runner [0-9.]+ s", worker.output()), worker.output()[-2000:]
    finally:
        worker.kill()
