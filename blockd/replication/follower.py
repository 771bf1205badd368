"""A follower's side of log replication (``docs/ha.md``): stream, apply, persist, acknowledge.

:class:`FollowerLoop` runs on its own thread while the replica does not
lead. It dials the leader the election last saw, opens ``ReplicateLog`` from
its own last LSN with its term history, and for each message:

* records: checks each body's crc32, appends them to its own log as they
  are, one fsync per batch, acknowledges the last LSN persisted, then
  applies them with the code recovery uses
  (:meth:`blockd.engine.machine.Engine.apply_replicated`); a heartbeat is
  acknowledged too, so an idle, caught-up follower joins the in-sync set.
  Acknowledgements go on the replication port when the leader offered it
  (``FramesOffer``: the feed goes on there, :mod:`blockd.replication.transport`; a
  port out of reach means gRPC for ``FRAMES_OFF_S``), else on the feed's
  ``StreamAcks`` call (:class:`AckStream`; one ``AckLog`` call each to a
  leader that does not serve the stream);
* a truncation: cuts its log after that LSN (a copy kept in quarantine,
  :mod:`blockd.storage.cut`), reloads its engine from disk and opens again;
* snapshot chunks: writes them to ``<name>.tmp`` in its data dir, checks the
  whole file's crc32, makes it the whole log (old files to quarantine) and
  reloads; records from the snapshot's LSN on follow on the same stream.

The stream carries the follower's peer credentials (``--peer-tls-*``,
``--peer-token-file``) when the group serves TLS or tokens.

A message from a term older than the newest this replica knows ends the
stream (a deposed leader's feed). Any failure closes the stream and the loop
dials again after a short pause. A leader that goes away (its connection
reset: killed, partitioned, a normal failover) is a WARNING saying the loop
waits for the next leader, never an ERROR with a traceback.

A watchdog (:class:`FeedWatch`) cancels a feed that cannot end by itself:
one whose leader the election no longer names, or one silent for
``silence_s`` while the follower waits for it (the leader sends a heartbeat
every 0.1 s when idle). A leader that is paused (SIGSTOP, a VM frozen, a
partition that drops packets) keeps its TCP connection open and sends
nothing; without the watchdog the follower waited on it for ever, and a new
leader that needs it in the in-sync set could not commit its first record.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import cast

import grpc

from blockd.auth.channels import open_channel
from blockd.auth.config import TlsConfig
from blockd.engine.machine import Engine
from blockd.replication.framing import Link
from blockd.replication.transport import connect
from blockd.storage.cut import CannotTruncate
from blockd.v1 import replication_pb2 as rpb
from blockd.v1 import replication_pb2_grpc as rpb_grpc

log = logging.getLogger("blockd.replication")

RETRY_S = 0.2
ACK_TIMEOUT_S = 2.0
#: a feed silent this long while the follower waits is given up (heartbeats come every 0.1 s)
SILENCE_S = 2.0
WATCH_S = 0.1
#: a follower that cannot reach its leader's replication port follows over gRPC this long
FRAMES_OFF_S = 60.0
#: a snapshot being received (not ".tmp": the compactor removes those)
INCOMING = ".incoming"
#: a leader heard from within this long (its heartbeats come every 0.1 s) is alive: the follower's
#: election skips reading the leader key (:meth:`FollowerLoop.heard_from`)
HEARD_S = 0.3


class AckStream:
    """One feed's acknowledgements, sent on one ``StreamAcks`` call.

    A call per acknowledgement cost the leader about 0.2 ms of CPU and the
    follower 0.14 ms (loopback, this machine's Python gRPC); a message on an
    open stream costs about a quarter of that, and sync mode acknowledges
    every step. Acknowledgements are cumulative, so when several queue up
    behind a slow send only the newest goes. Once the call has ended,
    :meth:`send` raises its error (the feed is opened again), except
    UNIMPLEMENTED: a leader that does not serve the stream gets one
    ``AckLog`` call each, as before.
    """

    def __init__(self, stub: rpb_grpc.ReplicationServiceStub) -> None:
        self._stub = stub
        self._queue: queue.SimpleQueue[rpb.StreamAcksRequest | None] = queue.SimpleQueue()
        self._call = stub.StreamAcks.future(self._requests())
        self._unary = False
        #: closed by this side: cancel() does nothing to a call already ended (an older leader's
        #: UNIMPLEMENTED), so without this flag a closed stream went on sending as AckLog calls
        self._closed = False

    def _requests(self) -> Iterator[rpb.StreamAcksRequest]:
        while True:
            latest = self._queue.get()
            while latest is not None and not self._queue.empty():
                latest = self._queue.get_nowait()
            if latest is None:
                return
            yield latest

    def send(self, replica_id: str, term: int, persisted_lsn: int) -> None:
        if self._closed:
            raise ConnectionError("this feed's acknowledgement stream is closed")
        if not self._unary and self._call.done():
            if self._call.cancelled():
                raise ConnectionError("this feed's acknowledgement stream is closed")
            err = self._call.exception()
            if not isinstance(err, grpc.RpcError) or err.code() != grpc.StatusCode.UNIMPLEMENTED:
                if isinstance(err, grpc.RpcError):
                    raise err
                raise ConnectionError("the leader ended the acknowledgement stream")
            self._unary = True
        if self._unary:
            self._stub.AckLog(rpb.AckLogRequest(replica_id=replica_id, term=term, persisted_lsn=persisted_lsn),
                              timeout=ACK_TIMEOUT_S)
        else:
            self._queue.put(rpb.StreamAcksRequest(replica_id=replica_id, term=term, persisted_lsn=persisted_lsn))

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._call.cancel()


class FeedWatch:
    """Cancels one feed's call once ``leader()`` names another address than
    ``target``, or once the follower has waited ``silence_s`` for a message.
    The time the follower spends applying a message does not count."""

    def __init__(self, call: grpc.Call, target: str, leader: Callable[[], str], silence_s: float) -> None:
        self._call, self._target, self._leader, self._silence_s = call, target, leader, silence_s
        self._feed = cast(Iterator[rpb.ReplicateLogResponse], call)  # a unary-stream call iterates
        self._waiting_since: float | None = time.monotonic()
        self._done = threading.Event()
        self.why = ""  #: why it cancelled the call ("" if it did not)
        self._also: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name="feed-watch", daemon=True)
        self._thread.start()

    def messages(self) -> Iterator[rpb.ReplicateLogResponse]:
        """The call's messages, the waits between them watched; a cancel by
        this watch ends them with :class:`_GaveUp`."""
        while True:
            self._waiting_since = time.monotonic()
            try:
                msg = next(self._feed)
            except StopIteration:
                return
            except grpc.RpcError as err:
                if self.why and err.code() == grpc.StatusCode.CANCELLED:
                    raise _GaveUp(self.why) from None
                raise
            self._waiting_since = None  # applying it is not the leader's silence
            yield msg

    def also_cancel(self, cancel: Callable[[], None]) -> None:
        """Run ``cancel`` too when this watch cancels the call (at once if it already has)."""
        self._also.append(cancel)
        if self.why:
            cancel()

    def close(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(WATCH_S):
            named = self._leader()
            since = self._waiting_since
            if named and named != self._target:
                self.why = f"the election names another leader ({named})"
            elif since is not None and time.monotonic() - since > self._silence_s:
                self.why = f"nothing arrived for {self._silence_s:g} s (the leader sends a heartbeat every 0.1 s)"
            else:
                continue
            self._call.cancel()
            for cancel in list(self._also):
                cancel()
            return


class Repeats:
    """Whether a feed ended the same way as the one before: a leader that is
    gone refuses every ``RETRY_S`` until the election names the next one, so
    the first such end is logged at INFO and the same end again at DEBUG."""

    def __init__(self) -> None:
        self._last: tuple[str, str] | None = None

    def level(self, target: str, why: str) -> int:
        repeated = self._last == (target, why)
        self._last = (target, why)
        return logging.DEBUG if repeated else logging.INFO


class FollowerLoop:
    """Follows whichever replica ``leader()`` names while ``following()``; see the module docstring."""

    def __init__(self, replica_id: str, address: str, engine: Engine, data_dir: str,
                 leader: Callable[[], str], following: Callable[[], bool], known_term: Callable[[], int],
                 saw_term: Callable[[int], None], progress: Callable[[int], None], log_id: str = "",
                 tls: TlsConfig | None = None, token: str | None = None, silence_s: float = SILENCE_S,
                 frames: bool = False) -> None:
        self.replica_id, self.address, self.engine, self.data_dir = replica_id, address, engine, data_dir
        self.silence_s = silence_s
        self.frames = frames  #: ask for the framed socket (:mod:`blockd.replication.transport`)
        self._frames_off_until = 0.0  #: after a failed connect: gRPC only until then
        self._conn: Link | None = None
        self.log_id, self._tls, self._token = log_id, tls, token
        self._leader, self._following, self._known_term, self._saw_term = leader, following, known_term, saw_term
        self._progress = progress
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._call: grpc.Call | None = None
        # read by the metrics (blockd.replication.metrics) at scrape time; plain values, written by this loop only
        self.streaming = False  #: a feed from the leader is open and has delivered a message
        self._ends = Repeats()
        self._heard = (0, 0.0)  #: (term, monotonic time) of the last message taken from a leader
        self.leader_commit_lsn = 0  #: the leader's commit point in its last message
        self.snapshots_installed = self.truncations = 0

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"follow-{self.replica_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        call, conn = self._call, self._conn
        if call is not None:
            call.cancel()
        if conn is not None:
            conn.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set() and self._following():
            target = self._leader()
            if not target or target == self.address:
                self._stop.wait(RETRY_S)
                continue
            try:
                self._follow(target)
            except grpc.RpcError as err:
                if not self._stop.is_set():
                    why = f"{err.code()} {err.details()}"
                    log.log(self._ends.level(target, why), "replication from %s ended: %s", target, why)
            except _GaveUp as err:
                if not self._stop.is_set():
                    log.warning("replication from %s given up: %s; dialling the leader again", target, err)
            except ConnectionError as err:
                # the leader's replication socket reset or closed mid-frame: what a leader killed or
                # partitioned away does in a normal failover. Nothing was half-applied (a record is
                # applied only once read whole), so no reload; the election names the next leader.
                if not self._stop.is_set():
                    log.warning("lost the leader %s (%s: %s); waiting for the next leader the election names, "
                                "then following it", target, type(err).__name__, err)
            except Exception:  # the loop must survive and retry; the log has the details
                log.exception("replication from %s failed; reloading from disk and retrying", target)
                self.engine.reload()
            self._stop.wait(RETRY_S)

    def _follow(self, target: str) -> None:
        last, history, _ = self.engine.log_state()
        frames = self.frames and time.monotonic() >= self._frames_off_until
        request = rpb.ReplicateLogRequest(replica_id=self.replica_id, term=self._known_term(), from_lsn=last + 1,
                                          terms=[rpb.TermRun(term=t, first_lsn=f) for t, f in history.runs()],
                                          address=self.address, log_id=self.log_id, frames=frames)
        # the leader checks the stream like any call (the replicate permission)
        with open_channel(target, self._tls, self._token) as channel:
            stub = rpb_grpc.ReplicationServiceStub(channel)
            self._call = call = stub.ReplicateLog(request)
            watch = FeedWatch(call, target, self._leader, self.silence_s)
            acks: AckStream | None = None
            snapshot: list[rpb.SnapshotChunk] = []

            def ack(term: int, lsn: int) -> None:
                nonlocal acks
                if acks is None:  # opened on the first one: a feed moved to the socket needs none
                    acks = AckStream(stub)
                acks.send(self.replica_id, term, lsn)

            try:
                for msg in watch.messages():
                    if not self._accept(target, msg):
                        return
                    if msg.WhichOneof("kind") == "frames":
                        self._follow_frames(target, msg.frames, watch, snapshot)
                        return
                    if not self._handle(ack, msg, snapshot):
                        return
            finally:
                watch.close()
                self.streaming = False
                if acks is not None:
                    acks.close()
                call.cancel()
                self._call = None

    def _follow_frames(self, target: str, offer: rpb.FramesOffer, watch: FeedWatch,
                       snapshot: list[rpb.SnapshotChunk]) -> None:
        """The rest of the feed on the leader's replication port (:mod:`blockd.replication.transport`)."""
        try:
            link = connect(target, offer.port, offer.ticket, self._tls)
        except OSError as err:  # ssl.SSLError included
            self._frames_off_until = time.monotonic() + FRAMES_OFF_S
            log.warning("cannot reach the leader's replication port %s:%d (%s); following over gRPC for %g s",
                        target, offer.port, err, FRAMES_OFF_S)
            return
        self._conn = link
        log.info("replica %s follows %s on its replication port %d%s", self.replica_id, target, offer.port,
                 " (TLS)" if self._tls is not None else "")
        watch.also_cancel(link.shutdown)  # another leader named: wake the read below
        link.records.settimeout(self.silence_s)  # the leader sends a heartbeat every 0.1 s
        link.acks.settimeout(self.silence_s)

        def ack(term: int, lsn: int) -> None:
            link.acks.send(rpb.StreamAcksRequest(replica_id=self.replica_id, term=term, persisted_lsn=lsn))

        try:
            while True:
                try:
                    msg = link.records.receive(rpb.ReplicateLogResponse.FromString)
                except TimeoutError:
                    raise _GaveUp(f"nothing arrived on the replication port for {self.silence_s:g} s (the leader "
                                  f"sends a heartbeat every 0.1 s)") from None
                if watch.why:
                    raise _GaveUp(watch.why)
                if msg is None or not self._accept(target, msg) or not self._handle(ack, msg, snapshot):
                    return
        finally:
            self._conn = None
            link.close()

    def _accept(self, target: str, msg: rpb.ReplicateLogResponse) -> bool:
        """Whether to take ``msg`` (this replica still follows; not a deposed leader's term)."""
        if self._stop.is_set() or not self._following():
            return False
        if msg.term < self._known_term():
            log.warning("%s streams term %d, older than term %d: not following it", target, msg.term,
                        self._known_term())
            return False
        self._saw_term(msg.term)
        self.streaming, self.leader_commit_lsn = True, msg.commit_lsn
        self._heard = (msg.term, time.monotonic())
        return True

    def heard_from(self, term: int) -> bool:
        """Whether the leader of ``term`` sent this replica a message within ``HEARD_S``."""
        heard_term, at = self._heard
        return heard_term == term and time.monotonic() - at < HEARD_S

    def _handle(self, ack: Callable[[int, int], None], msg: rpb.ReplicateLogResponse,
                snapshot: list[rpb.SnapshotChunk]) -> bool:
        """Apply one message and acknowledge it with ``ack(term, persisted_lsn)``; False when the
        stream must be opened again."""
        kind = msg.WhichOneof("kind")
        if kind == "records":
            frames = []
            for r in msg.records.records:
                if zlib.crc32(r.body) != r.crc32:
                    raise ValueError(f"record lsn {r.lsn} arrived damaged (crc32 mismatch)")
                frames.append((r.lsn, r.term, r.body))
            failed: list[Exception] = []

            def acknowledge(lsn: int) -> None:
                try:
                    ack(msg.term, lsn)
                except Exception as err:  # noqa: BLE001 - raised below: the records must be applied first
                    failed.append(err)

            persisted = self.engine.apply_replicated(frames, self._following, acknowledge)
            self._progress(persisted)
            if failed:
                raise failed[0]
            return True
        if kind == "truncate":
            lsn = msg.truncate.lsn
            self.truncations += 1
            try:
                self.engine.reload(lambda d: d.cut_after(lsn, f"the leader of term {msg.term} does not hold the "
                                                              f"records after lsn {lsn}"))
            except CannotTruncate as err:
                log.error("cannot follow the leader: %s; replace this replica's data dir", err)
                self._stop.wait(5)
            return False
        if kind == "snapshot":
            snapshot.append(msg.snapshot)
            if not msg.snapshot.last:
                return True
            self._install(snapshot, msg.term)
            self.snapshots_installed += 1
            snapshot.clear()
        persisted = self.engine.log_state()[0]
        ack(msg.term, persisted)
        self._progress(persisted)
        return True

    def _install(self, chunks: list[rpb.SnapshotChunk], term: int) -> None:
        last = chunks[-1]
        data = b"".join(c.data for c in chunks)
        if len(data) != last.total_bytes or zlib.crc32(data) != last.file_crc32 or "/" in last.name:
            raise ValueError(f"the leader's snapshot {last.name!r} arrived damaged or incomplete")
        path = os.path.join(self.data_dir, last.name + INCOMING)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        why = f"this replica was behind the log the leader of term {term} retains; it sent snapshot lsn {last.lsn}"
        self.engine.reload(lambda d: d.replace_with_snapshot(path, last.name, why))
        log.info("installed the leader's snapshot %s (lsn %d, %d bytes)", last.name, last.lsn, len(data))


class _GaveUp(Exception):
    """The watchdog cancelled the feed (:class:`FeedWatch`)."""
