"""A whole blockd cluster on one machine: processes, a demo, the reference.

* :mod:`cluster.local` - ``blockd serve`` and ``blockd-worker --model``
  processes on loopback, started and stopped as one;
* :mod:`cluster.demo` - ``python -m cluster.demo`` (``make demo``): a tiny
  model served by such a cluster, checked against the reference;
* :mod:`cluster.reference` - transformers' own ``generate`` with a contiguous
  cache: the ground truth for paged outputs.

The top of the tree: imports the SDK, the workers' model package and the
simulations' workload; nothing imports it but tests and benchmarks.
"""
