"""KV memory efficiency: paging vs contiguous reservation, block size, sharing.

The memory comparison of the PagedAttention paper (Kwon et al., SOSP '23),
measured on blockd's own allocator. Prints one JSON object per line:

* ``memory_trace``: a fixed KV budget (2,048 blocks of 16 slots) in a
  continuous-batching steady state (admit while there is room, one decode
  token per running request per step, free finished requests; requests are
  always waiting). ``scheme="paging"`` serves them with
  :class:`client.scheduler.Scheduler` on blockd's engine in process
  (:func:`bench.sim.memory.run_paging`: preempting the newest request when a decode
  step finds no block; a request generating N tokens holds prompt + N - 1 in
  the pool, the last token's KV is never computed); the reservation schemes reserve contiguous
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
statistics (:mod:`bench.sim.workload`; ``params`` states them, with the empirical
means after clipping). The simulations are :mod:`bench.sim.memory`; this file
runs them and prints the lines. Deterministic for ``--seed``. Run: ``python bench/memory.py [--seed N] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.sim.memory import (
    BEAM_PARENT_WEIGHTS,
    BLOCK_SIZE,
    BUDGET_BLOCKS,
    BUDGET_SLOTS,
    WATERMARK_RATIO,
    beam_search_block_steps,
    parallel_sampling_block_steps,
    run_paging,
    run_reservation,
    trace_params,
)
from bench.sim.workload import ALPACA, SHAREGPT, TraceSpec

SWEEP_SIZES = (1, 8, 16, 32, 64, 128)


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
    return [{**common, "scheme": "paging", **paging}, *lines]


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
