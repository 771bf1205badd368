"""Pools over daemon groups (``blockd serve --cluster``): the ``groups`` rows of ``bench/rpc.py``.

A real etcd (``etcd`` on PATH) holds the directory; each group is one
``blockd serve --cluster NAME --group G`` process, state in memory. Two
scheduler processes (``multiprocessing`` spawn, so no GIL is shared), each
with its own pool of 256 running sequences, send the 256-sequence decode step
through a :class:`~client.groups.ClusterClient` (``cluster://`` target),
which routes each step to the pool's group. Rows (``name``: ``groups``):

* ``daemons`` 1 or 2: the two pools on one daemon process, or one on each
  (placement, fewest pools first, spreads them); ``steps_per_s`` of both
  schedulers together, ``p50_ms`` / ``p99_ms`` per step, ``daemon_cpu_us_per_step``
  (all daemon processes' CPU from ``/proc``, per step);
* ``routing``: what routing by pool costs a scheduler, in CPU per step of the
  scheduler's own process: ``sdk_cpu_us_per_step`` through a plain
  :class:`~client.sdk.BlockdClient` and ``cluster_cpu_us_per_step`` through a
  ``ClusterClient`` to the same daemon, alternating rounds (medians), their
  difference ``routing_us_per_step`` (noisy: the cores are shared), and
  ``route_only_us``, the routing path alone (the cached route, the group's
  client, the call wrapper) around a call that does nothing (target: at most
  20 us).

``cpus`` says how many cores daemon and schedulers shared.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Iterator

from bench.daemon import BLOCK_SIZE, MAX_STEPS, NUM_BLOCKS, NUM_SEQS, percentile, start_daemon, stop_daemon
from bench.daemon_cost import process_cpu_s
from blockd.core import Allocate, PoolConfig
from client.groups import ClusterClient
from client.sdk import BlockdClient
from tests.support.etcd import EtcdServer

WARMUP_STEPS = 50
SCHEDULERS = 2


def _prepare(client, pool: str) -> list[str]:
    ids = [f"{pool}-{i}" for i in range(NUM_SEQS)]
    client.step(pool, [Allocate(s, list(range(BLOCK_SIZE))) for s in ids])
    return ids


def _scheduler(target: str, pool: str, seconds: float, barrier, results) -> None:
    with ClusterClient(target) as client:
        ids, tokens = _prepare(client, pool), [7] * NUM_SEQS
        for _ in range(WARMUP_STEPS):
            client.decode_append(pool, ids, tokens)
        barrier.wait()
        times: list[float] = []
        began = time.perf_counter()
        end = began + seconds
        while time.perf_counter() < end and len(times) < MAX_STEPS - WARMUP_STEPS - 1:
            start = time.perf_counter()
            client.decode_append(pool, ids, tokens)
            times.append(time.perf_counter() - start)
        results.put((times, time.perf_counter() - began))


def _aggregate(etcd_url: str, daemons: int, seconds: float) -> dict:
    cluster = f"bench-{daemons}"
    procs = [start_daemon("--cluster", cluster, "--group", f"g{i}", "--cluster-etcd", etcd_url)[0]
             for i in range(daemons)]
    target = f"cluster://{etcd_url.split('://', 1)[1]}/{cluster}"
    try:
        pools = [f"{cluster}-p{i}" for i in range(SCHEDULERS)]
        with ClusterClient(target) as client:
            for pool in pools:
                client.create_pool(PoolConfig(pool, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
            placed = sorted({client.group_of(pool) for pool in pools})
        ctx = multiprocessing.get_context("spawn")
        barrier, results = ctx.Barrier(SCHEDULERS + 1), ctx.Queue()
        workers = [ctx.Process(target=_scheduler, args=(target, pool, seconds, barrier, results)) for pool in pools]
        for worker in workers:
            worker.start()
        barrier.wait()
        cpu0 = sum(process_cpu_s(p.pid) for p in procs)
        runs = [results.get(timeout=seconds + 120) for _ in workers]
        cpu = sum(process_cpu_s(p.pid) for p in procs) - cpu0
        for worker in workers:
            worker.join(30)
    finally:
        for proc in procs:
            stop_daemon(proc)
    times = sorted(t for run, _ in runs for t in run)
    return {"name": "groups", "daemons": daemons, "groups_used": placed, "schedulers": SCHEDULERS,
            "seqs": NUM_SEQS, "steps": len(times),
            "steps_per_s": round(sum(len(run) / wall for run, wall in runs), 1),
            "p50_ms": round(percentile(times, 0.5) * 1e3, 3), "p99_ms": round(percentile(times, 0.99) * 1e3, 3),
            "daemon_cpu_us_per_step": round(cpu / max(1, len(times)) * 1e6, 1), "cpus": os.cpu_count()}


def _cpu_per_step(client, pool: str, ids: list[str], steps: int) -> float:
    tokens = [7] * NUM_SEQS
    began = time.process_time()
    for _ in range(steps):
        client.decode_append(pool, ids, tokens)
    return (time.process_time() - began) / steps * 1e6


def _routing(etcd_url: str, seconds: float) -> dict:
    proc, address = start_daemon("--cluster", "bench-routing", "--group", "g0", "--cluster-etcd", etcd_url)
    target = f"cluster://{etcd_url.split('://', 1)[1]}/bench-routing"
    try:
        with ClusterClient(target) as cluster, BlockdClient(address) as plain:
            cluster.create_pool(PoolConfig("r", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
            ids = _prepare(cluster, "r")
            steps = max(20, min(400, int(seconds * 100)))
            rounds = max(1, (MAX_STEPS - WARMUP_STEPS) // (2 * steps) - 1)
            _cpu_per_step(plain, "r", ids, WARMUP_STEPS)
            plain_us, cluster_us = [], []
            for _ in range(min(rounds, 5)):
                plain_us.append(_cpu_per_step(plain, "r", ids, steps))
                cluster_us.append(_cpu_per_step(cluster, "r", ids, steps))
            reps = 100_000
            began = time.process_time()
            for _ in range(reps):
                cluster.on_pool("r", _nothing)
            route_only = (time.process_time() - began) / reps * 1e6
    finally:
        stop_daemon(proc)
    plain_med, cluster_med = statistics.median(plain_us), statistics.median(cluster_us)
    return {"name": "groups", "part": "routing", "seqs": NUM_SEQS, "steps_per_round": steps,
            "rounds": len(plain_us), "sdk_cpu_us_per_step": round(plain_med, 1),
            "cluster_cpu_us_per_step": round(cluster_med, 1),
            "routing_us_per_step": round(cluster_med - plain_med, 1), "route_only_us": round(route_only, 2),
            "target_us": 20, "cpus": os.cpu_count()}


def _nothing(client: BlockdClient) -> None:
    return None


def groups_rows(seconds: float) -> Iterator[dict]:
    """The rows above, against an etcd of their own in a temp dir."""
    with tempfile.TemporaryDirectory(prefix="blockd-bench-groups-") as root:
        etcd = EtcdServer(root).start()
        try:
            for daemons in (1, 2):
                yield _aggregate(etcd.url, daemons, seconds)
            yield _routing(etcd.url, seconds)
        finally:
            etcd.kill()
