"""Tools that work on a data directory with no daemon serving it.

* :mod:`blockd.offline.repair` - ``blockd check-data`` and ``blockd repair-data``;
* :mod:`blockd.offline.compact` - ``blockd compact``: a snapshot built from the
  previous one and the closed log, in the compactor's own process (the daemon
  starts it: :mod:`blockd.engine.snapshots`).
"""
