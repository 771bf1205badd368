"""OpenTelemetry tracing of a scheduler step across its three processes: the
switch, the spans, and the trace context on the wire.

One step's trace::

    scheduler.step                              (the scheduler's process)
      ├─ blockd.v1.BlockService/Step  CLIENT    (unary Step; a StepStream step sends its
      │    └─ .../Step  SERVER                   context in StepRequest.traceparent instead)
      └─ blockd.v1.KVShardService/ModelStep CLIENT   (one per rank)
           └─ .../ModelStep SERVER              (each worker)
                ├─ model_forward
                │    └─ write_kv, attention     (per layer: the kernel parts the worker times)
                └─ sampling

**Off by default, and free when off.** Tracing is on in a process only when
the standard OpenTelemetry variables ask for an exporter
(:func:`settings_from_env`) or an application hands over its own provider
(:func:`use`). Off, :data:`tracer` is None: no interceptor is installed on a
server or a channel, and each hook on the hot path is one ``is None`` test
(:func:`span` returns a shared no-op context). opentelemetry is imported only
when tracing is switched on, so without the ``otel`` extra nothing of it
loads.

**Traces start in the scheduler.** A server opens a span only for a call that
carries a trace context, so heartbeats, Watch streams and ``blockctl`` calls
make no traces of their own.

Imports the standard library only (the interceptors, which need grpc, are
:mod:`blockd.rpc.trace_grpc`); opentelemetry only inside the functions that
run once tracing is on. Never the daemon.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

#: the process's tracer once tracing is on; None (the default) means off
tracer: Any = None
_provider: Any = None
_decided = False
_OFF = contextlib.nullcontext()

#: OTEL_TRACES_EXPORTER values this build can serve
EXPORTERS = ("otlp", "console", "none")
#: the OTLP/gRPC port a collector listens on when only OTEL_TRACES_EXPORTER=otlp is set
DEFAULT_OTLP_ENDPOINT = "http://localhost:4317"


class TracingConfigError(ValueError):
    """Tracing settings that cannot work; the message says which variable and why."""


def settings_from_env(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """``(exporter, endpoint)`` the OpenTelemetry variables ask for, or None (off).

    On when ``OTEL_TRACES_EXPORTER`` is ``otlp`` or ``console``, or when it is
    unset and an OTLP endpoint is (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT``): setting a collector's address is the
    switch. ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: off.
    The SDK's own default (``otlp`` when nothing is set) is deliberately not
    followed: tracing must cost nothing unless asked for."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or "").strip()
    if exporter == "none" or (not exporter and not endpoint):
        return None
    exporter = exporter or "otlp"
    if exporter not in EXPORTERS:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={exporter!r} is not one of {', '.join(EXPORTERS)} "
                                 "(blockd exports spans over OTLP/gRPC, or prints them with console)")
    if exporter == "otlp":
        protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                    or "grpc").strip()
        if protocol != "grpc":
            raise TracingConfigError(f"OTLP protocol {protocol!r}: blockd exports OTLP over gRPC only (the otel "
                                     "extra's exporter); unset OTEL_EXPORTER_OTLP_PROTOCOL or set it to grpc")
        endpoint = endpoint or DEFAULT_OTLP_ENDPOINT
        parts = urlsplit(endpoint)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise TracingConfigError(
                f"OTLP endpoint {endpoint!r} is not a URL like http://collector:4317 (scheme http for plain "
                "text or https for TLS, a host, an optional port): check OTEL_EXPORTER_OTLP_ENDPOINT")
    return exporter, endpoint


def set_up(service_name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Switch tracing on for this process if the environment asks for it
    (:func:`settings_from_env`); True when on. The first call decides: later
    ones (the SDK's, inside a worker that already decided) change nothing.
    :class:`TracingConfigError` for settings that cannot work, or when they
    ask for tracing and the ``otel`` extra is not installed."""
    global _decided  # noqa: PLW0603 - the process's one switch (see tracer)
    if _decided:
        return tracer is not None
    environ = os.environ if environ is None else environ
    settings = settings_from_env(environ)
    _decided = True
    if settings is None:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        _decided = False
        raise TracingConfigError("tracing is asked for (OTEL_* variables) but OpenTelemetry is not installed: "
                                 "pip install 'blockd[otel]', or unset OTEL_EXPORTER_OTLP_ENDPOINT and "
                                 "OTEL_TRACES_EXPORTER") from None
    exporter, endpoint = settings
    if exporter == "console":
        span_exporter: Any = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        span_exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are read by Resource.create; ours is the fallback
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    # batched, on the processor's own thread: a span's end costs the step a queue append
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    use(provider)
    return True


def use(provider: Any) -> None:
    """Trace with ``provider`` (an ``opentelemetry.sdk.trace.TracerProvider``):
    an application that configures OpenTelemetry itself, or a test with the
    SDK's in-memory exporter. ``None`` switches tracing off again. Channels
    and servers made before keep what they were made with."""
    # module globals, not an object's fields: the hot path's check is one attribute read
    global tracer, _provider, _decided  # noqa: PLW0603
    _provider, _decided = provider, True
    tracer = None if provider is None else provider.get_tracer("blockd")


def shut_down() -> None:
    """Export what is still queued and stop the exporter (a server's graceful stop)."""
    if _provider is not None and hasattr(_provider, "shutdown"):
        _provider.shutdown()


# --- spans ------------------------------------------------------------------------------
def span(name: str) -> Any:
    """A context manager: a span of ``name`` under the current one, or nothing when off."""
    if tracer is None:
        return _OFF
    return tracer.start_as_current_span(name)


def record(name: str, seconds: float, **attributes: Any) -> None:
    """A span of ``name`` that ended now and lasted ``seconds``, under the
    current span: for parts already timed (a worker's kernels), so a traced
    part costs one wall-clock read more, not a timer of its own around it.
    Call only when :data:`tracer` is set."""
    end = time.time_ns()
    span = tracer.start_span(name, start_time=end - int(seconds * 1e9), attributes=attributes or None)
    span.end(end_time=end)


def carry(fn: Callable) -> Callable:
    """``fn`` bound to the caller's context (its current span), to run on
    another thread; ``fn`` itself when off."""
    if tracer is None:
        return fn
    return functools.partial(contextvars.copy_context().run, fn)


# --- the trace context on the wire --------------------------------------------------------
def traceparent() -> str:
    """The current span's W3C ``traceparent`` value; "" when off or outside a span."""
    if tracer is None:
        return ""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent", "")


def _parent(carrier: Mapping[str, str]) -> Any:
    """The remote context ``carrier`` names, or None when it names none."""
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    context = extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def server_span(name: str, carrier: Mapping[str, str] | str) -> Any:
    """A context manager: a SERVER span of ``name`` under the caller's span
    that ``carrier`` names (call metadata, or a ``traceparent`` value), current
    while the call is served; nothing when the caller sent no trace context
    (module docstring) or tracing is off."""
    if tracer is None or not carrier:
        return _OFF
    parent = _parent({"traceparent": carrier} if isinstance(carrier, str) else carrier)
    if parent is None:
        return _OFF
    from opentelemetry.trace import SpanKind

    return tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER)
