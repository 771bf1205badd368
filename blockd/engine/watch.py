"""Watchers of the engine's pools: Watch and Events streams, and the wait for
the next change.

A Watch stream hands a follower (a worker's table mirror) every
:class:`~blockd.core.VersionDelta` after the version it names, in order, then
each new one as it commits; when those deltas are no longer retained, or when
the follower names another pool incarnation than the pool's, it opens with a
:class:`~blockd.core.types.Snapshot` instead. An Events stream hands a router
the pool's KV events after a sequence number, from the retained window
(:data:`blockd.engine.pools.MAX_RETAINED_EVENTS`).

With replication (``docs/ha.md``) both deliver only committed changes: what
a stream takes from the state under the lock is handed out once the record
logged last at that moment is committed (the engine's gate), so a worker
never holds a version a new leader would not have.

Both wait on one condition shared with the engine's lock: the engine calls
:meth:`Watchers.notify` after every change, under the lock. A stream wakes at
least every :data:`WAIT_S` to ask its ``should_stop`` (the client went away,
the server is shutting down), so none outlives its reader by more than that;
a deleted pool ends its streams. Imports the core and the pool entry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import islice

from blockd.core import InvalidArgument, KVEvent, SnapshotRequired, VersionDelta, WrongState
from blockd.core.errors import shown
from blockd.core.types import Snapshot
from blockd.engine.pools import PoolEntry

#: longest a stream sleeps before it checks whether it should stop
WAIT_S = 0.25


class Watchers:
    """The streams over ``lock``'s state (the engine's lock)."""

    def __init__(self, lock: threading.RLock, position: Callable[[], int] = lambda: 0,
                 committed: Callable[[int], object] = lambda lsn: None) -> None:
        """``position()``: the last LSN logged (under the lock);
        ``committed(lsn)``: returns once it is committed, or raises."""
        self._lock = lock
        self._changed = threading.Condition(lock)
        self._position, self._committed = position, committed

    def notify(self) -> None:
        """Something changed: wake every stream. Call with the lock held."""
        self._changed.notify_all()

    def watch(self, entry: PoolEntry, from_version: int, should_stop: Callable[[], bool],
              incarnation: str = "", resync: bool = False) -> Iterator[Snapshot | VersionDelta]:
        """Deltas after ``from_version`` in order (a snapshot first when they are
        no longer retained, when ``incarnation``, the follower's, is set and
        is not the pool's, or when ``resync``: then marked so, see
        ``WatchResponse.resync``), then new ones as they commit."""
        with self._lock:
            version = from_version
            if incarnation and incarnation != entry.identity.incarnation:
                pending: list = [entry.snapshot()]
            elif resync:
                pending = [replace(entry.snapshot(), resync=True)]
            else:
                pending = self._since(entry, version)
            lsn = self._position()
        while True:
            self._committed(lsn)
            for item in pending:
                yield item
                version = item.version
            with self._lock:
                while entry.pool.version == version and not entry.deleted and not should_stop():
                    self._changed.wait(WAIT_S)
                if entry.deleted or should_stop():
                    return
                pending = self._since(entry, version)
                lsn = self._position()

    @staticmethod
    def _since(entry: PoolEntry, version: int) -> list:
        try:
            return entry.pool.deltas_since(version)
        except SnapshotRequired:
            return [entry.snapshot()]

    def events(self, entry: PoolEntry, pool: str, from_seq_no: int,
               should_stop: Callable[[], bool]) -> Iterator[KVEvent]:
        """KV events of ``entry`` (named ``pool``) with ``seq_no > from_seq_no``,
        in order, waiting for new ones. Refuses a start ahead of the pool or
        behind the retained window before yielding anything."""
        if type(from_seq_no) is not int or from_seq_no < 0:
            raise InvalidArgument(f"from_seq_no must be a non-negative int, got {shown(from_seq_no)}")
        with self._lock:
            last = entry.pool.last_event_seq_no
            if from_seq_no > last:
                raise WrongState(f"event {from_seq_no} is ahead of pool {shown(pool)} (last is {last})")
            oldest = entry.events[0].seq_no if entry.events else last + 1
            if from_seq_no + 1 < oldest:
                raise WrongState(f"events after {from_seq_no} are no longer retained (oldest is {oldest}); "
                                 "rebuild from a table snapshot and resume from the latest event")
        return self._follow_events(entry, from_seq_no, should_stop)

    def _follow_events(self, entry: PoolEntry, seen: int, should_stop: Callable[[], bool]) -> Iterator[KVEvent]:
        while True:
            with self._lock:
                while entry.pool.last_event_seq_no == seen and not entry.deleted and not should_stop():
                    self._changed.wait(WAIT_S)
                if entry.deleted or should_stop():
                    return
                first = entry.events[0].seq_no if entry.events else seen + 1
                if seen + 1 < first:
                    raise WrongState(f"events after {seen} fell out of the retained window while the "
                                     "reader was slow; rebuild from a table snapshot and resume")
                batch = list(islice(entry.events, seen + 1 - first, None))
                lsn = self._position()
            self._committed(lsn)
            for event in batch:
                yield event
                seen = event.seq_no
