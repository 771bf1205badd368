"""One gRPC endpoint: the server plumbing blockd and its workers share.

:class:`GrpcEndpoint` builds a ``grpc.server`` on one address, registers the
given services and the stock health and reflection services
(:mod:`blockd.rpc.stock`), and drives health through the endpoint's life:
SERVING for "" and each service once started, NOT_SERVING once shutdown
begins. The daemon's server (:mod:`blockd.service.server`) and the worker's
(:mod:`worker.service`) are this plus their servicers.

Handlers are built from the service descriptors
(:func:`blockd.rpc.errors.method_handlers`) rather than the generated
``add_*_to_server`` helpers for one reason: the request deserializer must not
raise, or gRPC answers INTERNAL (and logs a traceback) for a request whose
bytes do not parse; :func:`blockd.rpc.errors.lenient_parser` makes that
INVALID_ARGUMENT instead. The same goes for health and reflection.

The server accepts a client's keepalive pings every second even on a quiet
stream (gRPC's default refuses more than one in 5 minutes without data, and
ends the connection): our clients ping every 2 s while a call is open
(:data:`blockd.auth.channels.KEEPALIVE_OPTIONS`) to notice a paused server.
Imports grpc and the rest of :mod:`blockd.rpc`; never the daemon.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent import futures

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2

from blockd.rpc.addresses import join, split_listen
from blockd.rpc.errors import method_handlers
from blockd.rpc.stock import add_stock_services


class GrpcEndpoint:
    """``services`` (servicer, descriptor) pairs served on ``listen`` (port 0
    picks a free port); ``address`` is then the bound ``HOST:PORT``.

    ``max_workers`` bounds the RPC threads (created on demand; every open
    stream holds one for its lifetime); ``max_message_bytes`` caps messages
    both ways; ``interceptors`` wrap every handler; ``options`` are extra
    ``grpc.server`` channel arguments; ``credentials`` (TLS, from
    :func:`blockd.auth.security.server_security`) serve a secure port instead
    of plain text.
    """

    def __init__(self, services: Iterable[tuple[object, ServiceDescriptor]], listen: str, *, max_workers: int,
                 max_message_bytes: int, thread_name_prefix: str,
                 interceptors: Sequence[grpc.ServerInterceptor] = (),
                 options: Sequence[tuple[str, object]] = (),
                 credentials: grpc.ServerCredentials | None = None) -> None:
        host, _ = split_listen(listen)
        executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self.server = grpc.server(executor, interceptors=list(interceptors), options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),  # ..._MIN_RECV_PING_INTERVAL_..._MS in C
            ("grpc.keepalive_permit_without_calls", 1),
            *options])
        names = []
        for servicer, descriptor in services:
            self.server.add_registered_method_handlers(descriptor.full_name, method_handlers(servicer, descriptor))
            names.append(descriptor.full_name)
        self.service_names = tuple(names)
        self.health = add_stock_services(self.server, self.service_names)
        if credentials is not None:
            self.port = self.server.add_secure_port(listen, credentials)
        else:
            self.port = self.server.add_insecure_port(listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {listen!r} (address in use or not local?)")
        self.address = join(host, self.port)

    def start(self) -> None:
        self.server.start()
        for name in ("", *self.service_names):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float) -> None:
        """Health turns NOT_SERVING, then the server stops accepting calls and
        gives in-flight ones ``grace_s``; returns when they are done."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()

    def wait_for_termination(self, timeout_s: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout_s)
