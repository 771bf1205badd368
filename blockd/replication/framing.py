"""The replication port's wire format: length-prefixed protobuf frames, and one connection's two ends.

A frame is a 4-byte big-endian length and the serialized message; no frame
is larger than ``MAX_FRAME``, and one that announces more, or a connection
that ends inside a frame, is a :class:`FrameError` (the connection is closed
and the follower dials again: nothing is guessed at). :class:`Framed` sends
and receives whole frames on one socket (one thread sends and one receives);
:class:`Link` is a feed's pair of them (one connection both ways in plain
text, one per direction over TLS: :mod:`blockd.replication.transport` says
why). What the messages mean stays with the feeds
(:mod:`blockd.replication.feeds`, :mod:`blockd.replication.follower`).
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message

LENGTH = struct.Struct(">I")
#: larger than any message of the feed (a snapshot chunk or a batch of records: 1 MiB each)
MAX_FRAME = 64 << 20
#: what :meth:`Framed.receive_ready` takes at once (a thousand acknowledgements)
RECEIVE_BYTES = 1 << 16

M = TypeVar("M", bound=Message)


class FrameError(ConnectionError):
    """The peer sent something that is not a frame; the connection is closed."""


def frame(msg: Message) -> bytes:
    """``msg`` as one frame: its length, then its bytes."""
    data = msg.SerializeToString()
    return LENGTH.pack(len(data)) + data


def _frame_size(buf: bytes | bytearray) -> int:
    """The payload size a frame starting at ``buf`` announces (``buf`` holds its length at least)."""
    (size,) = LENGTH.unpack_from(buf)
    if size > MAX_FRAME:
        raise FrameError(f"a frame of {size} bytes is larger than any message of the feed ({MAX_FRAME})")
    return size


class Framed:
    """One end of a framed connection. One thread sends and one receives."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._reader = sock.makefile("rb")
        self._writable = select.poll()
        self._writable.register(sock, select.POLLOUT)
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)
        self._arrived = bytearray()  #: the start of a frame :meth:`receive_ready` has not all of yet
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def settimeout(self, seconds: float | None) -> None:
        """For both directions: a receive (or a send into full buffers) that waits longer raises TimeoutError."""
        self._sock.settimeout(seconds)

    def send(self, msg: Message) -> None:
        self.send_bytes(frame(msg))

    def send_bytes(self, data: bytes) -> None:
        """Send frames made by :func:`frame`, waiting for room (up to the timeout)."""
        self._sock.sendall(data)

    @property
    def can_try_send(self) -> bool:
        """Whether :meth:`try_send` works here (plain sockets; ``ssl`` takes no send flags)."""
        return not isinstance(self._sock, ssl.SSLSocket)

    def try_send(self, data: bytes) -> int:
        """Send what the socket takes now without waiting: the bytes sent (0: no room).

        Only the thread holding the feed's lock sends, so the room this poll sees
        cannot shrink before the send. The poll is what keeps this from waiting:
        on a socket with a timeout (:meth:`settimeout`), CPython polls for room
        before every send, ``MSG_DONTWAIT`` or not, and waits up to the timeout
        (measured: 2 s on a full socket with a 2 s timeout), which would hold
        the step that pushed, under the engine lock, for as long as a stopped
        follower leaves the buffers full."""
        if not self._writable.poll(0):
            return 0
        try:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def receive_ready(self) -> list[bytes] | None:
        """The whole frames' payloads that have arrived, without waiting (None: the peer
        closed). For :class:`~blockd.replication.ack_reader.AckReader` only: a connection read this way is never read
        with :meth:`receive`, whose buffer this does not share. The poll comes first for
        the reason :meth:`try_send` gives."""
        if not self._readable.poll(0):
            return []
        try:
            data = self._sock.recv(RECEIVE_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        if not data:
            return None
        buf = self._arrived
        buf += data
        payloads = []
        while len(buf) >= LENGTH.size:
            size = _frame_size(buf)
            if len(buf) < LENGTH.size + size:
                break
            payloads.append(bytes(buf[LENGTH.size:LENGTH.size + size]))
            del buf[:LENGTH.size + size]
        return payloads

    @property
    def socket(self) -> socket.socket:
        return self._sock

    def receive(self, parse: Callable[[bytes], M]) -> M | None:
        """The next message, or None once the peer has closed the connection."""
        header = self._reader.read(LENGTH.size)
        if not header:
            return None
        if len(header) < LENGTH.size:
            raise FrameError("the connection ended inside a frame's length")
        size = _frame_size(header)
        data = self._reader.read(size)
        if len(data) != size:
            raise FrameError(f"the connection ended inside a frame ({len(data)} of {size} bytes)")
        return parse(data)

    def shutdown(self) -> None:
        """Wake a thread blocked on this connection (it sees the end); from any thread."""
        with contextlib.suppress(OSError):  # not connected any more: nothing is blocked on it
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self.shutdown()
        self._reader.close()
        self._sock.close()


@dataclass
class Link:
    """A feed's connections: records leave the leader on ``records``, acknowledgements
    come back on ``acks`` (one connection for both in plain text)."""

    records: Framed
    acks: Framed

    @property
    def closed(self) -> bool:
        return self.records.closed or self.acks.closed

    def shutdown(self) -> None:
        self.records.shutdown()
        self.acks.shutdown()

    def close(self) -> None:
        self.records.close()
        if self.acks is not self.records:
            self.acks.close()
