"""Security for blockd's servers and clients: TLS, who is calling, what it may do.

============================  ===========================================================
module                        owns
============================  ===========================================================
:mod:`~blockd.auth.tls`       :class:`TlsConfig`; server credentials (TLS / mutual TLS)
                              that reload certificate, key and CA when the files change
:mod:`~blockd.auth.channels`  client channels: TLS, client certificates, bearer tokens,
                              :class:`RotatingChannel` for client-side rotation
:mod:`~blockd.auth.identity`  :class:`Identity`, the certificate URI scheme, the per-call
                              :func:`current_identity` and :func:`require_tenant`
:mod:`~blockd.auth.policy`    roles, permissions, the permission of every RPC
:mod:`~blockd.auth.tokens`    the identities file (hashed tokens, certificate subjects),
                              reloaded on SIGHUP
:mod:`~blockd.auth.interceptor`  the one server interceptor: authenticate, authorize, audit
:mod:`~blockd.auth.audit`     JSON audit lines on the ``blockd.audit`` logger
:mod:`~blockd.auth.metrics_endpoint`  ``/metrics`` over TLS with basic auth
:mod:`~blockd.auth.certs`     development certificates (``blockd certs``)
:mod:`~blockd.auth.cli`       ``blockd tokens`` and ``blockd certs``
============================  ===========================================================

:func:`server_security` is what a server calls once: from its flags it
returns the credentials for ``add_secure_port`` (or None: plain text) and
the interceptors to install. Used by the daemon, the worker and the SDK
alike, so it imports only the standard library, grpc (with grpcio-status),
``cryptography`` and :mod:`blockd.core.errors`; never the engine, the
service layer, the client or the worker (a test checks).
"""

from __future__ import annotations

from blockd.auth.channels import RotatingChannel, is_loopback_target, open_channel
from blockd.auth.identity import (
    ROLES,
    AccessDenied,
    Identity,
    acting_as,
    current_identity,
    require_tenant,
    visible_to_caller,
)
from blockd.auth.security import ServerSecurity, server_security
from blockd.auth.tls import TlsConfig, TlsError
from blockd.auth.tokens import IdentityRegistry

__all__ = [
    "ROLES",
    "AccessDenied",
    "Identity",
    "IdentityRegistry",
    "RotatingChannel",
    "ServerSecurity",
    "TlsConfig",
    "TlsError",
    "acting_as",
    "current_identity",
    "is_loopback_target",
    "open_channel",
    "require_tenant",
    "server_security",
    "visible_to_caller",
]
