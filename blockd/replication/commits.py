"""The leader's commit point shared by threads: the waiters and etcd's in-sync set (``docs/ha.md`` 2.4).

:class:`Commits` wraps the pure :class:`~blockd.replication.commit_point.CommitPoint`
(what the rules are: read that module's docstring) in a lock, and does what
the rules ask of the world:

* it keeps the in-sync set's invariant (:mod:`blockd.ha.insync`): in ``sync``
  mode a member that does not confirm a step by its deadline is removed
  from the set in etcd (fenced by the term) *before* anything is
  acknowledged without it; with fewer than ``min_in_sync`` replicas left the
  call is refused (:class:`~blockd.core.errors.NotReplicated`: retry with
  the same request id). A follower that has caught up joins: its entry is
  written in etcd, and only then does it count. With ``max_members``
  (``--sync-followers``) a step waits for the first followers to catch up,
  not for the slowest (what a failover may then need: one of those members);
* :meth:`Commits.wait` blocks a step until its record is committed. In
  ``async`` mode it returns at once, unless a live follower trails by more
  than ``max_lag_records`` (back-pressure: a failover then loses at most
  that many acknowledged records to a follower that kept up), and then by
  the deadline at the latest.

Every acknowledgement, whatever carried it, reaches the commit point through
:meth:`Commits.ack` (called by :class:`blockd.replication.acks.AckIntake`).
A sync waiter may read the replication port's acknowledgements itself
(:meth:`Commits.use_reader`, :class:`~blockd.replication.ack_reader.AckReader`):
the one that commits its step then wakes the thread that answers it.
The lock is never held across an etcd call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from blockd.core.errors import NotLeader, NotReplicated
from blockd.replication.ack_reader import AckReader
from blockd.replication.commit_point import CommitPoint, CommitView, Joined

log = logging.getLogger("blockd.replication")

#: the longest a waiter sleeps before it checks the term and its deadline again
POLL_S = 0.05


class InSyncStore(Protocol):
    """The in-sync set as etcd keeps it (:class:`blockd.ha.insync.InSyncSet`)."""

    def members(self) -> dict[str, str]: ...
    def add(self, term: int, replica_id: str, lsn: int, log_id: str = "") -> None: ...
    def remove(self, term: int, replica_id: str) -> None: ...


class Commits:
    """The commit point of the term this replica leads; see the module docstring."""

    def __init__(self, replica_id: str, mode: str, min_in_sync: int, store: InSyncStore,
                 clock: Callable[[], float] = time.monotonic, max_lag_records: int = 0,
                 live_s: float = 1.0, max_members: int = 0) -> None:
        self.replica_id = replica_id
        self._point = CommitPoint(replica_id, mode, min_in_sync, max_lag_records, live_s, max_members)
        self._store, self._clock = store, clock
        self._cond = threading.Condition()
        self._reader: AckReader | None = None
        self._notices = 0  #: bumped by every notice: a waiter that was away from the lock sees it missed one

    # --- the term --------------------------------------------------------------------------------
    def begin(self, term: int, previous_leader: str) -> None:
        """This replica leads ``term`` now: load the set (without the previous leader)."""
        logs = self._store.members()
        members, leaving = self._point.starting_members(logs, previous_leader)
        for replica_id in leaving:
            self._store.remove(term, replica_id)
        with self._cond:
            self._point.begin(term, members, logs)
            self._notify_locked()

    def started(self, lsn: int) -> None:
        """The term's first record is ``lsn``: what earlier terms acknowledged is below it."""
        with self._cond:
            self._point.acknowledged(lsn)

    def end(self) -> None:
        with self._cond:
            self._point.end()
            self._notify_locked()

    # --- reading it ------------------------------------------------------------------------------
    def commit_lsn(self, last_lsn: int) -> int:
        with self._cond:
            return self._point.commit_index(last_lsn)

    def view(self, last_lsn: int) -> CommitView:
        with self._cond:
            return self._point.view(last_lsn, self._clock())

    # --- followers -------------------------------------------------------------------------------
    def opened(self, term: int, replica_id: str, address: str, lsn: int, log_id: str = "") -> None:
        """A follower opened its feed from ``lsn`` (:meth:`CommitPoint.opened
        <blockd.replication.commit_point.CommitPoint.opened>`)."""
        with self._cond:
            known = self._point.opened(term, replica_id, address, lsn, log_id, self._clock())
        if known is None:
            return
        self._store.remove(term, replica_id)  # before anything is acknowledged without it
        with self._cond:
            self._point.drop(replica_id)
        log.warning("replica %s left the in-sync set: its log %s is not the one its entry names (%s); its "
                    "data dir was lost or replaced", replica_id, log_id, known)

    def ack(self, term: int, replica_id: str, lsn: int) -> None:
        """A follower persisted up to ``lsn``; it joins the set once it holds everything."""
        with self._cond:
            acked = self._point.ack(term, replica_id, lsn, self._clock())
            if acked.wake:
                self._notify_locked()
        if not acked.join:
            return
        try:
            self._store.add(term, replica_id, lsn, acked.log_id)
        except Exception:
            with self._cond:
                self._point.join_failed(replica_id)
                self._notify_locked()
            raise
        with self._cond:
            joined = self._point.joined(term, replica_id, acked.log_id)
            if joined is Joined.MEMBER:
                self._notify_locked()
        if joined is Joined.DROPPED:  # dropped at a deadline while its entry was written: leaving is always safe
            self._store.remove(term, replica_id)
        elif joined is Joined.MEMBER:
            log.info("replica %s joined the in-sync set at lsn %d (term %d)", replica_id, lsn, term)

    # --- waiting ---------------------------------------------------------------------------------
    def wait(self, lsn: int, last_lsn: int, deadline: float, leading: Callable[[], bool]) -> None:
        """Return once ``lsn`` is committed; by ``deadline`` drop the members
        that did not confirm it (a live follower outside the set then gets
        one more ``live_s`` to take a free place and confirm), then refuse if
        too few remain. In ``async`` mode: return at once, or once every live
        follower is within ``max_lag_records`` of ``lsn`` (by the deadline at
        the latest)."""
        point = self._point
        if point.mode == "async":
            self._bound_lag(lsn, deadline, leading)
            return
        with self._cond:
            term = point.term
            if self._committed_by(lsn, last_lsn, deadline, leading, term):
                return
            laggards = point.laggards(lsn)
        for member in laggards:
            self._store.remove(term, member)  # before anything is acknowledged without it
            with self._cond:
                point.drop(member)  # one still joining: its adder removes the entry again once written
            log.warning("replica %s left the in-sync set: it did not confirm lsn %d in time", member, lsn)
        with self._cond:
            now = self._clock()
            until = now + point.live_s if point.joinable(now) else now
            if self._committed_by(lsn, last_lsn, until, leading, term):
                return
        raise NotReplicated(f"not acknowledged: no in-sync follower confirmed lsn {lsn} in time (at least "
                            f"{point.min_in_sync} replicas must hold a step); retry with the same request id")

    def _committed_by(self, lsn: int, last_lsn: int, until: float, leading: Callable[[], bool], term: int) -> bool:
        """Under the lock: wait until ``lsn`` is committed (True) or ``until`` passes (False)."""
        point = self._point
        while point.commit_index(last_lsn) < lsn:
            if not leading() or point.term != term:
                raise NotLeader("this replica stopped leading before the step was committed; retry it "
                                "with the same request id against the new leader")
            left = until - self._clock()
            if left <= 0:
                return False
            reader = self._reader
            if reader is not None and reader.has_links:
                seen = self._notices
                self._cond.release()  # held once, by wait(): the acknowledgements read take it
                try:
                    read = reader.read(min(left, POLL_S))
                finally:
                    self._cond.acquire()
                if read or self._notices != seen:
                    continue
            self._cond.wait(min(left, POLL_S))
        point.acknowledged(lsn)
        return True

    def _bound_lag(self, lsn: int, deadline: float, leading: Callable[[], bool]) -> None:
        point = self._point
        if point.max_lag_records <= 0:
            return
        with self._cond:
            term = point.term
            while True:
                now = self._clock()
                if not point.holding_back(lsn, now):
                    return
                if not leading() or point.term != term:
                    raise NotLeader("this replica stopped leading before the step was acknowledged; retry it "
                                    "with the same request id against the new leader")
                left = deadline - now
                if left <= 0:
                    return  # acknowledged; the follower is slow but alive, and the next step waits again
                self._cond.wait(min(left, POLL_S))

    # --- the replication port's reader -----------------------------------------------------------
    def use_reader(self, reader: AckReader) -> None:
        """Sync waiters read the replication port's acknowledgements themselves (:class:`AckReader`)."""
        self._reader = reader
        reader.on_notice = self._notice

    def _notice(self) -> None:
        """The reader's role is free: the waiters that found it taken try again (none is reading)."""
        with self._cond:
            self._notify_locked(interrupt=False)

    def _notify_locked(self, interrupt: bool = True) -> None:
        """Under the lock: wake every waiter, including one reading the replication port."""
        self._notices += 1
        self._cond.notify_all()
        if interrupt and self._reader is not None:
            self._reader.interrupt()
