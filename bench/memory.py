"""KV memory efficiency: paging vs contiguous reservation, block size, sharing.

The memory comparison of the PagedAttention paper (Kwon et al., SOSP '23),
measured on blockd's own allocator. Prints one JSON object per line:

* ``memory_trace``: a fixed KV budget (2,048 blocks of 16 slots) in a
  continuous-batching steady state (admit while there is room, one decode
  token per running request per step, free finished requests; requests are
  always waiting). ``scheme="paging"`` drives a real :class:`blockd.core.Pool`
  through :class:`blockd.sim.Scheduler` (preempting the newest request when a
  decode step finds no block); the reservation schemes reserve contiguous
  slots per request up front, as Orca / FasterTransformer do: ``max_reservation``
  the model's 2,048-token maximum, ``pow2_reservation`` prompt + output rounded
  up to a power of two, ``oracle_reservation`` exactly prompt + output.
  ``utilisation`` = slots holding tokens / all budget slots, ``admitted`` =
  concurrent sequences, both averaged over the measured steps; ``ratio`` =
  paging admitted / this scheme's admitted (on the paging line: over
  ``max_reservation``). ``waste_ratio`` = allocated-but-empty slots (tail waste
  for paging, reserved-unused for reservation) / budget.
* ``block_size_sweep``: the same steady state with the same 32,768-slot budget
  cut into blocks of 1 ... 128 slots: tail waste against block-table entries.
* ``sharing``: blocks held with Fork-based sharing vs every sequence holding
  its own copy, for parallel sampling (n = 2, 4, 6) and beam search (width 4);
  ``saving`` = 1 - block-steps with sharing / block-steps without (blocks in
  use summed over decode steps).

Synthetic lengths are lognormal fits of the published ShareGPT and Alpaca
statistics (``params`` states them, with the empirical means after clipping).
Deterministic for ``--seed``. Run: ``python bench/memory.py [--seed N] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from blockd.core import Allocate, Append, ExtraKeys, Fork, Free, Pool, PoolConfig
from blockd.core.arith import num_blocks_for
from blockd.sim import (
    ALPACA,
    SHAREGPT,
    Meter,
    Scheduler,
    TraceSpec,
    random_tokens,
    request_stream,
)

BUDGET_BLOCKS, BLOCK_SIZE = 2048, 16
BUDGET_SLOTS = BUDGET_BLOCKS * BLOCK_SIZE
WATERMARK_RATIO = 0.01  # vLLM's default reserve for running sequences
SWEEP_SIZES = (1, 8, 16, 32, 64, 128)
#: how likely each beam (by rank) is to be a parent of the next generation
BEAM_PARENT_WEIGHTS = (0.4, 0.3, 0.2, 0.1)


def trace_params(spec: TraceSpec, seed: int, samples: int = 20000) -> dict:
    rng = random.Random(seed)
    draws = [spec.draw(rng) for _ in range(samples)]
    return {**spec.params(), "empirical_mean_prompt": round(sum(p for p, _ in draws) / samples, 1),
            "empirical_mean_output": round(sum(o for _, o in draws) / samples, 1)}


def run_paging(spec: TraceSpec, *, seed: int, warmup: int, steps: int,
               block_size: int = BLOCK_SIZE, budget_slots: int = BUDGET_SLOTS) -> dict:
    """Steady state of continuous batching on a real pool of ``budget_slots``."""
    num_blocks = budget_slots // block_size
    pool = Pool(PoolConfig("memory", num_blocks, block_size,
                           watermark_blocks=int(num_blocks * WATERMARK_RATIO)))
    rng = random.Random(seed)
    sched = Scheduler(pool, request_stream(spec, rng), rng)
    meter = Meter()
    entries = num_table_samples = 0
    for index in range(warmup + steps):
        sched.step()
        if index < warmup:
            continue
        meter.add(pool.stats())
        if index % 25 == 0:
            entries += sum(len(table) for table in pool.tables().values())
            num_table_samples += 1
    means = meter.means()
    c = sched.counters
    return {
        "utilisation": round(means["utilisation"], 4), "admitted": round(means["num_seqs"], 2),
        "tail_waste_slots": round(means["tail_waste_slots"], 1),
        "tail_waste_ratio": round(means["tail_waste_ratio"], 4),
        "waste_ratio": round(means["tail_waste_slots"] / budget_slots, 4),
        "free_ratio": round(means["free_ratio"], 4),
        "table_entries": round(entries / num_table_samples, 1),
        "served": c.num_served, "preemptions": c.num_preempted, "decode_tokens": c.num_decode_tokens,
    }


def reservation(policy: str, num_prompt: int, num_output: int, max_len: int) -> int:
    """Slots a contiguous allocator reserves for one request."""
    if policy == "max":
        return max_len
    if policy == "pow2":
        return min(max_len, num_prompt + (1 << (num_output - 1).bit_length()))
    if policy == "oracle":
        return num_prompt + num_output
    raise ValueError(f"unknown reservation policy {policy!r}")


def run_reservation(spec: TraceSpec, policy: str, *, seed: int, warmup: int, steps: int,
                    budget_slots: int = BUDGET_SLOTS) -> dict:
    """The same request stream and step loop, with slots reserved up front."""
    stream = request_stream(spec, random.Random(seed))
    running: list[list[int]] = []  # [prompt, output, generated, reserved]
    reserved = 0
    sums = {"tokens": 0.0, "reserved": 0.0, "admitted": 0.0}
    nxt = next(stream)
    for index in range(warmup + steps):
        reserved -= sum(r[3] for r in running if r[2] >= r[1])
        running = [r for r in running if r[2] < r[1]]
        for r in running:
            r[2] += 1  # admitted requests decode from the step after their prefill
        while True:
            need = reservation(policy, len(nxt.prompt), nxt.output_len, spec.max_len)
            if reserved + need > budget_slots:
                break
            running.append([len(nxt.prompt), nxt.output_len, 0, need])
            reserved += need
            nxt = next(stream)
        if index >= warmup:
            sums["tokens"] += sum(r[0] + r[2] for r in running)
            sums["reserved"] += reserved
            sums["admitted"] += len(running)
    tokens, held = sums["tokens"] / steps, sums["reserved"] / steps
    return {"utilisation": round(tokens / budget_slots, 4), "admitted": round(sums["admitted"] / steps, 2),
            "waste_ratio": round((held - tokens) / budget_slots, 4),
            "free_ratio": round(1 - held / budget_slots, 4)}


def memory_trace(spec: TraceSpec, *, seed: int, warmup: int, steps: int) -> list[dict]:
    """One line per scheme for one trace; ``ratio`` = paging admitted / scheme's."""
    common = {"name": "memory_trace", "trace": spec.name, "budget_blocks": BUDGET_BLOCKS,
              "block_size": BLOCK_SIZE, "seed": seed, "warmup_steps": warmup, "steps": steps}
    paging = run_paging(spec, seed=seed, warmup=warmup, steps=steps)
    lines = []
    for policy in ("max", "pow2", "oracle"):
        result = run_reservation(spec, policy, seed=seed, warmup=warmup, steps=steps)
        result["ratio"] = round(paging["admitted"] / result["admitted"], 2)
        lines.append({**common, "scheme": f"{policy}_reservation", **result})
    paging["ratio"] = lines[0]["ratio"]
    paging["ratio_vs_oracle"] = lines[2]["ratio"]
    paging["params"] = {**trace_params(spec, seed), "watermark_ratio": WATERMARK_RATIO}
    return [{**common, "scheme": "paging", **paging}] + lines


