"""In-process allocator benchmarks (issue: allocator core).

Prints one JSON object per line:

* ``decode_step``: one token appended to each of N running sequences (block
  size 16) as one columnar ``DecodeAppend`` op; ``ratio_vs_per_op`` compares
  it with the same step sent as N single ``Append`` ops, measured in this run.
* ``prefill_alloc``: 256 prompts of 512 tokens, half of them sharing a
  256-token prefix that is already cached; ``ratio_vs_unshared`` compares it
  with 256 prompts that share nothing.
* ``pool_scaling``: the 256-sequence decode step on pools of 1k and 1M
  blocks; ``ratio_vs_1k`` shows the cost does not grow with the pool.

Absolute times drift ±20% on shared machines; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from blockd.core import Allocate, Append, Commit, Free, Pool, PoolConfig
from blockd.core.types import DecodeAppend

BLOCK = 16


def emit(name: str, **fields) -> None:
    print(json.dumps({"name": name, **fields, "python": platform.python_version()}), flush=True)


def running_pool(num_seqs: int, num_blocks: int, prompt_len: int) -> tuple[Pool, list[str]]:
    pool = Pool(PoolConfig("bench", num_blocks=num_blocks, block_size=BLOCK))
    ids = [f"seq-{i}" for i in range(num_seqs)]
    pool.step([Allocate(s, [i % 30000] * prompt_len) for i, s in enumerate(ids)])
    return pool, ids


def time_decode(num_seqs: int, num_blocks: int, steps: int, columnar: bool, prompt_len: int = 31) -> float:
    """Median µs per decode step. Every 16 steps each sequence crosses one block
    boundary; sequences are reset (untimed) so small pools never fill up."""
    pool, ids = running_pool(num_seqs, num_blocks, prompt_len)
    tokens = [7] * num_seqs
    samples = []
    gc.collect()
    for done in range(steps):
        if done and done % BLOCK == 0:
            pool.step([Free(s) for s in ids])
            pool.step([Allocate(s, [i % 30000] * prompt_len) for i, s in enumerate(ids)])
        start = time.perf_counter()
        if columnar:
            pool.step([DecodeAppend(ids, tokens)])
        else:
            pool.step([Append(s, [7]) for s in ids])
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def bench_decode(steps: int) -> None:
    for num_seqs in (256, 4096):
        n = steps if num_seqs == 256 else max(32, steps // 8)
        per_op = time_decode(num_seqs, 200_000, n, columnar=False)
        columnar = time_decode(num_seqs, 200_000, n, columnar=True)
        emit("decode_step", num_seqs=num_seqs, block_size=BLOCK, steps=n, us_per_step=round(columnar, 1),
             us_per_seq=round(columnar / num_seqs, 3), per_op_us_per_step=round(per_op, 1),
             ratio_vs_per_op=round(columnar / per_op, 3), target_us=200 if num_seqs == 256 else None)


def time_prefill(shared: bool, repeats: int) -> float:
    samples = []
    prefix = list(range(1000, 1256))
    for _ in range(repeats):
        pool = Pool(PoolConfig("bench", num_blocks=16_384, block_size=BLOCK))
        pool.step([Allocate("warm", [*prefix, 1]), Commit("warm", 257)])  # the shared prefix is cached
        ops = []
        for i in range(256):
            head = prefix if shared and i % 2 == 0 else [(i * 7 + j) % 30000 for j in range(256)]
            ops.append(Allocate(f"p{i}", head + [(i * 13 + j) % 30000 for j in range(256)]))
        start = time.perf_counter()
        result = pool.step(ops)
        samples.append(time.perf_counter() - start)
        hits = sum(r.num_cached_tokens for r in result.results)
    return statistics.median(samples) * 1e6, hits


def bench_prefill(repeats: int) -> None:
    unshared, _ = time_prefill(False, repeats)
    shared, hits = time_prefill(True, repeats)
    emit("prefill_alloc", num_prompts=256, prompt_len=512, shared_prefix_len=256, shared_fraction=0.5,
         block_size=BLOCK, us_per_batch=round(shared, 1), us_per_prompt=round(shared / 256, 2),
         cached_tokens=hits, unshared_us_per_batch=round(unshared, 1),
         ratio_vs_unshared=round(shared / unshared, 3))


def bench_pool_scaling(steps: int) -> None:
    small = time_decode(256, 1_000, steps, columnar=True)
    large = time_decode(256, 1_000_000, steps, columnar=True)
    for num_blocks, us in ((1_000, small), (1_000_000, large)):
        emit("pool_scaling", num_blocks=num_blocks, num_seqs=256, block_size=BLOCK, us_per_step=round(us, 1),
             ratio_vs_1k=round(us / small, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    args = parser.parse_args()
    steps = 64 if args.quick else 512
    bench_decode(steps)
    bench_prefill(2 if args.quick else 7)
    bench_pool_scaling(steps)


if __name__ == "__main__":
    main()
