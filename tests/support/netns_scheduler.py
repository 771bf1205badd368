"""The scheduler of the multi-host test (tests/blockd/test_netns_cluster.py), run
inside its own network namespace: ``python -m tests.support.netns_scheduler``.

It knows only blockd's address. It finds the model's workers the way a
scheduler on another host would: from blockd's registry (their advertised
addresses, rank order by KV-head range), waits (bounded) for ``--workers``
of them to be up, then either

* ``generate``: serves a seeded workload through
  :class:`client.scheduler.Scheduler` and prints the outputs, or
* ``probe``: serves one request and prints the error it meets (after a
  worker was killed: the scheduler must get a clear one, not hang).

Prints one JSON object per line: ``{"workers": [...]}`` first, then
``{"outputs": [...]}`` or ``{"error": ..., "message": ...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

from client.errors import BlockdClientError
from client.model_group import WorkerGroup
from client.scheduler import Scheduler, SchedulerConfig
from client.sdk import BlockdClient
from client.serving import GenerationRequest

VOCAB = 512  # the tiny models' vocabulary
WAIT_S = 60.0


def workload(seed: int) -> list[GenerationRequest]:
    """Shared prefixes, parallel samples, different lengths (as tests/blockd/test_cluster.py)."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(VOCAB) for _ in range(n)) for n in (37, 52)]
    requests = []
    for i in range(8):
        prefix = prefixes[i % 3] if i % 3 < 2 else ()
        prompt = prefix + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(2, 30)))
        requests.append(GenerationRequest(f"r{i}", prompt, rng.randint(4, 16), n=(1, 2, 1, 3)[i % 4]))
    return requests


def registered_workers(client: BlockdClient, pool: str, count: int) -> list:
    """``count`` workers of ``pool`` that are up, in rank order; bounded wait."""
    deadline = time.monotonic() + WAIT_S
    while True:
        workers = [w for w in client.list_workers(pool) if w.is_up]
        if len(workers) >= count or time.monotonic() > deadline:
            return sorted(workers, key=lambda w: (w.info.kv_head_start, w.info.worker_id))
        time.sleep(0.2)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.netns_scheduler")
    p.add_argument("action", choices=("generate", "probe"))
    p.add_argument("--blockd", required=True)
    p.add_argument("--pool", required=True)
    p.add_argument("--workers", type=int, default=2, help="workers of the pool that must be up")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with BlockdClient(args.blockd, timeout_s=30.0) as client:
        workers = registered_workers(client, args.pool, args.workers)
        emit(workers=[dataclasses.asdict(w.info) | {"is_up": w.is_up} for w in workers])
        if args.action == "probe":
            # every registered worker, also those reported down: the scheduler's view
            workers = sorted(client.list_workers(args.pool), key=lambda w: w.info.kv_head_start)
        if not workers:
            emit(error="NoWorkers", message=f"no worker of pool {args.pool} is registered")
            return 1
        requests = workload(args.seed) if args.action == "generate" else workload(args.seed)[:1]
        with WorkerGroup(args.pool, [w.info.address for w in workers], timeout_s=30.0) as group:
            sched = Scheduler(client, args.pool, group,
                              SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=16,
                                              # a killed worker is waited for this long, then reported
                                              worker_restart_timeout_s=10.0))
            for request in requests:
                sched.add_request(request)
            try:
                outputs = sched.run()
            except (BlockdClientError, RuntimeError) as err:  # what the test checks: which, and its message
                emit(error=type(err).__name__, message=str(err))
                return 0
        emit(outputs=[{"request_id": o.request_id, "output_token_ids": [list(t) for t in o.output_token_ids],
                       "error": o.error} for o in outputs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
