"""The commit point of one leader's term, as plain data (``docs/ha.md`` 2.4): no locks, clocks or I/O.

:class:`CommitPoint` holds what each follower has persisted and the in-sync
set's bookkeeping, and answers the quorum rule. It changes nothing outside
itself: where etcd's copy of the set must change, a method says so and the
caller (:class:`blockd.replication.commits.Commits`, which adds the lock,
the waiters and the etcd writes) does the write, then reports back. Every
time it needs is passed in (``now``, on the caller's monotonic clock).

The rules (``sync`` mode):

* the **members** are the in-sync followers etcd holds an entry for (the
  leader is not one of them); **joining** followers are being added: etcd's
  entry is being written. Commits wait for both (:meth:`waited_for`), but
  only members count towards ``min_in_sync``: a leader that dies while an
  entry is written has acknowledged nothing only a replica outside the etcd
  set holds;
* the **commit index** is the least LSN every waited-for follower has
  persisted (and at most the leader's last record); 0 while fewer than
  ``min_in_sync`` replicas (members and the leader) are in the set;
* a follower **joins** once it has persisted every record acknowledged so
  far (``acked``: the term's first record included), and only while the set
  has a free place (``max_members``, 0: no limit). A member a waiter gave up
  on (:meth:`laggards`) is **dropped** before anything is acknowledged
  without it; so is a member whose log is another copy than its entry names
  (its data dir was lost, :meth:`opened`);
* a new term starts without the previous leader (it may be dead; it rejoins
  once caught up) and without the members beyond ``max_members``.

``async`` mode: the commit index is the leader's last record; followers
trail, and a step waits while a live follower (one that acknowledged within
``live_s``) is more than ``max_lag_records`` behind it (:meth:`holding_back`).

Invariants: ``members`` and ``joining`` are disjoint and never hold the
leader; ``acked`` only grows within a term. This module imports only the
standard library's data types: no threading, sockets, gRPC or etcd.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

MODES = ("sync", "async")


@dataclass
class FollowerState:
    """What the leader knows of one follower: the LSN it has persisted, and when it last said so."""

    replica_id: str
    address: str = ""
    persisted_lsn: int = 0
    last_ack: float = 0.0  #: on the caller's clock; 0: never
    log_id: str = ""


@dataclass(frozen=True)
class CommitView:
    """A consistent copy of the leader's view, for metrics and status: the
    commit point, the in-sync members (other than the leader), each
    follower's state, and the clock reading they were taken at."""

    commit_lsn: int
    members: frozenset[str]
    followers: tuple[FollowerState, ...]
    now: float


@dataclass(frozen=True)
class Acked:
    """What an acknowledgement changed: ``wake`` (waiters may find their record committed
    now), ``join`` (the follower is joining: write its entry, naming ``log_id``, in etcd,
    then call :meth:`CommitPoint.joined`)."""

    wake: bool = False
    join: bool = False
    log_id: str = ""


class Joined(enum.Enum):
    """What became of a follower whose entry etcd now holds (:meth:`CommitPoint.joined`)."""

    MEMBER = "member"  #: it counts towards ``min_in_sync`` from now on
    DROPPED = "dropped"  #: a waiter dropped it while the entry was written: remove the entry again
    TERM_OVER = "term_over"  #: the term ended meanwhile: nothing to do (the next term loads the set)


