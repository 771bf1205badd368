"""What the gRPC benchmarks share: a ``blockd serve`` child on a free port, the
decode workload's sizes, and a percentile. Imported by ``bench/rpc.py``,
``bench/auth.py`` and ``bench/isolation.py``; imports none of them, so the
benchmarks form no import cycle.
"""

from __future__ import annotations

import time

from blockd.cluster.local import ChildProcess

NUM_SEQS = 256
BLOCK_SIZE = 16
NUM_BLOCKS = 1 << 17
#: decode steps of NUM_SEQS tokens the pool holds without freeing anything, each
#: sequence starting with one full block of prompt (its first block is taken by
#: the prompt, not by a step: counting it let a long run fail RESOURCE_EXHAUSTED)
MAX_STEPS = (NUM_BLOCKS // NUM_SEQS - 1) * BLOCK_SIZE - 2


def start_daemon(*flags: str, timeout_s: float = 30.0) -> tuple[ChildProcess, str]:
    """``blockd serve`` on a free port; returns the process and its address."""
    proc = ChildProcess("blockd", ["-m", "blockd.cli", "serve", "--listen", "127.0.0.1:0",
                                   "--log-level", "WARNING", *flags], "blockd listening on")
    try:
        return proc, proc.wait_ready(time.monotonic() + timeout_s)
    except RuntimeError:
        proc.kill()
        raise


def stop_daemon(proc: ChildProcess) -> None:
    proc.stop(30)


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
