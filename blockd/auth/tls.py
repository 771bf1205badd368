"""TLS for blockd's servers: server-auth TLS or mutual TLS, with certificate,
key and CA reload without restart.

:class:`TlsConfig` holds paths, the same shape on both sides (a worker is a
server and a client with one certificate):

* server (``blockd serve``, ``blockd-worker``): ``cert`` + ``key`` are its
  certificate chain and key; ``ca`` is the CA bundle client certificates are
  verified against and turns on mutual TLS: every connection must then
  present a client certificate that chains to it (gRPC Python has no
  "optional client certificate" mode: without ``ca`` none is asked for);
* client: ``ca`` is the bundle the server is verified against (None: the
  system roots), ``cert`` + ``key`` its own certificate for mTLS, and
  ``server_name`` the name to verify in the server's certificate when it
  differs from the dialled host (:mod:`blockd.auth.channels`).

Rotation on the server: :func:`server_credentials` uses gRPC's dynamic SSL
credentials. gRPC calls the fetcher before every new connection's
handshake; :class:`ReloadingCertificates` answers from a stat of the three
files (a few microseconds beside a handshake's milliseconds) and re-reads
them only when one changed (mtime, size or inode: Kubernetes swaps a
Secret volume's files through a symlink). A new set is checked first (the
key must match the certificate, the CA must parse): a half-written rotation
(a new certificate beside the old key) keeps the previous set in force and
is logged once, until the files agree. New connections get the new set;
open connections keep the one they shook hands with (TLS authenticates at
the handshake), so a revoked client is cut off by closing its connections
(restart, or GOAWAY via max connection age) as well as by the CA.

Imports the standard library, grpc and ``cryptography``.
"""

from __future__ import annotations

import logging
import os
import threading

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from blockd.auth.config import TlsConfig, TlsError

log = logging.getLogger("blockd.auth")


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise TlsError(f"cannot read the {what} {path}: {err.strerror}") from None


def _check_pair(cert_pem: bytes, key_pem: bytes, cert_path: str, key_path: str) -> x509.Certificate:
    """The leaf certificate, after checking the key belongs to it."""
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise TlsError(f"{cert_path} holds no PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise TlsError(f"{key_path} holds no unencrypted PEM private key") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, public) != \
            chain[0].public_key().public_bytes(serialization.Encoding.DER, public):
        raise TlsError(f"the key {key_path} does not belong to the certificate {cert_path} (a rotation "
                       "half done? write the key and the certificate together)")
    return chain[0]


def _check_ca(ca_pem: bytes, path: str) -> None:
    try:
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError:
        raise TlsError(f"{path} holds no PEM CA certificate") from None


def describe(cert: x509.Certificate) -> str:
    """Subject, SANs and expiry, for a log line."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = ", ".join(str(n.value) for n in sans)
    except x509.ExtensionNotFound:
        names = "none"
    return f"{cert.subject.rfc4514_string()} (SANs: {names}; expires {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC)"


def files_fingerprint(paths: tuple[str, ...]) -> tuple:
    """``(mtime_ns, size, inode)`` of each file, None for one that cannot be stat'ed."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class ReloadingCertificates:
    """The server's certificate configuration, re-read when its files change.

    Call :meth:`fetch` from gRPC's certificate fetcher: None means "no
    change". Thread-safe; never raises (an exception there would fail the
    handshake)."""

    def __init__(self, tls: TlsConfig) -> None:
        if tls.cert is None or tls.key is None:
            raise TlsError("a TLS server needs a certificate and a key (--tls-cert, --tls-key)")
        self.tls = tls
        self._lock = threading.Lock()
        self._seen = files_fingerprint(tls.files())
        self.initial = self._load()
        self.loads = 1

    def _load(self) -> grpc.ServerCertificateConfiguration:
        tls = self.tls
        cert, key = tls.cert, tls.key
        assert cert is not None and key is not None  # checked in __init__
        cert_pem, key_pem = read_pem(cert, "certificate"), read_pem(key, "key")
        leaf = _check_pair(cert_pem, key_pem, cert, key)
        ca_pem = None
        if tls.ca is not None:
            ca_pem = read_pem(tls.ca, "client CA bundle")
            _check_ca(ca_pem, tls.ca)
        log.info("TLS certificate %s from %s%s", describe(leaf), cert,
                 f"; client certificates must chain to {tls.ca}" if ca_pem else "")
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], root_certificates=ca_pem)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        seen = files_fingerprint(self.tls.files())
        if seen == self._seen:
            return None
        with self._lock:
            if seen == self._seen:
                return None
            self._seen = seen  # a bad set is logged once, then retried when the files change again
            try:
                config = self._load()
            except TlsError as err:
                log.error("TLS files changed but cannot be used, the previous certificate stays in force: %s",
                          err)
                return None
            except Exception:  # gRPC's handshake must never see an exception from here
                log.exception("TLS files changed but could not be loaded; the previous certificate stays")
                return None
            self.loads += 1
            return config


def server_credentials(tls: TlsConfig) -> tuple[grpc.ServerCredentials, ReloadingCertificates]:
    """Credentials for ``server.add_secure_port``: TLS, or mutual TLS when
    ``tls.ca`` is set, reloading the files on change (module docstring).
    :class:`TlsError` when the files cannot be used now."""
    certificates = ReloadingCertificates(tls)
    # the stubs type the fetcher as never returning None, which gRPC documents as "no change"
    credentials = grpc.dynamic_ssl_server_credentials(certificates.initial, certificates.fetch,  # type: ignore[arg-type]
                                                      require_client_authentication=tls.mutual)
    return credentials, certificates
