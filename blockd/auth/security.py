"""A server's or a client's security settings, from flags to gRPC objects.

Servers (``blockd serve``, later ``blockd-worker``) add the flags with
:func:`add_tls_flags` and turn them into a :class:`ServerSecurity` with
:func:`server_security`: the credentials for ``add_secure_port`` (None:
plain text), the interceptors to install, and :meth:`ServerSecurity.reload`
for SIGHUP. Clients (``blockctl``, the SDK) add theirs with the same
function and read them with :func:`client_security`.

Flags (each with an environment variable by the project's one rule,
:mod:`blockd.config_env`):

=============================  ==============================================================
server flag                    meaning
=============================  ==============================================================
``--tls-cert``/``--tls-key``   the server's certificate chain and key (PEM): TLS on
``--tls-client-ca``            CA bundle client certificates must chain to: mutual TLS on
``--tls-require-client-cert``  say so explicitly (needs ``--tls-client-ca``; gRPC Python has
                               no optional client certificate, so the CA alone already requires)
``--tokens-file``              the identities file (:mod:`blockd.auth.tokens`), reloaded on SIGHUP
``--insecure``                 allow plain text on a non-loopback address
=============================  ==============================================================

=============================  ==============================================================
client flag                    meaning
=============================  ==============================================================
``--tls-ca``                   CA bundle to verify the server: TLS on
``--tls-cert``/``--tls-key``   a client certificate (mutual TLS)
``--tls-server-name``          the name to check in the server's certificate, when it is not
                               the host dialled
``--token``/``--token-file``   a bearer token, or a file holding one (a Secret mount)
=============================  ==============================================================

Plain text is for loopback only: :func:`check_listen` refuses a
non-loopback listen address without TLS unless ``--insecure`` says so.
Callers are authenticated when mutual TLS or a tokens file is configured;
TLS alone encrypts but lets anyone who reaches the port do anything, which
is logged as a warning. Imports the standard library and :mod:`blockd.auth`.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

import grpc

from blockd.auth.channels import is_loopback_target
from blockd.auth.interceptor import Authenticator, AuthInterceptor
from blockd.auth.tls import ReloadingCertificates, TlsConfig, TlsError, server_credentials
from blockd.auth.tokens import IdentityRegistry

log = logging.getLogger("blockd.auth")


class InsecureListen(ValueError):
    """A non-loopback address without TLS and without ``--insecure``."""


def add_tls_flags(parser: argparse.ArgumentParser, *, server: bool = False, client: bool = False) -> None:
    """The flags above; a worker (both sides) passes both."""
    group = parser.add_argument_group("security")
    group.add_argument("--tls-cert", default=None, help="PEM certificate chain of this process")
    group.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    if server:
        group.add_argument("--tls-client-ca", default=None,
                           help="CA bundle that client certificates must chain to: turns on mutual TLS")
        group.add_argument("--tls-require-client-cert", action="store_true",
                           help="require client certificates (mutual TLS; needs --tls-client-ca)")
        group.add_argument("--tokens-file", default=None,
                           help="identities file: hashed bearer tokens and certificate subjects "
                                "(blockd tokens add); reloaded on SIGHUP")
        group.add_argument("--insecure", action="store_true",
                           help="allow plain text on a non-loopback address (a trusted network only)")
    if client:
        group.add_argument("--tls-ca", default=None, help="CA bundle to verify the server with: turns on TLS")
        group.add_argument("--tls-server-name", default=None,
                           help="name to verify in the server's certificate (default: the dialled host)")
        group.add_argument("--token", default=None,
                           help="bearer token (prefer --token-file or the environment: a flag shows in ps)")
        group.add_argument("--token-file", default=None, help="file holding the bearer token")


def server_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The server's :class:`TlsConfig` from its flags; :class:`TlsError` for a
    combination that cannot work."""
    if args.tls_require_client_cert and not args.tls_client_ca:
        raise TlsError("--tls-require-client-cert needs --tls-client-ca, the CA bundle client certificates "
                       "are verified against")
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca:
            raise TlsError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        return None
    return TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_client_ca)


def client_security(args: argparse.Namespace) -> tuple[TlsConfig | None, str | None]:
    """``(tls, token)`` for :func:`blockd.auth.channels.open_channel` from a client's flags."""
    token = args.token
    if args.token_file:
        if token:
            raise TlsError("give --token or --token-file, not both")
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as err:
            raise TlsError(f"cannot read --token-file {args.token_file}: {err.strerror}") from None
    if args.tls_ca is None and args.tls_cert is None and args.tls_server_name is None:
        return None, token
    return TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name), token


def check_listen(listen: str, tls: TlsConfig | None, insecure: bool) -> None:
    """Refuse plain text on an address other hosts can reach (module docstring)."""
    if tls is None and not insecure and not is_loopback_target(listen):
        raise InsecureListen(
            f"refusing to listen on {listen} without TLS: anyone who can reach that address could read and "
            "change every pool. Give --tls-cert and --tls-key (and --tls-client-ca for mutual TLS), listen on "
            "a loopback address (127.0.0.1), or pass --insecure to accept plain text on a trusted network")


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

    def reload(self) -> None:
        """SIGHUP: re-read the identities file (certificates reload by themselves)."""
        if self.registry is not None:
            self.registry.reload()


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
