"""A real, single-member etcd for tests, on loopback ports in a temp dir.

Load with ``pytest_plugins = ["tests.support.etcd"]``:

* ``etcd_server`` - one etcd per test module (started once, stopped after
  the module); ``.url`` is its client URL.
* ``own_etcd`` - a factory for an etcd of the test's own (for tests that
  stop, pause or kill it); stopped at the end of the test.

Without an ``etcd`` binary on PATH (Debian: ``apt-get install etcd-server``)
the tests that use them skip, saying so, unless ``BLOCKD_REQUIRE_ETCD=1``
(``.ci/run`` sets it), where that is a failure. Each server is bound to
ports that were free a moment before; if another process takes one in
between, etcd exits and the start is retried on new ports.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from blockd.cluster.local import free_port
from tests.support.procs import pause

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
START_ATTEMPTS = 3


def unavailable_reason() -> str | None:
    if shutil.which("etcd") is None:
        return "no etcd binary on PATH (Debian: apt-get install etcd-server)"
    return None


def require_etcd() -> None:
    """Skip (or fail, with ``BLOCKD_REQUIRE_ETCD=1``) when etcd cannot run here."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("BLOCKD_REQUIRE_ETCD") == "1":
        pytest.fail(f"BLOCKD_REQUIRE_ETCD=1 but {reason}")
    pytest.skip(reason)


class EtcdServer:
    """``etcd`` as a child process; :meth:`start` returns once ``/health`` says true."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.data_dir = os.path.join(root, "data")
        self.log_path = os.path.join(root, "etcd.log")
        self.popen: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> EtcdServer:
        for _attempt in range(START_ATTEMPTS):
            client, peer = free_port(), free_port()
            self.url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
            with open(self.log_path, "ab") as log:
                self.popen = subprocess.Popen(
                    ["etcd", "--name", "test", "--data-dir", self.data_dir,
                     "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                     "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                     "--initial-cluster", f"test={peer_url}"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            if self._wait_healthy(time.monotonic() + START_TIMEOUT_S):
                return self
            self.kill()
        raise RuntimeError(f"etcd did not become healthy; its log:\n{self.log_tail()}")

    def _wait_healthy(self, deadline: float) -> bool:
        while time.monotonic() < deadline and self.popen.poll() is None:
            if self.is_healthy():
                return True
            time.sleep(0.05)
        return False

    def is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1.0) as reply:
                return json.load(reply).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def pause(self) -> None:
        """SIGSTOP: etcd stops answering (and stops expiring leases) until :meth:`resume`."""
        pause(self.popen.pid)

    def resume(self) -> None:
        os.kill(self.popen.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGCONT)  # a paused etcd would not see SIGTERM
            self.popen.terminate()
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as log:
            return "".join(log.readlines()[-lines:])


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    require_etcd()
    with tempfile.TemporaryDirectory(prefix="blockd-etcd-") as root:
        server = EtcdServer(root).start()
        try:
            yield server
        finally:
            server.kill()


@pytest.fixture
def own_etcd() -> Iterator:
    require_etcd()
    servers: list[EtcdServer] = []
    roots: list[tempfile.TemporaryDirectory] = []

    def start() -> EtcdServer:
        roots.append(tempfile.TemporaryDirectory(prefix="blockd-etcd-"))
        servers.append(EtcdServer(roots[-1].name).start())
        return servers[-1]

    try:
        yield start
    finally:
        for server in servers:
            server.kill()
        for root in roots:
            root.cleanup()
