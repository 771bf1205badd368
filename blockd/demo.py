"""``python -m blockd.demo``: a serving workload on one in-process pool.

Owns the demo's workload and its report, nothing else: requests arrive over
time, most prompts start with one of a handful of shared system prompts (so
the prefix cache hits), some ask for several samples (parallel sampling via
Fork, so the first decode step copies shared partial blocks on write), and the
pool is small enough that the scheduler must preempt and the prefix cache
must evict. The scheduling itself is :class:`blockd.sim.Scheduler` (admit
with prefix reuse, chunked prefill with Commit, DecodeAppend, Free, preempt
on NoRoom), the same loop ``bench/memory.py`` measures.

Prints progress lines while it runs, then pool utilisation, tail waste,
prefix hit rate, evictions, copy-on-write copies, preemptions and requests
served, and finally checks the pool's invariants (from scratch, via
:func:`blockd.core.check_invariants`) and says so. Deterministic for
``--seed``; exit code 0 on success.

Imports only the standard library, ``blockd.core`` and ``blockd.sim`` (no
gRPC, torch or metrics: the demo needs no services).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

from blockd.core import InvalidArgument, Pool, PoolConfig, PoolStats, check_invariants
from blockd.sim import LengthDist, Meter, Scheduler, TraceSpec, random_tokens, request_stream

#: the user's part of a prompt and the answer; the system prompt comes on top
CHAT = TraceSpec("chat", LengthDist(80, 0.8), LengthDist(120, 0.8))
NUM_SYSTEM_PROMPTS = 4
SYSTEM_PROMPT_TOKENS = (60, 500)  # range of system prompt lengths
SHARE_OF_PREFIXED = 0.85
#: sample counts and their weights (n > 1: parallel sampling)
N_CHOICES = ((1, 0.7), (2, 0.15), (4, 0.15))
PREFILL_BUDGET = 512  # prompt tokens computed per step (chunked prefill)
INVARIANT_EVERY = 25  # steps between full invariant checks


@dataclass(frozen=True)
class DemoConfig:
    seed: int = 0
    num_requests: int = 300
    num_blocks: int = 1024
    block_size: int = 16
    #: mean arrivals per step; the default keeps the pool under pressure
    arrival_rate: float = 0.8


def parse_args(argv: list[str] | None) -> DemoConfig:
    parser = argparse.ArgumentParser(
        prog="python -m blockd.demo",
        description="Simulate a chat serving workload on one in-process blockd pool.")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--requests", type=int, default=300, help="requests to serve (default 300)")
    parser.add_argument("--blocks", type=int, default=1024, help="blocks in the pool (default 1024)")
    parser.add_argument("--block-size", type=int, default=16, help="token slots per block (default 16)")
    parser.add_argument("--rate", type=float, default=0.8, help="mean arrivals per step (default 0.8)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rate <= 0:
        parser.error("--requests must be >= 1 and --rate > 0")
    return DemoConfig(args.seed, args.requests, args.blocks, args.block_size, args.rate)


def make_workload(cfg: DemoConfig, rng: random.Random):
    """The system prompts and the request stream (all drawn from ``rng``)."""
    lo, hi = SYSTEM_PROMPT_TOKENS
    system_prompts = [tuple(random_tokens(rng, rng.randint(lo, hi))) for _ in range(NUM_SYSTEM_PROMPTS)]
    # an empty prefix stands for the requests that come without a system prompt
    num_bare = round(NUM_SYSTEM_PROMPTS * (1 - SHARE_OF_PREFIXED) / SHARE_OF_PREFIXED)
    prefixes = system_prompts + [()] * max(1, num_bare)
    stream = request_stream(CHAT, rng, prefixes=prefixes, n_choices=N_CHOICES,
                            rate=cfg.arrival_rate, limit=cfg.num_requests)
    return system_prompts, stream


def progress_line(sched: Scheduler, stats: PoolStats) -> str:
    c = sched.counters
    util = (stats.num_used_blocks * stats.block_size - stats.tail_waste_slots) / (
        stats.num_blocks * stats.block_size)
    return (f"step {sched.now:5d}  arrived {c.num_arrived:4d}  served {c.num_served:4d}  "
            f"running {len(sched.running):3d} ({sched.num_running_seqs:3d} seqs)  "
            f"waiting {len(sched.waiting):3d}  blocks used {stats.num_used_blocks:5d}/{stats.num_blocks}  "
            f"util {util:.3f}  prefix hit {stats.prefix_hit_ratio:.3f}  preempted {c.num_preempted}")


@dataclass
class DemoRun:
    sched: Scheduler
    system_prompts: list[tuple[int, ...]]
    #: every step with running sequences / only steps where requests waited
    busy: Meter
    saturated: Meter
    num_checks: int = 0


def run(cfg: DemoConfig, out=sys.stdout) -> DemoRun:
    """Serve every request, printing a progress line per tenth served."""
    rng = random.Random(cfg.seed)
    # ~8% reserve: a dozen decode steps of growth for ~100 running sequences,
    # so admissions rarely have to be preempted again right away
    pool = Pool(PoolConfig("demo", cfg.num_blocks, cfg.block_size,
                           watermark_blocks=max(1, cfg.num_blocks // 12)))
    system_prompts, stream = make_workload(cfg, rng)
    sched = Scheduler(pool, stream, rng, prefill_budget=PREFILL_BUDGET)
    result = DemoRun(sched, system_prompts, Meter(), Meter())
    next_report = 1
    while not sched.is_done:
        sched.step()
        stats = pool.stats()
        if sched.running:
            result.busy.add(stats)
        if sched.waiting:
            result.saturated.add(stats)
        if sched.now % INVARIANT_EVERY == 0:
            check_invariants(pool)
            result.num_checks += 1
        if sched.counters.num_served >= next_report * cfg.num_requests / 10 or sched.is_done:
            print(progress_line(sched, stats), file=out)
            while sched.counters.num_served >= next_report * cfg.num_requests / 10:
                next_report += 1
    check_invariants(pool)
    result.num_checks += 1
    return result


def _utilisation_summary(result: DemoRun) -> str:
    busy, saturated = result.busy, result.saturated
    overall = (f"{busy.means().get('utilisation', 0):.3f} over all {busy.num_samples} busy steps, "
               f"peak {busy.peak_utilisation:.3f}")
    if not saturated.num_samples:
        return f"{overall}; requests never had to wait"
    return (f"{saturated.means()['utilisation']:.3f} mean over the {saturated.num_samples} steps "
            f"where requests waited, {overall}")


def report(cfg: DemoConfig, result: DemoRun, seconds: float, out=sys.stdout) -> None:
    sched, busy = result.sched, result.busy.means()
    pool, c = sched.pool, sched.counters
    stats, b = pool.stats(), cfg.block_size
    print(f"\nserved {c.num_served} of {cfg.num_requests} requests ({c.num_seqs_served} sequences: "
          f"{c.num_seqs_served - c.num_served} of them forked samples; {c.num_rejected} rejected) in "
          f"{sched.now} steps, {c.num_decode_tokens} decode tokens, {seconds:.2f} s", file=out)
    print(f"pool utilisation    {_utilisation_summary(result)} "
          f"(slots holding tokens / all {cfg.num_blocks * b} slots)", file=out)
    print(f"tail waste          {busy.get('tail_waste_slots', 0):.1f} slots mean, ratio "
          f"{busy.get('tail_waste_ratio', 0):.4f} of the slots in used blocks (block size {b})", file=out)
    print(f"prefix hit rate     {stats.prefix_hit_ratio:.3f} ({stats.prefix_hit_tokens} of "
          f"{stats.prefix_queried_tokens} prompt tokens came from the cache)", file=out)
    print(f"evictions           {stats.num_evictions} cached blocks evicted for new ones", file=out)
    print(f"copy-on-write       {stats.num_copies} shared partial blocks copied ({c.num_forks} forks)",
          file=out)
    print(f"preemptions         {c.num_preempted} (recompute; the prefix cache keeps the prompts)",
          file=out)
    print(f"kv events           {c.num_kv_events} (BlockStored / BlockRemoved)", file=out)
    print(f"final pool          {stats.num_seqs} sequences, {stats.num_used_blocks} used, "
          f"{stats.num_evictable_blocks} cached (evictable), {stats.num_free_blocks} free blocks", file=out)
    for index, prompt in enumerate(result.system_prompts):
        cached = pool.lookup_prefix(list(prompt))
        print(f"lookup              system prompt {index}: {cached} of {len(prompt)} tokens cached",
              file=out)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    print(f"blockd demo: {cfg.num_requests} requests on one pool of {cfg.num_blocks} blocks x "
          f"{cfg.block_size} slots, {NUM_SYSTEM_PROMPTS} shared system prompts, seed {cfg.seed}")
    start = time.perf_counter()
    try:
        result = run(cfg)
    except InvalidArgument as err:  # e.g. a block size the pool refuses
        print(f"blockd demo: {err}", file=sys.stderr)
        return 2
    report(cfg, result, time.perf_counter() - start)
    print(f"invariants hold ({result.num_checks} full checks: every {INVARIANT_EVERY} steps and at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
