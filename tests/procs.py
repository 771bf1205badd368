"""Real processes for integration tests: ``blockd serve`` and ``blockd-worker``.

Each is started with ``python -m``, waits (bounded) for its ``listening on
HOST:PORT`` line, and is killed at exit of the ``with`` block, so a failing
test never leaves a process behind. Loopback addresses only.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

from tests.conftest import ROOT

START_TIMEOUT_S = 60.0


class Proc:
    """A child process whose output is collected in the background."""

    def __init__(self, args: list[str], ready_prefix: str, env: dict | None = None) -> None:
        self.args = args
        self.lines: list[str] = []
        self._ready: queue.Queue[str] = queue.Queue()
        full_env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, args=(ready_prefix,), daemon=True)
        self._reader.start()
        self.address = self._wait_ready()

    def _read(self, prefix: str) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip())
            if line.startswith(prefix):
                self._ready.put(line.split()[-1])

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return self._ready.get(timeout=0.1)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
        self.kill()
        raise RuntimeError(f"{self.args} did not start:\n" + "\n".join(self.lines[-40:]))

    def output(self) -> str:
        return "\n".join(self.lines)

    def terminate(self, timeout_s: float = 15.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


def start_blockd(*extra: str, env: dict | None = None) -> Proc:
    return Proc(["-m", "blockd.cli", "serve", "--listen", "127.0.0.1:0", *extra], "blockd listening on", env)


def start_worker(target: str, pool: str, *extra: str) -> Proc:
    return Proc(["-m", "worker.main", "--blockd", target, "--pool", pool, "--heartbeat-s", "0.2", *extra],
                "blockd-worker listening on")


@contextmanager
def running(*procs_factories):
    """Start processes in order; kill all of them on exit, whatever happened."""
    procs: list[Proc] = []
    try:
        for factory in procs_factories:
            procs.append(factory(procs))
        yield procs
    finally:
        for proc in reversed(procs):
            proc.kill()