class CommitPoint:
    """One term's commit point; see the module docstring."""

    def __init__(self, replica_id: str, mode: str, min_in_sync: int, max_lag_records: int = 0,
                 live_s: float = 1.0, max_members: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"the replication mode must be one of {MODES}, got {mode!r}")
        if min_in_sync < 1:
            raise ValueError(f"min_in_sync must be >= 1 (the leader counts), got {min_in_sync}")
        if max_members < 0 or max_lag_records < 0:
            raise ValueError(f"max_members ({max_members}) and max_lag_records ({max_lag_records}) must be >= 0")
        self.replica_id, self.mode, self.min_in_sync = replica_id, mode, min_in_sync
        self.max_members = max_members  #: followers the set may hold (0: every one caught up)
        self.max_lag_records, self.live_s = max_lag_records, live_s
        self.term = 0  #: the term led (0: none)
        self.followers: dict[str, FollowerState] = {}
        self.members: set[str] = set()  #: in-sync members other than this leader (in etcd)
        self.joining: set[str] = set()  #: being added to etcd's set: waited for, not yet counted
        self.member_logs: dict[str, str] = {}  #: member -> the log id its entry names ("": not known)
        #: every record acknowledged in this term (and every earlier term's) is at or below this
        self.acked = 0

    # --- the term --------------------------------------------------------------------------------
    def starting_members(self, logs: Mapping[str, str], previous_leader: str) -> tuple[set[str], list[str]]:
        """For a new term, from etcd's set (``member -> log id``): the members it starts
        with, and the entries to remove from etcd first, in order (the previous leader,
        then the members beyond ``max_members``, a set kept under a larger limit)."""
        members = set(logs) - {self.replica_id}
        leaving = []
        if previous_leader and previous_leader in members:
            leaving.append(previous_leader)
            members.discard(previous_leader)
        if self.max_members and len(members) > self.max_members:
            extra = sorted(members)[self.max_members:]  # leaving is always safe; they may join again later
            leaving += extra
            members.difference_update(extra)
        return members, leaving

    def begin(self, term: int, members: set[str], logs: Mapping[str, str]) -> None:
        """Lead ``term`` with ``members`` (from :meth:`starting_members`, once etcd has removed the rest)."""
        self.term, self.members, self.followers, self.member_logs = term, set(members), {}, dict(logs)
        self.joining = set()
        self.acked = 0

    def acknowledged(self, lsn: int) -> None:
        """Every record up to ``lsn`` is acknowledged (the term's first record; a committed step)."""
        self.acked = max(self.acked, lsn)

    def end(self) -> None:
        self.term = 0

    # --- the quorum rule -------------------------------------------------------------------------
    def waited_for(self) -> set[str]:
        """The followers every commit waits for: the members and those joining."""
        return self.members | self.joining

    def persisted(self, replica_id: str) -> int:
        state = self.followers.get(replica_id)
        return state.persisted_lsn if state is not None else 0

    def floor(self) -> int:
        """The least LSN the waited-for followers have persisted (-1: none is waited for)."""
        waited = self.waited_for()
        return min(self.persisted(m) for m in waited) if waited else -1

    def commit_index(self, last_lsn: int) -> int:
        """The last committed LSN, when the leader's log ends at ``last_lsn``."""
        if self.mode == "async":
            return last_lsn
        if len(self.members) + 1 < self.min_in_sync:
            return 0
        return min([last_lsn, *(self.persisted(m) for m in self.waited_for())])

    # --- followers -------------------------------------------------------------------------------
    def opened(self, term: int, replica_id: str, address: str, lsn: int, log_id: str, now: float) -> str | None:
        """A follower opened its feed from ``lsn``. Returns the log id its member entry names
        when that is another copy of its log (its data dir was lost): it holds none of what
        the entry vouches for and must leave the set now (remove the entry, then :meth:`drop`);
        None otherwise. It is admitted again, under ``log_id``, once it has caught up."""
        self.followers[replica_id] = FollowerState(replica_id, address, lsn, now, log_id)
        known = self.member_logs.get(replica_id, "")
        if term == self.term and replica_id in self.members and log_id and known not in ("", log_id):
            return known
        return None

    def ack(self, term: int, replica_id: str, lsn: int, now: float) -> Acked:
        """A follower persisted up to ``lsn``; see :class:`Acked` for what the caller does next."""
        if term != self.term:
            return Acked()
        state = self.followers.setdefault(replica_id, FollowerState(replica_id))
        floor = self.floor()
        state.persisted_lsn, state.last_ack = max(state.persisted_lsn, lsn), now
        # a sync step waits for the slowest of the followers it waits for: the first of two
        # acknowledgements of a step would wake it for nothing (a wake hands the GIL over twice)
        wake = self.mode == "async" or self.floor() != floor
        if self.mode == "async" or replica_id in self.waited_for():
            return Acked(wake)
        if self.max_members and len(self.waited_for()) >= self.max_members:
            return Acked(wake)  # no place free: it follows without holding steps back
        # It joins once it holds every record acknowledged so far (all at or below ``acked``): from
        # then on every commit waits for it. Waiting for it to reach the leader's *last* record
        # instead never happens under steady load.
        if state.persisted_lsn < self.acked:
            return Acked(wake)
        self.joining.add(replica_id)
        return Acked(wake, join=True, log_id=state.log_id)

    def joined(self, term: int, replica_id: str, log_id: str) -> Joined:
        """etcd holds the entry of ``replica_id`` (joining in ``term``) now."""
        current = self.term == term
        member = current and replica_id in self.joining
        self.joining.discard(replica_id)
        if member:
            self.members.add(replica_id)
            self.member_logs[replica_id] = log_id
            return Joined.MEMBER
        return Joined.DROPPED if current else Joined.TERM_OVER

    def join_failed(self, replica_id: str) -> None:
        """Writing the entry failed: the follower is not joining any more (it tries again at its next ack)."""
        self.joining.discard(replica_id)

    def laggards(self, lsn: int) -> list[str]:
        """The waited-for followers that have not persisted ``lsn`` (sorted): those a waiter drops."""
        return sorted(m for m in self.waited_for() if self.persisted(m) < lsn)

    def drop(self, replica_id: str) -> None:
        """It leaves the set (etcd's entry removed first). One still joining ends outside it
        too: :meth:`joined` then answers DROPPED."""
        self.members.discard(replica_id)
        self.joining.discard(replica_id)

    def joinable(self, now: float) -> bool:
        """Whether a live follower outside the set might take a free place and confirm."""
        inside = self.waited_for()
        return any(f.replica_id not in inside and f.last_ack and now - f.last_ack <= self.live_s
                   for f in self.followers.values())

    def holding_back(self, lsn: int, now: float) -> list[FollowerState]:
        """``async`` mode: the live followers more than ``max_lag_records`` behind ``lsn``."""
        return [f for f in self.followers.values() if f.last_ack and now - f.last_ack <= self.live_s
                and lsn - f.persisted_lsn > self.max_lag_records]

    def view(self, last_lsn: int, now: float) -> CommitView:
        return CommitView(self.commit_index(last_lsn), frozenset(self.members),
                          tuple(replace(f) for f in self.followers.values()), now)
