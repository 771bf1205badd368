"""The replication transport's framed socket (``docs/ha.md``, "The replication transport").

Python's gRPC costs each side about 0.35 ms of CPU and a thread hand-off per
stream message (measured on the 2-core test machines), and sync mode sends
two messages per step: a record to every follower, an acknowledgement back.
A plain TCP socket carrying the same protobuf messages, each framed as a
4-byte big-endian length and the serialized message, round-trips in about
0.07 ms. So the gRPC call ``ReplicateLog`` stays the feed's session (the
authorization, the log comparison and cut, the term) and, when the follower
asks, its first message is a :class:`~blockd.v1.replication_pb2.FramesOffer`:
a port on the leader's host and a one-time ticket. The follower connects,
sends the ticket, and from then on reads the feed's messages and writes its
acknowledgements on the socket.

This module owns the socket's side of that: :class:`FramesListener` (the
leader's replication port: accepts a connection, reads its ticket, hands it
to the feed the ticket was offered by), :func:`connect` (the follower's
side) and :class:`Framed` (whole messages in and out). What the messages
mean stays with :mod:`blockd.replication.leader` and :mod:`blockd.replication.follower`.

A group that serves TLS serves the port with TLS too: the leader with its
server certificate (and, under mutual TLS, the client CA: a follower must
present its peer certificate), re-read at each connection so a rotated
certificate takes effect as gRPC's does; the follower verifies the leader
as its gRPC channel does (``--peer-tls-ca``, ``--peer-tls-server-name``).
An ``ssl`` connection must not be read and written by two threads at once,
and the leader reads acknowledgements on one thread while it sends records
on another, so a TLS feed takes two connections, one per direction (each
presents the ticket and its role); a plain one takes one connection both ways.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import select
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message

from blockd.auth.config import TlsConfig, target_host

log = logging.getLogger("blockd.replication")

LENGTH = struct.Struct(">I")
#: larger than any message of the feed (a snapshot chunk or a batch of records: 1 MiB each)
MAX_FRAME = 64 << 20
TICKET_BYTES = 32
#: what a connection carries, the byte after its ticket: both directions (plain text), or one (TLS)
BOTH, RECORDS, ACKS = b"B", b"R", b"A"
#: how long a connection may take to present its ticket, and a feed to receive its connection
CONNECT_S = 2.0
ACCEPT_POLL_S = 0.5
#: what :meth:`Framed.receive_ready` takes at once (a thousand acknowledgements)
RECEIVE_BYTES = 1 << 16
#: how long :class:`AckReader`'s thread stays away after a waiter read, and its longest wait
IDLE_S = 0.05

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
        closed). For :class:`AckReader` only: a connection read this way is never read
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


class Offer:
    """One feed's ticket, waiting for its connections."""

    def __init__(self, listener: FramesListener, ticket: bytes) -> None:
        self.ticket, self.port = ticket, listener.port
        self._listener = listener
        self._arrived = threading.Event()
        self._conns: dict[bytes, Framed] = {}

    def deliver(self, role: bytes, conn: Framed) -> bool:
        """Take a connection of ``role``; True once the feed has all it needs."""
        if role in self._conns:  # the same role twice: not this feed's follower
            conn.close()
            return False
        self._conns[role] = conn
        done = BOTH in self._conns or (RECORDS in self._conns and ACKS in self._conns)
        if done:
            self._arrived.set()
        return done

    def wait(self, timeout_s: float) -> Link | None:
        """The feed's connections, or None by the timeout; the ticket is spent either way."""
        self._arrived.wait(timeout_s)
        self._listener.withdraw(self)
        conns = self._conns
        if BOTH in conns:
            return Link(conns[BOTH], conns[BOTH])
        if RECORDS in conns and ACKS in conns:
            return Link(conns[RECORDS], conns[ACKS])
        for conn in conns.values():
            conn.close()
        return None


