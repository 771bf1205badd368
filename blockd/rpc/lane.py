"""The step lane's wire form, and the caller's end of one lane connection.

The step lane (docs/protocol.md, "Step lane") carries a ``StepStream``'s
messages over a TCP connection of its own, TLS when the daemon's gRPC port is:
each message is one *frame*, a 4-byte big-endian length and that many bytes.
The caller's first frame is a :class:`~blockd.v1.blockd_pb2.StepLaneHello`
(the metadata gRPC would send in headers: ``authorization``,
``traceparent``); after it, each frame from the caller is a
``StepStreamRequest`` and each frame back the ``StepStreamResponse`` at the
same place, exactly as on the gRPC stream. A refusal of the whole connection
(no credentials, a frame over the size limit) is one ``StepStreamResponse``
whose ``error_status`` says why, and the daemon then closes the connection.

Why a lane at all: over Python gRPC a stream message costs the daemon about
170 us of CPU with no work in it, while a framed socket costs about 23 us
(``bench/rpc.py --part transport_floor``); for the 256-sequence decode step
that is most of what stands between blockd and its per-step CPU target.

Owns the framing (:func:`read_frame`, :func:`frame`), the hello
(:func:`hello_frame`, :func:`read_hello`), the TLS auth context the server's
interceptors read (:func:`auth_context_of`), and :class:`LaneConnection`.
The server is :mod:`blockd.service.lane`. Imports the standard library and
the generated protocol only.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

from blockd.v1 import blockd_pb2 as pb

_LENGTH = struct.Struct(">I")
#: a hello carries a few metadata entries; anything larger is not a hello
MAX_HELLO_BYTES = 64 << 10
#: a caller's connect and TLS handshake, and the daemon's wait for the hello
CONNECT_TIMEOUT_S = 2.0

#: gRPC's metadata entry: read as ``.key``/``.value`` and unpacked as a pair
Metadatum = namedtuple("Metadatum", "key value")


class FrameTooLarge(ValueError):
    """A frame's length is over the limit: the connection cannot go on (its
    bytes would have to be read to find the next frame)."""


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def read_frame(reader, max_bytes: int) -> bytes | None:
    """The next frame's payload from a buffered ``reader``; None when the
    connection ended cleanly between frames. :class:`EOFError` when it ended
    inside one, :class:`FrameTooLarge` for a length over ``max_bytes``."""
    head = reader.read(4)
    if not head:
        return None
    if len(head) < 4:
        raise EOFError("the connection ended inside a frame's length")
    (length,) = _LENGTH.unpack(head)
    if length > max_bytes:
        raise FrameTooLarge(f"a step lane frame of {length} bytes is over this end's limit of {max_bytes}")
    payload = reader.read(length)
    if len(payload) < length:
        raise EOFError(f"the connection ended {length - len(payload)} bytes short of a frame's end")
    return payload


def hello_frame(metadata: Sequence[tuple[str, str]]) -> bytes:
    hello = pb.StepLaneHello(metadata=[pb.StepLaneMetadata(key=k, value=v) for k, v in metadata])
    return frame(hello.SerializeToString())


def read_hello(reader) -> tuple[Metadatum, ...]:
    """The caller's metadata; ValueError (a message for the caller) for a first
    frame that is no hello, EOFError when the connection ended before one."""
    try:
        payload = read_frame(reader, MAX_HELLO_BYTES)
    except FrameTooLarge:
        raise ValueError(f"the step lane's first frame must be a StepLaneHello of at most {MAX_HELLO_BYTES} "
                         "bytes (is this a step lane client?)") from None
    if payload is None:
        raise EOFError("the connection ended before its hello")
    try:
        hello = pb.StepLaneHello.FromString(payload)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: bytes that are not a hello
        raise ValueError("the step lane's first frame did not parse as a StepLaneHello") from None
    return tuple(Metadatum(item.key.lower(), item.value) for item in hello.metadata)


def auth_context_of(sock: socket.socket) -> dict[str, list[bytes]]:
    """What gRPC's ``ServicerContext.auth_context()`` holds for a TLS peer (the
    keys :mod:`blockd.auth.interceptor` reads); empty for plain TCP."""
    if not isinstance(sock, ssl.SSLSocket):
        return {}
    found: dict[str, list[bytes]] = {"transport_security_type": [b"ssl"]}
    der = sock.getpeercert(binary_form=True)
    if not der:
        return found  # server-auth TLS: no client certificate (a token must say who calls)
    found["x509_pem_cert"] = [ssl.DER_cert_to_PEM_cert(der).encode()]
    cert: dict[str, Any] = dict(sock.getpeercert() or {})
    uris = [str(value).encode() for kind, value in cert.get("subjectAltName", ()) if kind == "URI"]
    if uris:
        found["peer_uri"] = uris
    names = [str(value).encode() for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    if names:
        found["x509_common_name"] = names
    return found


class LaneConnection:
    """The caller's end of one lane connection: :meth:`exchange` sends one
    ``StepStreamRequest`` and reads its answer. Errors are ``OSError``
    (the connection broke: reconnect), :class:`EOFError` (it ended) or
    :class:`FrameTooLarge`; the caller turns them into its own."""

    def __init__(self, host: str, port: int, metadata: Sequence[tuple[str, str]], *,
                 tls: ssl.SSLContext | None = None, server_name: str | None = None,
                 max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_name or host)
            sock.settimeout(None)
            sock.sendall(hello_frame(metadata))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._reader = sock.makefile("rb")

    def exchange(self, request: bytes) -> bytes:
        self._sock.sendall(frame(request))
        answer = read_frame(self._reader, self.max_bytes)
        if answer is None:
            raise EOFError("blockd closed the step lane without answering")
        return answer

    def cancel(self) -> None:
        """Wake a blocked :meth:`exchange` (it raises); from any thread."""
        with contextlib.suppress(OSError):  # already gone
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.cancel()
        self._reader.close()
        self._sock.close()
