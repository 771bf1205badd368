"""Hosts for a multi-host test on one machine: Linux network namespaces.

:class:`NetnsLab` makes one namespace per host plus a hub namespace holding
a bridge; each host gets a veth pair (``eth0`` in the host, a port on the
bridge in the hub), an address in ``SUBNET``, and ``lo`` up. Nothing is
connected to the namespace the test runs in (no veth end, no route there),
so traffic stays between the lab's namespaces; the addresses are from
TEST-NET-2 (RFC 5737, documentation only), which no real network routes.

Names are unique per lab (``bdlab<pid>x<random>-<host>``): parallel runs
never collide. :meth:`NetnsLab.close` deletes every namespace it made (the
veths and the bridge go with them) and is idempotent; the test fixture calls
it whatever happens. Only a test process killed outright (SIGKILL) leaves
its lab behind: :func:`sweep_stale` deletes labs whose process is gone. :func:`unavailable_reason` tells
why namespaces cannot be made here (not root, no ``ip``, no permission).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator

SUBNET = "198.51.100"  # TEST-NET-2, /24
IP_TIMEOUT_S = 20
LAB_PREFIX = "bdlab"


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")


def unavailable_reason() -> str | None:
    """Why this process cannot make network namespaces, or None if it can."""
    if not os.path.isdir("/proc/self/ns") or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the ip command is missing: apt-get install iproute2"
    probe = f"bdprobe{os.getpid()}{secrets.token_hex(2)}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        return f"cannot create a network namespace here: {err}"
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        _ip("netns", "del", probe)
    return None


class NetnsLab:
    """Hosts ``names`` (in order: addresses .1, .2, ...), each its own namespace."""

    def __init__(self, names: list[str]) -> None:
        self.tag = f"{LAB_PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.hub = f"{self.tag}-hub"
        self.namespaces: list[str] = []
        #: processes started on the lab's hosts (``blockd.cluster.local.ChildProcess``); :func:`lab_of` kills them
        self.children: list = []
        self.addresses = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        began = time.monotonic()
        try:
            self._make(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "dev", "br0", "up")
            for i, name in enumerate(names):
                self._host(name, f"port{i}")
        except BaseException:
            self.close()
            raise
        #: seconds it took to make the namespaces, veths and bridge
        self.setup_s = time.monotonic() - began

    def _make(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self.namespaces.append(namespace)

    def _host(self, name: str, port: str) -> None:
        ns = self.namespace(name)
        self._make(ns)
        _ip("-n", ns, "link", "set", "dev", "lo", "up")
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.hub)
        _ip("-n", self.hub, "link", "set", "dev", port, "master", "br0")
        _ip("-n", self.hub, "link", "set", "dev", port, "up")
        _ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "dev", "eth0", "up")

    def namespace(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program on host ``name`` (it execs the program)."""
        return ["ip", "netns", "exec", self.namespace(name)]

    def run(self, name: str, argv: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 120,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(name), *argv], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout_s, check=False)

    def close(self) -> None:
        """Delete every namespace this lab made (hosts first, then the hub)."""
        for ns in reversed(self.namespaces):
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):  # gone already: the rest must go
                _ip("netns", "del", ns)
        self.namespaces.clear()

    def existing(self) -> list[str]:
        """This lab's namespaces the kernel still lists (for the teardown check)."""
        return [name for name in _listed() if name.startswith(f"{self.tag}-")]


def _listed() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                            check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Delete the namespaces of labs whose test process no longer runs; their names."""
    swept = []
    for name in _listed():
        match = re.fullmatch(rf"{LAB_PREFIX}(\d+)x[0-9a-f]+-\w+", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            try:
                _ip("netns", "del", name)
                swept.append(name)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
    return swept


@contextlib.contextmanager
def lab_of(names: list[str]) -> Iterator[NetnsLab]:
    """A pytest fixture's body: a lab of hosts ``names`` whose ``children``
    (:class:`blockd.cluster.local.ChildProcess`) are killed and whose namespaces are
    deleted at the end; skips where namespaces cannot be made, unless
    ``BLOCKD_REQUIRE_NETNS=1`` (``.ci/run``), where that fails."""
    import pytest

    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("BLOCKD_REQUIRE_NETNS") == "1":
            pytest.fail(f"BLOCKD_REQUIRE_NETNS=1 but {reason}")
        pytest.skip(reason)
    sweep_stale()  # labs of test runs that were killed outright
    lab = NetnsLab(names)
    try:
        yield lab
    finally:
        for child in lab.children:
            child.kill()
        lab.close()
        assert lab.existing() == [], "namespaces left behind"
