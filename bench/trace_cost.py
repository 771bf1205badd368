"""What tracing costs a scheduler step when it is off: this checkout against another one.

The step measured is the whole scheduler step over a real local cluster
(``blockd serve`` and a ``blockd-worker --model tiny-llama``, both child
processes): a StepStream step to blockd and a ModelStep of 32 decoding
sequences. That path holds every tracing hook (the scheduler's span, the
stream's trace context, the daemon's per-step span, the worker's forward span
and kernel records), and the tiny model keeps the model's share small, so
the hooks' share is as large as it gets. No ``OTEL_*`` variable is set:
tracing is off, as by default.

Each round runs the same loop once with ``--before`` on ``PYTHONPATH``
(e.g. ``/work/main``, the code without the hooks) and once with this
checkout, alternating which goes first, so both see the same machine load.
Prints one JSON object: ``p50_ms_before`` and ``p50_ms_off`` (the median
over all rounds' steps), ``ratio`` (off / before), each round's p50s, and
the set-up. On a shared machine the rounds' p50s spread more than the hooks
can cost, so ``hooks_us_per_step`` also times, in this process, the off
path of every hook one such step runs (median of many calls each): the
bound the end-to-end ratio cannot resolve.

Run: ``python bench/trace_cost.py --before /work/main [--rounds 4] [--steps 300]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_SEQS = 32
PROMPT_LEN = 8
WARMUP_STEPS = 20


def measure(steps: int) -> list[float]:
    """Step times (seconds) of decode steps, in the checkout ``PYTHONPATH`` names."""
    from blockd.cluster.local import ClusterSpec, LocalCluster
    from client.model_group import WorkerGroup
    from client.scheduler import Scheduler, SchedulerConfig
    from client.sdk import BlockdClient
    from client.serving import GenerationRequest

    # tiny-llama holds 256 positions: each request decodes at most 256 - PROMPT_LEN tokens
    per_request = min(steps + WARMUP_STEPS + 2, 256 - PROMPT_LEN)
    spec = ClusterSpec(num_blocks=NUM_SEQS * 256 // 16 + 8, block_size=16)
    times: list[float] = []
    with LocalCluster(spec) as cluster, BlockdClient(cluster.blockd_address) as client, \
            WorkerGroup("model", cluster.worker_addresses) as group:
        batch = 0
        while len(times) < steps:
            sched = Scheduler(client, "model", group, SchedulerConfig(4096, NUM_SEQS))
            for i in range(NUM_SEQS):
                sched.add_request(GenerationRequest(f"r{batch}-{i}", [1 + (i + j) % 500 for j in range(PROMPT_LEN)],
                                                    per_request))
            batch += 1
            sched.step()  # the prefill
            for n in range(per_request - 1):
                start = time.perf_counter()
                sched.step()
                if n >= WARMUP_STEPS and len(times) < steps:
                    times.append(time.perf_counter() - start)
            sched.run()  # the releases
    return times


def hooks_us_per_step(layers: int = 2, reps: int = 200_000) -> float:
    """The off path of the hooks one step runs (tracing off), microseconds:
    the scheduler's span, the stream's traceparent (and its field), the
    daemon's per-step span, the rank thread's and the worker's carry, the
    worker's forward span, and the tracer check of each kernel timing
    (write_kv and attention per layer, the written-slot record, sampling)."""
    sys.path.insert(0, ROOT)
    import timeit

    from blockd.rpc import tracing
    from blockd.v1 import blockd_pb2 as pb

    assert tracing.tracer is None, "tracing must be off"
    request = pb.StepRequest()

    def step_hooks() -> None:
        with tracing.span("scheduler.step"):
            request.traceparent = tracing.traceparent()
            with tracing.server_span("blockd.v1.BlockService/StepStream", request.traceparent):
                pass
            tracing.carry(step_hooks)
            tracing.carry(step_hooks)
            with tracing.span("model_forward"):
                for _ in range(2 * layers + 2):
                    if tracing.tracer is not None:
                        raise AssertionError

    times = timeit.repeat(step_hooks, number=reps // 10, repeat=10)
    return statistics.median(times) / (reps // 10) * 1e6


def _child(root: str, steps: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": root}
    for name in [n for n in env if n.startswith("OTEL_")]:
        del env[name]  # tracing off, as by default
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", "--steps", str(steps)], env=env,
                         cwd=root, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the checkout to compare with (its root, e.g. /work/main)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of one run per checkout")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per run")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.steps)))
        return 0
    if not args.before:
        parser.error("--before ROOT is required (the checkout without the tracing hooks)")
    runs: dict[str, list[list[float]]] = {"before": [], "off": []}
    for r in range(args.rounds):
        order = [("before", args.before), ("off", ROOT)]
        for label, root in order if r % 2 == 0 else order[::-1]:
            runs[label].append(_child(root, args.steps))
    p50 = {label: statistics.median(t for run in r for t in run) * 1e3 for label, r in runs.items()}
    print(json.dumps({
        "name": "trace_cost", "tracing": "off", "seqs": NUM_SEQS, "model": "tiny-llama", "cpus": os.cpu_count(),
        "rounds": args.rounds, "steps_per_run": args.steps, "before": os.path.abspath(args.before),
        "p50_ms_before": round(p50["before"], 3), "p50_ms_off": round(p50["off"], 3),
        "ratio": round(p50["off"] / p50["before"], 4),
        "round_p50_ms_before": [round(statistics.median(r) * 1e3, 3) for r in runs["before"]],
        "round_p50_ms_off": [round(statistics.median(r) * 1e3, 3) for r in runs["off"]],
        "hooks_us_per_step": round(hooks_us_per_step(), 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