def block_size_sweep(spec: TraceSpec, *, seed: int, warmup: int, steps: int,
                     sizes=SWEEP_SIZES) -> list[dict]:
    lines = []
    for b in sizes:
        result = run_paging(spec, seed=seed, warmup=warmup, steps=steps, block_size=b)
        lines.append({"name": "block_size_sweep", "trace": spec.name, "block_size": b,
                      "budget_slots": BUDGET_SLOTS, "utilisation": result["utilisation"],
                      "admitted": result["admitted"], "tail_waste_slots": result["tail_waste_slots"],
                      "tail_waste_ratio": result["tail_waste_ratio"],
                      "tail_waste_per_seq": round(result["tail_waste_slots"] / result["admitted"], 2),
                      "table_entries": result["table_entries"],
                      "table_entries_per_seq": round(result["table_entries"] / result["admitted"], 1)})
    return lines


def _sharing_pool(width: int, spec: TraceSpec) -> Pool:
    # room for every sequence of one request to hold max_len tokens, twice over
    return Pool(PoolConfig("sharing", 2 * width * num_blocks_for(spec.max_len, BLOCK_SIZE) + 8, BLOCK_SIZE))


def _request_rng(seed: int, r: int) -> random.Random:
    """One generator per request, so runs with different ``n`` or with and
    without sharing see the same prompts and the same first samples."""
    return random.Random(seed * 1_000_003 + r)


def _start(pool: Pool, ids: list[str], prompt: list[int], share: bool) -> None:
    """All ``ids`` hold ``prompt``: forked from the first, or each a private copy
    (a per-sequence cache salt keeps the prefix cache out of it)."""
    if share:
        pool.step([Allocate(ids[0], prompt)] + [Fork(ids[0], child) for child in ids[1:]])
    else:
        pool.step([Allocate(s, prompt, ExtraKeys(cache_salt=s)) for s in ids])


