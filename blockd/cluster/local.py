"""A whole cluster as local child processes on loopback: ``blockd serve`` (with
its step lane, ``--step-lane-port 0``), one
pool sized for a model, and ``blockd-worker --model`` processes (one holding
the whole model, or a tensor-parallel group each holding its share of the KV
heads). For demos, benchmarks and integration tests.

Owns the children's lifetimes. Each runs in its own session, so a terminal's
Ctrl-C reaches only the parent, which stops them in order; their output is
collected in the background for error messages; :meth:`LocalCluster.stop`
(also on ``with`` exit, whatever happened) sends SIGTERM to blockd, then to
the workers, waits, SIGKILLs stragglers and reaps every child. Only a parent
killed by SIGKILL cannot do this: its children then live on.
:meth:`LocalCluster.restart_worker` kills a worker with SIGKILL and starts it
again at the same address (fault tests: a new worker incarnation, its KV gone).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

# how a worker child's OpenMP threads wait (blockd-worker sets the same itself; worker/openmp.py says why)
from worker.openmp import default_env

if TYPE_CHECKING:
    from blockd.core.types import PoolConfig

#: the tree holding the blockd, worker and client packages (the repository, or site-packages):
#: children start there with it on their path, so they import this very blockd
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child that imports this checkout."""
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


