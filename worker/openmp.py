"""How a worker's idle OpenMP threads wait: the default every way of starting one gets.

libgomp (torch's OpenMP on Linux) reads its settings once, when it loads with
torch, so :func:`default_env` must be in the environment before anything
imports torch: ``blockd-worker`` sets it first thing (:mod:`worker.main`), and
:mod:`blockd.cluster.local` also puts :func:`default_env` in each worker
child's environment. A caller that sets ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` itself keeps its own choice.

Why 30,000 rounds (about a millisecond of spinning, then sleep): a forward
opens hundreds of parallel regions back to back.

* libgomp's default (300,000 rounds, several milliseconds) keeps a worker
  thread spinning on the other core while the calling thread runs the
  serial ops between the GEMMs (the norms, RoPE), which then run slower: on
  a 2-core AMD EPYC VM (2026-12-06) SmolLM2's 30 layers without attention
  (``bench/forward_compile.py``'s, 64 rows) took 101 ms with the default,
  87 with 30,000 rounds (SiLU alone 234 against 71 us a layer; 47 us with
  no other thread), and the model's whole 64-row decode step in process,
  four runs of each alternating, median 139.7 against 126.3 ms. A
  standalone forward took 1.5-1.7 s instead of 0.23-0.54 s while another
  process kept the cores busy.
* ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) makes each region first wake a
  sleeping thread: ``bench/serve.py --profile`` read 152 ms a step with
  PASSIVE, 129 with 30,000 rounds, 141-143 with 10,000.

Standard library only (no torch), so the launchers can import it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["WORKER_SPIN_COUNT", "default_env"]

#: libgomp's spin rounds before an idle worker thread sleeps (see the module docstring)
WORKER_SPIN_COUNT = "30000"
#: the settings that mean the caller chose how OpenMP threads wait
_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def default_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """What a worker's environment needs added: ``GOMP_SPINCOUNT``, unless ``environ``
    (default: this process's) already says how OpenMP threads wait."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _CHOICES):
        return {}
    return {"GOMP_SPINCOUNT": WORKER_SPIN_COUNT}

