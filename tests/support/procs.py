"""Real processes for integration tests: ``blockd serve`` and ``blockd-worker``.

Built on :class:`blockd.cluster.local.ChildProcess` (the project's one way to
start its own processes): each waits, bounded, for its ``listening on
HOST:PORT`` line and is killed when a ``running`` block exits, so a failing
test never leaves a process behind. Loopback addresses only.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from contextlib import contextmanager

from blockd.cluster.local import ChildProcess

START_TIMEOUT_S = 60.0


class Proc(ChildProcess):
    """A child that is ready (or killed, with its output in the error) on return."""

    def __init__(self, args: list[str], ready_prefix: str, env: dict | None = None) -> None:
        super().__init__(ready_prefix.split()[0], args, ready_prefix, env=env)
        try:
            self.wait_ready(time.monotonic() + START_TIMEOUT_S)
        except RuntimeError:
            self.kill()
            raise

    @property
    def proc(self):
        return self.popen

    @property
    def stderr(self) -> str:
        """Everything it printed (stdout and stderr are one stream)."""
        return self.output()


def free_port() -> int:
    """A loopback port free right now (a child binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pause(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads has stopped.

    kill() returns as soon as the signal is queued. One thread takes it and
    only then stops the others, so on a busy machine another thread can still
    answer a request sent right after kill() returned.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass  # a thread that ended meanwhile
        if states and all(state in "tT" for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout_s} s: thread states {states}")
        time.sleep(0.005)


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
