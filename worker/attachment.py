"""Keeps a worker attached to blockd: registration, heartbeats, and the Watch
stream that feeds the table mirror.

Two daemon threads, both bounded and stoppable:

* the watch thread reads ``Watch(pool, from_version=received, incarnation)`` and
  pushes each delta (or snapshot) into the mirror; when the stream breaks
  (blockd restarted, network blip) it reconnects from the last version
  received, so there is no gap, and any duplicate is dropped by the mirror.
  The stream names the mirror's pool incarnation: when the pool was deleted
  and re-created (or blockd restarted without its data) blockd answers with a
  snapshot of the new incarnation, and the mirror drops everything and loads
  it (the runtime then forgets every slot it wrote: that KV belongs to the
  old pool). A new incarnation with another geometry leaves the worker
  unusable (every call refused, saying so): restart it;
* with a replicated blockd (docs/ha.md) each Watch message names the term
  of the leader serving it: the mirror refuses one older than a term it
  has seen, and the stream is reopened with ``min_term``, so a deposed
  leader that still streams is never followed after a newer one. Where
  the group may lose committed versions in a failover (``async``), the new
  leader's stream opens with a snapshot marked ``resync``: the mirror loads
  it and the worker registers as a new worker incarnation (its KV may hold
  steps the new leader does not have), so blockd marks every sequence's KV
  lost and schedulers recompute;
* the heartbeat thread reports the applied version every ``interval_s``; a
  NOT_FOUND answer (blockd restarted and forgot its in-memory registry) makes
  it register again, with the same worker incarnation (its KV is intact).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from blockd.core.errors import BlockdError
from blockd.core.hashing import DEFAULT_TENANT
from blockd.core.types import PoolConfig, Snapshot, WorkerInfo
from client.errors import BlockdClientError, NotFoundError
from client.groups import connect
from client.leader import BACKOFF_S
from client.sdk import BlockdClient
from worker.runtime import WorkerRuntime

log = logging.getLogger("blockd.worker")


class Attachment:
    def __init__(self, client: BlockdClient, runtime: WorkerRuntime, info: WorkerInfo,
                 heartbeat_interval_s: float = 1.0, metrics=None) -> None:
        self.client = client
        self.runtime = runtime
        self.info = info
        self.heartbeat_interval_s = heartbeat_interval_s
        self.metrics = metrics
        self.connected = threading.Event()
        self._stop = threading.Event()
        # the stream gets its own channel: closing it is the one way to end a
        # blocked stream from another thread (a generator cannot be closed
        # while it runs)
        self._watch_client = connect(client.target, timeout_s=client.timeout_s, tls=client.tls, token=client.token)
        self._threads = [
            threading.Thread(target=self._follow, name="blockd-worker-watch", daemon=True),
            threading.Thread(target=self._heartbeat, name="blockd-worker-heartbeat", daemon=True),
        ]

    def start(self) -> None:
        mirror = self.runtime.mirror
        if not mirror.incarnation and not mirror.received_version:
            # name the pool's incarnation from version 0, so the stream starts with deltas
            mirror.adopt(self.client.get_pool(self.info.pool).incarnation)
        self.client.register_worker(self.info)
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._watch_client.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _follow(self) -> None:
        mirror, backoff = self.runtime.mirror, 0.05
        while not self._stop.is_set():
            try:
                stream = self._watch_client.watch(self.info.pool, mirror.received_version,
                                                  incarnation=mirror.incarnation, min_term=mirror.term,
                                                  timeout_s=None)
                self.connected.set()
                for item in stream:
                    mirror.check_term(item.term)  # a deposed leader's message is refused: reconnect
                    if isinstance(item, Snapshot) and item.incarnation != mirror.incarnation:
                        if not self._resync(item):
                            return
                    elif isinstance(item, Snapshot) and item.resync:
                        self._forget_kv(item)
                    elif isinstance(item, Snapshot):
                        log.warning("replica of %s fell behind; loading the snapshot of version %d",
                                    self.info.pool, item.version)
                        mirror.load_snapshot(item.version, item.tables)
                    else:
                        mirror.push(item)
                    # only now: a model step planned on this term waits for it (wait_term), so it never
                    # runs on the tables (or KV) an older leader's stream left before a resync replaced them
                    mirror.note_term(item.term)
                    if mirror.lag > mirror.max_pending:
                        self.runtime.catch_up()
                    self._report_lag()
                    backoff = 0.05
                if not self._stop.is_set():
                    log.warning("blockd ended the Watch stream of %s (pool deleted?)", self.info.pool)
                    self._stop.wait(1.0)
            except (BlockdClientError, BlockdError, ValueError) as err:
                # ValueError: the channel was closed by stop(); BlockdError: the
                # replica refused a delta (a gap) -- reconnecting from the last
                # version received repairs both
                self.connected.clear()
                if self._stop.is_set():
                    return
                log.info("Watch stream broke (%s); reconnecting from version %d", err,
                         mirror.received_version)
                self._stop.wait(backoff)
                # capped as the SDK's own leader search is: after a failover the first
                # reconnect that reaches the new leader ends the worker's lag, and every
                # model step planned on the new leader's versions waits for it
                backoff = min(backoff * 2, BACKOFF_S[1])

    def _resync(self, snapshot: Snapshot) -> bool:
        """Move the mirror to a new pool incarnation; False (and the worker
        unusable) when the new pool's geometry does not fit this worker."""
        runtime, name = self.runtime, self.info.pool
        log.warning("pool %s is a new incarnation (%s, was %s): dropping the mirror and every KV slot written, "
                    "loading the snapshot of version %d", name, snapshot.incarnation,
                    runtime.mirror.incarnation or "none", snapshot.version)
        config, held = self.client.pool_config(name), runtime.config

        def shape(c: PoolConfig) -> PoolConfig:  # geometry and owner ("" was the default tenant)
            return replace(c, watermark_blocks=0, max_retained_versions=1, tenant=c.tenant or DEFAULT_TENANT)

        if shape(config) != shape(held):
            runtime.unusable = (f"pool {name!r} was re-created with another geometry or tenant ({config}) than "
                                f"this worker holds ({held}); restart the worker")
            log.error("%s", runtime.unusable)
            return False
        runtime.mirror.load_snapshot(snapshot.version, snapshot.tables, snapshot.incarnation)
        return True

    def _forget_kv(self, snapshot: Snapshot) -> None:
        """A new leader that may lack versions this replica holds (``WatchResponse.resync``):
        load its snapshot and register as a new incarnation, so blockd marks the KV lost."""
        runtime = self.runtime
        # the KV is forgotten before the new leader's tables are visible: no model step
        # ever pairs those tables with KV written for versions the new leader lacks
        self.info = replace(self.info, incarnation=runtime.new_incarnation())
        runtime.mirror.load_snapshot(snapshot.version, snapshot.tables)
        log.warning("blockd's new leader (term %d) may lack versions of pool %s this worker held (async "
                    "replication): loaded its snapshot of version %d; registering as incarnation %s, so every "
                    "sequence's KV is marked lost and schedulers recompute it", snapshot.term, self.info.pool,
                    snapshot.version, self.info.incarnation)
        while not self._stop.is_set():  # the next Watch names the new term: this is the one chance
            try:
                self.client.register_worker(self.info)
                return
            except BlockdClientError as err:
                log.warning("registering the new incarnation failed (%s); retrying", err)
                self._stop.wait(0.2)

    def _report_lag(self) -> None:
        if self.metrics is not None:
            self.metrics.set_replica_lag(self.runtime.mirror.lag)
            self.metrics.set_applied_version(self.runtime.mirror.applied_version)

    def latest_committed(self) -> int:
        """The pool's version as blockd sees it (to refuse versions that never come)."""
        return self.client.get_pool(self.info.pool).version

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            self._report_lag()
            try:
                self.client.heartbeat(self.info.worker_id, self.runtime.mirror.applied_version)
            except NotFoundError:
                log.info("blockd forgot worker %s; registering again", self.info.worker_id)
                try:
                    self.client.register_worker(self.info)
                except BlockdClientError as err:
                    log.warning("re-registration failed: %s", err)
            except BlockdClientError as err:
                log.debug("heartbeat failed: %s", err)
