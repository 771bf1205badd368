"""Client channels: TLS or mutual TLS, a bearer token, and credential rotation.

:func:`open_channel` is how every client of the project (the SDK, blockctl,
a worker's blockd client, the scheduler's worker clients) dials:

* ``tls`` (:class:`~blockd.auth.tls.TlsConfig`): verify the server against
  ``tls.ca`` (system roots when None) and, with ``tls.cert``/``tls.key``,
  present a client certificate (mTLS);
* ``token``: sent as ``authorization: Bearer <token>`` on every call. Over
  TLS, or in plain text to a loopback address only; any other plain-text
  target is refused, since the token would cross the network readable;
* neither: a plain channel (loopback development).

Rotation: a gRPC channel keeps the credentials it was made with. Its open
connections stay up across a server's certificate change (TLS checks at
the handshake); new connections verify against the CA bundle given at
creation. So a client whose own certificate or CA bundle is renewed must
make a new channel: :class:`RotatingChannel` (what :func:`open_channel`
returns when TLS files are involved) stats them at most every
``check_interval_s`` and, when one changed, makes a new channel for new
calls and closes the old one ``grace_s`` later (calls and streams still on
it end then, and are retried or resumed on the new one). Servers pick up
their own new files by themselves (:mod:`blockd.auth.tls`).

Keepalive: while a call is open the channel pings the server every 2 s and
gives the connection up when a ping is not answered within 4 s
(:data:`KEEPALIVE_OPTIONS`), so the call fails UNAVAILABLE and the caller
moves on. A server that is paused (SIGSTOP, a frozen VM) or cut off by a
partition that drops packets keeps its connection open and answers nothing:
a stream to it (a worker's Watch, a follower's feed) waited for ever, and a
unary call until its deadline. Our servers accept pings that often
(:mod:`blockd.rpc.endpoint`).

Imports the standard library and grpc.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

import grpc

from blockd.auth.config import TlsConfig, TlsError, is_loopback_target
from blockd.auth.tls import files_fingerprint, read_pem

log = logging.getLogger("blockd.auth")

DEFAULT_CHECK_INTERVAL_S = 5.0
DEFAULT_GRACE_S = 30.0
#: gRPC's own keepalive (see the module docstring); caller options with the same keys win
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 2000),
    # grpcio 1.85 gives a keepalive ping up after the ping timeout (measured: with keepalive_timeout_ms
    # alone a paused server's stream hung for ever), so both are set
    ("grpc.keepalive_timeout_ms", 4000),
    ("grpc.http2.ping_timeout_ms", 4000),
    ("grpc.keepalive_permit_without_calls", 0),  # an idle channel need not be watched
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging a stream that is quiet for long
)


def _check_token(target: str, tls: TlsConfig | None, token: str | None) -> None:
    if token is None:
        return
    if not token or any(c.isspace() for c in token):
        raise ValueError("a bearer token must be non-empty and contain no white space")
    if tls is None and not is_loopback_target(target):
        raise TlsError(f"refusing to send a bearer token in plain text to {target}: give TLS settings "
                       "(a CA bundle to verify the server), or dial a loopback address")


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """TLS credentials: the CA bundle (system roots when None) and, for mutual TLS, the client pair."""
    ca = read_pem(tls.ca, "CA bundle") if tls.ca else None
    key = read_pem(tls.key, "client key") if tls.key else None
    cert = read_pem(tls.cert, "client certificate") if tls.cert else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def tls_options(tls: TlsConfig | None) -> list[tuple[str, Any]]:
    if tls is not None and tls.server_name:
        return [("grpc.ssl_target_name_override", tls.server_name)]
    return []


class _CallDetails(namedtuple("_CallDetails", "method timeout metadata credentials wait_for_ready compression"),
                   grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call's metadata.

    Not gRPC's ``access_token_call_credentials``: its metadata plugin runs
    in a new Python thread for every call, which costs a sync client about
    0.4 ms per call (``bench/auth.py``); this costs a few microseconds. The
    plain-text rule is checked once when the channel is made instead."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, d) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, (*(d.metadata or ()), self._entry), d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def _make_aio(target: str, tls: TlsConfig | None, token: str | None, options: list):
    # asyncio channels take call credentials (their plugin runs on the event loop, not in a thread)
    if tls is not None:
        credentials = channel_credentials(tls)
    elif token is not None:
        credentials = grpc.local_channel_credentials()
    else:
        return grpc.aio.insecure_channel(target, options=options)
    if token is not None:
        credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(token))
    return grpc.aio.secure_channel(target, credentials, options=options)


def _make(target: str, tls: TlsConfig | None, token: str | None, options: Sequence, aio: bool):
    _check_token(target, tls, token)
    given = {key for key, _ in options}
    options = [*(o for o in KEEPALIVE_OPTIONS if o[0] not in given), *options, *tls_options(tls)]
    if aio:
        return _make_aio(target, tls, token, options)
    if tls is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, channel_credentials(tls), options=options)
    return channel if token is None else grpc.intercept_channel(channel, _BearerToken(token))


def open_channel(target: str, tls: TlsConfig | None = None, token: str | None = None, *,
                 options: Sequence = (), aio: bool = False, check_interval_s: float = DEFAULT_CHECK_INTERVAL_S,
                 grace_s: float = DEFAULT_GRACE_S):
    """A channel to ``target`` with the credentials above. Sync channels with
    TLS files rotate (:class:`RotatingChannel`); asyncio ones do not (make a
    new client after a rotation)."""
    if aio or tls is None or not tls.files():
        return _make(target, tls, token, options, aio)
    return RotatingChannel(target, tls, token, options=options, check_interval_s=check_interval_s,
                           grace_s=grace_s)


class _Multicallable:
    """A multicallable that resolves to the current channel's at each call."""

    __slots__ = ("_args", "_generation", "_kind", "_kwargs", "_owner", "_resolved")

    def __init__(self, owner: RotatingChannel, kind: str, args: tuple, kwargs: dict) -> None:
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs
        self._generation, self._resolved = -1, None

    def _current(self):
        channel, generation = self._owner._current()
        if generation != self._generation:
            self._resolved = getattr(channel, self._kind)(*self._args, **self._kwargs)
            self._generation = generation
        return self._resolved

    def __call__(self, *args, **kwargs):
        return self._current()(*args, **kwargs)

    def __getattr__(self, name: str):  # with_call, future
        return getattr(self._current(), name)


