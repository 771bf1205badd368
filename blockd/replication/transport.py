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

This module owns the connections: :class:`FramesListener` (the leader's
replication port: accepts a connection, reads its ticket, hands it to the
feed the ticket was offered by, :class:`Offer`), :func:`connect` (the
follower's side) and the TLS contexts of both. The frames themselves are
:mod:`blockd.replication.framing`; the acknowledgements of plain-text feeds
are read by :mod:`blockd.replication.ack_reader`. What the messages mean
stays with :mod:`blockd.replication.feeds`, :mod:`blockd.replication.acks`
and :mod:`blockd.replication.follower`.

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

import hmac
import logging
import secrets
import socket
import ssl
import threading

from blockd.auth.config import TlsConfig, target_host
from blockd.replication.ack_reader import AckReader
from blockd.replication.framing import Framed, Link

log = logging.getLogger("blockd.replication")

TICKET_BYTES = 32
#: what a connection carries, the byte after its ticket: both directions (plain text), or one (TLS)
BOTH, RECORDS, ACKS = b"B", b"R", b"A"
#: how long a connection may take to present its ticket, and a feed to receive its connection
CONNECT_S = 2.0
ACCEPT_POLL_S = 0.5


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
