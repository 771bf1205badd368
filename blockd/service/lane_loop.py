"""The step lane's loop: every lane connection served on one thread.

Why one thread: with a thread per connection, schedulers' steps handed the
GIL to each other at every read and write (16 futex calls and 8 context
switches a step with four schedulers, against one with one). The loop waits
for any connection (epoll), reads what each ready one has sent, and answers
its steps one after the other (the engine lock and the GIL serialise them
anyway). Their answers are held back from the wait for durability
(:meth:`blockd.engine.durability.Acknowledgements.hold`) and waited for once
per connection: here when this is the only connection (no thread handoff),
else by the syncer thread while the loop answers the next ones; its next
fsync covers whatever came meanwhile (group commit). Only then are they
written. So durable throughput grows with the schedulers.

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
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from google.rpc import status_pb2

from blockd.engine.durability import Held
from blockd.rpc.lane import frame
from blockd.v1 import blockd_pb2 as pb

log = logging.getLogger("blockd.lane")

#: a connection's requests answered in one round at most (the others wait for the next)
ROUND_FRAMES = 8
#: a connection's unsent answers past which it is not read until they drain
MAX_UNSENT_BYTES = 8 << 20
_CHUNK = 1 << 18
#: what makes a connection worth reading: bytes, its end, an error (recv says which)
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def status_of(code: grpc.StatusCode, details: str, trailing: Sequence = ()) -> bytes:
    """A refusal's ``google.rpc.Status`` bytes (the details an interceptor attached, when it did)."""
    for key, value in trailing or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            return value
    return status_pb2.Status(code=code.value[0], message=details or "").SerializeToString()


class Aborted(Exception):
    """An interceptor or handler aborted the call: ``status`` is the refusal's bytes."""

    def __init__(self, status: bytes) -> None:
        super().__init__("aborted")
        self.status = status


class Conn:
    """One lane connection in the loop: its buffers and its call."""

    def __init__(self, sock: socket.socket, raw: socket.socket, peer: str, context: Any,
                 call: Callable[[Iterator[Any]], Iterator[Any]], parse: Callable[[bytes], Any],
                 max_bytes: int) -> None:
        self.sock, self.raw, self.peer, self.context = sock, raw, peer, context
        self._call, self._parse, self.max_bytes = call, parse, max_bytes
        self.fd = sock.fileno()
        self.inbuf = bytearray()
        self.out = bytearray()
        self.payloads: collections.deque[bytes] = collections.deque()
        self.answers: Iterator[Any] | None = None
        self.ended = False  # no request will come any more (the caller's end, a cut, the lane's stop)
        self.eof = False
        self.cut: str = ""  # a frame over the limit: the refusal, once the answers before it are out
        self.inflight = 0  # its answers in batches not delivered yet
        self.released = False  # the loop is done with it (its end is the lane's)
        self.last = False  # the call is over: write what is left, then hand the socket back
        self.interest = 0

    def requests(self) -> Iterator[Any]:
        """The call's request stream: a request is asked for only after its
        frame arrived (answer_each asks for one per answer)."""
        while True:
            if self.payloads:
                yield self._parse(self.payloads.popleft())
            elif self.ended:
                return
            else:
                raise RuntimeError("the StepStream handler asked for a request before answering the last")

    def receive(self, scratch: memoryview) -> None:
        """Read what the socket holds now into complete frames (``payloads``);
        ``scratch``: the loop's read buffer (a fresh one a read would cost an mmap)."""
        sock, buf, room = self.sock, self.inbuf, len(scratch)
        while True:
            try:
                got = sock.recv_into(scratch)
            except _WOULD_BLOCK:
                break
            except OSError as err:
                log.debug("step lane connection from %s ended: %s", self.peer, err)
                self.context.active = False
                self.eof = True
                break
            if not got:
                self.eof = True
                break
            buf += scratch[:got]
            # a plain socket read short has nothing more; TLS may hold decrypted bytes
            if got < room and not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                break
        pos, size = 0, len(buf)
        with memoryview(buf) as view:
            while size - pos >= 4 and not self.cut:
                length = int.from_bytes(view[pos:pos + 4], "big")
                if length > self.max_bytes:
                    self.cut = (f"a step lane frame of {length} bytes is over this end's limit of "
                                f"{self.max_bytes}; nothing of it was applied")
                    break
                if size - pos - 4 < length:
                    break
                self.payloads.append(view[pos + 4:pos + 4 + length].tobytes())
                pos += 4 + length
        del buf[:pos]
        if self.eof and buf and not self.cut:
            log.debug("step lane connection from %s ended inside a frame", self.peer)

    def next_answer(self) -> Any:
        """The call's answer to the next request; StopIteration when the call is over."""
        if self.answers is None:
            self.answers = iter(self._call(self.requests()))
        return next(self.answers)

    def finish_call(self) -> None:
        """Let the call end (its slot, its interceptors' bookkeeping) now that no request will come."""
        self.ended = True
        self.payloads.clear()
        if self.answers is None:
            return
        try:
            for _ in self.answers:  # a well-behaved handler answers nothing more
                pass
        except Aborted:
            pass
        except Exception:  # a fault of ours ending a call: logged, the loop serves on
            log.exception("the step lane call from %s failed as it ended", self.peer)


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
    ``refused(err)``: a StepStream refusal's answer; ``release(conn)``: the
    connection's end (on another thread: it may block). Batches are
    acknowledged in order, so a connection's answers leave in order."""

    def __init__(self, hold: Callable[[], Held | None], waits: Callable[[int], bool],
                 acknowledge: Callable[[int], int], refused: Callable[[BaseException], Any],
                 serialize: Callable[[Any], bytes], release: Callable[[Conn], None]) -> None:
        self._hold, self._waits, self._acknowledge = hold, waits, acknowledge
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
            self._poll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _round(self) -> None:
        """Wait for any connection (or the syncer, or a new connection); serve what is ready."""
        ready, self._again = self._again, []
        for fd, mask in self._poll.poll(0 if ready else -1):
            conn = self._fds.get(fd)
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
        elif self._syncing or (len(self._conns) > 1 and self._waits(batch.lsn)):
            # behind batches in the syncer (in order), or others may send while the disk writes
            self._syncing += 1
            with self._sync_cv:
                self._to_sync.append(batch)
                self._sync_cv.notify()
        else:  # one connection (it waits for this answer) or no wait: here costs no thread handoff
            self._acknowledged(batch)
            self._deliver(batch, flush=False)

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
            except _WOULD_BLOCK:
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
