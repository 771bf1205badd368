"""``python -m bench.sim.demo``: a serving workload on one in-process pool.

Owns the demo's workload and its report, nothing else: requests arrive over
time, most prompts start with one of a handful of shared system prompts (so
the prefix cache hits), some ask for several samples (parallel sampling via
Fork, so the first decode step copies shared partial blocks on write), and the
pool is small enough that the scheduler must preempt and the prefix cache
must evict. The serving is :class:`client.scheduler.Scheduler` (admit with
prefix reuse, chunked prefill with Commit, DecodeAppend, Free, preempt when
the pool refuses) on blockd's engine in process
(:class:`bench.sim.backend.InProcessBlockd`) with a model stub that makes up its
tokens (:class:`bench.sim.model.StubModel`): the loop ``bench/memory.py`` measures.

Prints progress lines while it runs, then pool utilisation, tail waste,
prefix hit rate, evictions, copy-on-write copies, preemptions and requests
served, and finally checks the pool's invariants (from scratch, via
:func:`blockd.core.check_invariants`) and says so. Deterministic for
``--seed``; exit code 0 on success, 2 for a pool blockd refuses.

No gRPC server, no torch: the demo needs no services.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

from bench.sim.backend import InProcessBlockd
from bench.sim.meter import Meter
from bench.sim.model import StubModel
from bench.sim.workload import LengthDist, TimedRequest, TraceSpec, request_stream, system_prompts, with_bare
from blockd.core import PoolConfig
from client.errors import InvalidArgumentError
from client.scheduler import Scheduler, SchedulerConfig

#: the user's part of a prompt and the answer; the system prompt comes on top
CHAT = TraceSpec("chat", LengthDist(80, 0.8), LengthDist(120, 0.8))
NUM_SYSTEM_PROMPTS = 4
SYSTEM_PROMPT_TOKENS = (60, 500)  # range of system prompt lengths
SHARE_OF_PREFIXED = 0.85
#: sample counts and their weights (n > 1: parallel sampling)
N_CHOICES = ((1, 0.7), (2, 0.15), (4, 0.15))
#: a step computes one token per running sequence plus up to 512 prompt tokens (chunked prefill)
SCHEDULER = SchedulerConfig(max_num_batched_tokens=768, max_num_seqs=256)
INVARIANT_EVERY = 25  # steps between full invariant checks
POOL = "demo"


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
        prog="python -m bench.sim.demo",
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


def make_workload(cfg: DemoConfig, rng: random.Random) -> tuple[list[tuple[int, ...]], list[TimedRequest]]:
    """The system prompts and the requests (all drawn from ``rng``)."""
    prompts = system_prompts(rng, NUM_SYSTEM_PROMPTS, SYSTEM_PROMPT_TOKENS)
    stream = request_stream(CHAT, rng, prefixes=with_bare(prompts, SHARE_OF_PREFIXED), n_choices=N_CHOICES,
                            rate=cfg.arrival_rate, limit=cfg.num_requests)
    return prompts, list(stream)


@dataclass
class DemoRun:
    sched: Scheduler
    blockd: InProcessBlockd
    system_prompts: list[tuple[int, ...]]
    #: every step with running sequences / only steps where requests waited
    busy: Meter
    saturated: Meter
    num_steps: int = 0
    num_served: int = 0
    num_seqs_served: int = 0
    num_checks: int = 0


def progress_line(result: DemoRun, num_arrived: int) -> str:
    sched, stats = result.sched, result.blockd.get_pool(POOL)
    util = (stats.num_used_blocks * stats.block_size - stats.tail_waste_slots) / (
        stats.num_blocks * stats.block_size)
    return (f"step {result.num_steps:5d}  arrived {num_arrived:4d}  served {result.num_served:4d}  "
            f"running {len(sched.running):3d} ({sched.num_running_seqs:3d} seqs)  "
            f"waiting {len(sched.waiting):3d}  blocks used {stats.num_used_blocks:5d}/{stats.num_blocks}  "
            f"util {util:.3f}  prefix hit {stats.prefix_hit_ratio:.3f}  "
            f"preempted {sched.counters.num_preemptions}")


def _step(result: DemoRun) -> None:
    """One scheduler step, then the meters and, now and then, the invariants."""
    sched, blockd = result.sched, result.blockd
    sched.step()
    result.num_steps += 1
    for output in sched.take_finished():
        if output.error is None:
            result.num_served += 1
            result.num_seqs_served += len(output.output_token_ids)
    stats = blockd.get_pool(POOL)
    if sched.running:
        result.busy.add(stats)
    if sched.waiting:
        result.saturated.add(stats)
    if result.num_steps % INVARIANT_EVERY == 0:
        blockd.check_invariants()
        result.num_checks += 1


def run(cfg: DemoConfig, out=sys.stdout) -> DemoRun:
    """Serve every request, printing a progress line per tenth served."""
    rng = random.Random(cfg.seed)
    blockd = InProcessBlockd()
    # ~8% reserve: a dozen decode steps of growth for ~100 running sequences,
    # so admissions rarely have to be preempted again right away
    blockd.create_pool(PoolConfig(POOL, cfg.num_blocks, cfg.block_size,
                                  watermark_blocks=max(1, cfg.num_blocks // 12)))
    prompts, pending = make_workload(cfg, rng)
    result = DemoRun(Scheduler(blockd, POOL, StubModel(), SCHEDULER), blockd, prompts, Meter(), Meter())
    sched, arrived, next_report = result.sched, 0, 1
    while arrived < len(pending) or not sched.is_idle:
        if sched.is_idle:  # nothing to do until the next arrival: skip ahead to it
            result.num_steps = max(result.num_steps, pending[arrived].arrival)
        while arrived < len(pending) and pending[arrived].arrival <= result.num_steps:
            sched.add_request(pending[arrived].request)
            arrived += 1
        _step(result)
        done = result.num_served + sched.counters.num_rejected
        if done >= next_report * cfg.num_requests / 10 or (arrived == len(pending) and sched.is_idle):
            print(progress_line(result, arrived), file=out)
            while done >= next_report * cfg.num_requests / 10:
                next_report += 1
    blockd.check_invariants()
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
    busy, c = result.busy.means(), result.sched.counters
    stats, b = result.blockd.get_pool(POOL), cfg.block_size
    print(f"\nserved {result.num_served} of {cfg.num_requests} requests ({result.num_seqs_served} sequences: "
          f"{result.num_seqs_served - result.num_served} of them forked samples; {c.num_rejected} rejected) in "
          f"{result.num_steps} steps, {c.num_output_tokens} output tokens, {seconds:.2f} s", file=out)
    print(f"pool utilisation    {_utilisation_summary(result)} "
          f"(slots holding tokens / all {cfg.num_blocks * b} slots)", file=out)
    print(f"tail waste          {busy.get('tail_waste_slots', 0):.1f} slots mean, ratio "
          f"{busy.get('tail_waste_ratio', 0):.4f} of the slots in used blocks (block size {b})", file=out)
    print(f"prefix hit rate     {stats.prefix_hit_ratio:.3f} ({stats.prefix_hit_tokens} of "
          f"{stats.prefix_queried_tokens} prompt tokens came from the cache)", file=out)
    print(f"evictions           {stats.num_evictions} cached blocks evicted for new ones", file=out)
    print(f"copy-on-write       {stats.num_copies} shared partial blocks copied ({c.num_forks} forks)",
          file=out)
    print(f"preemptions         {c.num_preemptions} (recompute; the prefix cache keeps the prompts); "
          f"{c.num_refused_batches} refused batches planned again", file=out)
    print(f"kv events           {stats.last_event_seq_no} (BlockStored / BlockRemoved)", file=out)
    print(f"final pool          {stats.num_seqs} sequences, {stats.num_used_blocks} used, "
          f"{stats.num_evictable_blocks} cached (evictable), {stats.num_free_blocks} free blocks", file=out)
    for index, prompt in enumerate(result.system_prompts):
        cached = result.blockd.lookup_prefix(prompt, pools=[POOL])[POOL]
        print(f"lookup              system prompt {index}: {cached} of {len(prompt)} tokens cached",
              file=out)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    print(f"blockd demo: {cfg.num_requests} requests on one pool of {cfg.num_blocks} blocks x "
          f"{cfg.block_size} slots, {NUM_SYSTEM_PROMPTS} shared system prompts, seed {cfg.seed}")
    start = time.perf_counter()
    try:
        result = run(cfg)
    except InvalidArgumentError as err:  # e.g. a block size the pool refuses
        print(f"blockd demo: {err.message}", file=sys.stderr)
        return 2
    report(cfg, result, time.perf_counter() - start)
    print(f"invariants hold ({result.num_checks} full checks: every {INVARIANT_EVERY} steps and at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
