"""What a server installs for its security settings: :func:`server_security`.

From a :class:`~blockd.auth.config.TlsConfig` (None: plain text), an
identities file and ``--insecure`` (:mod:`blockd.auth.config` reads them
from the flags), it checks the combination (:func:`~blockd.auth.config.check_listen`:
plain text is for loopback only) and returns a :class:`ServerSecurity`: the
credentials for ``add_secure_port`` (None: plain text), the interceptors to
install, and :meth:`ServerSecurity.reload` for SIGHUP.

Callers are authenticated when mutual TLS or an identities file is
configured; TLS alone encrypts but lets anyone who reaches the port do
anything, which is logged as a warning. Imports grpc and :mod:`blockd.auth`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from blockd.auth.config import TlsConfig, check_listen, is_loopback_target
from blockd.auth.interceptor import Authenticator, AuthInterceptor
from blockd.auth.quotas import Quota
from blockd.auth.tls import ReloadingCertificates, server_credentials
from blockd.auth.tokens import IdentityRegistry

log = logging.getLogger("blockd.auth")


@dataclass
class ServerSecurity:
    """What a server installs: ``credentials`` (None: plain text) and
    ``interceptors`` (empty: nobody is authenticated)."""

    credentials: grpc.ServerCredentials | None = None
    interceptors: list = field(default_factory=list)
    registry: IdentityRegistry | None = None
    certificates: ReloadingCertificates | None = None

    @property
    def authenticates(self) -> bool:
        return bool(self.interceptors)

    def quota_source(self) -> Callable[[str], Quota] | None:
        """Each tenant's quota as the identities file says it now (None without a file)."""
        registry = self.registry
        if registry is None:
            return None

        def quota(tenant: str) -> Quota:  # read at each call: a reload swaps ``current``
            return registry.current.quota_for(tenant)

        return quota

    def reload(self) -> tuple[bool, str]:
        """SIGHUP: re-read the identities file (certificates reload by themselves).
        Whether it took effect, and what happened in words."""
        if self.registry is None:
            return True, "no identities file (--tokens-file) to reload"
        return self.registry.reload(), self.registry.last_reload


def server_security(listen: str, tls: TlsConfig | None = None, tokens_file: str | None = None,
                    insecure: bool = False) -> ServerSecurity:
    """Check the settings and build what the server needs (module docstring).
    :class:`InsecureListen`, :class:`TlsError` or
    :class:`~blockd.auth.tokens.IdentitiesFileError` when they cannot be used."""
    check_listen(listen, tls, insecure)
    security = ServerSecurity()
    if tls is not None:
        security.credentials, security.certificates = server_credentials(tls)
    if tokens_file is not None:
        security.registry = IdentityRegistry(tokens_file)
    if security.registry is not None or (tls is not None and tls.mutual):
        security.interceptors.append(AuthInterceptor(Authenticator(security.registry)))
    if tls is not None and not security.authenticates:
        log.warning("TLS without caller authentication: anyone who reaches %s may do anything; give "
                    "--tls-client-ca (mutual TLS) or --tokens-file", listen)
    if tls is None and security.registry is not None and not is_loopback_target(listen):
        log.warning("bearer tokens will cross the network in plain text to %s (--insecure): use TLS", listen)
    if not security.authenticates:
        log.info("no caller authentication: every call is allowed (loopback development)")
    return security
