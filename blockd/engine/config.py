"""How an :class:`~blockd.engine.machine.Engine` is set up: one frozen dataclass.

The settings an operator chooses (``blockd serve`` flags: the data dir and
its fsync and snapshot policies, how long a silent worker counts as up, the
idempotency table's bounds) and what a test or the metrics inject (the two
clocks, and callbacks observing WAL syncs and steps). Every field has the
daemon's default, so ``EngineConfig()`` is an engine in memory and
``EngineConfig(data_dir=...)`` a durable one. Imports only the standard
library, the idempotency limits and the guardrails.

Replication (``docs/ha.md``) plugs in through two protocols, so the engine
imports nothing of it: a :class:`LogObserver` sees every record of the log
(replication keeps the recent ones in memory for its followers) and a
:class:`Replication` gate decides whether this replica may take a write or
answer a read, in which term its records are written, and when a record is
committed (acknowledged by the in-sync followers) so that an answer that
depends on it may leave.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from blockd.auth.quotas import Quota
from blockd.engine.guardrails import Guardrails
from blockd.engine.idempotency import IdempotencyLimits


class LogObserver(Protocol):
    """Told about the log's records, in LSN order, from the newest snapshot on."""

    def reset(self, snapshot_lsn: int) -> None:
        """The log is (re-)read from the snapshot of ``snapshot_lsn``."""

    def record(self, lsn: int, term: int, body: bytes) -> None:
        """Record ``lsn`` of ``term`` with this JSON body is in the log."""

    def snapshotted(self, lsn: int) -> None:
        """A snapshot of ``lsn`` is durable."""


class Replication(Protocol):
    """The engine's gate to replication (``docs/ha.md``); see the module docstring."""

    @property
    def term(self) -> int:
        """The term this replica's records are written in now (0: not replicated)."""

    def not_leader(self, why: str) -> Exception:
        """The refusal to raise for a call this replica must not serve
        (NOT_LEADER naming the leader it knows, or NO_LEADER)."""

    def writable(self) -> None:
        """Raise (NOT_LEADER, NO_LEADER) unless this replica may serve a call
        now; called under the engine lock, before anything changes."""

    def committed(self, lsn: int) -> int:
        """Return once record ``lsn`` is committed and this replica may still
        acknowledge, with the term it acknowledges in; raise (NOT_REPLICATED,
        NOT_LEADER) when it cannot say so in time. Called outside the engine
        lock."""

    @property
    def keeps_committed(self) -> bool:
        """True when a failover keeps every committed record (``sync`` with at
        least one follower in the set); False when a new leader may lack
        records the old one committed (``async``, or ``--min-in-sync 1``)."""


@dataclass(frozen=True)
class EngineConfig:
    #: where the log and snapshots live; None keeps the state in memory only
    data_dir: str | None = None
    #: ``always`` (fsync before acknowledging), ``interval`` or ``never`` (see :mod:`blockd.storage.wal`)
    fsync: str = "always"
    fsync_interval_s: float = 0.05
    #: snapshot after this many log records, once the log since the last
    #: snapshot is ``snapshot_log_ratio`` times its size (:class:`blockd.engine.snapshots.Snapshots`)
    snapshot_every: int = 10000
    snapshot_log_ratio: float = 0.25
    #: a worker without a heartbeat for longer is reported down
    worker_timeout_s: float = 10.0
    #: bounds of the idempotency table (:mod:`blockd.engine.idempotency`)
    idempotency: IdempotencyLimits = field(default_factory=IdempotencyLimits)
    #: the size bounds of every request, whoever sends it (:mod:`blockd.engine.guardrails`)
    guardrails: Guardrails = field(default_factory=Guardrails)
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
    #: replication's view of the log (a data dir is needed), and its gate
    log_observer: LogObserver | None = None
    replication: Replication | None = None
