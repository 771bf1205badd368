"""Tests pick free ports: a daemon someone runs on this host (on blockd's
default 127.0.0.1:50051) must not make a test fail or talk to it.

The ``daemon`` fixture (:func:`tests.support.grpc_fixtures.start_daemon`) listens on
port 0 unless a test names an address, so a test that starts a daemon with
only its own flags gets a port of its own."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

import pytest

from client.sdk import BlockdClient

pytest_plugins = ["tests.support.grpc_fixtures"]

DEFAULT_PORT = 50051  # blockd serve's default --listen port


@pytest.fixture
def default_port_taken() -> Iterator[None]:
    """127.0.0.1:50051 held by a listener for the test (or already held by someone else)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", DEFAULT_PORT))
            s.listen()
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
        yield


def test_a_daemon_started_with_only_its_own_flags_gets_a_free_port(default_port_taken, daemon) -> None:
    d = daemon("--fsync", "never")
    assert not d.address.endswith(f":{DEFAULT_PORT}"), d.address
    with BlockdClient(d.address, timeout_s=10) as client:
        assert client.list_pools() == []
