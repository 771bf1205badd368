"""The ``/metrics`` HTTP endpoint over TLS (optionally mutual) and with basic auth.

prometheus-client's ``start_http_server`` can serve TLS (``certfile``,
``keyfile``, ``client_cafile``) but has no basic auth on the serving side,
so :func:`serve` wraps its WSGI app (``make_wsgi_app(registry)``, passed
in: this module does not import prometheus_client) in
:class:`BasicAuth` and serves it with the standard library's threaded WSGI
server, TLS through an :class:`ssl.SSLContext` that :meth:`MetricsEndpoint.reload`
reloads (certificate and key for new connections, and the users file) on SIGHUP.

The users file has one ``user:sha256hex`` line per scraper (``#`` comments
allowed); ``blockd tokens metrics-user FILE --user prometheus`` makes a
random password, prints it once and stores its SHA-256. Generated
passwords have 256 bits, so a fast hash is enough (as for tokens,
:mod:`blockd.auth.tokens`); a person-chosen password would need a slow KDF
and is not supported. Prometheus reads it with ``basic_auth.password_file``.

Imports the standard library only.
"""

from __future__ import annotations

import base64
import hmac
import logging
import os
import ssl
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from blockd.auth.config import TlsConfig, TlsError
from blockd.auth.tokens import new_token, token_digest

log = logging.getLogger("blockd.auth")

REALM = "blockd metrics"


def load_users(path: str) -> dict[str, str]:
    """``user -> sha256 hex`` from a users file; :class:`ValueError` naming the line."""
    users: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            user, sep, digest = line.partition(":")
            if not sep or not user or len(digest) != 64 or digest.strip("0123456789abcdef"):
                raise ValueError(f"{path}:{number}: expected 'user:<64 hex digits>'")
            users[user] = digest
    return users


def add_user(path: str, user: str) -> str:
    """Make a password for ``user``, append its hash to ``path`` (0600), return it."""
    if not user or ":" in user or any(c.isspace() for c in user):
        raise ValueError("a user name must be non-empty, without ':' or white space")
    if os.path.exists(path) and user in load_users(path):
        raise ValueError(f"{path}: user {user!r} exists")
    password = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(f"{user}:{token_digest(password)}\n")
    return password


class BasicAuth:
    """WSGI middleware: 401 unless the request carries a known user and password."""

    def __init__(self, app, users_file: str) -> None:
        self.app = app
        self.users_file = users_file
        self.users = load_users(users_file)

    def reload(self) -> list[str]:
        """Re-read the users file; what went wrong, in words (empty: nothing)."""
        try:
            self.users = load_users(self.users_file)
        except (OSError, ValueError) as err:
            problem = f"metrics users file not reloaded, the previous one stays in force: {err}"
            log.error("%s", problem)
            return [problem]
        return []

    def _allowed(self, header: str) -> bool:
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(encoded, validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        stored = self.users.get(user)
        return bool(sep) and stored is not None and hmac.compare_digest(stored, token_digest(password))

    def __call__(self, environ, start_response):
        if self._allowed(environ.get("HTTP_AUTHORIZATION", "")):
            return self.app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", f'Basic realm="{REALM}"'),
                                            ("Content-Type", "text/plain")])
        return [b"blockd metrics need a user and password (basic auth)\n"]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class names it so  # scrapes every few seconds would flood the log
        pass


def _tls_context(tls: TlsConfig) -> ssl.SSLContext:
    if tls.cert is None or tls.key is None:
        raise TlsError("metrics over TLS need a certificate and a key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert, tls.key)
    if tls.ca is not None:
        context.load_verify_locations(cafile=tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class MetricsEndpoint:
    """A running endpoint: ``addr``, ``port``, :meth:`reload`, :meth:`close`."""

    def __init__(self, app, addr: str, port: int, tls: TlsConfig | None = None,
                 users_file: str | None = None) -> None:
        self.tls = tls
        self.auth = BasicAuth(app, users_file) if users_file else None
        self._context = _tls_context(tls) if tls is not None else None
        self._server = make_server(addr, port, self.auth or app, _Server, handler_class=_QuietHandler)
        if self._context is not None:
            self._server.socket = self._context.wrap_socket(self._server.socket, server_side=True)
        self.addr, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="blockd-metrics", daemon=True)
        self._thread.start()

    def reload(self) -> list[str]:
        """Re-read the users file, and the certificate and key for new connections;
        what went wrong, in words (empty: nothing)."""
        problems = self.auth.reload() if self.auth is not None else []
        if self._context is not None and self.tls is not None and self.tls.cert is not None:
            try:
                self._context.load_cert_chain(self.tls.cert, self.tls.key)
            except (OSError, ssl.SSLError) as err:
                problems.append(f"metrics TLS certificate not reloaded, the previous one stays: {err}")
                log.error("%s", problems[-1])
        return problems

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve(app, addr: str, port: int, tls: TlsConfig | None = None,
          users_file: str | None = None) -> MetricsEndpoint:
    """Serve the WSGI ``app`` on ``addr:port`` (0: any free port)."""
    return MetricsEndpoint(app, addr, port, tls, users_file)
