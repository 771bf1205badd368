"""blockd over gRPC on loopback: what a scheduler's step costs end to end.

Prints one JSON object per line. Parts (``--part NAME``, repeatable; all by
default) are functions registered in :data:`PARTS` that yield result dicts,
so another part (e.g. ``recovery``) is one more function and one more entry.

``crash_loop_restart`` and ``snapshot_stall`` (durability under a crash loop
and while a snapshot is taken) are described on their functions.

``step_rpc``: the daemon runs in its own process (``blockd serve``, state in
memory); each scheduler owns a pool of 256 running sequences and sends a
256-sequence decode step (one ``decode_append`` op) per call through the
sync SDK. With 4 schedulers each is a separate process, so the client GIL
does not serialise them. Fields:

* ``schedulers``, ``p50_ms``, ``p99_ms`` (per-step latency), ``steps_per_s``
  (all schedulers together);
* ``empty_rpc_p50_ms``: a GetPool round trip, the floor of any call;
* ``inprocess_us``: the same step on an in-process ``blockd.core.Pool``
  (median; ``inprocess_mean_us`` includes the block-boundary steps);
* ``cpus``: cores of this machine, shared by daemon and schedulers.

``security``: the cost of TLS, mutual TLS, bearer tokens and the auth
interceptor on the same step (rows of :mod:`bench.auth`: ``interceptor`` and
``step_security`` with ``p50_ratio`` / ``p99_ratio`` against plain text).

``idempotency``: two rows, in process (no gRPC).

* ``idempotency_memory``: 20k steps of 2,048 new tokens each (free the last
  sequence, allocate the next), every step with a request id, in a fresh
  process: the idempotency table's bytes (target: at or under the byte cap)
  and the process's RSS growth (target: under 100 MB), against the same
  steps without request ids (``baseline_rss_growth_mb``).
* ``idempotency_cost``: what a request id costs a step (content fingerprint,
  lookup, compact answer): median engine step with and without one, for a
  256-sequence decode step and a 2,048-token prefill.

``daemon_cost`` (and ``daemon_profile`` with ``--profile``): the daemon's
CPU per step from ``/proc`` for the decode step and a 2,048-token prefill, 1
and 4 schedulers, in memory and with ``--fsync always``, plain and with mTLS
and a token, against the in-process core; and where a step's time goes
(:mod:`bench.daemon_cost` has the fields).

``groups``: pools over daemon groups (``blockd serve --cluster``, a real
etcd): steps/s of two schedulers with their pools on 1 and on 2 daemon
processes, and the SDK's routing cost per step (rows of :mod:`bench.groups`).

``transport_floor``: the server CPU per message of a stream that does no
work, carrying the decode step's bytes, over sync gRPC, ``grpc.aio`` and a
framed TCP socket (rows of :mod:`bench.transport_floor`): what no code of
blockd's can take away from ``daemon_cost`` on that transport.

``big_batch_isolation``: one caller's 20,000- and 30,000-op failing batches
against another's small steps (rows of :mod:`bench.isolation`).

Run: ``python bench/rpc.py [--part step_rpc] [--seconds 3] [--quick] [--profile]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import blockd.core
from bench.auth import interceptor, step_security
from bench.daemon import BLOCK_SIZE, MAX_STEPS, NUM_BLOCKS, NUM_SEQS, percentile, start_daemon, stop_daemon
from bench.daemon_cost import daemon_cost
from bench.groups import groups_rows
from bench.isolation import big_batch_isolation
from bench.transport_floor import MESSAGES, transport_floor
from blockd.core import Allocate, Pool, PoolConfig
from blockd.core.types import DecodeAppend, Free
from client.sdk import BlockdClient


def _seq_ids(pool: str) -> list[str]:
    return [f"{pool}-seq-{i}" for i in range(NUM_SEQS)]


def inprocess_us(reps: int = 2000) -> tuple[float, float]:
    """(median, mean) of the same decode step on an in-process core Pool: the
    mean includes the one step in 16 where every sequence fills a block
    (hashing it) and takes a new one."""
    pool = Pool(PoolConfig("local", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
    ids = _seq_ids("local")
    pool.step([Allocate(s, list(range(BLOCK_SIZE))) for s in ids])
    op, times = [DecodeAppend(ids, [7] * NUM_SEQS)], []
    for _ in range(min(reps, MAX_STEPS)):
        start = time.perf_counter()
        pool.step(op)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, statistics.fmean(times) * 1e6


def empty_rpc_p50_ms(address: str, reps: int = 2000) -> float:
    with BlockdClient(address) as client:
        client.create_pool(PoolConfig("empty-rpc", num_blocks=1, block_size=1))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            client.get_pool("empty-rpc")
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_scheduler(address: str, pool: str, seconds: float, barrier=None) -> tuple[list[float], float]:
    """One scheduler's decode loop: (per-step latencies, loop wall time), seconds."""
    with BlockdClient(address) as client:
        client.create_pool(PoolConfig(pool, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
        ids = _seq_ids(pool)
        client.step(pool, [Allocate(s, list(range(BLOCK_SIZE))) for s in ids])
        tokens = [7] * NUM_SEQS
        for _ in range(50):  # warm up the channel and both sides' code paths
            client.decode_append(pool, ids, tokens)
        if barrier is not None:
            barrier.wait()
        times: list[float] = []
        began = time.perf_counter()
        end = began + seconds
        while time.perf_counter() < end and len(times) < MAX_STEPS - 50:
            start = time.perf_counter()
            client.decode_append(pool, ids, tokens)
            times.append(time.perf_counter() - start)
        elapsed = time.perf_counter() - began
    return times, elapsed


def _scheduler_process(address: str, pool: str, seconds: float, barrier, results) -> None:
    results.put(run_scheduler(address, pool, seconds, barrier))


def run_schedulers(address: str, count: int, seconds: float) -> tuple[list[float], float]:
    """``count`` scheduler processes on their own pools: (latencies, steps/s together)."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(count + 1), ctx.Queue()
    procs = [ctx.Process(target=_scheduler_process, args=(address, f"sched-{count}-{i}", seconds, barrier,
                                                          results)) for i in range(count)]
    for proc in procs:
        proc.start()
    barrier.wait()
    runs = [results.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join(30)
    return [t for times, _ in runs for t in times], sum(len(times) / elapsed for times, elapsed in runs)


def step_rpc(args: argparse.Namespace) -> Iterator[dict]:
    base = {"name": "step_rpc", "seqs": NUM_SEQS, "block_size": BLOCK_SIZE, "cpus": os.cpu_count(),
            "durability": "memory"}
    local_us, local_mean_us = inprocess_us()
    proc, address = start_daemon()
    try:
        empty_ms = empty_rpc_p50_ms(address)
        for count in (1, 4):
            if count == 1:
                times, elapsed = run_scheduler(address, "sched-1-0", args.seconds)
                rate = len(times) / elapsed
            else:
                times, rate = run_schedulers(address, count, args.seconds)
            times.sort()
            yield {**base, "schedulers": count, "steps": len(times),
                   "p50_ms": round(percentile(times, 0.50) * 1e3, 3),
                   "p99_ms": round(percentile(times, 0.99) * 1e3, 3),
                   "steps_per_s": round(rate, 1),
                   "empty_rpc_p50_ms": round(empty_ms, 3), "inprocess_us": round(local_us, 1),
                   "inprocess_mean_us": round(local_mean_us, 1)}
    finally:
        stop_daemon(proc)


def _fill_data_dir(data_dir: str, num_seqs: int, prompt_len: int, snapshot: bool) -> None:
    """A data directory holding ``num_seqs`` sequences (in batches of 1,000),
    written through the same engine the daemon runs."""
    from blockd.engine.config import EngineConfig
    from blockd.engine.machine import Engine

    engine = Engine(EngineConfig(data_dir=data_dir, fsync="never", snapshot_every=1 << 30))
    blocks = num_seqs * -(-prompt_len // BLOCK_SIZE) + 1024
    engine.create_pool(PoolConfig("big", num_blocks=blocks, block_size=BLOCK_SIZE))
    for start in range(0, num_seqs, 1000):
        engine.step("big", [Allocate(f"r{i}", [(i * 31 + j) % 32000 for j in range(prompt_len)])
                            for i in range(start, min(num_seqs, start + 1000))])
    if snapshot:
        engine.snapshot()
    engine.close()


def _time_restart(data_dir: str, num_seqs: int) -> float:
    """Seconds from ``blockd serve --data-dir`` to serving (process start included)."""
    began = time.perf_counter()
    proc, address = start_daemon("--data-dir", data_dir, timeout_s=120)
    elapsed = time.perf_counter() - began
    with BlockdClient(address) as client:
        restored = client.get_pool("big").num_seqs
    stop_daemon(proc)
    if restored != num_seqs:
        raise RuntimeError(f"restored {restored} sequences, expected {num_seqs}")
    return elapsed


def _durable_steps_per_s(fsync: str, seconds: float) -> float:
    import tempfile

    with tempfile.TemporaryDirectory() as data_dir:
        proc, address = start_daemon("--data-dir", data_dir, "--fsync", fsync)
        try:
            times, elapsed = run_scheduler(address, "durable", seconds)
        finally:
            stop_daemon(proc)
    return len(times) / elapsed


def recovery(args: argparse.Namespace) -> Iterator[dict]:
    """Restart time from a data directory of 100k sequences (from a snapshot,
    and from the write-ahead log alone), and decode-step throughput with
    fsync ``always`` vs ``never`` over the same daemon code."""
    import tempfile

    num_seqs, prompt_len = (10_000 if args.quick else 100_000), 64
    base = {"name": "recovery", "seqs": num_seqs, "prompt_len": prompt_len, "block_size": BLOCK_SIZE,
            "cpus": os.cpu_count()}
    for source in ("snapshot", "wal"):
        with tempfile.TemporaryDirectory() as data_dir:
            _fill_data_dir(data_dir, num_seqs, prompt_len, snapshot=source == "snapshot")
            size = sum(os.path.getsize(os.path.join(data_dir, n)) for n in os.listdir(data_dir))
            restart = _time_restart(data_dir, num_seqs)
        yield {**base, "source": source, "restart_s": round(restart, 2), "data_dir_mb": round(size / 2**20, 1),
               "target_s": 5.0}
    never = _durable_steps_per_s("never", args.seconds)
    always = _durable_steps_per_s("always", args.seconds)
    yield {**base, "source": "fsync", "seqs": NUM_SEQS, "steps_per_s_always": round(always, 1),
           "steps_per_s_never": round(never, 1), "ratio_always_vs_never": round(always / never, 3)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _prefill_steps(num_steps: int, prompt_len: int, with_ids: bool, results) -> None:
    """In a fresh process: ``num_steps`` steps that each free the previous
    sequence and allocate a new one of ``prompt_len`` distinct tokens."""
    from blockd.core import Free
    from blockd.engine.idempotency import IdempotencyLimits
    from blockd.engine.machine import Engine

    engine = Engine()  # the default limits, as blockd serve has them
    engine.create_pool(PoolConfig("big", num_blocks=4 * prompt_len // BLOCK_SIZE + 64, block_size=BLOCK_SIZE))
    prompts = [[(n * 7919 + j) % 32000 for j in range(prompt_len)] for n in range(64)]
    before = _rss_bytes()
    for n in range(num_steps):
        ops = [Free(f"s{n - 1}")] if n else []
        ops.append(Allocate(f"s{n}", prompts[n % 64]))
        engine.step("big", ops, f"prefill-{n}" if with_ids else "")
    usage = engine.idempotency_usage()
    results.put((_rss_bytes() - before, usage.num_ids, usage.num_answers, usage.num_bytes,
                 IdempotencyLimits().max_bytes))


def _in_fresh_process(*args) -> tuple:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_prefill_steps, args=(*args, results))
    proc.start()
    out = results.get(timeout=1800)
    proc.join(30)
    return out


def _median_step_us(engine, make_ops, rid_prefix: str, first: int, reps: int) -> float:
    times = []
    for n in range(first, first + reps):
        ops = make_ops(n)
        start = time.perf_counter()
        engine.step("cost", ops, f"{rid_prefix}{n}" if rid_prefix else "")
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _cost_rows(reps: int, prompt_len: int) -> Iterator[dict]:
    from blockd.core import Free
    from blockd.engine.machine import Engine

    engine = Engine()
    engine.create_pool(PoolConfig("cost", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
    ids = _seq_ids("cost")
    engine.step("cost", [Allocate(s, list(range(BLOCK_SIZE))) for s in ids])
    decode, prompt = [DecodeAppend(ids, [7] * NUM_SEQS)], list(range(prompt_len))

    def prefill(n: int) -> list:
        return [Free(f"p{n - 1}"), Allocate(f"p{n}", prompt)] if n else [Allocate("p0", prompt)]

    for name, make_ops, n in (("decode_256", lambda n: decode, reps), ("prefill_2048", prefill, reps // 4)):
        half = n // 2  # alternate halves so drift on a shared machine hits both alike
        runs = [_median_step_us(engine, make_ops, f"{name}-" if i % 2 else "", i * half, half) for i in range(4)]
        without, with_id = min(runs[0::2]), min(runs[1::2])
        yield {"name": "idempotency_cost", "step": name, "steps": 4 * half,
               "us_without_request_id": round(without, 1), "us_with_request_id": round(with_id, 1),
               "ratio_with_vs_without": round(with_id / without, 3)}


def idempotency(args: argparse.Namespace) -> Iterator[dict]:
    num_steps, prompt_len = (2_000 if args.quick else 20_000), 2048
    base_growth, *_ = _in_fresh_process(num_steps, prompt_len, False)
    growth, num_ids, num_answers, num_bytes, cap = _in_fresh_process(num_steps, prompt_len, True)
    yield {"name": "idempotency_memory", "steps": num_steps, "prompt_len": prompt_len,
           "table_bytes": num_bytes, "byte_cap": cap, "ids": num_ids, "answers_kept": num_answers,
           "rss_growth_mb": round(growth / 2**20, 1), "baseline_rss_growth_mb": round(base_growth / 2**20, 1),
           "target": "table_bytes <= byte_cap and rss_growth_mb < 100",
           "meets_target": num_bytes <= cap and growth < 100 * 2**20}
    yield from _cost_rows(200 if args.quick else 1000, prompt_len)



def _crash_loop_life(address: str, life: int, steps: int, live: list[str]) -> None:
    """One life's steps: a decode step over the live sequences; every 10th
    step frees the 4 oldest and admits 4 new ones (the state stays bounded)."""
    # its retries reuse the request id (at most once); a loaded machine may be slow to accept
    with BlockdClient(address, timeout_s=60) as client:
        if life == 0:
            client.create_pool(PoolConfig("loop", num_blocks=1 << 14, block_size=BLOCK_SIZE))
            live.extend(f"first-{k}" for k in range(32))
            client.step("loop", [Allocate(s, list(range(40))) for s in live])
        for i in range(steps):
            if i % 10 == 0:
                old, new = live[:4], [f"l{life}-{i}-{k}" for k in range(4)]
                del live[:4]
                client.step("loop", [Free(s) for s in old] +
                            [Allocate(s, [(life + i + k) % 500 for k in range(40)]) for s in new])
                live.extend(new)
            else:
                client.decode_append("loop", live, [i % 500] * len(live))


def crash_loop_restart(args: argparse.Namespace) -> Iterator[dict]:
    """A daemon SIGKILLed after every ~130 records, 100 lives (--snapshot-every
    300): the restart time once ~13k records were written against once ~3k
    were, in the same run. Snapshots must keep the replay (and so the
    restart) bounded; ``replayed`` is what the daemon says it replayed."""
    import re
    import tempfile

    lives, per_life = (30, 130) if args.quick else (100, 130)
    restarts, recovers, replayed, written, live = [], [], [], [], []
    with tempfile.TemporaryDirectory() as data_dir:
        for life in range(lives):
            began = time.perf_counter()
            proc, address = start_daemon("--data-dir", data_dir, "--snapshot-every", "300", "--log-level", "INFO",
                                         "--snapshot-log-ratio", os.environ.get("BENCH_LOG_RATIO", "0.25"),
                                         timeout_s=120)
            restarts.append(time.perf_counter() - began)
            found = re.search(r"(\d+) log records replayed.* in ([0-9.]+)s", proc.output())
            replayed.append(int(found.group(1)) if found else -1)
            recovers.append(float(found.group(2)) if found else -1.0)
            written.append(life * per_life)
            try:
                _crash_loop_life(address, life, per_life, live)
            finally:
                proc.kill()

        snapshot = max(_snapshot_files(data_dir), default="")
        snapshot_mb = os.path.getsize(os.path.join(data_dir, snapshot)) / 2**20 if snapshot else 0.0

    def around(target: int) -> tuple[float, float, int]:
        near = sorted(range(lives), key=lambda i: abs(written[i] - target))[:7]
        return (statistics.median(restarts[i] for i in near), statistics.median(recovers[i] for i in near),
                max(replayed[i] for i in near))

    early, late = around(3000 if not args.quick else 1000), around(written[-1])
    yield {"name": "crash_loop_restart", "lives": lives, "records_per_life": per_life, "snapshot_every": 300,
           "records_early": 3000 if not args.quick else 1000, "records_late": written[-1],
           "restart_s_early": round(early[0], 3), "restart_s_late": round(late[0], 3),
           "recover_s_early": round(early[1], 3), "recover_s_late": round(late[1], 3),
           "max_replayed_early": early[2], "max_replayed_late": late[2], "last_snapshot_mb": round(snapshot_mb, 2),
           "ratio_late_vs_early": round(late[0] / early[0], 3), "target_ratio": 1.5, "cpus": os.cpu_count(),
           "load_avg": round(os.getloadavg()[0], 2)}


def _snapshot_files(data_dir: str) -> set[str]:
    return {n for n in os.listdir(data_dir) if n.startswith("snapshot-") and not n.endswith(".tmp")}


def snapshot_stall(args: argparse.Namespace) -> Iterator[dict]:
    """The longest step while a snapshot of 100k sequences is taken.

    The daemon holds pool ``big`` (100k sequences of 64 tokens) and snapshots
    after a fixed number of records (``--snapshot-every``); one scheduler
    steps a 256-sequence decode batch on its own pool before the snapshot,
    while it is taken (from the record that triggers it until the snapshot
    file is in place), and as many steps again after it. Fields:
    ``max_step_ms`` / ``p99_ms_during`` while the snapshot is taken (target:
    max <= 50), ``p99_ms_without`` / ``max_ms_without`` over the steps before
    and after it (the same machine's noise floor)."""
    import tempfile

    num_seqs, baseline_steps = (10_000 if args.quick else 100_000), 1500
    fill_records = 1 + num_seqs // 1000
    trigger = fill_records + 2 + 50 + baseline_steps  # + small pool, its allocation, warm-up steps
    fsync = os.environ.get("BENCH_STALL_FSYNC", "always")
    with tempfile.TemporaryDirectory() as data_dir:
        proc, address = start_daemon("--data-dir", data_dir, "--snapshot-every", str(trigger), "--fsync", fsync,
                                     timeout_s=120)
        try:
            with BlockdClient(address, timeout_s=600) as client:
                client.create_pool(PoolConfig("big", num_blocks=num_seqs * 4 + 1024, block_size=BLOCK_SIZE))
                for start in range(0, num_seqs, 1000):
                    client.step("big", [Allocate(f"r{i}", [(i * 31 + j) % 32000 for j in range(64)])
                                        for i in range(start, start + 1000)])
            times, began, snapshot_at = _step_through_snapshot(address, data_dir, trigger - fill_records)
        finally:
            stop_daemon(proc)
    times = times[50:]  # after the warm-up
    without = sorted(t for t0, t in times if not began <= t0 <= snapshot_at)
    during = sorted(t for t0, t in times if began <= t0 <= snapshot_at)
    yield {"name": "snapshot_stall", "seqs": num_seqs, "fsync": fsync, "steps_without": len(without),
           "steps_during": len(during), "snapshot_s": round(snapshot_at - began, 2),
           "p99_ms_without": round(percentile(without, 0.99) * 1e3, 2), "max_ms_without": round(without[-1] * 1e3, 2),
           "p99_ms_during": round(percentile(during, 0.99) * 1e3, 2), "max_step_ms": round(during[-1] * 1e3, 2),
           "target_max_step_ms": 50.0, "cpus": os.cpu_count(), "load_avg": round(os.getloadavg()[0], 2)}


def _step_through_snapshot(address: str, data_dir: str, records_before: int) -> tuple[list, float, float]:
    """Decode steps on pool ``small``: [(start, seconds)], when the step that
    triggers the snapshot started, and when the snapshot file appeared; then
    as many steps again (at most 3000) as were taken while it was written."""
    with BlockdClient(address) as client:
        client.create_pool(PoolConfig("small", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
        ids = _seq_ids("small")
        client.step("small", [Allocate(s, list(range(BLOCK_SIZE))) for s in ids])
        tokens, times = [7] * NUM_SEQS, []
        began = snapshot_at = None
        deadline, stop_after = time.perf_counter() + 900, None
        while time.perf_counter() < deadline and (stop_after is None or len(times) < stop_after):
            start = time.perf_counter()
            if len(times) % (MAX_STEPS // 2) == MAX_STEPS // 2 - 1:  # start the sequences afresh
                client.step("small", [Free(s) for s in ids] + [Allocate(s, list(range(BLOCK_SIZE))) for s in ids])
            else:
                client.decode_append("small", ids, tokens)
            times.append((start, time.perf_counter() - start))
            if began is None and len(times) + 2 >= records_before:
                began = start
            if snapshot_at is None and began is not None and len(times) % 20 == 0 and _snapshot_files(data_dir):
                snapshot_at = time.perf_counter()
                during = sum(1 for t0, _ in times if t0 >= began)
                stop_after = len(times) + min(during, 3000)
        if snapshot_at is None:
            raise RuntimeError("no snapshot appeared within 900 s")
    return times, began, snapshot_at


#: part name -> generator of result lines; add new parts here
def security(args: argparse.Namespace) -> Iterator[dict]:
    """What TLS, mutual TLS, tokens and the auth interceptor add to this
    benchmark's step (``bench/auth.py`` has the rows and their fields)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="blockd-bench-auth-") as directory:
        yield from interceptor(directory)
        yield from step_security(directory, args.seconds, rounds=3)


def daemon_cost_part(args: argparse.Namespace) -> Iterator[dict]:
    """The daemon's CPU per step and its profile (:mod:`bench.daemon_cost`)."""
    yield from daemon_cost(args.seconds, args.quick, args.profile, args.placement)


def groups(args: argparse.Namespace) -> Iterator[dict]:
    """Pools over 1 and 2 daemon processes, and the SDK's routing cost (:mod:`bench.groups`)."""
    yield from groups_rows(args.seconds)


def floor(args: argparse.Namespace) -> Iterator[dict]:
    """Server CPU per message of each transport, doing no work (:mod:`bench.transport_floor`)."""
    yield from transport_floor(MESSAGES // 5 if args.quick else MESSAGES)


def big_batch(args: argparse.Namespace) -> Iterator[dict]:
    """A huge failing batch against other callers' small steps (:mod:`bench.isolation`)."""
    yield from big_batch_isolation(args.seconds)


PARTS: dict[str, Callable[[argparse.Namespace], Iterator[dict]]] = {
    "step_rpc": step_rpc, "recovery": recovery, "crash_loop_restart": crash_loop_restart,
    "snapshot_stall": snapshot_stall, "idempotency": idempotency, "security": security,
    "big_batch_isolation": big_batch, "daemon_cost": daemon_cost_part, "groups": groups,
    "transport_floor": floor}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=sorted(PARTS),
                        help="which part to run (repeatable; default: all)")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per configuration")
    parser.add_argument("--quick", action="store_true",
                        help="smaller data sets (recovery: 10k sequences; idempotency: 2k steps; "
                        "daemon_cost: the decode step, 1 scheduler)")
    parser.add_argument("--profile", action="store_true",
                        help="daemon_cost: also sample the daemon with py-spy (daemon_profile rows)")
    parser.add_argument("--placement", choices=("shared", "own_core"), default="shared",
                        help="daemon_cost: the daemon on any CPU (shared) or on a CPU of its own, the schedulers "
                        "on the others (own_core: blockd serve --cpus)")
    args = parser.parse_args(argv)
    try:
        for name in args.part or list(PARTS):
            for line in PARTS[name](args):  # the daemons run this checkout's install: its core build
                print(json.dumps({**line, "core_build": blockd.core.BUILD}), flush=True)
    except RuntimeError as err:  # a daemon or scheduler process that failed: said, not a traceback
        print(f"bench/rpc.py: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
