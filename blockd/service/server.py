"""The gRPC server around an engine: services, health, reflection, shutdown.

:class:`BlockdServer` registers the three blockd services, the stock health
service (grpcio-health-checking: SERVING for "" and for each service while
up, NOT_SERVING once shutdown begins; ``List`` answers too) and server
reflection, both through :mod:`blockd.service.stock`.

Handlers are built from the service descriptors
(:func:`blockd.service.errors.method_handlers`) rather than the generated
``add_*_to_server`` helpers for one reason: the request deserializer must not
raise, or gRPC answers INTERNAL (and logs a traceback) for a request whose
bytes do not parse; :func:`blockd.service.errors.lenient_parser` makes that
INVALID_ARGUMENT instead. The same goes for health and reflection.

Shutdown (:meth:`BlockdServer.stop`): health turns NOT_SERVING, streams are
told to end, the server stops accepting calls and gives in-flight ones a
grace period, then the engine is closed (its log flushed). Owns no
allocation logic.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2

from blockd.engine import Engine
from blockd.service.errors import method_handlers
from blockd.service.servicer import BlockServicer, PoolServicer, WorkerServicer
from blockd.service.stock import add_stock_services
from blockd.v1 import blockd_pb2 as pb

log = logging.getLogger("blockd.server")

SERVICE_NAMES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())
#: RPC threads, created on demand; every open Watch/Events stream holds one for
#: its lifetime, so this bounds followers + concurrent unary calls
DEFAULT_MAX_WORKERS = 128
DEFAULT_GRACE_S = 5.0
#: large enough for a full table dump of a big pool or a very long prompt
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

__all__ = ["BlockdServer", "method_handlers", "split_address"]


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 hosts in brackets) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address must be HOST:PORT, got {address!r}")
    return host, int(port)


class BlockdServer:
    """One engine served over gRPC on one address (port 0 picks a free port).

    ``interceptors`` wrap every handler (e.g. :mod:`blockd.metrics`' RPC timer,
    :mod:`blockd.auth`'s interceptor); ``credentials`` (from
    :func:`blockd.auth.server_security`) serve TLS instead of plain text.
    """

    def __init__(self, engine: Engine, listen: str = "127.0.0.1:0", *,
                 max_workers: int = DEFAULT_MAX_WORKERS, grace_s: float = DEFAULT_GRACE_S,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 interceptors: Sequence[grpc.ServerInterceptor] = (),
                 credentials: grpc.ServerCredentials | None = None) -> None:
        host, _ = split_address(listen)
        self.engine = engine
        self.grace_s = grace_s
        self._shutdown = threading.Event()
        self._stopped = False
        options = [
            # two daemons on one port would split the pools' writers
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="blockd-rpc")
        self._server = grpc.server(executor, interceptors=list(interceptors), options=options)
        services = {
            "blockd.v1.PoolService": PoolServicer(engine),
            "blockd.v1.BlockService": BlockServicer(engine, self._shutdown),
            "blockd.v1.WorkerService": WorkerServicer(engine),
        }
        for name, servicer in services.items():
            descriptor = pb.DESCRIPTOR.services_by_name[name.rsplit(".", 1)[1]]
            self._server.add_registered_method_handlers(name, method_handlers(servicer, descriptor))
        self.health = add_stock_services(self._server, SERVICE_NAMES)
        if credentials is not None:
            self.port = self._server.add_secure_port(listen, credentials)
        else:
            self.port = self._server.add_insecure_port(listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {listen!r} (address in use or not local?)")
        self.address = f"{host}:{self.port}"

    def start(self) -> None:
        self._server.start()
        for name in ("", *SERVICE_NAMES):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s", ", ".join(SERVICE_NAMES), self.address)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting calls, let in-flight ones finish within the grace
        period, end every stream, then close the engine. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.grace_s if grace_s is None else grace_s
        log.info("shutting down: %.1fs grace for in-flight calls", grace)
        self.health.enter_graceful_shutdown()
        self._shutdown.set()
        self._server.stop(grace).wait()
        self.engine.close()
        log.info("stopped")

    def wait_for_termination(self, timeout_s: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout_s)
