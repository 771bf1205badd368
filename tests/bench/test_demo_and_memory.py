"""The in-process demo runs end to end, and bench/memory.py measures what it claims.

The memory checks run the simulations (:mod:`bench.sim.memory`) and the
benchmark's own line assembly on short runs and assert on the measured
numbers: paging admits several times the sequences that max-length
reservation does, sharing saves blocks, and larger blocks trade tail waste
for fewer table entries.
"""

import dataclasses
import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest

from bench.sim import demo
from bench.sim import memory as sim_memory
from bench.sim.workload import ALPACA, SHAREGPT
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def memory():
    path = os.path.join(ROOT, "bench", "memory.py")
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _number(text: str, label: str) -> float:
    match = re.search(rf"^{label}\s+([0-9.]+)", text, re.MULTILINE)
    assert match, f"no {label!r} line in:\n{text}"
    return float(match.group(1))


def test_demo_subprocess_reports_and_exits_zero():
    out = subprocess.run([sys.executable, "-m", "bench.sim.demo", "--requests", "40", "--seed", "1",
                          "--blocks", "256"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "served 40 of 40 requests" in text
    utilisation = _number(text, "pool utilisation")
    assert "requests waited" in text  # 256 blocks are too few for 40 requests at once
    assert 0.5 < utilisation <= 1.0
    assert 0.0 <= _number(text, "tail waste") < 40 * 16  # mean slots: < b per sequence
    # most prompts start with a shared system prompt, so the cache must hit
    assert _number(text, "prefix hit rate") > 0.2
    assert "invariants hold" in text


def test_demo_bad_block_size_is_refused_with_a_message():
    out = subprocess.run([sys.executable, "-m", "bench.sim.demo", "--block-size", "0", "--requests", "5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "block_size" in out.stderr


def test_demo_in_process_is_deterministic_and_exercises_the_pool():
    cfg = demo.DemoConfig(seed=7, num_requests=60, num_blocks=256, block_size=16)
    first = demo.run(cfg, out=io.StringIO())
    second = demo.run(cfg, out=io.StringIO())
    assert first.sched.counters == second.sched.counters
    stats = first.blockd.get_pool(demo.POOL)
    # equal but for the pool's incarnation, a random id made at creation
    assert dataclasses.replace(stats, incarnation="") == dataclasses.replace(
        second.blockd.get_pool(demo.POOL), incarnation="")
    counters = first.sched.counters
    assert first.num_served + counters.num_rejected == 60
    assert counters.num_forks > 0 and stats.num_copies > 0  # parallel sampling copied on write
    assert counters.num_preemptions > 0  # the pool is too small for the load
    assert stats.prefix_hit_tokens > 0 and stats.num_evictions > 0
    assert stats.num_seqs == 0 and stats.num_used_blocks == 0  # every request freed its blocks
    first.blockd.check_invariants()


def test_reservation_sizes():
    assert sim_memory.reservation("max", 100, 7, 2048) == 2048
    assert sim_memory.reservation("pow2", 100, 5, 2048) == 108
    assert sim_memory.reservation("pow2", 100, 8, 2048) == 108
    assert sim_memory.reservation("pow2", 2000, 40, 2048) == 2048
    assert sim_memory.reservation("oracle", 100, 7, 2048) == 107


def test_paging_admits_more_than_reservation():
    paging = sim_memory.run_paging(SHAREGPT, seed=0, warmup=100, steps=300)
    max_res = sim_memory.run_reservation(SHAREGPT, "max", seed=0, warmup=100, steps=300)
    oracle = sim_memory.run_reservation(SHAREGPT, "oracle", seed=0, warmup=100, steps=300)
    assert max_res["admitted"] == sim_memory.BUDGET_SLOTS // 2048  # 16 reservations of 128 blocks
    assert paging["admitted"] >= 2.5 * max_res["admitted"]
    assert paging["admitted"] > oracle["admitted"]  # even knowing lengths, contiguity wastes more
    assert paging["utilisation"] >= 0.9 > max_res["utilisation"]
    # slots holding tokens + tail waste + free <= all slots (evictable counts as free)
    total = paging["utilisation"] + paging["waste_ratio"] + paging["free_ratio"]
    assert total == pytest.approx(1.0, abs=2e-3)
    assert 0 < paging["tail_waste_slots"] < 16 * paging["admitted"]


def test_memory_trace_lines_carry_ratio_and_params(memory):
    lines = memory.memory_trace(ALPACA, seed=0, warmup=20, steps=60)
    schemes = {line["scheme"]: line for line in lines}
    assert set(schemes) == {"paging", "max_reservation", "pow2_reservation", "oracle_reservation"}
    paging = schemes["paging"]
    assert paging["ratio"] == pytest.approx(paging["admitted"] / schemes["max_reservation"]["admitted"],
                                            rel=0.01)
    assert paging["params"]["prompt"]["dist"] == "lognormal"
    assert 15 < paging["params"]["empirical_mean_prompt"] < 25


def test_sharing_saves_blocks():
    def saving(measure, spec, n):
        shared = measure(spec, n, seed=0, num_requests=20, share=True)
        private = measure(spec, n, seed=0, num_requests=20, share=False)
        return 1 - shared / private

    parallel = saving(sim_memory.parallel_sampling_block_steps, ALPACA, 4)
    # the prompt is shared, the continuations are not: some saving, at most (n-1)/n
    assert 0.01 < parallel < 0.75
    beam = saving(sim_memory.beam_search_block_steps, ALPACA, 4)
    assert beam > parallel  # beams also share what they generated


def test_block_size_trades_tail_waste_for_table_entries(memory):
    lines = memory.block_size_sweep(SHAREGPT, seed=0, warmup=50, steps=150, sizes=(8, 32, 128))
    waste = [line["tail_waste_per_seq"] for line in lines]
    entries = [line["table_entries_per_seq"] for line in lines]
    assert waste == sorted(waste) and waste[-1] > 4 * waste[0]
    assert entries == sorted(entries, reverse=True) and entries[0] > 4 * entries[-1]
    for line in lines:  # mean tail waste per sequence is about (b - 1) / 2
        assert line["tail_waste_per_seq"] < line["block_size"]
