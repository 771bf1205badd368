"""A step lane connection as the loop holds it: its buffers, its frames, its call.

:class:`Conn` reads what a non-blocking socket has (TLS included) into
complete frames, each at most the lane's message limit (a larger one is
``cut``: refused once the answers before it are out), and runs the
StepStream handler over them, one request in and one answer out.
:func:`status_of` and :class:`Aborted` turn an interceptor's or handler's
abort into the refusal the loop writes. :mod:`blockd.service.lane_loop`
serves every Conn on one thread.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from google.rpc import status_pb2

log = logging.getLogger("blockd.lane")

#: what a non-blocking read or write that has to wait raises (TLS's too)
WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


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
            except WOULD_BLOCK:
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
