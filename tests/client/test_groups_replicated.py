"""A replicated group (``blockd serve --etcd ... --cluster ...``) as one group of a cluster.

Its leader announces the group in the directory; when the leader dies, a
follower takes over and announces itself, and the group's pools are served
again through the same ``cluster://`` target while the other group's pools
serve throughout. A pool moves into the replicated group and back.
"""

from __future__ import annotations

import time

from blockd.core.types import Allocate, PoolConfig
from client.errors import BlockdClientError
from client.groups import ClusterClient
from tests.support.procs import start_blockd

pytest_plugins = ["tests.support.etcd"]


def _until(call, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = call()
            if found:
                return found
        except BlockdClientError as err:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {err}") from err
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_replicated_groups_pools_survive_its_leaders_death(etcd_server, tmp_path) -> None:
    cluster = ("--cluster", "rep", "--cluster-etcd", etcd_server.url, "--lease-ttl-s", "2")
    replicas = {rid: start_blockd("--etcd", etcd_server.url, "--group", "rg", "--replica-id", rid,
                                  "--data-dir", str(tmp_path / rid), "--replication", "sync", "--min-in-sync", "1",
                                  *cluster) for rid in ("r0", "r1")}
    single = start_blockd("--group", "g1", *cluster)
    try:
        with ClusterClient(f"cluster://{etcd_server.url.split('://')[1]}/rep", timeout_s=10) as client:
            _until(lambda: len(client.groups()) == 2, "the replicated group's leader to announce it")
            client.create_pool(PoolConfig("a", num_blocks=16, block_size=4))
            client.create_pool(PoolConfig("b", num_blocks=16, block_size=4))
            assert (client.group_of("a"), client.group_of("b")) == ("g1", "rg")
            client.step("b", [Allocate("s", [1, 2, 3])])
            leader = next(p for p in replicas.values() if p.address == client.groups()["rg"])
            time.sleep(0.5)  # the follower holds the step (min-in-sync 1 acknowledges before it does)
            leader.kill()
            assert client.step("a", [Allocate("s", [1])]).version == 1  # the other group serves meanwhile
            _until(lambda: client.get_pool("b").num_seqs == 1, "the follower to lead and announce the group")
            assert client.step("b", [Allocate("t", [4])]).version >= 2
            moved = client.move_pool("a", "rg")  # into the replicated group, and back
            assert (moved.group, client.get_pool("a").num_seqs) == ("rg", 1)
            assert client.move_pool("a", "g1").epoch == 3 and client.get_pool("a").num_seqs == 1
    finally:
        for proc in (*replicas.values(), single):
            proc.kill()
