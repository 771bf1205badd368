"""One pool as the daemon holds it, and its section of a snapshot.

A :class:`PoolEntry` is the allocator's :class:`~blockd.core.Pool`, the
pool's identity (:class:`~blockd.engine.incarnations.PoolIncarnations`: incarnation,
worker incarnations, KV-lost sequences), the KV events retained for Events
streams that resume, and whether the pool was deleted (which ends its
streams). :meth:`PoolEntry.dump` and :meth:`PoolEntry.load` are its snapshot
codec: the pool's exact state (:mod:`blockd.core.state`), the identity, and
the retained events as ``[seq_no, kind, block hash hex, parent hash hex,
block id, token ids]``.

The same snapshot form is how a pool moves between a cluster's daemon groups
(``blockd serve --cluster``, :mod:`blockd.service.moves`): :class:`PoolMoves`,
mixed into :class:`~blockd.engine.machine.Engine`, hands a pool's state out
(:meth:`PoolMoves.export_pool`, under the engine lock) and takes one in
through the logged ``import_pool`` record (:meth:`PoolMoves.import_pool`), so
a restart brings it back. The pool keeps its incarnation and version: a
scheduler's next step and a worker's Watch continue where they were. When a
move may happen (drained, the directory switched) is the service's business.
Imports the core, :mod:`blockd.engine.incarnations` and the records.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from blockd.core import KVEvent, Pool, PoolStats
from blockd.core.errors import InvalidArgument
from blockd.core.hashing import DEFAULT_TENANT
from blockd.core.state import dump_pool, extra_from_json, extra_to_json, load_pool
from blockd.core.types import Snapshot
from blockd.engine import records
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


class PoolMoves:
    """Export and import of one pool; :class:`~blockd.engine.machine.Engine`
    provides what is declared here."""

    if TYPE_CHECKING:
        _state: Any  # blockd.engine.state.State, which imports this module
        _lock: threading.RLock

        def _guard(self, name: object) -> None: ...
        def _mutate_in_term(self, record: records.Record, rid: str = "",
                            check: Callable[[], object] | None = None) -> tuple[object, int]: ...

    def export_pool(self, name: str) -> dict:
        """Pool ``name``'s exact state as plain JSON-able data (NOT_FOUND if none),
        with the request ids answered for it (``requests``): a step resent to the
        pool's new owner under the same id is answered, not applied again."""
        self._guard(name)
        with self._lock:
            entry = self._state.entry(name)
            data = entry.dump()
            data["requests"] = self._state.requests.dump_scope(entry.identity.incarnation)
            return data

    def import_pool(self, name: str, state: dict) -> PoolStats:
        """Build pool ``name`` from :meth:`export_pool`'s output, logged;
        ALREADY_EXISTS if a pool of that name is here, INVALID_ARGUMENT if
        ``state`` is not a pool's snapshot form (nothing changes either way)."""
        if not isinstance(state, dict):
            raise InvalidArgument("a pool's state must be a JSON object")
        stats = self._mutate_in_term(records.ImportPool(name, state))[0]
        assert isinstance(stats, PoolStats), "an import record answers with the pool's stats"
        return stats
