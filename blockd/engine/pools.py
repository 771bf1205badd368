"""One pool as the daemon holds it, and its section of a snapshot.

A :class:`PoolEntry` is the allocator's :class:`~blockd.core.Pool`, the
pool's identity (:class:`~blockd.engine.incarnations.PoolIncarnations`: incarnation,
worker incarnations, KV-lost sequences), the KV events retained for Events
streams that resume, and whether the pool was deleted (which ends its
streams). :meth:`PoolEntry.dump` and :meth:`PoolEntry.load` are its snapshot
codec: the pool's exact state (:mod:`blockd.core.state`), the identity, and
the retained events as ``[seq_no, kind, block hash hex, parent hash hex,
block id, token ids]``. Imports the core and :mod:`blockd.engine.incarnations`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from blockd.core import KVEvent, Pool, PoolStats
from blockd.core.hashing import DEFAULT_TENANT
from blockd.core.state import dump_pool, extra_from_json, extra_to_json, load_pool
from blockd.core.types import Snapshot
from blockd.engine.incarnations import PoolIncarnations, legacy_incarnation

#: KV events kept per pool for Events streams that resume
MAX_RETAINED_EVENTS = 65536


def event_to_json(event: KVEvent) -> list:
    return [event.seq_no, event.kind, event.block_hash.hex(), event.parent_hash.hex(), event.block_id,
            list(event.token_ids), event.medium]


def event_from_json(data: list) -> KVEvent:
    """An event as :func:`event_to_json` wrote it; one written before the host
    tier has no medium: it was on the device."""
    return KVEvent(data[0], data[1], bytes.fromhex(data[2]), bytes.fromhex(data[3]), data[4], tuple(data[5]),
                   data[6] if len(data) > 6 else "device")


class PoolEntry:
    """A pool, its identity and its retained events. Not thread-safe: the
    engine uses it under its lock."""

    __slots__ = ("deleted", "events", "identity", "pool", "retain")

    def __init__(self, pool: Pool, identity: PoolIncarnations) -> None:
        self.pool = pool
        self.identity = identity
        self.events: deque[KVEvent] = deque(maxlen=MAX_RETAINED_EVENTS)
        self.deleted = False
        #: sequences whose Allocate asked to retain the prompt, by id: (TTL, the
        #: prompt's full-block tokens[, its tokens and extra keys once freed]);
        #: the engine pins them once committed (:mod:`blockd.engine.retention.retain`)
        self.retain: dict[str, tuple[Any, ...]] = {}

    def snapshot(self) -> Snapshot:
        return Snapshot(self.pool.version, self.pool.tables(), self.identity.incarnation)

    def stats(self) -> PoolStats:
        return self.identity.stats(self.pool.stats())

    def drain_events(self) -> None:
        """Keep the events the pool's last change published."""
        self.events.extend(self.pool.take_events())

    def dump(self) -> dict:
        data = dump_pool(self.pool)
        data["identity"] = self.identity.dump()
        data["events"] = [event_to_json(e) for e in self.events]
        if self.retain:
            data["retain"] = [[seq_id, ttl, n, *([p[0], extra_to_json(p[1])] if p else [])]
                              for seq_id, (ttl, n, *p) in self.retain.items()]
        return data

    @classmethod
    def load(cls, data: dict, lsn: int) -> PoolEntry:
        """From :meth:`dump`'s output in a snapshot at ``lsn`` (one without an
        identity predates incarnations: its pool gets a stable legacy one)."""
        identity = (PoolIncarnations.load(data["identity"]) if "identity" in data
                    else PoolIncarnations(legacy_incarnation(data["config"]["name"], lsn)))
        if not data["config"].get("tenant"):  # written before tenants: the default tenant's
            data = {**data, "config": {**data["config"], "tenant": DEFAULT_TENANT}}
        entry = cls(load_pool(data), identity)
        entry.events.extend(event_from_json(e) for e in data.get("events", []))
        entry.retain.update((seq_id, (ttl, n, *([p[0], extra_from_json(p[1])] if p else [])))
                            for seq_id, ttl, n, *p in data.get("retain", []))
        return entry
