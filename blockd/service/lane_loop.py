"""The step lane's loop: every lane connection served on one thread.

Why one thread: with a thread per connection, schedulers' steps handed the
GIL to each other at every read and write (16 futex calls and 8 context
switches a step with four schedulers, against one with one). The loop waits
for any connection (epoll), reads what each ready one has sent, and answers
its steps one after the other (the engine lock and the GIL serialise them
anyway). Their answers are held back from the wait for durability
(:meth:`blockd.engine.durability.Acknowledgements.hold`) and waited for once
per connection: here when this is the only connection (no thread handoff),
else behind the loop while it answers the next ones, and the next fsync
covers whatever came meanwhile (group commit). Only then are they written.
So durable throughput grows with the schedulers.

Behind the loop means, with a log and no replication
(``Engine.syncs_behind``), a :class:`blockd.storage.fsyncer.Fsyncer`: a
thread (in C where it was compiled) that never takes the GIL and says what
it synced on a pipe this loop polls with its connections. With four durable
schedulers on the 2-core VM that took durable steps/s from 1.4-1.6x one
scheduler's to 1.7-2.0x (``docs/benchmarks.md``): a Python thread there made
the loop give up the GIL and wait for it back at every handover. With
replication (whose commit waits for the followers) it is the syncer, a
Python thread.

What stays as it was: each connection runs the very StepStream handler, one
request in and one answer out, in order; an answer never leaves before the
records it depends on are durable and committed; a refusal of that wait (a
failed fsync, NOT_LEADER) is every held answer's refusal.

Bounds, so that no caller stalls the others: sockets are non-blocking (a
caller that sends half a frame, or reads no answers, holds only its own
buffers); at most :data:`ROUND_FRAMES` of one connection's requests a round;
a connection whose unsent answers pass :data:`MAX_UNSENT_BYTES` is not read
until they drain. Set-up (TLS handshake, hello) and the end of a connection
(its last answers, the linger) run on short-lived threads of
:class:`blockd.service.lane.StepLane`, never here.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

import grpc

from blockd.engine.durability import Held
from blockd.rpc.lane import frame
from blockd.service.lane_conn import WOULD_BLOCK, Aborted, Conn, status_of
from blockd.storage.fsyncer import Fsyncer
from blockd.threads import name_os_thread
from blockd.v1 import blockd_pb2 as pb

log = logging.getLogger("blockd.lane")

#: a connection's requests answered in one round at most (the others wait for the next)
ROUND_FRAMES = 8
#: a connection's unsent answers past which it is not read until they drain
MAX_UNSENT_BYTES = 8 << 20
_CHUNK = 1 << 18
#: what makes a connection worth reading: bytes, its end, an error (recv says which)
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP


class _Batch:
    """One connection's answers of a round, in order: ``(conn, answer, frame)``, an answer
    held for the batch's acknowledgement, or the connection's last frame (an abort, a cut)."""

    __slots__ = ("entries", "error", "lsn", "term")

    def __init__(self, lsn: int, entries: list[tuple[Conn, Any, bytes]]) -> None:
        self.lsn, self.entries = lsn, entries
        self.term = 0
        self.error: BaseException | None = None


class LaneLoop:
    """The thread that serves every adopted :class:`Conn`, and the syncer that
    waits for durability for it. ``hold()``, ``waits(lsn)`` and
    ``acknowledge(lsn)``: the engine's (:class:`blockd.engine.durability.Acknowledgements`);
    ``behind``: its ``(acknowledge_behind, acknowledged_behind)`` where it
    ``syncs_behind`` (the waits then go to an :class:`Fsyncer`), else None;
    ``refused(err)``: a StepStream refusal's answer; ``release(conn)``: the
    connection's end (on another thread: it may block). Batches are
    acknowledged in order, so a connection's answers leave in order."""

    def __init__(self, hold: Callable[[], Held | None], waits: Callable[[int], bool],
                 acknowledge: Callable[[int], int], refused: Callable[[BaseException], Any],
                 serialize: Callable[[Any], bytes], release: Callable[[Conn], None],
                 behind: tuple[Callable[[int, Fsyncer], bool], Callable[[int, int, float], None]] | None = None
                 ) -> None:
        self._hold, self._waits, self._acknowledge = hold, waits, acknowledge
        self._behind_ops = behind
        self._fsyncer: Fsyncer | None = None
        self._fsyncer_fd = -1
        #: batches whose wait is the fsyncer's, in LSN order
        self._behind: collections.deque[_Batch] = collections.deque()
        self._refused, self._serialize, self._release = refused, serialize, release
        # epoll itself, not the selectors module: its key objects cost a few us a round
        self._poll = select.epoll()
        self._fds: dict[int, Conn] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll.register(self._wake_r, select.EPOLLIN)
        self._adopted: collections.deque[Conn] = collections.deque()
        self._conns: set[Conn] = set()
        self._again: list[Conn] = []  # connections to serve next round whatever the selector says
        self._scratch = memoryview(bytearray(_CHUNK))
        self._to_sync: collections.deque[_Batch] = collections.deque()
        self._synced: collections.deque[_Batch] = collections.deque()
        self._syncing = 0  # batches handed to the syncer and not delivered yet
        self._sync_cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="blockd-lane", daemon=True)
        self._syncer = threading.Thread(target=self._sync, name="blockd-lane-sync", daemon=True)

    def start(self) -> None:
        if self._behind_ops is not None:
            self._fsyncer = Fsyncer()
            self._fsyncer_fd = self._fsyncer.fileno()
            self._poll.register(self._fsyncer_fd, select.EPOLLIN)
        self._thread.start()
        self._syncer.start()

    def adopt(self, conn: Conn) -> None:
        """Serve ``conn`` from now on (from any thread)."""
        conn.sock.setblocking(False)
        self._adopted.append(conn)
        self._wake()

    def stop(self) -> None:
        """End every connection and both threads."""
        self._stopping = True
        with self._sync_cv:
            self._sync_cv.notify()
        self._wake()
        self._thread.join(timeout=5)
        self._syncer.join(timeout=5)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: it wakes anyway
            os.write(self._wake_w, b"\0")

    # --- the syncer --------------------------------------------------------------------------
    def _sync(self) -> None:
        name_os_thread("blockd-lane-sync")
        cv, queue = self._sync_cv, self._to_sync
        while True:
            with cv:
                while not queue and not self._stopping:
                    cv.wait()
                if self._stopping:
                    return
                batches = list(queue)
                queue.clear()
            last = max(batches, key=lambda batch: batch.lsn)
            self._acknowledged(last)
            for batch in batches:
                batch.term, batch.error = last.term, last.error
                self._synced.append(batch)
            self._wake()

    def _acknowledged(self, batch: _Batch) -> None:
        """Wait until what ``batch`` answers is durable and committed (or say why not)."""
        try:
            if self._waits(batch.lsn):
                batch.term = self._acknowledge(batch.lsn)
        except Exception as err:  # noqa: BLE001 - the wait failed: every held answer is refused
            batch.error = err

    # --- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread("blockd-lane")
        try:
            while not self._stopping:
                self._round()
        except Exception:  # a fault of ours: logged; the connections end, the daemon serves on
            log.exception("the step lane's loop failed; its connections are closed (the SDK steps over gRPC)")
        finally:
            for conn in list(self._conns):
                conn.context.active = False
                conn.inflight = 0
                self._drop(conn)
            while self._adopted:
                self._drop(self._adopted.popleft())
            self._behind.clear()
            if self._fsyncer is not None:
                self._fsyncer.close()
            self._poll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _round(self) -> None:
        """Wait for any connection (or the syncer, or a new connection); serve what is ready."""
        ready, self._again = self._again, []
        for fd, mask in self._poll.poll(0 if ready else -1):
            conn = self._fds.get(fd)
            if conn is None and fd == self._fsyncer_fd:
                self._synced_behind()
                continue
            if conn is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                while self._adopted:
                    self._watch(self._adopted.popleft())
                continue
            if mask & select.EPOLLOUT:
                self._flush(conn)
            if mask & _READABLE and conn not in ready:
                ready.append(conn)
        self._delivered()
        ready = [conn for conn in ready if conn in self._conns]
        scratch = self._scratch
        for conn in ready:
            conn.receive(scratch)
        for conn in ready:
            # one connection's answers at a time: the syncer starts on its fsync while the
            # next connection's steps run, and answers leave as soon as they are durable
            entries: list[tuple[Conn, Any, bytes]] = []
            held = self._hold()
            try:
                self._answer(conn, entries)
            finally:
                lsn = held.release() if held is not None else 0
            if entries:
                self._settle(_Batch(lsn, entries), held is not None)
            self._delivered()
        for conn in ready:
            self._flush(conn)

    def _delivered(self) -> None:
        """Deliver what the syncer has acknowledged (or refused) since the last look."""
        while self._synced:
            self._syncing -= 1
            self._deliver(self._synced.popleft())

    def _settle(self, batch: _Batch, held: bool) -> None:
        """Deliver ``batch`` now, after waiting here, or once the syncer has waited for it."""
        for conn, _, _ in batch.entries:
            conn.inflight += 1
        if not held:  # nothing waits (no log, no replication): the answers leave now
            self._deliver(batch, flush=False)
        elif self._fsyncer is not None and (self._behind or (len(self._conns) > 1 and self._waits(batch.lsn))):
            self._sync_behind(batch)
        elif self._syncing or (len(self._conns) > 1 and self._waits(batch.lsn)):
            # behind batches in the syncer (in order), or others may send while the disk writes
            self._syncing += 1
            with self._sync_cv:
                self._to_sync.append(batch)
                self._sync_cv.notify()
        else:  # one connection (it waits for this answer) or no wait: here costs no thread handoff
            self._acknowledged(batch)
            self._deliver(batch, flush=False)

    def _sync_behind(self, batch: _Batch) -> None:
        """Hand ``batch``'s wait to the fsyncer; it is delivered, in order, once
        :meth:`_synced_behind` finds it durable (or refused)."""
        assert self._fsyncer is not None and self._behind_ops is not None, "the loop syncs behind"
        try:
            self._behind_ops[0](batch.lsn, self._fsyncer)
        except Exception as err:  # noqa: BLE001 - a broken log: this batch's answers are refused
            batch.error = err
        self._behind.append(batch)
        self._release_behind()

    def _synced_behind(self) -> None:
        """Take what the fsyncer says; deliver the batches it made durable (or every one, refused, when it failed)."""
        assert self._fsyncer is not None and self._behind_ops is not None, "the loop syncs behind"
        try:
            for lsn, error, seconds in self._fsyncer.done():
                self._behind_ops[1](lsn, error, seconds)
        except Exception as err:  # noqa: BLE001 - the fsync failed (the log is broken): none may leave
            for batch in self._behind:
                if batch.error is None:
                    batch.error = err
        self._release_behind()

    def _release_behind(self) -> None:
        behind, waits = self._behind, self._waits
        while behind and (behind[0].error is not None or not waits(behind[0].lsn)):
            self._deliver(behind.popleft())

    def _deliver(self, batch: _Batch, flush: bool = True) -> None:
        """Write a batch acknowledged (or refused) into its connections' buffers;
        ``flush``: and write them out (not when the round does next)."""
        serialize, refusal, term = self._serialize, None, batch.term
        if batch.error is not None:
            refusal = serialize(self._refused(batch.error))
        touched: list[Conn] = []
        for conn, answer, raw in batch.entries:
            conn.inflight -= 1
            if answer is None:
                conn.out += raw
            elif refusal is not None:
                conn.out += frame(refusal)
            else:
                if term and answer.HasField("response"):
                    answer.response.term = term
                conn.out += frame(serialize(answer))
            if flush and (not touched or touched[-1] is not conn):
                touched.append(conn)
        for conn in touched:
            if conn in self._conns:
                self._flush(conn)

    def _answer(self, conn: Conn, entries: list[tuple[Conn, Any, bytes]]) -> None:
        """Answer up to ROUND_FRAMES of ``conn``'s requests; end its call when it is over."""
        if conn.last:
            return
        for _ in range(ROUND_FRAMES):
            if not conn.payloads or len(conn.out) > MAX_UNSENT_BYTES:
                break
            try:
                entries.append((conn, conn.next_answer(), b""))
            except StopIteration:
                conn.ended = conn.last = True
                return
            except Aborted as aborted:
                entries.append((conn, None, frame(pb.StepStreamResponse(error_status=aborted.status)
                                                  .SerializeToString())))
                conn.last = True
                conn.finish_call()
                return
            except Exception:  # a fault of ours: logged, the connection closed, the loop serves on
                log.exception("step lane connection from %s failed", conn.peer)
                conn.last = True
                conn.finish_call()
                return
        if (conn.eof or conn.cut) and not conn.payloads:
            conn.finish_call()
            conn.last = True
            if conn.cut:  # gRPC's answer to a message over its limit, and the connection cannot go on
                entries.append((conn, None, frame(pb.StepStreamResponse(error_status=status_of(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, conn.cut)).SerializeToString())))

    def _flush(self, conn: Conn) -> None:
        """Write what ``conn`` can take now; then watch it for what it needs next."""
        out = conn.out
        while out:
            try:
                sent = conn.sock.send(out)
            except WOULD_BLOCK:
                break
            except OSError as err:
                log.debug("step lane connection from %s ended: %s", conn.peer, err)
                conn.context.active = False
                out.clear()
                if not conn.last:
                    conn.finish_call()
                    conn.last = True
                break
            del out[:sent]
        if conn.last:
            if not conn.inflight:  # the rest is written, blocking, by the connection's end on a thread of its own
                self._drop(conn)
            else:
                self._interest(conn, select.EPOLLOUT if out else 0)
            return
        room = len(out) <= MAX_UNSENT_BYTES
        self._interest(conn, (select.EPOLLOUT if out else 0) | (select.EPOLLIN if room else 0))
        if room and conn.payloads and conn not in self._again:
            self._again.append(conn)  # requests left over from a full round: answered next round

    def _watch(self, conn: Conn) -> None:
        if self._stopping:
            self._release(conn)
            return
        self._conns.add(conn)
        self._interest(conn, select.EPOLLIN)
        self._again.append(conn)  # bytes that came behind the hello are read already (TLS: decrypted)

    def _interest(self, conn: Conn, want: int) -> None:
        if want == conn.interest:
            return
        if conn.interest == 0:
            self._poll.register(conn.fd, want)
            self._fds[conn.fd] = conn
        elif want == 0:
            self._poll.unregister(conn.fd)
            del self._fds[conn.fd]
        else:
            self._poll.modify(conn.fd, want)
        conn.interest = want

    def _drop(self, conn: Conn) -> None:
        """``conn`` leaves the loop; its end (the rest of its answers, the linger) is the lane's."""
        if conn.released:
            return
        conn.released = True
        if conn.interest:
            self._fds.pop(conn.fd, None)
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._poll.unregister(conn.fd)
            conn.interest = 0
        self._conns.discard(conn)
        if not conn.ended:
            conn.finish_call()
        self._release(conn)
