"""The daemon's step lane: ``StepStream`` served over framed TCP (or TLS).

:class:`StepLane` listens on a port of its own beside the gRPC server
(``blockd serve --step-lane-port``) and serves every connection on one
thread (:mod:`blockd.service.lane_loop`), each exactly as a gRPC
``StepStream`` call: the very handler the gRPC
server registers for ``/blockd.v1.BlockService/StepStream``, run through the
very interceptors, in the same order, once per connection (gRPC runs them
once per call). So authentication (the hello's ``authorization``, or the
client certificate), permissions, tenants, the group gate, the stream slots
(``STEP_STREAMS_FULL``), idempotency and every refusal are the same code,
and a step's answer over the lane is byte for byte what the stream gives.
The interceptors see a :class:`_LaneContext`, which answers the parts of
``grpc.ServicerContext`` they use; an ``abort`` becomes the connection's last
answer (its ``error_status``) and the connection is closed.

What a lane step costs the daemon: its share of one ``epoll_wait``, a
``recv``, the handler, a ``send``; gRPC's per-message machinery (its
completion queue, HTTP/2 framing, the Python call objects) is what it saves
(``bench/rpc.py --part daemon_cost``, transport ``lane``).

Bounds, so that no caller stalls the others: at most ``max_connections``
connections (more are answered ``STEP_STREAMS_FULL`` and closed), a hello
within :data:`~blockd.rpc.lane.CONNECT_TIMEOUT_S` of connecting, the TLS
handshake and the hello on a thread of the connection's own (never the
accepting one, never the loop), the loop's bounds, frames up to
the server's message limit. TLS uses the gRPC port's files, re-read when they
change (as :mod:`blockd.auth.tls` does for gRPC); mutual TLS when a CA is set.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import grpc

from blockd.auth.config import TlsConfig
from blockd.auth.tls import files_fingerprint
from blockd.engine.durability import Held
from blockd.rpc.addresses import join
from blockd.rpc.lane import (
    CONNECT_TIMEOUT_S,
    Metadatum,
    auth_context_of,
    frame,
    read_hello,
)
from blockd.service.lane_conn import Aborted, Conn, status_of
from blockd.service.lane_loop import LaneLoop
from blockd.storage.fsyncer import Fsyncer
from blockd.v1 import blockd_pb2 as pb

log = logging.getLogger("blockd.lane")
#: connections past the limit answered and read to their close at once; more are closed after the answer
LINGERING = 64

METHOD = "/blockd.v1.BlockService/StepStream"


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: tuple[Metadatum, ...]) -> None:
        self.method, self.invocation_metadata = method, invocation_metadata


class _LaneContext(grpc.ServicerContext):
    """The parts of ``grpc.ServicerContext`` blockd's interceptors and servicer use."""

    def __init__(self, metadata: tuple[Metadatum, ...], auth: dict, peer: str, shutdown: threading.Event) -> None:
        self._metadata, self._auth, self._peer, self._shutdown = metadata, auth, peer, shutdown
        self.active = True
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: Sequence = ()

    def invocation_metadata(self):
        return self._metadata

    def auth_context(self):
        return self._auth

    def peer(self) -> str:
        return self._peer

    def peer_identities(self):
        return self._auth.get("peer_uri") or self._auth.get("x509_common_name")

    def peer_identity_key(self):
        return None

    def is_active(self) -> bool:
        return self.active and not self._shutdown.is_set()

    def time_remaining(self):
        return None

    def cancel(self) -> bool:
        self.active = False
        return True

    def add_callback(self, callback) -> bool:
        return False

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self._code, self._details = code, details
        raise Aborted(status_of(code, details))

    def abort_with_status(self, status) -> NoReturn:
        self._code, self._details = status.code, status.details
        raise Aborted(status_of(status.code, status.details, status.trailing_metadata))

    def set_code(self, code) -> None:
        self._code = code

    def code(self):
        return self._code

    def set_details(self, details) -> None:
        self._details = details

    def details(self):
        return self._details

    def set_trailing_metadata(self, trailing_metadata) -> None:
        self._trailing = trailing_metadata

    def trailing_metadata(self):
        return self._trailing

    def send_initial_metadata(self, initial_metadata) -> None:
        pass

    def set_compression(self, compression) -> None:
        pass

    def disable_next_message_compression(self) -> None:
        pass


