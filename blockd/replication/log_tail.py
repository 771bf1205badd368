"""The leader's retained window of log records, in memory, for its followers.

:class:`LogTail` is the engine's :class:`~blockd.engine.config.LogObserver`
(``docs/ha.md``): it sees every record the durability module replays or
appends, as ``(lsn, term, body)`` with the body byte for byte as logged, and
keeps those after the *previous* snapshot. A follower that asks for records
the window still holds streams them from memory (no disk read on the hot
path); one that asks for older records catches up from the newest snapshot
(which the window always continues: it starts at or before it).

The window is bounded by the snapshot policy (``--snapshot-every`` records,
or the log outgrowing a share of the snapshot): about two snapshots' worth
of records. Thread-safe: appends come under the engine lock,
reads from the replication streams' threads.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("blockd.replication")

#: records and bytes a single message carries at most
BATCH_RECORDS = 256
BATCH_BYTES = 1 << 20


class LogTail:
    """Records after the snapshot before the newest one; see the module docstring."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._records: deque[tuple[int, int, bytes]] = deque()
        #: the records kept are those after ``_base``
        self._base = 0
        self._last = 0
        self._snapshot = 0
        self.generation = 0  #: bumped by every reset: a stream reading across one must restart
        #: ``(push, wake)`` pairs. ``push`` is called with each record as it is appended (before the
        #: readers are woken): a leader's socket feeds send it to their followers from the appending
        #: thread (:class:`blockd.replication.feeds.LinkFeed`). ``wake`` is called where the readers are woken
        #: for anything but a record (a reset, a role change): a feed's thread waits on its own signal,
        #: not on this tail, and must re-check too
        self._listeners: list[tuple[Callable[[int, int, bytes], None], Callable[[], None]]] = []

    # --- LogObserver ---------------------------------------------------------------------
    def reset(self, snapshot_lsn: int) -> None:
        with self._changed:
            self._records.clear()
            self._base = self._last = self._snapshot = snapshot_lsn
            self.generation += 1
            self._changed.notify_all()
        self._wake_listeners()

    def record(self, lsn: int, term: int, body: bytes) -> None:
        with self._changed:
            assert lsn == self._last + 1, f"log record {lsn} after {self._last}"
            kept = bytes(body)
            self._records.append((lsn, term, kept))
            self._last = lsn
            # before the readers wake: a feed's thread woken first took the record from its push
            # more often than not (measured), and a push must not wait (it never blocks: a try-lock)
            for push, _ in self._listeners:
                try:
                    push(lsn, term, kept)
                except Exception:  # the record is logged already: a push that fails leaves it to the reader
                    log.exception("a log listener failed on lsn %d; its feed's thread sends the record", lsn)
            self._changed.notify_all()

    def listen(self, push: Callable[[int, int, bytes], None], wake: Callable[[], None]) -> None:
        """Call ``push`` with every record appended from now on, and ``wake`` where the readers
        are woken for another reason (see ``_listeners``)."""
        with self._changed:
            self._listeners = [*self._listeners, (push, wake)]

    def unlisten(self, push: Callable[[int, int, bytes], None]) -> None:
        with self._changed:
            self._listeners = [pair for pair in self._listeners if pair[0] != push]

    def _wake_listeners(self) -> None:
        for _, wake in self._listeners:
            wake()

    def snapshotted(self, lsn: int) -> None:
        with self._changed:
            if lsn <= self._snapshot:
                return
            drop_upto, self._snapshot = self._snapshot, lsn
            while self._records and self._records[0][0] <= drop_upto:
                self._records.popleft()
            self._base = max(self._base, drop_upto)

    # --- readers ------------------------------------------------------------------------
    @property
    def last_lsn(self) -> int:
        with self._changed:
            return self._last

    @property
    def first_lsn(self) -> int:
        """The oldest record kept (``last_lsn + 1`` when none is)."""
        with self._changed:
            return self._base + 1

    def wake(self) -> None:
        """Wake every reader (a role change: they re-check whether to go on)."""
        with self._changed:
            self._changed.notify_all()
        self._wake_listeners()

    def read(self, from_lsn: int, wait_s: float) -> list[tuple[int, int, bytes]] | None:
        """Records from ``from_lsn`` on (a batch, waiting up to ``wait_s`` for
        the first; 0: not at all); ``[]`` when none came; None when ``from_lsn``
        is no longer kept (catch up from the snapshot)."""
        with self._changed:
            if from_lsn <= self._base:
                return None
            if from_lsn > self._last and wait_s > 0:
                self._changed.wait(wait_s)
                if from_lsn <= self._base:
                    return None
            start = from_lsn - self._base - 1
            out: list[tuple[int, int, bytes]] = []
            size = 0
            for i in range(start, min(len(self._records), start + BATCH_RECORDS)):
                item = self._records[i]
                out.append(item)
                size += len(item[2])
                if size >= BATCH_BYTES:
                    break
            return out


__all__ = ["BATCH_BYTES", "BATCH_RECORDS", "LogTail"]
