"""pytest fixtures for tests that talk to a real blockd over real gRPC.

Load with ``pytest_plugins = ["tests.support.grpc_fixtures"]`` in a test module.

* ``blockd_server`` - an in-process :class:`~blockd.service.server.BlockdServer`
  on ``127.0.0.1:0`` around a fresh in-memory engine (``.engine`` gives the
  tests the allocator state to check); stopped afterwards.
* ``client`` - a :class:`~client.sdk.BlockdClient` connected to it.
* ``daemon`` - a factory that runs ``blockd serve`` as a subprocess (env and
  flags as given), waits for its ``blockd listening on HOST:PORT`` line and
  stops it with SIGTERM at the end of the test.
* ``run_module`` - runs ``python -m MODULE ARGS`` on this checkout and returns
  the completed process (for ``blockctl`` and ``blockd`` as real commands).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from blockd.cluster.local import child_env
from blockd.engine.machine import Engine
from blockd.service.server import BlockdServer
from client.sdk import BlockdClient
from tests.support.procs import Proc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def blockd_server() -> Iterator[BlockdServer]:
    server = BlockdServer(Engine(), "127.0.0.1:0", max_workers=16, grace_s=2.0)
    server.start()
    try:
        yield server
    finally:
        server.stop(0.5)


@pytest.fixture
def client(blockd_server: BlockdServer) -> Iterator[BlockdClient]:
    with BlockdClient(blockd_server.address, timeout_s=5.0) as c:
        yield c


def start_daemon(*flags: str, env: dict[str, str] | None = None) -> Proc:
    """``blockd serve FLAGS`` as a child process, ready on return; on a free
    port unless FLAGS or ``env`` name an address (serve's default, 50051, may
    be taken by a daemon someone else runs on this host)."""
    chosen = any(f == "--listen" or f.startswith("--listen=") for f in flags) or "BLOCKD_LISTEN" in (env or {})
    listen = [] if chosen else ["--listen", "127.0.0.1:0"]
    return Proc(["-m", "blockd.cli", "serve", *listen, *flags], "blockd listening on", env)


@pytest.fixture
def daemon() -> Iterator:
    started: list[Proc] = []

    def factory(*flags: str, env: dict[str, str] | None = None) -> Proc:
        d = start_daemon(*flags, env=env)
        started.append(d)
        return d

    yield factory
    for d in started:
        d.kill()


@pytest.fixture
def run_module():
    def run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=child_env(**(env or {})),
                              capture_output=True, text=True, timeout=60, check=False)

    return run