class AckReader:
    """The acknowledgements of every plain-text feed on the replication port, read
    by the thread that waits for them.

    A sync step waits for its followers' acknowledgements. Read on a thread of
    their own, each one woke that thread, which then woke the step's: two
    hand-offs of the GIL and of a core, 0.25-0.55 ms a step on the 2-core test
    machines (measured). Here the waiter reads them itself (:meth:`read`, one
    ``select`` over every feed's socket), so the acknowledgement that commits a
    step wakes the thread that answers it.

    One thread reads at a time (``_role``). The reader's own thread takes the
    role only when no waiter has read for ``IDLE_S`` (no steps: acknowledgements
    of heartbeats, an async group), and a waiter that finds it reading pokes it
    out of its ``select`` (a byte on ``_wake``). A waiter that finds another
    waiter reading returns False and waits for the commit point's notice, which
    the reader gives (``on_notice``) as it leaves. ``handle(payload)`` takes
    one message; an exception from it, a frame no message can be, or the end
    of the connection ends that feed (``on_end``, the follower dials again).
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake, self._woken = socket.socketpair()
        self._wake.setblocking(False)
        self._woken.setblocking(False)
        self._selector.register(self._woken, selectors.EVENT_READ, None)
        self._role = threading.Lock()
        self._holder = 0  #: the thread reading (its ident; 0: none)
        self._waited = 0.0  #: when a waiter last asked to read (monotonic)
        self._wanting = False  #: a waiter found the role taken: tell it when it is free
        self._links = 0
        self._links_lock = threading.Lock()
        #: called (from the thread leaving the role) when a waiter that found it taken may read now
        self.on_notice: Callable[[], None] = lambda: None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="repl-acks", daemon=True)
        self._thread.start()

    @property
    def has_links(self) -> bool:
        return self._links > 0 and not self._closed.is_set()

    def add(self, conn: Framed, handle: Callable[[bytes], None],
            on_end: Callable[[BaseException | None], None]) -> None:
        with self._links_lock:
            self._selector.register(conn.socket, selectors.EVENT_READ, _Acks(conn, handle, on_end))
            self._links += 1
        self.interrupt()  # a select in progress has not seen it

    def remove(self, conn: Framed) -> None:
        """Stop reading ``conn`` (before it is closed); nothing once it ended here already."""
        with self._links_lock, contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.socket)
            self._links -= 1

    def read(self, timeout_s: float) -> bool:
        """Read what arrives within ``timeout_s``; False at once when another thread reads."""
        self._waited = time.monotonic()
        if not self._role.acquire(blocking=False):
            self._wanting = True
            # again, now that the holder will see ``_wanting`` when it leaves: one that left
            # between the first try and that flag gave no notice, but left the role free
            if not self._role.acquire(blocking=False):
                if self._holder == self._thread.ident:
                    self._poke()
                return False
        self._serve(timeout_s)
        return True

    def interrupt(self) -> None:
        """Wake a waiter reading (it re-checks what it waits for): the commit point moved
        without it, through an acknowledgement that came another way."""
        holder = self._holder
        if holder and holder != threading.get_ident():
            self._poke()

    def close(self) -> None:
        self._closed.set()
        self._poke()
        self._thread.join(5)

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # a byte there already does the same
            self._wake.send(b"w")

    def _run(self) -> None:
        while not self._closed.is_set():
            if time.monotonic() - self._waited < IDLE_S or not self._role.acquire(timeout=IDLE_S):
                self._closed.wait(IDLE_S)
                continue
            self._serve(IDLE_S)
        with contextlib.suppress(OSError):
            self._selector.close()
            self._wake.close()
            self._woken.close()

    def _serve(self, timeout_s: float) -> None:
        """Under the role (taken): one ``select``, then leave the role."""
        self._holder = threading.get_ident()
        try:
            for key, _ in self._selector.select(timeout_s):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._woken.recv(4096)
                elif not key.data.pump():
                    self.remove(key.data.conn)
                    key.data.end()
        except (OSError, ValueError) as err:  # closed meanwhile; a waiter goes on waiting for notices
            if not self._closed.is_set():
                log.warning("reading the replication port's acknowledgements failed: %s", err)
        finally:
            self._holder = 0
            self._role.release()
            if self._wanting:
                self._wanting = False
                self.on_notice()


class _Acks:
    """One feed's acknowledgements as they arrive, cut into frames."""

    def __init__(self, conn: Framed, handle: Callable[[bytes], None],
                 on_end: Callable[[BaseException | None], None]) -> None:
        self.conn, self._handle, self._on_end = conn, handle, on_end
        self._error: BaseException | None = None

    def pump(self) -> bool:
        """Handle every whole frame that has arrived; False once the feed must end."""
        try:
            payloads = self.conn.receive_ready()
            if payloads is None:
                return False
            for payload in payloads:
                self._handle(payload)
            return True
        except Exception as err:  # noqa: BLE001 - any failure ends this feed; the follower opens it again
            self._error = err
            return False

    def end(self) -> None:
        self._on_end(self._error)


