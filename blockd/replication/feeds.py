"""What the leader sends a follower (``docs/ha.md`` 2.3): records, heartbeats, snapshots, on either transport.

A feed starts at the LSN the follower asked for and sends, for as long as
this replica leads the feed's term, the records as they are logged (read
from the retained window, :class:`blockd.replication.log_tail.LogTail`), a
heartbeat when idle for ``HEARTBEAT_S``, and the newest snapshot file when
the follower is behind the window (:func:`snapshot_messages`). Every message
carries the term and the commit point, so a follower learns what it may
report as committed.

Two senders, one per transport: :func:`grpc_feed` yields the messages on
the ``ReplicateLog`` stream; :class:`LinkFeed` sends them on the replication
port (:mod:`blockd.replication.transport`), where the logging step pushes
each record itself. Where the follower's acknowledgements go is
:mod:`blockd.replication.acks`; how a feed is opened is
:mod:`blockd.replication.servicer`. No etcd here, and no gRPC but the
messages' types.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Generator, Iterator
from typing import Protocol

from blockd.core.errors import NotReplicated
from blockd.engine.machine import Engine
from blockd.replication.commits import Commits
from blockd.replication.framing import Link, frame
from blockd.replication.log_tail import LogTail
from blockd.storage.wal import parse_name
from blockd.v1 import replication_pb2 as rpb

log = logging.getLogger("blockd.replication")

HEARTBEAT_S = 0.1
SNAPSHOT_CHUNK = 1 << 20

#: a feed's snapshot stream; it returns the snapshot's LSN
Snapshot = Generator[rpb.ReplicateLogResponse, None, int]


class FeedSource(Protocol):
    """What a feed reads of its replica (:class:`blockd.replication.replica.Replica`)."""

    engine: Engine
    tail: LogTail
    commits: Commits
    data_dir: str
    stopping: threading.Event

    def leading_term(self) -> int: ...


def records_message(term: int, batch: list[tuple[int, int, bytes]], commit_lsn: int) -> rpb.ReplicateLogResponse:
    """A feed's message carrying ``batch`` (``(lsn, term, body)`` each, a crc32 per body)."""
    records = [rpb.LogRecord(lsn=lsn, term=t, body=body, crc32=zlib.crc32(body)) for lsn, t, body in batch]
    return rpb.ReplicateLogResponse(records=rpb.LogRecords(records=records), term=term, commit_lsn=commit_lsn)


def heartbeat_message(term: int, commit_lsn: int) -> rpb.ReplicateLogResponse:
    return rpb.ReplicateLogResponse(heartbeat=rpb.ReplicateHeartbeat(), term=term, commit_lsn=commit_lsn)


def snapshot_messages(replica: FeedSource, term: int) -> Snapshot:
    """Stream the newest snapshot file in chunks (the last one with the file's crc32); returns its LSN."""
    for _ in range(5):  # a compaction may replace it between the look-up and the open
        _, _, lsn = replica.engine.log_state()
        name = next((n for n in os.listdir(replica.data_dir) if parse_name(n) == ("snapshot", lsn)), "")
        try:
            f = open(os.path.join(replica.data_dir, name), "rb")  # noqa: SIM115 - read in chunks below
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


def grpc_feed(replica: FeedSource, term: int, position: int,
              active: Callable[[], bool]) -> Iterator[rpb.ReplicateLogResponse]:
    """A feed's messages from ``position`` on, for as long as ``replica`` leads ``term`` and ``active()``."""
    r, sent = replica, time.monotonic()
    while r.leading_term() == term and active() and not r.stopping.is_set():
        batch = r.tail.read(position, HEARTBEAT_S)
        if batch is None:
            lsn = yield from snapshot_messages(r, term)
            position = lsn + 1
            continue
        commit = r.commits.commit_lsn(r.tail.last_lsn)
        if batch:
            yield records_message(term, batch, commit)
            position, sent = batch[-1][0] + 1, time.monotonic()
        elif time.monotonic() - sent >= HEARTBEAT_S:
            yield heartbeat_message(term, commit)
            sent = time.monotonic()


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

    def __init__(self, link: Link, term: int, position: int, replica: FeedSource,
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

    def run(self, active: Callable[[], bool], snapshot: Callable[[int], Snapshot]) -> None:
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