class _ServerTls:
    """The lane's server-side TLS context, rebuilt when the files change."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self._seen: tuple = ()
        self._context: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self.context()  # bad files fail at start, not at the first connection

    def context(self) -> ssl.SSLContext:
        with self._lock:
            seen = files_fingerprint(self.tls.files())
            if self._context is None or seen != self._seen:
                try:
                    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                    context.minimum_version = ssl.TLSVersion.TLSv1_2
                    assert self.tls.cert is not None and self.tls.key is not None, "a TLS server has a certificate"
                    context.load_cert_chain(self.tls.cert, self.tls.key)
                    if self.tls.ca is not None:
                        context.verify_mode = ssl.CERT_REQUIRED
                        context.load_verify_locations(self.tls.ca)
                except (OSError, ssl.SSLError) as err:
                    if self._context is None:
                        raise
                    log.warning("the step lane keeps its TLS files: the new ones do not load (%s)", err)
                    self._seen = seen
                    return self._context
                self._context, self._seen = context, seen
            return self._context


class StepLane:
    """``handler`` (the gRPC server's StepStream handler) through ``interceptors``,
    served on ``host:port`` (0: a free port); ``refused(err, rpc)``: the
    servicer's StepStream answer for a refusal (its ``STEP_STREAMS_FULL``);
    ``hold``, ``waits`` and ``acknowledge``: the engine's
    (:class:`blockd.engine.durability.Acknowledgements`), so that a round of
    the loop waits once for what it changed; ``behind``: its
    ``(acknowledge_behind, acknowledged_behind)`` where it ``syncs_behind``."""

    def __init__(self, handler: grpc.RpcMethodHandler, interceptors: Sequence[grpc.ServerInterceptor], host: str,
                 port: int, *, tls: TlsConfig | None, max_bytes: int, max_connections: int,
                 shutdown: threading.Event, refused: Callable[[BaseException, str], pb.StepStreamResponse],
                 full: Callable[[], BaseException], hold: Callable[[], Held | None],
                 waits: Callable[[int], bool], acknowledge: Callable[[int], int],
                 behind: tuple[Callable[[int, Fsyncer], bool], Callable[[int, int, float], None]] | None = None
                 ) -> None:
        self._handler, self._interceptors = handler, list(interceptors)
        self._tls = _ServerTls(tls) if tls is not None else None
        self.tls = tls is not None
        self._max_bytes, self._shutdown = max_bytes, shutdown
        self._refused, self._full = refused, full
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lingering = threading.BoundedSemaphore(LINGERING)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((host.strip("[]"), port))
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self.port = self._listener.getsockname()[1]
        self.address = join(host, self.port)
        self._thread = threading.Thread(target=self._accept, name="blockd-lane-accept", daemon=True)
        serialize = handler.response_serializer
        assert serialize is not None, "blockd's handlers name both (method_handlers)"
        self._loop = LaneLoop(hold, waits, acknowledge, lambda err: refused(err, "StepStream"), serialize,
                              self._released, behind)

    def start(self) -> None:
        self._loop.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and end every connection."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._loop.stop()
        with self._lock:
            conns = list(self._open)
        for conn in conns:  # those still in their set-up, and any the loop's end has not closed
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    # --- per connection -------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._shutdown.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return  # the listener closed: stop()
            peer = f"ipv6:[{addr[0]}]:{addr[1]}" if conn.family == socket.AF_INET6 else f"ipv4:{addr[0]}:{addr[1]}"
            if not self._slots.acquire(blocking=False):
                # answered without reading: a caller past the limit learns why, and steps by unary Step
                threading.Thread(target=self._turn_away, args=(conn,), name="blockd-lane-full", daemon=True).start()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="blockd-lane", daemon=True).start()

    def _turn_away(self, conn: socket.socket) -> None:
        """Answer STEP_STREAMS_FULL and close, lingering (:meth:`_linger`) if
        fewer than LINGERING turned-away connections do now."""
        linger = self._tls is None and self._lingering.acquire(blocking=False)
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            if self._tls is None:  # a TLS caller could not read a plain answer: it just sees the close
                conn.sendall(frame(self._refused(self._full(), "StepStream").SerializeToString()))
            if linger:
                self._linger(conn)
        except OSError:
            pass
        finally:
            conn.close()
            if linger:
                self._lingering.release()

    def _linger(self, sock: socket.socket) -> None:
        """Before a plain connection the daemon ends is closed: a socket closed
        with the caller's frames unread (a step sent behind its hello) is
        reset, and the reset can reach the caller before it has read the last
        answer (a refusal), so its write fails ("Broken pipe") and it retries
        into the same refusal until its deadline. So stop sending and read to
        the caller's close, for at most CONNECT_TIMEOUT_S."""
        if self._tls is not None:
            return
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.shutdown(socket.SHUT_WR)
        until = time.monotonic() + CONNECT_TIMEOUT_S
        while time.monotonic() < until and sock.recv(1 << 16):
            pass

    def _serve(self, conn: socket.socket, peer: str) -> None:
        """A new connection's TLS handshake and hello (bounded by CONNECT_TIMEOUT_S), on a
        thread of its own; then the loop serves it."""
        sock: socket.socket = conn
        with self._lock:
            self._open.add(conn)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.settimeout(CONNECT_TIMEOUT_S)
            if self._tls is not None:
                sock = self._tls.context().wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                sock.do_handshake()
            try:
                # exact reads: what the caller sent behind its hello stays in the socket for the loop
                metadata = read_hello(_ExactReader(sock))
            except ValueError as err:
                refusal = pb.StepStreamResponse(error_status=status_of(grpc.StatusCode.INVALID_ARGUMENT, str(err)))
                self._end(sock, conn, frame(refusal.SerializeToString()))
                return
            context = _LaneContext(metadata, auth_context_of(sock), peer, self._shutdown)
            handler = self._chain(_CallDetails(METHOD, context.invocation_metadata()))
            assert handler is not None and handler.stream_stream is not None, "StepStream is a stream-stream handler"
            parse, stream = handler.request_deserializer, handler.stream_stream
            assert parse is not None, "blockd's handlers name both (method_handlers)"
            self._loop.adopt(Conn(sock, conn, peer, context, lambda requests: stream(requests, context), parse,
                                  self._max_bytes))
        except (OSError, EOFError, ssl.SSLError) as err:
            log.debug("step lane connection from %s ended: %s", peer, err)
            self._close(sock, conn)
        except Exception:  # a fault of ours: logged, the connection closed, the daemon serves on
            log.exception("step lane connection from %s failed", peer)
            self._close(sock, conn)

    def _end(self, sock: socket.socket, raw: socket.socket, rest: bytes) -> None:
        """A connection's end, on a thread that may block: ``rest`` (the answers
        the loop could not write yet, or a refusal), the linger, the close."""
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            if rest:
                sock.sendall(rest)
            self._linger(sock)
        except OSError:
            pass
        self._close(sock, raw)

    def _close(self, sock: socket.socket, raw: socket.socket) -> None:
        with self._lock:
            self._open.discard(raw)
        try:
            sock.close()
        except OSError:
            pass
        finally:
            self._slots.release()

    def _released(self, conn: Conn) -> None:
        """The loop is done with ``conn``: its end, off the loop's thread."""
        if self._shutdown.is_set() or (not conn.out and (self._tls is not None or conn.eof)):
            self._close(conn.sock, conn.raw)  # nothing to write, nothing to linger for
            return
        threading.Thread(target=self._end, args=(conn.sock, conn.raw, bytes(conn.out)), name="blockd-lane-end",
                         daemon=True).start()

    def _chain(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        """The handler as the gRPC server would run it: the first interceptor outermost."""
        interceptors, handler = self._interceptors, self._handler

        def at(index: int) -> Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None]:
            if index == len(interceptors):
                return lambda _details: handler
            return lambda d: interceptors[index].intercept_service(at(index + 1), d)

        return at(0)(details)


class _ExactReader:
    """``read(n)`` of exactly ``n`` bytes (fewer at the end), never more from the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def read(self, size: int) -> bytes:
        parts, got = [], 0
        while got < size:
            part = self._sock.recv(size - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)

