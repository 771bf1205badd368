"""Security for blockd's servers and clients: TLS, who is calling, what it may do.

============================  ===========================================================
module                        owns
============================  ===========================================================
:mod:`~blockd.auth.config`    :class:`TlsConfig`, the security flags, plain text for loopback only
:mod:`~blockd.auth.tls`       server credentials (TLS / mutual TLS) that reload certificate,
                              key and CA when the files change
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
:mod:`~blockd.auth.security`  :func:`server_security`: credentials and interceptors of a server
============================  ===========================================================

:func:`server_security` is what a server calls once: from its settings it
returns the credentials for ``add_secure_port`` (or None: plain text) and
the interceptors to install. Used by the daemon, the worker and the SDK
alike, so the package imports only the standard library, grpc (with
grpcio-status), ``cryptography`` and :mod:`blockd.core.errors`; never the
engine, the service layer, the client or the worker (a test checks). The
names below are imported on first use.
"""

from __future__ import annotations

import importlib

#: the public names, by the module that defines them (imported on first use, so that
#: ``import blockd.auth.config`` stays free of grpc and cryptography)
_EXPORTS = {
    "RotatingChannel": "channels", "open_channel": "channels",
    "TlsConfig": "config", "TlsError": "config", "is_loopback_target": "config",
    "ROLES": "identity", "AccessDenied": "identity", "Identity": "identity", "acting_as": "identity",
    "current_identity": "identity", "require_tenant": "identity", "visible_to_caller": "identity",
    "ServerSecurity": "security", "server_security": "security",
    "IdentityRegistry": "tokens",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'blockd.auth' has no attribute {name!r}")
    return getattr(importlib.import_module(f"blockd.auth.{module}"), name)


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