class ChildProcess:
    """One child: started with ``python -m``, ready when it prints ``ready_prefix ADDRESS``.

    The one way this project starts its own processes (demo, benchmarks,
    tests): the checkout on ``PYTHONPATH``, stdout and stderr merged and kept
    (the last ``keep_lines``), its own session so a terminal's Ctrl-C reaches
    only the parent. ``prefix`` runs it through a command that then execs it
    (e.g. ``ip netns exec NAME``: the pid stays the child's).
    """

    def __init__(self, name: str, args: list[str], ready_prefix: str, *, env: dict[str, str] | None = None,
                 keep_lines: int = 2000, prefix: Sequence[str] = ()) -> None:
        self.name = name
        self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._ready: queue.Queue[str] = queue.Queue()
        env = child_env(PYTHONUNBUFFERED="1", **(env or {}))
        self.popen = subprocess.Popen([*prefix, sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                      start_new_session=True)
        self.address = ""
        threading.Thread(target=self._read, args=(ready_prefix,), daemon=True, name=f"{name}-output").start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self, prefix: str) -> None:
        assert self.popen.stdout is not None, "started with stdout=PIPE"
        for line in self.popen.stdout:
            self.lines.append(line.rstrip())
            if line.startswith(prefix):
                self._ready.put(line.split()[-1])

    def wait_ready(self, deadline: float) -> str:
        while time.monotonic() < deadline:
            try:
                self.address = self._ready.get(timeout=0.1)
                return self.address
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
        raise RuntimeError(f"{self.name} did not start (exit code {self.popen.poll()}); its last output:\n"
                           + "\n".join(list(self.lines)[-30:]))

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def reap(self, deadline: float) -> int:
        try:
            return self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; the exit code."""
        self.terminate()
        return self.reap(time.monotonic() + timeout_s)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()

    def output(self) -> str:
        return "\n".join(self.lines)


def free_port() -> int:
    """A loopback port nobody listens on now (for the TP rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ClusterSpec:
    model: str = "tiny-llama"
    tp_size: int = 1
    pool: str = "model"
    num_blocks: int = 256
    block_size: int = 16
    watermark_blocks: int = 0
    #: the pool's host tier (blocks per shard; 0: none): evicted prefixes move there and come back on a hit
    num_host_blocks: int = 0
    model_seed: int = 0
    #: serve each worker's Prometheus metrics on a free port (``LocalCluster.worker_metrics_urls``)
    worker_metrics: bool = False
    #: pools of this geometry in the one daemon, each with its own ``tp_size`` workers:
    #: ``pool``, then ``pool-1``, ``pool-2``... (:attr:`pool_names`); they may share prefixes
    num_pools: int = 1

    @property
    def pool_names(self) -> list[str]:
        return [self.pool] + [f"{self.pool}-{i}" for i in range(1, self.num_pools)]

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("tp_size, num_blocks and block_size must be >= 1")
        if self.num_host_blocks < 0 or self.num_pools < 1:
            raise ValueError("num_host_blocks must be >= 0 and num_pools >= 1")


class LocalCluster:
    """Start with :meth:`start` (or ``with``); ``blockd_address`` and
    ``worker_addresses`` (rank order) are then set."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.blockd: ChildProcess | None = None
        self.workers: list[ChildProcess] = []
        self._worker_args: list[list[str]] = []
        self.worker_metrics_urls: list[str] = []
        self.pool_config: PoolConfig | None = None

    @property
    def blockd_address(self) -> str:
        return self.blockd.address if self.blockd else ""

    @property
    def worker_addresses(self) -> list[str]:
        """The first pool's workers (rank order)."""
        return [worker.address for worker in self.workers[: self.spec.tp_size]]

    def pool_worker_addresses(self, pool: str) -> list[str]:
        """Pool ``pool``'s workers (rank order)."""
        i = self.spec.pool_names.index(pool) * self.spec.tp_size
        return [worker.address for worker in self.workers[i : i + self.spec.tp_size]]

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self._children()]

    def _children(self) -> list[ChildProcess]:
        return [*self.workers, *([self.blockd] if self.blockd else [])]

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        # imported here: the launcher itself needs neither torch nor the SDK
        from client.sdk import BlockdClient
        from worker.model import pool_config_for

        spec = self.spec
        # the step lane on: everything here is on loopback, so the scheduler's steps take the cheaper path
        self.blockd = ChildProcess("blockd", ["-m", "blockd.cli", "serve", "--listen", "127.0.0.1:0",
                                              "--fsync", "never", "--step-lane-port", "0"], "blockd listening on")
        self.blockd.wait_ready(time.monotonic() + START_TIMEOUT_S)
        config = pool_config_for(model_config(spec.model), spec.pool, spec.num_blocks, spec.block_size,
                                 dtype="float32", watermark_blocks=spec.watermark_blocks)
        config = dataclasses.replace(config, num_host_blocks=spec.num_host_blocks)
        with BlockdClient(self.blockd.address) as client:
            for name in spec.pool_names:
                client.create_pool(dataclasses.replace(config, name=name))
        self.pool_config = config
        for name in spec.pool_names:
            tp_init = f"tcp://127.0.0.1:{free_port()}"
            for rank in range(spec.tp_size):
                args = ["-m", "worker.main", "--blockd", self.blockd.address, "--pool", name,
                        "--model", spec.model, "--model-seed", str(spec.model_seed), "--device", "cpu",
                        "--worker-id", f"{name}-rank{rank}", "--heartbeat-s", "0.5"]
                if spec.tp_size > 1:
                    args += ["--tp-rank", str(rank), "--tp-world-size", str(spec.tp_size), "--tp-init", tp_init]
                if spec.worker_metrics:
                    port = free_port()
                    args += ["--metrics-port", str(port)]
                    self.worker_metrics_urls.append(f"http://127.0.0.1:{port}/metrics")
                self._worker_args.append(args)
                self.workers.append(ChildProcess(f"worker rank {rank} of {name}", args,
                                                 "blockd-worker listening on", env=default_env()))
        # the ranks meet in their rendezvous before any prints its ready line
        deadline = time.monotonic() + START_TIMEOUT_S
        for worker in self.workers:
            worker.wait_ready(deadline)

    def restart_worker(self, rank: int = 0) -> ChildProcess:
        """Kill worker ``rank`` with SIGKILL and start it again at the same
        address; returns it once it serves. One worker per model only: a
        tensor-parallel group cannot take a new member into its collectives."""
        if self.spec.tp_size > 1:
            raise ValueError("restarting one rank of a tensor-parallel group is not supported")
        old = self.workers[rank]
        old.kill()
        new = ChildProcess(f"worker rank {rank}", [*self._worker_args[rank], "--listen", old.address],
                           "blockd-worker listening on", env=default_env())
        self.workers[rank] = new
        new.wait_ready(time.monotonic() + START_TIMEOUT_S)
        return new

    def stop(self) -> None:
        """blockd first, then the workers; every child reaped.

        In this order a worker's Watch stream ends as blockd goes away, so the
        worker stops at once; stopped first, a worker waits seconds for its
        watch thread, blocked on a stream that nothing cancels.
        """
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for group in ([self.blockd] if self.blockd else [], self.workers):
            for child in group:
                child.terminate()
            for child in group:
                child.reap(deadline)


def model_config(model: str):
    """The Hugging Face config of a worker's ``--model`` (see :func:`worker.model.build_model`)."""
    from worker.model import load_config

    return load_config(model)


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (which may
    hold spaces and parentheses): ``[0]`` the state, ``[11]`` and ``[12]``
    user and system CPU time in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def live_pids(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are still running (not gone, not zombies), read from /proc."""
    alive = []
    for pid in pids:
        try:
            state = proc_stat(pid)[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive
