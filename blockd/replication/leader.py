"""The leader's side of log replication (``docs/ha.md``): the commit point and the feeds.

:class:`Commits` tracks what each follower has persisted and keeps the
in-sync set's invariant (:mod:`blockd.ha.insync`): in ``sync`` mode a record
is committed once every other member of the set has persisted it, and a
member that does not confirm by the deadline is removed from the set in etcd
(fenced by the term) *before* anything is acknowledged without it; with
fewer than ``min_in_sync`` replicas left the call is refused
(:class:`~blockd.core.errors.NotReplicated`: retry with the same request id).
A follower joins the set once it has persisted every record acknowledged
so far (the term's first record included); from then on no record is
acknowledged without it. It counts towards ``min_in_sync`` only once its
entry is in etcd: a leader that dies in between has acknowledged nothing
that only a replica outside the etcd set holds (no other replica could
lead then, and the group would wait for the dead one). With
``max_members`` (``--sync-followers``) the set holds at most that many
followers besides the leader: the others replicate
as in ``async`` mode and take a free place once it opens (a member dropped
at the deadline), so a step waits for the first followers to catch up, not
for the slowest (what a failover may then need: one of those members). ``async`` mode commits a record once
the leader has logged it; followers trail, by at most ``max_lag_records``:
a step whose record is further ahead of a live follower (one that has
acknowledged within ``live_s``) than that waits for it, until the deadline
(back-pressure: a failover then loses at most that many acknowledged
records to a follower that kept up; a follower that stops acknowledging
stops counting once its last acknowledgement is ``live_s`` old).

:class:`ReplicationServicer` serves ``ReplicationService``: ``ReplicateLog``
checks where the follower's log stops agreeing with the leader's (their term
histories, :func:`blockd.core.terms.common_prefix`) and tells it to cut its
tail there, streams the newest snapshot when the follower is behind the
retained window (:class:`blockd.replication.log_tail.LogTail`), then records as they are
logged and a heartbeat when idle; ``GetReplicaStatus`` answers the
replica's view (:meth:`blockd.replication.replica.Replica.status`); ``StreamAcks`` takes a follower's
acknowledgements on one stream (``AckLog``, one call each, stays for
followers that do not stream them). A follower that asks for frames gets a
``FramesOffer`` first and the rest of its feed on the replication port
(:mod:`blockd.replication.transport`): :class:`LinkFeed` sends there (the logging step
pushes each record itself) and a thread per feed reads the acknowledgements.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from blockd.core.errors import NoLeader, NotLeader, NotReplicated
from blockd.core.terms import TermHistory, common_prefix
from blockd.core.types import ReplicaStatus
from blockd.engine.machine import Engine
from blockd.replication.ack_reader import AckReader
from blockd.replication.framing import Link, frame
from blockd.replication.log_tail import LogTail
from blockd.replication.transport import CONNECT_S, FramesListener
from blockd.rpc.convert import replica_status_to_proto
from blockd.rpc.errors import client_stream, server_stream, unary
from blockd.storage.wal import parse_name
from blockd.v1 import replication_pb2 as rpb
from blockd.v1 import replication_pb2_grpc as rpb_grpc

log = logging.getLogger("blockd.replication")

HEARTBEAT_S = 0.1
#: a socket feed whose follower takes no bytes for this long is closed (it may be applying a snapshot)
FRAMES_SEND_S = 30.0
SNAPSHOT_CHUNK = 1 << 20


class InSyncStore(Protocol):
    """The in-sync set as etcd keeps it (:class:`blockd.ha.insync.InSyncSet`)."""

    def members(self) -> dict[str, str]: ...
    def add(self, term: int, replica_id: str, lsn: int, log_id: str = "") -> None: ...
    def remove(self, term: int, replica_id: str) -> None: ...


@dataclass
class FollowerState:
    replica_id: str
    address: str = ""
    persisted_lsn: int = 0
    last_ack: float = 0.0
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


class Commits:
    """The commit point of one term; see the module docstring."""

    def __init__(self, replica_id: str, mode: str, min_in_sync: int, store: InSyncStore,
                 clock: Callable[[], float] = time.monotonic, max_lag_records: int = 0,
                 live_s: float = 1.0, max_members: int = 0) -> None:
        self.replica_id, self.mode, self.min_in_sync = replica_id, mode, min_in_sync
        self.max_members = max_members  #: followers the set may hold (0: every one caught up)
        self.max_lag_records, self.live_s = max_lag_records, live_s
        self._store, self._clock = store, clock
        self._cond = threading.Condition()
        self.term = 0
        self.followers: dict[str, FollowerState] = {}
        self.members: set[str] = set()  #: in-sync members other than this leader (in etcd)
        #: followers being added to the set: commits wait for them, but they do not count
        #: towards ``min_in_sync`` before etcd holds their entry
        self.joining: set[str] = set()
        self.member_logs: dict[str, str] = {}  #: member -> the log id its entry names ("": not known)
        #: every record acknowledged in this term (and every earlier term's) is at or below this
        self.acked = 0
        self._reader: AckReader | None = None
        self._notices = 0  #: bumped by every notice: a waiter that was away from the lock sees it missed one

    def begin(self, term: int, previous_leader: str) -> None:
        """This replica leads ``term`` now: load the set (without the previous leader)."""
        logs = self._store.members()
        members = set(logs) - {self.replica_id}
        if previous_leader and previous_leader in members and previous_leader != self.replica_id:
            self._store.remove(term, previous_leader)  # it may be dead; it rejoins once caught up
            members.discard(previous_leader)
        if self.max_members and len(members) > self.max_members:  # set up under a larger limit
            for extra in sorted(members)[self.max_members:]:
                self._store.remove(term, extra)  # leaving is always safe; it may join again later
                members.discard(extra)
        with self._cond:
            self.term, self.members, self.followers, self.member_logs = term, members, {}, logs
            self.joining = set()
            self.acked = 0
            self._notify_locked()

    def started(self, lsn: int) -> None:
        """The term's first record is ``lsn``: what earlier terms acknowledged is below it."""
        with self._cond:
            self.acked = max(self.acked, lsn)

    def end(self) -> None:
        with self._cond:
            self.term = 0
            self._notify_locked()

    def commit_lsn(self, last_lsn: int) -> int:
        with self._cond:
            return self._commit_locked(last_lsn)

    def view(self, last_lsn: int) -> CommitView:
        with self._cond:
            return CommitView(self._commit_locked(last_lsn), frozenset(self.members),
                              tuple(replace(f) for f in self.followers.values()), self._clock())

    def _waited_for(self) -> set[str]:
        """Under the lock: the followers every commit waits for (members, and those joining)."""
        return self.members | self.joining

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

    def _floor_locked(self) -> int:
        """Under the lock: the least LSN the followers commits wait for have persisted (-1: none)."""
        waited = self._waited_for()
        if not waited:
            return -1
        return min(self.followers[m].persisted_lsn if m in self.followers else 0 for m in waited)

    def _commit_locked(self, last_lsn: int) -> int:
        if self.mode == "async":
            return last_lsn
        if len(self.members) + 1 < self.min_in_sync:
            return 0
        persisted = [self.followers[m].persisted_lsn if m in self.followers else 0 for m in self._waited_for()]
        return min([last_lsn, *persisted])

    def opened(self, term: int, replica_id: str, address: str, lsn: int, log_id: str = "") -> None:
        """A follower opened its feed from ``lsn``. A member whose entry names another
        copy of its log (its data dir was lost) holds none of what the entry vouches
        for: it leaves the set now, rather than stall commits until the ack deadline,
        and is admitted again, under ``log_id``, once it has caught up."""
        with self._cond:
            self.followers[replica_id] = FollowerState(replica_id, address, lsn, self._clock(), log_id)
            known = self.member_logs.get(replica_id, "")
            stale = term == self.term and replica_id in self.members and bool(log_id) and known not in ("", log_id)
        if stale:
            self._store.remove(term, replica_id)  # before anything is acknowledged without it
            with self._cond:
                self.members.discard(replica_id)
            log.warning("replica %s left the in-sync set: its log %s is not the one its entry names (%s); its "
                        "data dir was lost or replaced", replica_id, log_id, known)

    def ack(self, term: int, replica_id: str, lsn: int) -> None:
        """A follower persisted up to ``lsn``; it joins the set once it holds everything."""
        with self._cond:
            if term != self.term:
                return
            state = self.followers.setdefault(replica_id, FollowerState(replica_id))
            floor = self._floor_locked()
            state.persisted_lsn, state.last_ack = max(state.persisted_lsn, lsn), self._clock()
            # a sync step waits for the slowest of the followers it waits for: the first of two
            # acknowledgements of a step would wake it for nothing (a wake hands the GIL over twice)
            if self.mode == "async" or self._floor_locked() != floor:
                self._notify_locked()
            if self.mode == "async" or replica_id in self._waited_for():
                return
            if self.max_members and len(self._waited_for()) >= self.max_members:
                return  # no place free: it follows without holding steps back
            # It joins once it holds every record acknowledged so far (all at or below ``acked``,
            # which moves under this lock): from then on every commit waits for it. Waiting for it
            # to reach the leader's *last* record instead never happens under steady load.
            if state.persisted_lsn < self.acked:
                return
            self.joining.add(replica_id)
            log_id = state.log_id
        try:
            self._store.add(term, replica_id, lsn, log_id)
        except Exception:
            with self._cond:
                self.joining.discard(replica_id)
                self._notify_locked()
            raise
        with self._cond:
            current = self.term == term
            joined = current and replica_id in self.joining
            self.joining.discard(replica_id)
            if joined:  # counts towards min_in_sync from now on
                self.members.add(replica_id)
                self.member_logs[replica_id] = log_id
                self._notify_locked()
        if not joined:
            if current:  # dropped at a deadline while its entry was written: leaving is always safe
                self._store.remove(term, replica_id)
            return
        log.info("replica %s joined the in-sync set at lsn %d (term %d)", replica_id, lsn, term)

    def wait(self, lsn: int, last_lsn: int, deadline: float, leading: Callable[[], bool]) -> None:
        """Return once ``lsn`` is committed; by ``deadline`` drop the members
        that did not confirm it (a live follower outside the set then gets
        one more ``live_s`` to take a free place and confirm), then refuse if
        too few remain. In ``async`` mode: return at once, or once every live
        follower is within ``max_lag_records`` of ``lsn`` (by the deadline at
        the latest)."""
        if self.mode == "async":
            self._bound_lag(lsn, deadline, leading)
            return
        with self._cond:
            term = self.term
            if self._committed_by(lsn, last_lsn, deadline, leading, term):
                return
            laggards = sorted(m for m in self._waited_for()
                              if (self.followers[m].persisted_lsn if m in self.followers else 0) < lsn)
        for member in laggards:
            self._store.remove(term, member)  # before anything is acknowledged without it
            with self._cond:
                self.members.discard(member)
                self.joining.discard(member)  # its adder removes the entry again once written
            log.warning("replica %s left the in-sync set: it did not confirm lsn %d in time", member, lsn)
        with self._cond:
            now = self._clock()
            inside = self._waited_for()
            joinable = any(f.replica_id not in inside and f.last_ack and now - f.last_ack <= self.live_s
                           for f in self.followers.values())
            if self._committed_by(lsn, last_lsn, now + self.live_s if joinable else now, leading, term):
                return
        raise NotReplicated(f"not acknowledged: no in-sync follower confirmed lsn {lsn} in time (at least "
                            f"{self.min_in_sync} replicas must hold a step); retry with the same request id")

    def _committed_by(self, lsn: int, last_lsn: int, until: float, leading: Callable[[], bool], term: int) -> bool:
        """Under the lock: wait until ``lsn`` is committed (True) or ``until`` passes (False)."""
        while self._commit_locked(last_lsn) < lsn:
            if not leading() or self.term != term:
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
                    read = reader.read(min(left, 0.05))
                finally:
                    self._cond.acquire()
                if read or self._notices != seen:
                    continue
            self._cond.wait(min(left, 0.05))
        self.acked = max(self.acked, lsn)
        return True

    def _bound_lag(self, lsn: int, deadline: float, leading: Callable[[], bool]) -> None:
        if self.max_lag_records <= 0:
            return
        with self._cond:
            term = self.term
            while True:
                now = self._clock()
                behind = [f for f in self.followers.values() if f.last_ack and now - f.last_ack <= self.live_s
                          and lsn - f.persisted_lsn > self.max_lag_records]
                if not behind:
                    return
                if not leading() or self.term != term:
                    raise NotLeader("this replica stopped leading before the step was acknowledged; retry it "
                                    "with the same request id against the new leader")
                left = deadline - now
                if left <= 0:
                    return  # acknowledged; the follower is slow but alive, and the next step waits again
                self._cond.wait(min(left, 0.05))


class Leading(Protocol):
    """What the servicer asks the replica (:class:`blockd.replication.replica.Replica`)."""

    engine: Engine
    tail: LogTail
    commits: Commits
    data_dir: str
    address: str
    stopping: threading.Event
    frames: FramesListener | None  #: the replication port (None: feeds stay on gRPC)

    def leading_term(self) -> int: ...
    def not_leader(self, why: str) -> NotLeader | NoLeader: ...
    def status(self) -> ReplicaStatus: ...


def records_message(term: int, batch: list[tuple[int, int, bytes]], commit_lsn: int) -> rpb.ReplicateLogResponse:
    """A feed's message carrying ``batch`` (``(lsn, term, body)`` each, a crc32 per body)."""
    records = [rpb.LogRecord(lsn=lsn, term=t, body=body, crc32=zlib.crc32(body)) for lsn, t, body in batch]
    return rpb.ReplicateLogResponse(records=rpb.LogRecords(records=records), term=term, commit_lsn=commit_lsn)


def heartbeat_message(term: int, commit_lsn: int) -> rpb.ReplicateLogResponse:
    return rpb.ReplicateLogResponse(heartbeat=rpb.ReplicateHeartbeat(), term=term, commit_lsn=commit_lsn)


class PushedFrames:
    """The frame the last pushed record went out in, for every feed of the leader: the
    pushes of one record (one per follower, one after the other under the engine lock)
    build and serialize it once. A feed that finds another record here builds its own."""

    def __init__(self) -> None:
        self._last: tuple[int, int, bytes] = (0, 0, b"")  #: (term, lsn, frame); replaced whole

    def get(self, term: int, lsn: int, build: Callable[[], bytes]) -> bytes:
        last = self._last
        if last[0] == term and last[1] == lsn:
            return last[2]
        data = build()
        self._last = (term, lsn, data)
        return data


class LinkFeed:
    """The sending side of one feed on the replication port (:mod:`blockd.replication.transport`).

    The step that logs a record pushes it to the socket itself (:meth:`push`,
    a :class:`~blockd.replication.log_tail.LogTail` listener, so under the engine lock,
    before the leader's own fsync), without waiting: a record reaches the
    follower without waking this feed's thread first, a wake that cost a
    sync step about 0.3 ms here. The feed's thread (:meth:`run`) sends
    whatever a push could not: a push skips when the thread is sending (it
    holds the lock), when the socket has no room (the rest of the frame is
    kept, the thread sends it first) and on TLS (``ssl`` cannot send without
    waiting; there the thread sends everything). Every send happens under the
    lock and starts at ``position``, so the follower gets each record once,
    in order.

    While pushes are on (:meth:`attach`), the thread does not wait on the
    tail, whose every record would wake it for nothing (a push has sent it):
    it waits for a push that could not send (``_kick``), the tail's wake (a
    role change) or the heartbeat's time, then reads the tail without waiting.
    In a profile of a sync leader (py-spy, GIL held), waking them, two a step
    with two followers, and their reads were about 10 % of its time.
    """

    def __init__(self, link: Link, term: int, position: int, replica: Leading,
                 pushed: PushedFrames | None = None) -> None:
        self.link, self.term, self.position, self._replica = link, term, position, replica
        self._pushed = pushed or PushedFrames()
        self._lock = threading.Lock()
        self._pending = b""  #: the rest of a frame a push could send only in part
        self._sent = time.monotonic()
        self._pushing = False
        self._kick = threading.Event()  #: the thread has something to send (see the class docstring)
        self._kick.set()  # what the tail held before the first push

    def attach(self) -> None:
        """Push every record the tail gets from now on (a plain-text link only: see the class docstring)."""
        if self.link.records.can_try_send:
            self._pushing = True
            self._replica.tail.listen(self.push, self._kick.set)

    def detach(self) -> None:
        self._replica.tail.unlisten(self.push)
        self._pushing = False
        self._kick.set()

    def push(self, lsn: int, term: int, body: bytes) -> None:
        if not self._lock.acquire(blocking=False):
            self._kick.set()  # the thread is sending; it sends this record too, once it is done
            return
        done = False
        try:
            r = self._replica
            if lsn != self.position or self._pending or r.leading_term() != self.term:
                return
            data = self._pushed.get(self.term, lsn, lambda: frame(
                records_message(self.term, [(lsn, term, body)], r.commits.commit_lsn(lsn))))
            try:
                sent = self.link.records.try_send(data)
            except OSError:
                return  # the thread's next send fails the same way and ends the feed
            self._pending, self.position, self._sent = data[sent:], lsn + 1, time.monotonic()
            done = not self._pending
        finally:
            self._lock.release()
            if not done:  # the thread sends it (the rest of it); set after the release, so it finds the lock free
                self._kick.set()

    def run(self, active: Callable[[], bool],
            snapshot: Callable[[int], Generator[rpb.ReplicateLogResponse, None, int]]) -> None:
        """Send until this replica stops leading ``term`` or not ``active()``."""
        r, out = self._replica, self.link.records
        while r.leading_term() == self.term and active() and not r.stopping.is_set():
            if self._pushing:
                self._kick.wait(HEARTBEAT_S)
                self._kick.clear()  # before the read: a push that fails after it sets it again
                batch = r.tail.read(self.position, 0)
            else:
                batch = r.tail.read(self.position, HEARTBEAT_S)
            with self._lock:
                if self._pending:
                    out.send_bytes(self._pending)
                    self._pending = b""
                if batch is None:  # behind the retained window
                    chunks = snapshot(self.term)
                    while True:
                        try:
                            out.send(next(chunks))
                        except StopIteration as done:
                            self.position = done.value + 1
                            break
                    continue
                batch = [item for item in batch if item[0] >= self.position]  # a push sent the rest
                if batch:
                    out.send(records_message(self.term, batch, r.commits.commit_lsn(r.tail.last_lsn)))
                    self.position, self._sent = batch[-1][0] + 1, time.monotonic()
                elif time.monotonic() - self._sent >= HEARTBEAT_S:
                    out.send(heartbeat_message(self.term, r.commits.commit_lsn(r.tail.last_lsn)))
                    self._sent = time.monotonic()


class ReplicationServicer(rpb_grpc.ReplicationServiceServicer):
    def __init__(self, replica: Leading) -> None:
        self._replica = replica
        self._pushed = PushedFrames()

    @server_stream
    def ReplicateLog(self, request: rpb.ReplicateLogRequest, context) -> Iterator[rpb.ReplicateLogResponse]:
        r = self._replica
        term = r.leading_term()
        if not term:
            raise r.not_leader("only the leader serves its log")
        if request.term > term:
            raise r.not_leader(f"the follower knows term {request.term}, newer than this leader's {term}")
        last, history, _ = r.engine.log_state()
        theirs = TermHistory((t.term, t.first_lsn) for t in request.terms)
        agreed = common_prefix(history, last, theirs, request.from_lsn - 1)
        if agreed < request.from_lsn - 1:
            log.info("replica %s: its log stops agreeing after lsn %d (it has %d): cut", request.replica_id,
                     agreed, request.from_lsn - 1)
            yield rpb.ReplicateLogResponse(truncate=rpb.TruncateTo(lsn=agreed), term=term)
            return
        r.commits.opened(term, request.replica_id, request.address, request.from_lsn - 1, request.log_id)
        frames = r.frames
        if not request.frames or frames is None:
            yield from self._feed(term, request.from_lsn, context.is_active)
            return
        offer = frames.offer()
        yield rpb.ReplicateLogResponse(frames=rpb.FramesOffer(port=offer.port, ticket=offer.ticket), term=term)
        link = offer.wait(CONNECT_S)
        if link is None:
            log.warning("replica %s did not connect to the replication port %d in %g s; it dials again (over "
                        "gRPC if the port stays out of its reach)", request.replica_id, offer.port, CONNECT_S)
            return
        # a follower that stops reading (paused, partitioned) blocks a send at most this long
        link.records.settimeout(FRAMES_SEND_S)
        link.acks.settimeout(FRAMES_SEND_S)
        if link.acks.can_try_send:  # plain text: the steps that wait for them read them (AckReader)
            def ended(err: BaseException | None) -> None:
                self._acks_ended(link, request.replica_id, err)

            frames.acks.add(link.acks, self._ack_frame, ended)
        else:
            threading.Thread(target=self._read_acks, args=(link, request.replica_id), name="repl-acks",
                             daemon=True).start()
        feed = LinkFeed(link, term, request.from_lsn, r, self._pushed)
        feed.attach()
        try:
            feed.run(lambda: context.is_active() and not link.closed, self._snapshot)
        except OSError as err:
            log.info("the feed of replica %s on the replication port ended: %s", request.replica_id, err)
        finally:
            feed.detach()
            frames.acks.remove(link.acks)
            link.close()

    def _feed(self, term: int, position: int, active: Callable[[], bool]) -> Iterator[rpb.ReplicateLogResponse]:
        """A feed's messages from ``position`` on, for as long as this replica leads ``term`` and ``active()``."""
        r, sent = self._replica, time.monotonic()
        while r.leading_term() == term and active() and not r.stopping.is_set():
            batch = r.tail.read(position, HEARTBEAT_S)
            if batch is None:
                lsn = yield from self._snapshot(term)
                position = lsn + 1
                continue
            commit = r.commits.commit_lsn(r.tail.last_lsn)
            if batch:
                yield records_message(term, batch, commit)
                position, sent = batch[-1][0] + 1, time.monotonic()
            elif time.monotonic() - sent >= HEARTBEAT_S:
                yield heartbeat_message(term, commit)
                sent = time.monotonic()

    def _read_acks(self, link: Link, replica_id: str) -> None:
        """A TLS feed's acknowledgements, until it closes; a bad one closes it (the follower dials again)."""
        error: BaseException | None = None
        try:
            while True:
                request = link.acks.receive(rpb.StreamAcksRequest.FromString)
                if request is None:
                    return
                self._ack(request)
        except Exception as err:  # noqa: BLE001 - any failure ends this feed; the follower opens it again
            error = err
        finally:
            self._acks_ended(link, replica_id, error)

    def _ack_frame(self, payload: bytes) -> None:
        self._ack(rpb.StreamAcksRequest.FromString(payload))

    @staticmethod
    def _acks_ended(link: Link, replica_id: str, err: BaseException | None) -> None:
        if err is not None and not link.closed:
            log.info("acknowledgements of replica %s on the replication port ended: %s", replica_id, err)
        link.shutdown()  # the sender notices at its next message (a heartbeat within 0.1 s)

    def _snapshot(self, term: int) -> Generator[rpb.ReplicateLogResponse, None, int]:
        """Stream the newest snapshot file; returns its LSN."""
        r = self._replica
        for _ in range(5):  # a compaction may replace it between the look-up and the open
            _, _, lsn = r.engine.log_state()
            name = next((n for n in os.listdir(r.data_dir) if parse_name(n) == ("snapshot", lsn)), "")
            try:
                f = open(os.path.join(r.data_dir, name), "rb")  # noqa: SIM115 - read in chunks below
            except OSError:
                continue
            with f:
                total, offset, crc = os.fstat(f.fileno()).st_size, 0, 0
                log.info("sending snapshot %s (%d bytes) to a follower behind the retained log", name, total)
                while True:
                    data = f.read(SNAPSHOT_CHUNK)
                    crc = zlib.crc32(data, crc)
                    last = offset + len(data) >= total
                    yield rpb.ReplicateLogResponse(
                        snapshot=rpb.SnapshotChunk(lsn=lsn, name=name, offset=offset, data=data, total_bytes=total,
                                                   file_crc32=crc if last else 0, last=last), term=term)
                    offset += len(data)
                    if last:
                        return lsn
        raise NotReplicated("the leader's snapshot kept changing while it was being sent; the follower retries")

    @unary
    def AckLog(self, request: rpb.AckLogRequest, context) -> rpb.AckLogResponse:
        self._ack(request)
        return rpb.AckLogResponse()

    @client_stream
    def StreamAcks(self, requests: Iterator[rpb.StreamAcksRequest], context) -> rpb.StreamAcksResponse:
        acks = 0
        for request in requests:
            self._ack(request)
            acks += 1
        return rpb.StreamAcksResponse(acks=acks)

    @unary
    def GetReplicaStatus(self, request: rpb.GetReplicaStatusRequest, context) -> rpb.GetReplicaStatusResponse:
        return replica_status_to_proto(self._replica.status())

    def _ack(self, request: rpb.AckLogRequest | rpb.StreamAcksRequest) -> None:
        r = self._replica
        term = r.leading_term()
        if term and request.term < term:  # a feed opened in an older term: the follower opens it again
            raise NotLeader(f"acknowledgement for term {request.term}; this replica leads term {term}: open the "
                            f"feed again", leader_id=r.commits.replica_id, leader_address=r.address, term=term)
        if not term or request.term != term:
            raise r.not_leader(f"acknowledgement for term {request.term}; this replica does not lead it")
        r.commits.ack(term, request.replica_id, request.persisted_lsn)
