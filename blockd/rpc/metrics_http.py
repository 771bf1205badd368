"""The ``/metrics`` HTTP endpoint that blockd and its workers serve beside gRPC.

:func:`serve_metrics` starts prometheus_client's HTTP server for one
registry and returns a :class:`MetricsServer` to close it with. The address
defaults to ``$BLOCKD_METRICS_ADDR`` or 127.0.0.1 for both programs: metrics
stay on loopback unless an operator (or a container) opens them up. What is
measured is each side's own (:mod:`blockd.service.metrics`, :mod:`worker.metrics`).

With ``tls`` (HTTPS; with ``tls.ca``, client certificates required) or a
``users_file`` (basic auth), the registry is served by
:mod:`blockd.auth.metrics_endpoint` instead: prometheus_client's own server
has TLS but no basic auth. Both kinds have ``reload()`` (SIGHUP: the
certificate and the users file) and ``close()``. Imports prometheus_client
and :mod:`blockd.auth`; never the daemon.
"""

from __future__ import annotations

import os
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app, start_http_server

from blockd.auth.config import TlsConfig
from blockd.auth.metrics_endpoint import MetricsEndpoint

DEFAULT_METRICS_ADDR = "127.0.0.1"
ADDR_ENV = "BLOCKD_METRICS_ADDR"


class MetricsServer:
    """A running ``/metrics`` HTTP endpoint; ``port`` is the bound port."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.addr, self.port = server.server_address[:2]

    def reload(self) -> list[str]:
        """Nothing to re-read without TLS or basic auth (SIGHUP calls it): no problems."""
        return []

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


#: what :func:`serve_metrics` returns: either kind has ``addr``, ``port``, ``reload()`` and ``close()``
ServedMetrics = MetricsServer | MetricsEndpoint


def serve_metrics(registry: CollectorRegistry, port: int, addr: str | None = None, *,
                  tls: TlsConfig | None = None, users_file: str | None = None) -> ServedMetrics:
    """Serve ``registry`` on ``addr:port`` (port 0 picks a free one; see ``.port``)."""
    if type(port) is not int or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an int in 0..65535, got {port!r}")
    host = addr if addr is not None else os.environ.get(ADDR_ENV, DEFAULT_METRICS_ADDR)
    if tls is not None or users_file is not None:
        return MetricsEndpoint(make_wsgi_app(registry), host, port, tls, users_file)
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)


__all__ = ["DEFAULT_METRICS_ADDR", "MetricsServer", "ServedMetrics", "serve_metrics"]
