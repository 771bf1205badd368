"""How an :class:`~blockd.engine.Engine` is set up: one frozen dataclass.

The settings an operator chooses (``blockd serve`` flags: the data dir and
its fsync and snapshot policies, how long a silent worker counts as up, the
idempotency table's bounds) and what a test or the metrics inject (the two
clocks, and callbacks observing WAL syncs and steps). Every field has the
daemon's default, so ``EngineConfig()`` is an engine in memory and
``EngineConfig(data_dir=...)`` a durable one. Imports only the standard
library and the idempotency limits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from blockd.auth.quotas import Quota
from blockd.idempotency import IdempotencyLimits


@dataclass(frozen=True)
class EngineConfig:
    #: where the log and snapshots live; None keeps the state in memory only
    data_dir: str | None = None
    #: ``always`` (fsync before acknowledging), ``interval`` or ``never`` (see :mod:`blockd.wal`)
    fsync: str = "always"
    fsync_interval_s: float = 0.05
    #: snapshot after this many log records, once the log since the last
    #: snapshot is ``snapshot_log_ratio`` times its size (:class:`blockd.compact.Snapshots`)
    snapshot_every: int = 10000
    snapshot_log_ratio: float = 0.25
    #: a worker without a heartbeat for longer is reported down
    worker_timeout_s: float = 10.0
    #: bounds of the idempotency table (:mod:`blockd.idempotency`)
    idempotency: IdempotencyLimits = field(default_factory=IdempotencyLimits)
    #: monotonic seconds, for worker heartbeats
    clock: Callable[[], float] = time.monotonic
    #: seconds since the epoch, stamped on request ids (logged: they must mean
    #: something after a restart)
    wall_clock: Callable[[], float] = time.time
    #: each tenant's quota (:mod:`blockd.auth.quotas`; ``blockd serve`` reads
    #: them from the identities file); None: no quotas
    quotas: Callable[[str], Quota] | None = None
    #: called with the seconds each WAL fsync took
    observe_wal_sync: Callable[[float], None] | None = None
    #: called as (pool, ops, outcome, seconds) after every step; outcome is
    #: "ok" or the lowercase status code name
    observe_step: Callable[[str, list, str, float], None] | None = None
