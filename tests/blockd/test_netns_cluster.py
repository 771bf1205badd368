"""A real multi-host cluster on one machine: blockd, a tensor-parallel pair of
model workers and the scheduler, each in its own network namespace with its
own address (tests/support/netns.py), talking over veth pairs and a bridge.

blockd and the workers bind ``0.0.0.0`` and advertise their namespace's
address; the pool is created by ``blockctl pools apply`` from the
scheduler's host; the TP pair meets over gloo across namespaces; the
scheduler knows only blockd's address and finds the workers through the
registry. Checked: the workers registered their advertised addresses; the
greedy outputs equal transformers' own ``generate``; after one worker is
SIGKILLed, blockd reports it down and the scheduler gets a clear error.

Skips where namespaces cannot be made (not root, no ``ip``), unless
``BLOCKD_REQUIRE_NETNS=1`` (``.ci/run`` sets it: CI runs as root), where
that is a failure. The namespaces are deleted whatever happens.
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import pytest

from blockd.cluster.local import ROOT, ChildProcess, child_env, model_config
from tests.support.netns import NetnsLab, lab_of
from tests.support.netns_scheduler import workload
from worker.model import pool_config_for
from worker.model.reference import ContiguousReference

MODEL, POOL, SEED = "tiny-llama", "m", 3
BLOCKD_PORT, WORKER_PORT, TP_PORT = 50051, 50061, 29500
START_TIMEOUT_S = 120.0
DOWN_TIMEOUT_S = 30.0


@pytest.fixture
def lab():
    with lab_of(["blockd", "w0", "w1", "sched"]) as made:
        yield made


def start(lab: NetnsLab, host: str, name: str, args: list[str], ready: str, **env: str) -> ChildProcess:
    child = ChildProcess(name, args, ready, env=env, prefix=lab.prefix(host))
    lab.children.append(child)
    return child


def blockctl(lab: NetnsLab, target: str, *args: str) -> str:
    """``blockctl`` run on the scheduler's host; its stdout (it must succeed)."""
    proc = lab.run("sched", [sys.executable, "-m", "client.cli", "--target", target, *args], env=child_env(),
                   cwd=ROOT, timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def scheduler(lab: NetnsLab, target: str, action: str, num_up: int) -> dict:
    """``tests/support/netns_scheduler.py`` on the scheduler's host; its JSON lines, merged."""
    proc = lab.run("sched", [sys.executable, "-m", "tests.support.netns_scheduler", action, "--blockd", target,
                             "--pool", POOL, "--seed", str(SEED), "--workers", str(num_up)],
                  env=child_env(), cwd=ROOT, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged: dict = {}
    for line in proc.stdout.splitlines():
        merged.update(json.loads(line))
    return merged


def start_cluster(lab: NetnsLab, tmp_path) -> str:
    """blockd, the pool, the TP pair; blockd's advertised address."""
    ip = lab.addresses
    d = start(lab, "blockd", "blockd", ["-m", "blockd.cli", "serve", "--listen", f"0.0.0.0:{BLOCKD_PORT}",
                                        "--insecure", "--advertise-address", ip["blockd"], "--fsync", "never",
                                        "--worker-timeout-s", "2"], "blockd advertising")
    target = d.wait_ready(time.monotonic() + START_TIMEOUT_S)
    config = pool_config_for(model_config(MODEL), POOL, 26, 8, dtype="float32", watermark_blocks=1)
    pools = tmp_path / "pools.json"
    pools.write_text(json.dumps({"pools": [config.__dict__]}))
    assert blockctl(lab, target, "pools", "apply", str(pools)) == f"created pool {POOL}\n"
    workers = []
    for rank in range(2):
        host = f"w{rank}"
        # rank 0 hosts the TP rendezvous; gloo must use the veth, not what the hostname resolves to
        workers.append(start(lab, host, f"worker {rank}", [
            "-m", "worker.main", "--blockd", target, "--pool", POOL, "--model", MODEL, "--device", "cpu",
            "--worker-id", host, "--heartbeat-s", "0.5", "--listen", f"0.0.0.0:{WORKER_PORT}", "--insecure",
            "--advertise-address", ip[host], "--tp-rank", str(rank), "--tp-world-size", "2",
            "--tp-init", f"tcp://{ip['w0']}:{TP_PORT}", "--tp-timeout-s", "20"],
            "blockd-worker listening on", GLOO_SOCKET_IFNAME="eth0"))
    deadline = time.monotonic() + START_TIMEOUT_S
    for worker in workers:
        worker.wait_ready(deadline)
    return target


def wait_down(lab: NetnsLab, target: str, worker_id: str) -> dict[str, bool]:
    """Poll ``blockctl workers list`` until ``worker_id`` is down (bounded); worker -> is_up."""
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while True:
        listed = json.loads(blockctl(lab, target, "workers", "list", "--pool", POOL, "--json"))
        up = {w["info"]["worker_id"]: w["is_up"] for w in listed}
        if not up.get(worker_id, True) or time.monotonic() > deadline:
            return up
        time.sleep(0.5)


def test_cluster_across_network_namespaces(lab, tmp_path) -> None:
    began = time.monotonic()
    target = start_cluster(lab, tmp_path)
    setup_s = time.monotonic() - began
    ip = lab.addresses
    assert target == f"{ip['blockd']}:{BLOCKD_PORT}"

    served = scheduler(lab, target, "generate", num_up=2)
    assert [(w["worker_id"], w["address"], w["is_up"]) for w in served["workers"]] == [
        ("w0", f"{ip['w0']}:{WORKER_PORT}", True), ("w1", f"{ip['w1']}:{WORKER_PORT}", True)]
    requests = workload(SEED)
    outputs = [SimpleNamespace(request_id=o["request_id"], error=o["error"],
                               output_token_ids=[tuple(t) for t in o["output_token_ids"]])
               for o in served["outputs"]]
    assert ContiguousReference(MODEL).mismatches(requests, outputs) == []
    print(f"netns cluster: namespaces made in {lab.setup_s:.2f}s, cluster started in {setup_s:.1f}s; "
          f"{len(requests)} requests, "
          f"{sum(len(o.output_token_ids) for o in outputs)} samples equal the reference")

    w1 = next(child for child in lab.children if child.name == "worker 1")
    w1.kill()  # SIGKILL: no goodbye to blockd or the TP peer
    assert wait_down(lab, target, "w1") == {"w0": True, "w1": False}
    probe = scheduler(lab, target, "probe", num_up=1)
    assert probe["error"] == "UnavailableError", probe
    assert f"{ip['w1']}:{WORKER_PORT}" in probe["message"] and "rank 1" in probe["message"], probe
