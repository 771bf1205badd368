"""Security settings as plain data: :class:`TlsConfig`, the flags that fill
it, and the rule that plain text is for loopback only.

Servers (``blockd serve``, later ``blockd-worker``) add the flags with
:func:`add_tls_flags` and read them with :func:`server_tls` (then
:func:`blockd.auth.server_security` builds the gRPC side); clients
(``blockctl``, the SDK) add theirs with the same function and read them
with :func:`client_security`.

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
Standard library only, so ``blockd --help`` and the flag parsing of every
program stay free of grpc and ``cryptography``.
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass

#: development leaf certificates' default validity in days (the CA's: ten years;
#: :mod:`blockd.auth.certs`, ``blockd certs --days``)
CERT_DAYS = 30


class TlsError(ValueError):
    """TLS settings or files that cannot work; the message names the file and the fix."""


@dataclass(frozen=True)
class TlsConfig:
    """Paths of PEM files; what each means on a server and on a client: :mod:`blockd.auth.tls`."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsError("a TLS certificate and its key go together: give both or neither")

    @property
    def mutual(self) -> bool:
        """As a server: whether clients must present a certificate."""
        return self.ca is not None

    def files(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert, self.key, self.ca) if p is not None)


def target_host(target: str) -> str:
    """The host of a gRPC target or listen address ``HOST:PORT`` (a ``dns:``/``ipv4:``/
    ``ipv6:`` scheme prefix allowed, IPv6 brackets removed; a bare host is itself)."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    host = target.rpartition(":")[0] if ":" in target else target
    return host.strip("[]")


def is_loopback_target(target: str) -> bool:
    """``localhost:P``, ``127.x.y.z:P``, ``[::1]:P`` (a ``dns:``/``ipv4:``
    scheme prefix allowed); anything else, including a bare host name, is not."""
    host = target_host(target)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
