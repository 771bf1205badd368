"""A replica group across hosts: etcd and three ``blockd serve --etcd`` replicas,
each in its own network namespace with its own address (tests/support/netns.py), and a
client on a fifth host that knows the three replicas' addresses.

The replicas bind ``0.0.0.0`` and advertise their namespace's address, so a
follower dials its leader's address and takes its feed on the leader's
replication port there (``--replication-port``, docs/ha.md 2.3). Checked: the
client's sync steps are acknowledged (each needs a follower's acknowledgement
from that port); both followers say they follow on it; the leader reports both
followers holding its whole log; after the leader is SIGKILLed, another replica
leads and holds every acknowledged step, and steps on.

Skips where namespaces cannot be made or etcd is missing, unless
``BLOCKD_REQUIRE_NETNS=1`` / ``BLOCKD_REQUIRE_ETCD=1`` (``.ci/run``), where
that fails. The namespaces are deleted whatever happens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from blockd.cluster.local import ROOT, ChildProcess, child_env
from tests.support.etcd import require_etcd
from tests.support.netns import lab_of

REPLICAS = ("r0", "r1", "r2")
BLOCKD_PORT, REPLICATION_PORT, ETCD_PORT = 50051, 50052, 2379
START_TIMEOUT_S = 60.0
STEPS = 40

# Run on the client's host: steps through the SDK with every replica's address (it follows the leader).
CLIENT = r'''
import json, sys, time
from blockd.core import Allocate, PoolConfig
from client.sdk import BlockdClient

action, target, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
seqs = [f"s{i}" for i in range(steps)]
with BlockdClient(target, timeout_s=30) as client:
    if action == "load":
        client.create_pool(PoolConfig("p", num_blocks=1024, block_size=4), request_id="create-p")
        for i, seq in enumerate(seqs):
            client.step("p", [Allocate(seq, [i, i + 1])], request_id=f"step-{i}")
        deadline = time.monotonic() + 30
        while True:  # the steps were acknowledged once one follower held them; wait for both
            status = client.replica_status()
            if len(status.followers) == 2 and all(f.persisted_lsn == status.last_lsn for f in status.followers):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        print(json.dumps({"leader": status.leader_id, "term": status.term,
                          "followers": sorted(f.replica_id for f in status.followers)}))
    else:
        _, tables = client.get_tables("p", seqs)
        client.step("p", [Allocate("after", [1])], request_id="after")
        status = client.replica_status()
        print(json.dumps({"leader": status.leader_id, "term": status.term, "held": sorted(tables)}))
'''


@pytest.fixture
def lab():
    require_etcd()
    with lab_of(["etcd", *REPLICAS, "client"]) as made:
        yield made


def client(lab, target: str, action: str) -> dict:
    proc = lab.run("client", [sys.executable, "-c", CLIENT, action, target, str(STEPS)], env=child_env(), cwd=ROOT,
                   timeout_s=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_replica_group_across_network_namespaces_replicates_on_the_replication_port(lab, tmp_path):
    ip = lab.addresses
    etcd_url = f"http://{ip['etcd']}:{ETCD_PORT}"
    with open(tmp_path / "etcd.log", "wb") as log:
        etcd = subprocess.Popen(
            [*lab.prefix("etcd"), "etcd", "--name", "lab", "--data-dir", str(tmp_path / "etcd"),
             "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
             "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
             "--initial-cluster", "lab=http://127.0.0.1:2380"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        replicas: dict[str, ChildProcess] = {}
        for rid in REPLICAS:
            replicas[rid] = child = ChildProcess(rid, [
                "-m", "blockd.cli", "serve", "--listen", f"0.0.0.0:{BLOCKD_PORT}", "--insecure",
                "--advertise-address", ip[rid], "--data-dir", str(tmp_path / rid), "--etcd", etcd_url,
                "--replica-id", rid, "--lease-ttl-s", "3", "--replication-port", str(REPLICATION_PORT)],
                "blockd advertising", prefix=lab.prefix(rid))
            lab.children.append(child)
        deadline = time.monotonic() + START_TIMEOUT_S
        for child in replicas.values():
            child.wait_ready(deadline)
        target = ",".join(f"{ip[rid]}:{BLOCKD_PORT}" for rid in REPLICAS)

        first = client(lab, target, "load")
        leader = first["leader"]
        assert first["followers"] == sorted(set(REPLICAS) - {leader}), first
        said = f"follows {ip[leader]}:{BLOCKD_PORT} on its replication port {REPLICATION_PORT}"
        for rid in first["followers"]:
            assert said in replicas[rid].output(), replicas[rid].output()

        replicas[leader].kill()  # SIGKILL: no resignation, the lease must expire
        after = client(lab, target, "after")
        assert after["leader"] != leader and after["term"] > first["term"], after
        assert after["held"] == sorted(f"s{i}" for i in range(STEPS)), after
    finally:
        etcd.kill()
        etcd.wait()
