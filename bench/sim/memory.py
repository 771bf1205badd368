"""The KV memory simulations behind ``bench/memory.py``: paging against
contiguous reservation, and sharing by fork against private copies.

* :func:`run_paging`: a fixed KV budget in a continuous-batching steady
  state, served by :class:`client.scheduler.Scheduler` (the one scheduler of
  the tree) on blockd's engine in process (:class:`bench.sim.backend.InProcessBlockd`)
  with a token-inventing model (:class:`bench.sim.model.StubModel`): admit while
  the pool has room above its watermark, one decode token per running
  sequence per step, preempt the newest request (recompute) when a decode
  finds no block, free what finished. Requests are always waiting
  (:data:`QUEUE_DEPTH` of them), so the pool is what limits concurrency.
* :func:`run_reservation`: the same request stream and step loop with slots
  reserved per request up front, as contiguous allocators (Orca,
  FasterTransformer) must: the model's maximum, a power of two, or exactly
  prompt + output (:func:`reservation`).
* :func:`parallel_sampling_block_steps` and :func:`beam_search_block_steps`:
  blocks held over a request's decode steps with Fork-based sharing and
  without, on a core :class:`~blockd.core.Pool` driven directly.

Deterministic for ``seed``. Imports the core, the engine (through the
in-process backend), the scheduler and the workload; no grpc server, no torch.
"""

from __future__ import annotations

import random

from bench.sim.backend import InProcessBlockd
from bench.sim.meter import Meter
from bench.sim.model import StubModel
from bench.sim.workload import TraceSpec, random_tokens, request_stream
from blockd.core import Allocate, Append, ExtraKeys, Fork, Free, Op, Pool, PoolConfig
from blockd.core.arith import num_blocks_for
from client.scheduler import Scheduler, SchedulerConfig

BUDGET_BLOCKS, BLOCK_SIZE = 2048, 16
BUDGET_SLOTS = BUDGET_BLOCKS * BLOCK_SIZE
WATERMARK_RATIO = 0.01  # vLLM's default reserve for running sequences
#: requests kept waiting: more than ever fit in one step, so the pool binds
QUEUE_DEPTH = 32
#: the pool, not the scheduler's batch limits, bounds what runs
UNBOUNDED = SchedulerConfig(max_num_batched_tokens=1 << 24, max_num_seqs=1 << 16)
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
    blockd = InProcessBlockd()
    blockd.create_pool(PoolConfig("memory", num_blocks, block_size,
                                  watermark_blocks=int(num_blocks * WATERMARK_RATIO)))
    stream = request_stream(spec, random.Random(seed))
    sched = Scheduler(blockd, "memory", StubModel(), UNBOUNDED)
    meter = Meter()
    entries = num_table_samples = 0
    for index in range(warmup + steps):
        while len(sched.waiting) < QUEUE_DEPTH:
            sched.add_request(next(stream).request)
        sched.step()
        sched.take_finished()
        if index < warmup:
            continue
        meter.add(blockd.get_pool("memory"))
        if index % 25 == 0:
            entries += sum(len(table) for table in blockd.get_tables("memory")[1].values())
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
        "served": c.num_finished, "preemptions": c.num_preemptions, "output_tokens": c.num_output_tokens,
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
    nxt = next(stream).request
    for index in range(warmup + steps):
        reserved -= sum(r[3] for r in running if r[2] >= r[1])
        running = [r for r in running if r[2] < r[1]]
        for r in running:
            r[2] += 1  # admitted requests decode from the step after their prefill
        while True:
            num_prompt = len(nxt.prompt_token_ids)
            need = reservation(policy, num_prompt, nxt.max_new_tokens, spec.max_len)
            if reserved + need > budget_slots:
                break
            running.append([num_prompt, nxt.max_new_tokens, 0, need])
            reserved += need
            nxt = next(stream).request
        if index >= warmup:
            sums["tokens"] += sum(r[0] + r[2] for r in running)
            sums["reserved"] += reserved
            sums["admitted"] += len(running)
    tokens, held = sums["tokens"] / steps, sums["reserved"] / steps
    return {"utilisation": round(tokens / budget_slots, 4), "admitted": round(sums["admitted"] / steps, 2),
            "waste_ratio": round((held - tokens) / budget_slots, 4),
            "free_ratio": round(1 - held / budget_slots, 4)}


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
    ops: list[Op]
    if share:
        ops = [Allocate(ids[0], prompt), *(Fork(ids[0], child) for child in ids[1:])]
    else:
        ops = [Allocate(s, prompt, ExtraKeys(cache_salt=s)) for s in ids]
    pool.step(ops)


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
                ops: list[Op]
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
