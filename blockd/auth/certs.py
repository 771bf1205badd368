"""Throwaway certificates for development and tests: a CA, server
certificates with SANs for the addresses clients dial, and client
certificates that carry a blockd identity (:mod:`blockd.auth.identity`).

    blockd certs dev DIR              # CA + server (localhost) + an admin client
    blockd certs ca DIR
    blockd certs server DIR --host blockd.example --host 10.0.0.5
    blockd certs client DIR --name router-0 --tenant acme --role scheduler
    blockd certs client DIR --name worker-0 --tenant acme --role worker --host 10.0.0.9

(the commands are :mod:`blockd.auth.cli`'s, which imports this module only
when one runs, so ``cryptography`` loads only then). Files are ``NAME.pem`` (certificate) and
``NAME-key.pem`` (private key, mode 0600) in DIR; ``ca.pem`` is the bundle
servers and clients trust.

For development only: the CA key sits unprotected beside the certificates.
A real cluster issues them from its own PKI, e.g. cert-manager in
Kubernetes (an ``Issuer`` backed by a CA kept in a Secret or by Vault; a
``Certificate`` per daemon with its service DNS names, and one per client
with ``uris: [spiffe://blockd/tenant/T/role/R/id/N]``), or SPIRE, whose
SVIDs are exactly such URI SANs. Keys are ECDSA P-256; certificates are
valid from five minutes ago (clock skew) for ``days`` days.

Imports the standard library and ``cryptography``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from blockd.auth.config import CERT_DAYS as DEFAULT_DAYS
from blockd.auth.identity import DEFAULT_TRUST_DOMAIN, spiffe_uri

_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class CertKey:
    """A PEM certificate and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    @property
    def key(self):
        return serialization.load_pem_private_key(self.key_pem, password=None)


def _validity(days: float, not_after: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.timezone.utc)
    end = not_after if not_after is not None else now + dt.timedelta(days=days)
    start = min(now - _SKEW, end - dt.timedelta(minutes=10))
    return start, end


def _sign(builder: x509.CertificateBuilder, signer_key, key) -> CertKey:
    cert = builder.public_key(key.public_key()).serial_number(x509.random_serial_number()).sign(
        signer_key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return CertKey(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def make_ca(common_name: str = "blockd development CA", *, days: float = 3650) -> CertKey:
    """A self-signed CA that may sign leaf certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start, end = _validity(days, None)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    return _sign(builder, key, key)


def _san_entry(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def make_leaf(ca: CertKey, common_name: str, *, hosts=(), uris=(), server: bool, client: bool,
              days: float = DEFAULT_DAYS, not_after: dt.datetime | None = None) -> CertKey:
    """A certificate signed by ``ca``: SANs for ``hosts`` (IP or DNS) and
    ``uris``; extended key usage for a TLS server and/or client.
    ``not_after`` in the past makes an expired certificate (tests)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days, not_after)
    usages = [oid for oid, wanted in ((ExtendedKeyUsageOID.SERVER_AUTH, server),
                                      (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if wanted]
    sans = [_san_entry(h) for h in hosts] + [x509.UniformResourceIdentifier(u) for u in uris]
    ca_cert = ca.cert
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca_cert.subject).not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                   ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return _sign(builder, ca.key, key)


def make_server_cert(ca: CertKey, hosts=("localhost", "127.0.0.1", "::1"), *, name: str = "blockd",
                     days: float = DEFAULT_DAYS, not_after: dt.datetime | None = None) -> CertKey:
    """A server certificate valid for the addresses in ``hosts``."""
    return make_leaf(ca, name, hosts=hosts, server=True, client=False, days=days, not_after=not_after)


def make_client_cert(ca: CertKey, name: str, tenant: str, roles=("scheduler",), *,
                     trust_domain: str = DEFAULT_TRUST_DOMAIN, days: float = DEFAULT_DAYS,
                     not_after: dt.datetime | None = None, hosts=()) -> CertKey:
    """A client certificate naming ``name@tenant`` with ``roles`` in its URI
    SAN (and ``name`` as its CN). Also usable as a server certificate of a
    worker (both usages; ``hosts``: the addresses schedulers dial it at), so
    one certificate serves a worker both ways."""
    uri = spiffe_uri(tenant, roles, name, trust_domain)
    return make_leaf(ca, name, hosts=hosts, uris=(uri,), server=True, client=True, days=days, not_after=not_after)


def write_pair(directory: str, stem: str, pair: CertKey) -> tuple[str, str]:
    """Write ``stem.pem`` and ``stem-key.pem`` (0600); returns their paths."""
    os.makedirs(directory, exist_ok=True)
    cert_path = os.path.join(directory, f"{stem}.pem")
    key_path = os.path.join(directory, f"{stem}-key.pem")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pair.key_pem)
    with open(cert_path, "wb") as f:
        f.write(pair.cert_pem)
    return cert_path, key_path


def read_ca(directory: str) -> CertKey:
    """The CA written by ``ca`` or ``dev`` in ``directory``."""
    with open(os.path.join(directory, "ca.pem"), "rb") as c, open(os.path.join(directory, "ca-key.pem"), "rb") as k:
        return CertKey(c.read(), k.read())


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    hosts = tuple(getattr(args, "host", None) or (() if args.certs_command == "client"
                                                   else ("localhost", "127.0.0.1", "::1")))
    if args.certs_command in ("ca", "dev"):
        ca = make_ca(days=args.days if args.certs_command == "ca" else 3650)
        written = [*write_pair(args.dir, "ca", ca)]
    else:
        ca, written = read_ca(args.dir), []
    if args.certs_command == "dev":
        written += write_pair(args.dir, "server", make_server_cert(ca, hosts, days=args.days))
        written += write_pair(args.dir, "admin", make_client_cert(ca, "admin", "default", ("admin",),
                                                                  days=args.days))
    elif args.certs_command == "server":
        written += write_pair(args.dir, args.name, make_server_cert(ca, hosts, name=args.name, days=args.days))
    elif args.certs_command == "client":
        pair = make_client_cert(ca, args.name, args.tenant, args.role, trust_domain=args.trust_domain,
                                days=args.days, hosts=hosts)
        written += write_pair(args.dir, args.name, pair)
    for path in written:
        print(path, file=out)
    return 0
