"""The gRPC server around an engine: blockd's three services, health,
reflection and graceful shutdown.

:class:`BlockdServer` serves the ``PoolService``, ``BlockService`` and
``WorkerService`` servicers (:mod:`blockd.service.servicer`) on a
:class:`blockd.rpc.endpoint.GrpcEndpoint`, which adds the stock health service
(SERVING for "" and for each service while up, NOT_SERVING once shutdown
begins; ``List`` answers too) and server reflection.

Shutdown (:meth:`BlockdServer.stop`): health turns NOT_SERVING, streams are
told to end, the server stops accepting calls and gives in-flight ones a
grace period, then the engine is closed (its log flushed). While it serves,
a :class:`~blockd.engine.retention.pins.PinExpiry` thread lets pins past their
deadline go. Owns no allocation logic.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from blockd.auth.config import TlsConfig
from blockd.engine.machine import Engine
from blockd.engine.retention.pins import PinExpiry
from blockd.rpc.addresses import split_listen
from blockd.rpc.endpoint import GrpcEndpoint
from blockd.rpc.errors import method_handlers
from blockd.service.lane import StepLane
from blockd.service.servicer import BlockServicer, PoolServicer, StepStreamsFull, WorkerServicer
from blockd.v1 import blockd_pb2 as pb

log = logging.getLogger("blockd.server")

#: RPC threads, created on demand; every open Watch/Events/StepStream stream holds one
#: for its lifetime, so this bounds followers + concurrent unary calls (StepStreams
#: may hold at most half of them: blockd.service.servicer.StepStreamsFull)
DEFAULT_MAX_WORKERS = 128
DEFAULT_GRACE_S = 5.0
#: large enough for a full table dump of a big pool or a very long prompt
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


class BlockdServer:
    """One engine served over gRPC on one address (port 0 picks a free port).

    ``interceptors`` wrap every handler (e.g. :mod:`blockd.service.metrics`' RPC timer,
    :mod:`blockd.auth`'s interceptor); ``credentials`` (from
    :func:`blockd.auth.server_security`) serve TLS instead of plain text.
    ``extra_services``: more ``(servicer, service descriptor)`` pairs to serve (a
    replica's ``ReplicationService``). ``step_lane_port``: serve the step lane
    (:mod:`blockd.service.lane`) on that port of the listen host (0: a free
    one; None: no lane), TLS with ``lane_tls`` (the gRPC port's files) when given.
    """

    def __init__(self, engine: Engine, listen: str = "127.0.0.1:0", *,
                 max_workers: int = DEFAULT_MAX_WORKERS, grace_s: float = DEFAULT_GRACE_S,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 interceptors: Sequence[grpc.ServerInterceptor] = (),
                 credentials: grpc.ServerCredentials | None = None,
                 extra_services: Sequence[tuple[object, Any]] = (), step_lane_port: int | None = None,
                 lane_tls: TlsConfig | None = None) -> None:
        self.engine = engine
        self.grace_s = grace_s
        self._shutdown = threading.Event()
        self._stopped = False
        extra, services = list(extra_services), pb.DESCRIPTOR.services_by_name
        blocks = BlockServicer(engine, self._shutdown, max(1, max_workers // 2))
        self._endpoint = GrpcEndpoint(
            [(PoolServicer(engine), services["PoolService"]), (blocks, services["BlockService"]),
             (WorkerServicer(engine), services["WorkerService"]), *extra],
            listen, max_workers=max_workers, max_message_bytes=max_message_bytes,
            thread_name_prefix="blockd-rpc", interceptors=interceptors,
            # two daemons on one port would split the pools' writers
            options=[("grpc.so_reuseport", 0)], credentials=credentials)
        #: lets pins past their deadline go while this server runs (blockd.engine.retention.pins)
        self._pin_expiry = PinExpiry(engine.expire_pins)
        self.health = self._endpoint.health
        self.port = self._endpoint.port
        self.address = self._endpoint.address
        self.lane: StepLane | None = None
        if step_lane_port is not None:
            if credentials is not None and lane_tls is None:
                raise ValueError("a TLS server's step lane needs its TLS files (lane_tls): it never serves "
                                 "in plain text what the gRPC port serves over TLS")
            host, _ = split_listen(listen)
            self.lane = StepLane(
                method_handlers(blocks, services["BlockService"])["StepStream"], interceptors, host, step_lane_port,
                tls=lane_tls, max_bytes=max_message_bytes, max_connections=blocks.max_step_streams + 16,
                shutdown=self._shutdown, refused=blocks.refused,
                full=lambda: StepStreamsFull("blockd's step lane has no room for another connection: step by "
                                             "unary Step (the SDK does), or raise --max-workers"),
                hold=engine.hold, waits=engine.waits, acknowledge=engine.acknowledge,
                behind=(engine.acknowledge_behind, engine.acknowledged_behind) if engine.syncs_behind else None)
            blocks.step_lane = (self.lane.port, self.lane.tls)

    def start(self) -> None:
        self._endpoint.start()
        if self.lane is not None:
            self.lane.start()
            log.info("serving the step lane on %s%s", self.lane.address, " (TLS)" if self.lane.tls else "")
        self._pin_expiry.start()
        log.info("serving %s on %s", ", ".join(self._endpoint.service_names), self.address)

    @property
    def stopping(self) -> bool:
        """True from :meth:`stop` on (health stays NOT_SERVING from then)."""
        return self._stopped

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
        if self.lane is not None:
            self.lane.stop()
        self._endpoint.stop(grace)
        self._pin_expiry.stop()
        self.engine.close()
        log.info("stopped")

    def wait_for_termination(self, timeout_s: float | None = None) -> bool:
        return self._endpoint.wait_for_termination(timeout_s)
