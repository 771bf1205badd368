"""Trace context over gRPC metadata: the interceptors :mod:`blockd.rpc.tracing`
installs when tracing is on, and only then.

* :func:`server_interceptors`: a unary call that carries a ``traceparent``
  in its metadata is served inside a SERVER span under the caller's span
  (:func:`blockd.rpc.tracing.server_span`); calls without one are served as
  they are. Streams pass through: a StepStream opens a span per step from
  ``StepRequest.traceparent`` (:mod:`blockd.service.servicer`), since gRPC
  has no metadata per stream message.
* :func:`intercept`: a channel whose unary calls made inside a span get a
  CLIENT span and send its context as ``traceparent`` metadata.

Both return what they were given (no interceptor, no wrapper) while
tracing is off. Imports grpc and :mod:`blockd.rpc.tracing`; never the daemon.
"""

from __future__ import annotations

from typing import Any

import grpc

from blockd.rpc import tracing


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """What a server adds to its interceptors: none while tracing is off."""
    return [] if tracing.tracer is None else [_ServerTracing()]


def intercept(channel: Any) -> Any:
    """``channel`` with :class:`_ClientTracing` when tracing is on (sync channels only)."""
    if tracing.tracer is None or isinstance(channel, grpc.aio.Channel):
        return channel
    return grpc.intercept_channel(channel, _ClientTracing())


class _ServerTracing(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        if not any(key == "traceparent" for key, _ in metadata):
            return handler
        carrier = {key: value for key, value in metadata if isinstance(value, str)}
        name, inner = handler_call_details.method.lstrip("/"), handler.unary_unary

        def traced(request, context):
            with tracing.server_span(name, carrier):
                return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(traced, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata) -> None:
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = d.credentials, d.wait_for_ready, d.compression


class _ClientTracing(grpc.UnaryUnaryClientInterceptor):
    def intercept_unary_unary(self, continuation, client_call_details, request):
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        if not trace.get_current_span().get_span_context().is_valid:
            return continuation(client_call_details, request)  # not part of a trace: start none
        method = client_call_details.method
        name = method.decode() if isinstance(method, bytes) else method
        with tracing.tracer.start_as_current_span(name.lstrip("/"), kind=SpanKind.CLIENT) as span:
            metadata = (*(client_call_details.metadata or ()), ("traceparent", tracing.traceparent()))
            outcome = continuation(_Details(client_call_details, metadata), request)
            # a blocking call is complete here; the span ends with it, its code recorded
            code = outcome.code() if hasattr(outcome, "code") else None
            if code is not None and code != grpc.StatusCode.OK:
                span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
            return outcome
