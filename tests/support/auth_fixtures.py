"""Certificates and secured servers for the security tests.

Load with ``pytest_plugins = ["tests.support.auth_fixtures"]``.

* ``pki`` (module scope) - a directory of real certificates made with
  ``cryptography`` (:mod:`blockd.auth.certs`): ``ca`` / ``server`` (SANs
  localhost, 127.0.0.1, ::1), one client per role of tenant ``acme``
  (``admin``, ``scheduler``, ``worker``, ``reader``), ``other-tenant`` (a
  scheduler of ``globex``), ``expired`` (a scheduler whose validity ended
  an hour ago), ``rogue`` (a scheduler signed by another CA), ``plain-cn``
  (no URI SAN, CN ``legacy-client``) and ``bad-uri`` (a blockd URI that is
  not key/value pairs). ``pki.tls(name)`` is the client's :class:`TlsConfig`.
* ``secure_server`` - a factory for an in-process :class:`BlockdServer` on
  loopback with the given TLS settings and identities file, through
  :func:`blockd.auth.server_security` exactly as ``blockd serve`` builds it
  (the engine takes its quotas from the identities file).
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from blockd.auth import TlsConfig, server_security
from blockd.auth.certs import make_ca, make_client_cert, make_leaf, make_server_cert, write_pair
from blockd.auth.identity import spiffe_uri
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.service.server import BlockdServer

TENANT = "acme"
ROLE_CLIENTS = ("admin", "scheduler", "worker", "reader")


@dataclass
class Pki:
    dir: str

    def path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.pem")

    def key(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}-key.pem")

    @property
    def ca(self) -> str:
        return self.path("ca")

    def tls(self, client: str | None = None, ca: str | None = None) -> TlsConfig:
        """What a client with certificate ``client`` (None: no certificate) uses."""
        if client is None:
            return TlsConfig(ca=ca or self.ca)
        return TlsConfig(cert=self.path(client), key=self.key(client), ca=ca or self.ca)

    def server_tls(self, mutual: bool = True) -> TlsConfig:
        return TlsConfig(cert=self.path("server"), key=self.key("server"), ca=self.ca if mutual else None)


def make_pki(directory: str) -> Pki:
    ca = make_ca()
    write_pair(directory, "ca", ca)
    write_pair(directory, "server", make_server_cert(ca))
    for role in ROLE_CLIENTS:
        write_pair(directory, role, make_client_cert(ca, f"{role}-0", TENANT, (role,)))
    write_pair(directory, "other-tenant", make_client_cert(ca, "sched-g", "globex", ("scheduler",)))
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    write_pair(directory, "expired", make_client_cert(ca, "old-0", TENANT, ("scheduler",), not_after=past))
    write_pair(directory, "rogue", make_client_cert(make_ca("rogue CA"), "rogue-0", TENANT, ("admin",)))
    write_pair(directory, "plain-cn", make_leaf(ca, "legacy-client", server=False, client=True))
    bad_uri = spiffe_uri(TENANT, ("admin",), "x").replace("/id/x", "/id")
    write_pair(directory, "bad-uri", make_leaf(ca, "bad", uris=(bad_uri,), server=False, client=True))
    return Pki(directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(str(tmp_path_factory.mktemp("pki")))


@pytest.fixture
def secure_server() -> Iterator:
    started: list[BlockdServer] = []

    def factory(tls: TlsConfig | None, tokens_file: str | None = None, engine: Engine | None = None):
        security = server_security("127.0.0.1:0", tls, tokens_file)
        engine = engine or Engine(EngineConfig(quotas=security.quota_source()))
        server = BlockdServer(engine, "127.0.0.1:0", max_workers=8, grace_s=1.0,
                              interceptors=security.interceptors, credentials=security.credentials)
        server.start()
        server.security = security
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop(0.2)