def parallel_sampling_block_steps(spec: TraceSpec, n: int, *, seed: int, num_requests: int,
                                  share: bool) -> int:
    """n samples per prompt, each with its own output length and tokens."""
    pool = _sharing_pool(n, spec)
    block_steps = 0
    for r in range(num_requests):
        rng = _request_rng(seed, r)
        num_prompt, _ = spec.draw(rng)
        prompt = random_tokens(rng, num_prompt)
        lengths = {f"r{r}.{i}": spec.output.draw(rng, 1, spec.max_len - num_prompt) for i in range(n)}
        _start(pool, list(lengths), prompt, share)
        for t in range(max(lengths.values())):
            live = [s for s, length in lengths.items() if length > t]
            pool.step([Append(s, [tok]) for s, tok in zip(live, random_tokens(rng, len(live)))])
            block_steps += pool.stats().num_used_blocks
            pool.step([Free(s) for s in live if lengths[s] == t + 1])
        pool.take_events()  # nobody follows them; do not let them pile up
    return block_steps


def beam_search_block_steps(spec: TraceSpec, width: int, *, seed: int, num_requests: int,
                            share: bool, fork_every: int = 4) -> int:
    """Every ``fork_every`` steps the next generation of ``width`` beams is
    chosen among the current beams' candidates (top-ranked beams more often,
    a beam possibly several times); beams left without a child are pruned."""
    pool = _sharing_pool(width, spec)
    block_steps = 0
    for r in range(num_requests):
        rng = _request_rng(seed, r)
        num_prompt, num_output = spec.draw(rng)
        beams = [f"r{r}.0.{j}" for j in range(width)]
        tokens = {s: random_tokens(rng, num_prompt) for s in beams[:1]}
        tokens.update({s: list(tokens[beams[0]]) for s in beams[1:]})
        _start(pool, beams, tokens[beams[0]], share)
        for t in range(num_output):
            if t and t % fork_every == 0:
                parents = sorted(rng.choices(range(width), BEAM_PARENT_WEIGHTS[:width], k=width))
                children = [f"r{r}.{t}.{j}" for j in range(width)]
                if share:
                    ops = [Fork(beams[p], c) for p, c in zip(parents, children)]
                else:
                    ops = [Allocate(c, tokens[beams[p]], ExtraKeys(cache_salt=c))
                           for p, c in zip(parents, children)]
                pool.step(ops + [Free(s) for s in beams])
                tokens = {c: list(tokens[beams[p]]) for p, c in zip(parents, children)}
                beams = children
            new = random_tokens(rng, width)
            pool.step([Append(s, [tok]) for s, tok in zip(beams, new)])
            for s, tok in zip(beams, new):
                tokens[s].append(tok)
            block_steps += pool.stats().num_used_blocks
        pool.step([Free(s) for s in beams])
        pool.take_events()
    return block_steps


def sharing(spec: TraceSpec, *, seed: int, num_requests: int) -> list[dict]:
    cases = [("parallel_sampling", n, parallel_sampling_block_steps) for n in (2, 4, 6)]
    cases.append(("beam_search", 4, beam_search_block_steps))
    lines = []
    for mode, width, measure in cases:
        shared = measure(spec, width, seed=seed, num_requests=num_requests, share=True)
        private = measure(spec, width, seed=seed, num_requests=num_requests, share=False)
        line = {"name": "sharing", "trace": spec.name, "mode": mode, "n": width, "requests": num_requests,
                "block_size": BLOCK_SIZE, "block_steps_shared": shared, "block_steps_private": private,
                "saving": round(1 - shared / private, 4), "seed": seed}
        if mode == "beam_search":
            line["fork_every"] = 4
            line["parent_weights"] = list(BEAM_PARENT_WEIGHTS)
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer steps and requests")
    args = parser.parse_args(argv)
    scale = 4 if args.quick else 1
    start = time.perf_counter()
    lines = []
    for spec, warmup, steps in ((SHAREGPT, 800, 3000), (ALPACA, 200, 1000)):
        lines += memory_trace(spec, seed=args.seed, warmup=warmup // scale, steps=steps // scale)
    lines += block_size_sweep(SHAREGPT, seed=args.seed, warmup=400 // scale, steps=1200 // scale)
    for spec, num_requests in ((SHAREGPT, 60), (ALPACA, 300)):
        lines += sharing(spec, seed=args.seed, num_requests=num_requests // scale)
    for line in lines:
        print(json.dumps(line), flush=True)
    paging = [ln for ln in lines if ln.get("scheme") == "paging"]
    for ln in paging:
        print(f"{ln['trace']}: paging utilisation {ln['utilisation']:.3f}, admits {ln['ratio']}x "
              f"max reservation", file=sys.stderr)
    print(f"bench/memory.py: {len(lines)} lines in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
