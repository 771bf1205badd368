"""pytest fixtures for tests that talk to a real blockd over real gRPC.

Load with ``pytest_plugins = ["tests.grpc_fixtures"]`` in a test module.

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
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from blockd.engine import Engine
from blockd.service.server import BlockdServer
from client.sdk import BlockdClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY = re.compile(r"^blockd listening on (\S+)$")


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


@dataclass
class Daemon:
    """A ``blockd serve`` subprocess and what it printed so far."""

    proc: subprocess.Popen
    address: str
    stderr_lines: list[str] = field(default_factory=list)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that imports this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def start_daemon(*flags: str, env: dict[str, str] | None = None, timeout_s: float = 30.0) -> Daemon:
    proc = subprocess.Popen([sys.executable, "-m", "blockd.cli", "serve", *flags], cwd=ROOT,
                            env=python_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    # drain stderr continuously so a chatty daemon never blocks on a full pipe
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    found: list[str] = []

    def read_ready() -> None:
        for line in iter(proc.stdout.readline, ""):
            match = READY.match(line.strip())
            if match:
                found.append(match.group(1))
                return

    reader = threading.Thread(target=read_ready, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"blockd did not become ready; stderr:\n{''.join(lines)}")
    return Daemon(proc, found[0], lines)


@pytest.fixture
def daemon() -> Iterator:
    started: list[Daemon] = []

    def factory(*flags: str, env: dict[str, str] | None = None) -> Daemon:
        d = start_daemon(*flags, env=env)
        started.append(d)
        return d

    yield factory
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.fixture
def run_module():
    def run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=python_env(**(env or {})),
                              capture_output=True, text=True, timeout=60, check=False)

    return run
