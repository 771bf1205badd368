"""The stock health and reflection services, served so that a client's mistake
is a clear INVALID_ARGUMENT and never a logged traceback.

The state and the answers stay the stock ones (grpcio-health-checking,
grpcio-reflection); only the way they are registered differs from the
generated ``add_*_to_server`` helpers:

* requests are read with :func:`~blockd.rpc.errors.lenient_parser`: bytes
  that do not parse get INVALID_ARGUMENT through the one error mapping, where
  the stock registration answers INTERNAL and gRPC logs "Exception
  deserializing message!" with a traceback for every such call;
* ``Health.List`` is implemented (reflection advertises it; the stock
  servicer leaves it UNIMPLEMENTED);
* a health service name longer than any name blockd serves is
  INVALID_ARGUMENT before anything echoes it.

Used by blockd's server and by the worker's. Imports grpc and the stock
services; never the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from blockd.core.validate import MAX_ID_LEN
from blockd.rpc.errors import (
    BadField,
    MalformedRequest,
    method_handlers,
    server_stream,
    status_for,
    unary,
)

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


class HealthServicer(health.HealthServicer):
    """The stock servicer (``set``, ``enter_graceful_shutdown``, ``Check``,
    non-blocking ``Watch``) plus ``List``."""

    def List(self, request, context):  # -> health_pb2.HealthListResponse (newer than the stubs)
        # the parent keeps the statuses in _server_status under _lock (not in its stubs)
        with self._lock:  # type: ignore[attr-defined]
            statuses = dict(self._server_status)  # type: ignore[attr-defined]
        return health_pb2.HealthListResponse(  # type: ignore[attr-defined]
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()})


def _service_name(request) -> str:
    if len(request.service) > MAX_ID_LEN:
        raise BadField("service", f"is {len(request.service)} characters long; service names are at most "
                                  f"{MAX_ID_LEN}")
    return request.service


class _Health:
    """Adapter: every failure leaves through :mod:`blockd.rpc.errors`."""

    def __init__(self, servicer: HealthServicer) -> None:
        self._servicer = servicer

    @unary
    def Check(self, request, context):
        _service_name(request)
        return self._servicer.Check(request, context)

    @unary
    def List(self, request, context):
        return self._servicer.List(request, context)

    def Watch(self, request, context, send_response_callback=None):
        # non-blocking like the stock Watch: no RPC thread held per watcher
        try:
            if isinstance(request, MalformedRequest):
                raise request
            _service_name(request)
        except BadField as err:
            context.abort_with_status(status_for(err, "Watch"))
        return self._servicer.Watch(request, context, send_response_callback)

    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]  # gRPC reads this marker


def _parsed(requests: Iterable) -> Iterator:
    for request in requests:
        if isinstance(request, MalformedRequest):
            raise request
        yield request


class _Reflection:
    def __init__(self, service_names: Iterable[str]) -> None:
        self._servicer = reflection.ReflectionServicer(tuple(service_names))

    @server_stream
    def ServerReflectionInfo(self, requests, context):
        yield from self._servicer.ServerReflectionInfo(_parsed(requests), context)


def add_stock_services(server: grpc.Server, service_names: Iterable[str]) -> HealthServicer:
    """Register health and reflection (which lists ``service_names`` and
    itself and health) on ``server``; returns the health servicer, whose
    ``set`` and ``enter_graceful_shutdown`` the caller drives."""
    servicer = HealthServicer(experimental_non_blocking=True)
    server.add_registered_method_handlers(HEALTH.full_name, method_handlers(_Health(servicer), HEALTH))
    names = (*service_names, HEALTH.full_name, REFLECTION.full_name)
    server.add_registered_method_handlers(REFLECTION.full_name,
                                          method_handlers(_Reflection(names), REFLECTION))
    return servicer
