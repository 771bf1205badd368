"""``bench/daemon_cost.py``: CPU read from ``/proc``, py-spy's stacks charged to
the innermost known part, and one short real configuration (a ``blockd serve``
child and a scheduler process) by unary calls and over a stream, with its
profile when py-spy is installed."""

from __future__ import annotations

import os
import time

import pytest

from bench import daemon_cost
from bench.auth import security_variants


def test_process_cpu_counts_this_process_work():
    before = daemon_cost.process_cpu_s(os.getpid())
    end = time.process_time() + 0.15
    while time.process_time() < end:
        pass
    assert daemon_cost.process_cpu_s(os.getpid()) - before >= 0.1


def test_a_stack_is_charged_to_its_innermost_known_part():
    handler = "_call_behavior (grpc/_server.py:608);Step (blockd/service/servicer.py:9);step (blockd/engine/m.py:1)"
    stacks = [
        "_bootstrap (threading.py:1);_serve (grpc/_server.py:1314) 30",
        "_worker (concurrent/futures/thread.py:81) 10",
        f"{handler};step (blockd/core/pool.py:3);replace (dataclasses.py:1) 50",
        f"{handler};append (blockd/storage/wal.py:7) 5",
        "run (threading.py:1);wait (threading.py:2) 4",
        "garbage line",
    ]
    text = "\n".join(stacks)
    parts, other = daemon_cost.parse_collapsed(text)
    assert parts == {"grpc_poller": 30, "thread_pool": 10, "allocator_core": 50, "wal": 5, "other": 4}
    assert other == {"wait (threading.py:2)": 4}


def test_one_short_configuration_by_unary_calls_and_over_a_stream(tmp_path):
    variants = security_variants(str(tmp_path))
    rows = {}
    for transport in ("unary", "stream"):
        row, stacks = daemon_cost.measure("decode", 1, "memory", "plain", transport, 1.0, str(tmp_path), variants)
        assert stacks is None
        rows[transport] = row
        assert row["steps"] > 50 and row["transport"] == transport
        assert 0 < row["daemon_cpu_us_per_step"] < 1e5 and 0 < row["daemon_cores_busy"] <= row["cpus"]
        assert row["sdk_cpu_us_per_step"] > 0
    assert daemon_cost.core_cpu_us("decode", 20) > 0 and daemon_cost.core_cpu_us("prefill", 5) > 0
    # the cold-cache baseline: one L2's worth of other data copied before each (untimed) step
    assert daemon_cost.l2_bytes() >= 1 << 16
    assert daemon_cost.core_cpu_us("decode", 20, 1 << 20) > 0 and daemon_cost.core_cpu_us("prefill", 5, 1 << 20) > 0
    # the daemon's own step path in process, back to back and after an (untimed) sleep before each step
    assert daemon_cost.chain_cpu_us(5) > 0
    began = time.perf_counter()
    assert 0 < daemon_cost.chain_cpu_us(5, idle_s=0.05) < 50_000
    assert time.perf_counter() - began >= 5 * 0.05


def test_the_daemon_on_a_core_of_its_own(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        assert daemon_cost.placement_cpus("own_core") is None
        pytest.skip("placement own_core needs two CPUs")
    assert daemon_cost.placement_cpus("shared") is None
    assert daemon_cost.placement_cpus("own_core") == (frozenset(allowed[:1]), frozenset(allowed[1:]))
    row, _ = daemon_cost.measure("decode", 1, "memory", "plain", "lane", 1.0, str(tmp_path),
                                 security_variants(str(tmp_path)), placement="own_core")
    assert row["placement"] == "own_core" and row["steps"] > 50 and row["daemon_cpu_us_per_step"] > 0


def test_the_threads_and_fsyncs_of_durable_steps_over_the_lane(tmp_path):
    from blockd.storage.fsyncer import BUILD
    row, _ = daemon_cost.measure("decode", 2, "fsync_always", "plain", "lane", 1.5, str(tmp_path),
                                 security_variants(str(tmp_path)))
    threads = row["threads"]
    # the lane's loop, named by blockd, does most of the daemon's work; two schedulers'
    # waits go to the fsync thread (compiled, or the Python fallback), named too
    assert threads["blockd-lane"]["cpu_us_per_step"] > 0.5 * row["daemon_cpu_us_per_step"]
    assert ("blockd-fsync" if BUILD == "compiled" else "blockd-fsync-py") in threads
    for figures in threads.values():
        assert figures["cpu_us_per_step"] >= 1.0 and figures["runqueue_wait_us_per_step"] >= 0
        assert figures["switches_per_step"] >= 0
    # every step's record is synced by some fdatasync, and no step needs two
    assert 0 < row["fsyncs_per_step"] <= 1.05


def test_thread_times_sum_a_process_threads_by_name():
    import threading

    from blockd.threads import name_os_thread
    done, named = threading.Event(), threading.Event()

    def spin() -> None:  # 50 ms of this thread's CPU, then it waits, alive, to be read
        name_os_thread("bench-test-spin")
        while time.thread_time() < 0.05:
            pass
        named.set()
        done.wait(10)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert named.wait(10)
        times = daemon_cost.thread_times(os.getpid())
        assert times["bench-test-spin"][0] >= 0.04 and times["bench-test-spin"][2] >= 1
        rows = daemon_cost.threads_per_step({}, times, 10)
        assert rows["bench-test-spin"]["cpu_us_per_step"] >= 4000
    finally:
        done.set()
        thread.join(10)


def test_the_profile_of_a_prefill_step(tmp_path):
    if daemon_cost._has_py_spy():
        pytest.skip(daemon_cost._has_py_spy())
    variants = security_variants(str(tmp_path))
    row, stacks = daemon_cost.measure("prefill", 1, "memory", "plain", "stream", 1.5, str(tmp_path), variants,
                                      profile_s=1.5)
    profile = daemon_cost.profile_row(row, stacks, 1.5)
    assert profile["samples"] > 20
    assert abs(sum(profile["share"].values()) - 1.0) < 0.01
    # a prefill step hashes 128 blocks: the allocator core is a visible part of it
    assert profile["share"].get("allocator_core", 0) > 0.05


def test_a_scheduler_that_fails_is_named_at_once(tmp_path):
    # a pool name blockd refuses: the scheduler fails before the barrier, and the
    # run says why in seconds instead of waiting two minutes for its result
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="scheduler bad name!-0: INVALID_ARGUMENT: pool name"):
        daemon_cost.measure("bad name!", 1, "memory", "plain", "unary", 1.0, str(tmp_path), {"plain": ([], {})})
    assert time.monotonic() - began < 60


def test_the_decode_pool_holds_every_step_a_run_may_take():
    from bench.daemon import BLOCK_SIZE, MAX_STEPS, NUM_BLOCKS, NUM_SEQS
    # each sequence starts with one full block; every BLOCK_SIZE steps take one more
    blocks_each = 1 + -(-(MAX_STEPS) // BLOCK_SIZE)
    assert blocks_each * NUM_SEQS <= NUM_BLOCKS


def test_the_durable_ratio_row_is_the_median_of_its_pairs():
    row = daemon_cost.ratio_row([(1000.0, 1800.0), (800.0, 2000.0), (1200.0, 2520.0)])
    assert [p["ratio"] for p in row["pairs"]] == [1.8, 2.5, 2.1]
    assert row["median_ratio"] == 2.1 and row["target"] == 2.0
    assert daemon_cost.ratio_row([(1000.0, 1800.0), (1000.0, 2200.0)])["median_ratio"] == 2.0
