"""A whole blockd cluster on one machine, for trying blockd and for its tests.

* :mod:`blockd.cluster.local` - ``blockd serve`` and ``blockd-worker --model``
  processes on loopback, started and stopped as one (:class:`LocalCluster`).

It starts the programs as child processes and talks to them through the SDK;
nothing installed imports it. The demo on it is ``bench/demo.py`` (``make demo``).
"""