class RotatingChannel(grpc.Channel):
    """A sync channel that remakes itself when its TLS files change (module docstring)."""

    def __init__(self, target: str, tls: TlsConfig, token: str | None = None, *, options: Sequence = (),
                 check_interval_s: float = DEFAULT_CHECK_INTERVAL_S, grace_s: float = DEFAULT_GRACE_S) -> None:
        self._target, self._tls, self._token, self._options = target, tls, token, tuple(options)
        self._check_interval_s, self._grace_s = check_interval_s, grace_s
        self._lock = threading.Lock()
        self._seen = files_fingerprint(tls.files())
        self._channel = _make(target, tls, token, self._options, aio=False)
        self._generation = 0
        self._next_check = time.monotonic() + check_interval_s
        self._retired: list[tuple[threading.Timer, grpc.Channel]] = []
        self._closed = False

    @property
    def generation(self) -> int:
        """How many times the channel was remade."""
        return self._generation

    def _current(self) -> tuple[grpc.Channel, int]:
        if time.monotonic() >= self._next_check and not self._closed:
            self.check()
        return self._channel, self._generation

    def check(self) -> None:
        """Look at the files now (calls do it at most every ``check_interval_s``)."""
        with self._lock:
            self._next_check = time.monotonic() + self._check_interval_s
            seen = files_fingerprint(self._tls.files())
            if seen == self._seen:
                return
            self._seen = seen
            try:
                fresh = _make(self._target, self._tls, self._token, self._options, aio=False)
            except TlsError as err:
                log.error("TLS files changed but cannot be used; keeping the previous channel: %s", err)
                return
            old, self._channel = self._channel, fresh
            self._generation += 1
            log.info("TLS files changed: new calls to %s use new credentials; the old channel closes in %.0fs",
                     self._target, self._grace_s)
            timer = threading.Timer(self._grace_s, old.close)
            timer.daemon = True
            timer.start()
            self._retired.append((timer, old))

    def unary_unary(self, *args, **kwargs):
        return _Multicallable(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args, **kwargs):
        return _Multicallable(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args, **kwargs):
        return _Multicallable(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args, **kwargs):
        return _Multicallable(self, "stream_stream", args, kwargs)

    def subscribe(self, callback, try_to_connect=False):
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        self._channel.unsubscribe(callback)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for timer, old in self._retired:
                timer.cancel()
                old.close()
            self._retired.clear()
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
