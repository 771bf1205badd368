"""Pools over daemon groups: two ``blockd serve --cluster`` daemons, a real etcd,
the SDK's :class:`~client.cluster.ClusterClient` routing by pool.

Placement (fewest pools), steps at the owner, listings and prefix lookups
across the groups, a group refusing another's pool (naming the owner) and
changing nothing, bad targets and flags refused in words, and a group that
dies: its pools unavailable with a clear error while the other group's serve.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from blockd.cluster.local import ROOT, child_env
from blockd.core.types import Allocate, DecodeAppend, PoolConfig
from client.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from client.groups import ClusterClient
from client.sdk import BlockdClient
from client.step_stream import _LaneCall
from tests.support.cli import run
from tests.support.procs import start_blockd, start_worker

pytest_plugins = ["tests.support.etcd", "tests.support.groups"]


def test_pools_are_placed_on_the_fewest_loaded_group_and_stepped_at_their_owner(two_groups) -> None:
    client, (g1, _) = two_groups
    for name in ("a", "b", "c"):
        client.create_pool(PoolConfig(name, num_blocks=16, block_size=4))
    assert [client.group_of(p) for p in ("a", "b", "c")] == ["g1", "g2", "g1"]
    for name in ("a", "b", "c"):
        result = client.step(name, [Allocate("s", list(range(10)))])
        client.step(name, [DecodeAppend(["s"], [7])], incarnation=result.incarnation)
        assert client.get_pool(name).num_seqs == 1
    assert [s.name for s in client.list_pools()] == ["a", "b", "c"]
    stream = client.watch("b", 0, timeout_s=5)  # a worker's Watch, at b's group
    assert next(stream).version == 1
    stream.close()
    with BlockdClient(g1.address) as one:
        assert [s.name for s in one.list_pools()] == ["a", "c"]  # a group lists only its own pools
    # the decode step committed the prompt: its two full blocks are cached in every pool
    assert client.lookup_prefix(list(range(10))) == {"a": 8, "b": 8, "c": 8}
    assert client.lookup_prefix(list(range(10)), pools=["b"]) == {"b": 8}
    with pytest.raises(NotFoundError, match="in no group of cluster"):
        client.step("nope", [Allocate("s", [1])])
    # streamed steps: over gRPC to g1, over g2's step lane to g2 (tests.support.groups), each answered alike
    with client.step_stream() as streams:
        slots = {name: streams.decode_append(name, ["s"], [8]).slot_mapping for name in ("a", "b", "c")}
        assert slots == {"a": (11,), "b": (11,), "c": (11,)}
        lanes = {target: isinstance(s._call, _LaneCall) for target, s in streams._streams.items()}
        assert sorted(lanes.values()) == [False, True]


def test_a_group_refuses_another_groups_pool_naming_the_owner_and_changes_nothing(two_groups) -> None:
    client, (g1, g2) = two_groups
    client.create_pool(PoolConfig("a", num_blocks=16, block_size=4))  # on g1
    with BlockdClient(g2.address, timeout_s=5) as wrong:
        with pytest.raises(FailedPreconditionError, match="served by group g1") as err:
            wrong.step("a", [Allocate("s", [1, 2, 3])])
        assert err.value.reason == "WRONG_GROUP"
        assert err.value.metadata["owner_group"] == "g1" and err.value.metadata["owner_address"] == g1.address
        assert err.value.metadata["epoch"] == "1"
        with pytest.raises(AlreadyExistsError, match="already exists on group g1") as exists:
            wrong.create_pool(PoolConfig("a", num_blocks=8, block_size=4))
        assert exists.value.reason == "EXISTS_ON_OTHER_GROUP"
        stream = wrong.step_stream()
        with pytest.raises(FailedPreconditionError, match="served by group g1"):
            stream.step("a", [Allocate("s", [1, 2, 3])])  # refused in band, the stream reads on
        stream.close()
        with pytest.raises(FailedPreconditionError, match="served by group g1"):
            next(iter(wrong.watch("a")))
        assert wrong.list_pools() == []
    assert client.get_pool("a").num_seqs == 0 and client.group_of("a") == "g1"
    # a CreatePool the engine refuses gives its claim back: the name stays free
    with pytest.raises(InvalidArgumentError):
        client.create_pool(PoolConfig("bad", num_blocks=0, block_size=4))
    with pytest.raises(NotFoundError, match="in no group"):
        client.get_pool("bad")
    client.delete_pool("a")  # released from the directory: the name can go to any group again
    with pytest.raises(NotFoundError, match="in no group"):
        client.get_pool("a")


def test_a_dead_group_leaves_its_pools_unavailable_while_the_others_serve(two_groups) -> None:
    client, (_, g2) = two_groups
    client.create_pool(PoolConfig("a", num_blocks=16, block_size=4))
    client.create_pool(PoolConfig("b", num_blocks=16, block_size=4))
    assert client.group_of("b") == "g2"
    g2.kill()
    deadline = time.monotonic() + 15
    while True:  # until the lease of g2 ends, a call to it fails as any unreachable daemon's
        try:
            client.step("b", [Allocate("s", [1])])
        except UnavailableError as err:
            if "has no live daemon" in str(err):
                break
            assert time.monotonic() < deadline, err
        time.sleep(0.2)
    assert client.step("a", [Allocate("s", [1, 2])]).version == 1
    assert [s.name for s in client.list_pools()] == ["a"]


def test_blockctl_and_a_worker_route_by_pool(two_groups, capsys) -> None:
    client, (_, g2) = two_groups
    target = client.target
    code, out, _ = run(capsys, "--target", target, "pools", "create", "a", "--num-blocks", "16", "--block-size", "4")
    assert code == 0, out
    run(capsys, "--target", target, "pools", "create", "b", "--num-blocks", "16", "--block-size", "4")
    assert client.group_of("b") == "g2"
    code, out, _ = run(capsys, "--target", target, "pools", "list", "--json")
    assert code == 0 and [p["name"] for p in json.loads(out)] == ["a", "b"]
    code, _, err = run(capsys, "--target", target, "cluster", "status")  # one replica's view: not over a cluster
    assert code == 2 and "is not HOST:PORT" in err and "Traceback" not in err
    with pytest.raises(InvalidArgumentError, match="not offered over a cluster target"):
        client.replica_status()
    code, _, err = run(capsys, "--target", "cluster://127.0.0.1:1", "pools", "list")
    assert code != 0 and "names no cluster" in err and "Traceback" not in err
    code, out, _ = run(capsys, "--target", target, "pools", "move", "a", "--to-group", "g2", "--json")
    assert code == 0 and json.loads(out) == {"pool": "a", "group": "g2", "epoch": 2, "version": 0}
    code, _, err = run(capsys, "--target", target, "pools", "move", "a", "--to-group", "g9")
    assert code == 3 and "group g9 has no live daemon" in err and "Traceback" not in err
    code, _, err = run(capsys, "--target", "127.0.0.1:1", "pools", "move", "a", "--to-group", "g1")
    assert code == 2 and "needs a cluster" in err
    worker = start_worker(target, "b", "--device", "cpu", "--worker-id", "wb")
    try:
        deadline = time.monotonic() + 20
        while True:  # registered at g2 and heartbeating there (a heartbeat names no pool: routed by the worker's)
            found = client.list_workers("b")
            if found and found[0].is_up and found[0].last_heartbeat_age_s < 1.0:
                break
            assert time.monotonic() < deadline, found
            time.sleep(0.1)
        with BlockdClient(g2.address) as owner:
            assert [w.info.worker_id for w in owner.list_workers()] == ["wb"]
        client.move_pool("b", "g1")  # the worker follows its pool: registers and heartbeats at g1
        deadline = time.monotonic() + 20
        while not [w for w in client.list_workers("b") if w.info.worker_id == "wb" and w.is_up]:
            assert time.monotonic() < deadline, "the worker did not follow its pool to g1"
            time.sleep(0.1)
    finally:
        worker.kill()


def test_bad_cluster_targets_are_refused_in_words() -> None:
    for target, says in [("cluster:///c", "names no etcd endpoint"), ("cluster://h:1/", "names no cluster"),
                         ("cluster://h:1/a/b", "has a '/'"), ("127.0.0.1:1", "not a cluster target")]:
        with pytest.raises(InvalidArgumentError, match=says):
            ClusterClient(target)
    with pytest.raises(InvalidArgumentError, match="cluster name"):
        ClusterClient("cluster://127.0.0.1:1/bad name")
    with pytest.raises(UnavailableError, match="cannot read cluster c's directory"):
        ClusterClient("cluster://127.0.0.1:1/c", timeout_s=1)


@pytest.mark.parametrize(("flags", "says"), [
    (["--cluster", "c"], "--cluster needs --cluster-etcd"),
    (["--cluster-etcd", "http://127.0.0.1:1"], "--cluster-etcd needs --cluster"),
    (["--cluster", "c/d", "--cluster-etcd", "http://127.0.0.1:1"], "cluster name must be"),
    (["--cluster", "c", "--cluster-etcd", "ftp://x"], "etcd endpoint must be"),
])
def test_bad_cluster_flags_stop_the_daemon_with_a_message(flags, says) -> None:
    done = subprocess.run([sys.executable, "-m", "blockd.cli", "serve", "--listen", "127.0.0.1:0", *flags],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr


def test_a_daemon_that_cannot_reach_the_directory_does_not_serve() -> None:
    done = subprocess.run([sys.executable, "-m", "blockd.cli", "serve", "--listen", "127.0.0.1:0", "--cluster",
                           "c", "--cluster-etcd", "http://127.0.0.1:1"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "cannot join cluster c as group main" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_group_restarted_on_its_data_dir_serves_its_pools_again(etcd_server, tmp_path) -> None:
    def group():
        return start_blockd("--cluster", "restart", "--group", "g1", "--cluster-etcd", etcd_server.url,
                            "--data-dir", str(tmp_path / "g1"), "--lease-ttl-s", "2")

    daemon = group()
    try:
        with ClusterClient(f"cluster://{etcd_server.url.split('://')[1]}/restart", timeout_s=5) as client:
            client.create_pool(PoolConfig("a", num_blocks=16, block_size=4))
            version = client.step("a", [Allocate("s", [1, 2, 3])]).version
            daemon.stop()  # SIGTERM: it leaves the directory at once
            with pytest.raises(UnavailableError, match="has no live daemon"):
                client.get_pool("a")
            daemon = group()  # another port: the directory says where
            assert client.get_pool("a").version == version and client.group_of("a") == "g1"
    finally:
        daemon.kill()


def test_a_source_pool_in_another_group_is_refused_in_words_and_a_scheduler_computes_instead(two_groups) -> None:
    from client.scheduler import SchedulerConfig
    from client.serving import GenerationRequest
    from tests.support.slot_model import check_outputs, make

    client, (g1, _) = two_groups
    client.create_pool(PoolConfig("a", num_blocks=16, block_size=4))  # g1
    client.create_pool(PoolConfig("b", num_blocks=16, block_size=4))  # g2
    client.create_pool(PoolConfig("c", num_blocks=16, block_size=4))  # g1: a source in the same group
    assert [client.group_of(p) for p in "abc"] == ["g1", "g2", "g1"]
    client.step("a", [Allocate("s", list(range(10)))])
    with pytest.raises(FailedPreconditionError, match="source_pool 'a' is served by group g1, not group g2") as err:
        client.step("b", [Allocate("x", list(range(10))), Allocate("t", list(range(10)), source_pool="a")])
    assert err.value.reason == "SOURCE_IN_OTHER_GROUP" and err.value.op_index == 1
    assert err.value.metadata["source_group"] == "g1" and err.value.metadata["source_address"] == g1.address
    assert client.get_pool("b").version == 0  # nothing applied, and the call was not re-routed
    assert client.step("c", [Allocate("t", list(range(10)), source_pool="a")]).version == 1  # one group: shared
    # a scheduler of b sharing from a steps on without the source: every token as the reference
    requests = [GenerationRequest(f"r{i}", tuple(range(i, i + 7)), 3) for i in range(3)]
    sched, _ = make(client, 24, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, source_pool="a"))
    assert client.group_of("p") == "g2"  # the fewest pools: a's group is the other one
    for req in requests:
        sched.add_request(req)
    check_outputs(sched.run(), requests)