def split_bind(listen: str) -> str:
    """The host part of a ``HOST:PORT`` listen address, to bind the replication port on."""
    return target_host(listen) or "0.0.0.0"


class FramesListener:
    """The leader's replication port; see the module docstring."""

    def __init__(self, host: str, port: int = 0, tls: TlsConfig | None = None) -> None:
        self.tls = tls
        ipv6 = ":" in host
        self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ipv6 else socket.AF_INET,
                                          backlog=16, dualstack_ipv6=ipv6 and host == "::")
        self._sock.settimeout(ACCEPT_POLL_S)  # so close() ends the accept loop promptly
        self.port: int = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._pending: list[Offer] = []
        self.acks = AckReader()  #: the plain-text feeds' acknowledgements
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="repl-frames", daemon=True)
        self._thread.start()

    def offer(self) -> Offer:
        offer = Offer(self, secrets.token_bytes(TICKET_BYTES))
        with self._lock:
            self._pending.append(offer)
        return offer

    def withdraw(self, offer: Offer) -> None:
        with self._lock:
            if offer in self._pending:
                self._pending.remove(offer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self.acks.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as err:
                if not self._stop.is_set():
                    log.warning("the replication port stopped accepting: %s", err)
                return
            threading.Thread(target=self._admit, args=(sock,), name="repl-frames-admit", daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        """TLS handshake (with ``tls``), then the ticket and role, all within CONNECT_S; hand
        the connection to its feed, or close it."""
        try:
            sock.settimeout(CONNECT_S)
            if self.tls is not None:
                sock = server_context(self.tls).wrap_socket(sock, server_side=True)
            head = b""
            while len(head) < TICKET_BYTES + 1:
                chunk = sock.recv(TICKET_BYTES + 1 - len(head))
                if not chunk:
                    break
                head += chunk
            sock.settimeout(None)
        except (OSError, ssl.SSLError, ValueError) as err:
            log.warning("a connection to the replication port failed before its ticket: %s", err)
            sock.close()
            return
        ticket, role = head[:TICKET_BYTES], head[TICKET_BYTES:]
        with self._lock:
            offer = next((o for o in self._pending if hmac.compare_digest(o.ticket, ticket)), None)
            if offer is not None and role in (BOTH, RECORDS, ACKS) and offer.deliver(role, Framed(sock)):
                self._pending.remove(offer)
                return
        if offer is None or role not in (BOTH, RECORDS, ACKS):
            log.warning("a connection to the replication port presented no valid ticket; closed")
            sock.close()


def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """The leader's side, from the files as they are now (a rotation applies to the next connection)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert or "", tls.key)
    if tls.ca:  # mutual TLS, as the gRPC server asks
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=tls.ca)
    return ctx


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    """The follower's side: verify the leader against ``tls.ca`` (system roots when None), present ``tls.cert``."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert:
        ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


def connect(target: str, port: int, ticket: bytes, tls: TlsConfig | None = None,
            timeout_s: float = CONNECT_S) -> Link:
    """The follower's side: connect to ``target``'s host at ``port`` and present ``ticket``
    (over TLS with ``tls``: two connections, one per direction)."""
    host = target_host(target)
    if tls is None:
        conn = _open(host, port, ticket + BOTH, None, timeout_s)
        return Link(conn, conn)
    records = _open(host, port, ticket + RECORDS, tls, timeout_s)
    try:
        return Link(records, _open(host, port, ticket + ACKS, tls, timeout_s))
    except BaseException:
        records.close()
        raise


def _open(host: str, port: int, head: bytes, tls: TlsConfig | None, timeout_s: float) -> Framed:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        if tls is not None:
            sock = client_context(tls).wrap_socket(sock, server_hostname=tls.server_name or host)
        sock.sendall(head)
        sock.settimeout(None)
        return Framed(sock)
    except BaseException:
        sock.close()
        raise
