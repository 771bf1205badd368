"""How a worker's idle OpenMP threads wait (worker/openmp.py), as libgomp itself reports it.

``OMP_DISPLAY_ENV=VERBOSE`` makes libgomp print the settings it loaded with,
so these tests read what the OpenMP runtime of a real ``blockd-worker``
process took, not what Python's environment says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from blockd.cluster.local import ROOT, child_env
from worker.openmp import WORKER_SPIN_COUNT, default_env

SCRIPT = os.path.join(os.path.dirname(sys.executable), "blockd-worker")


def _libgomp_settings(command: list[str], **env: str) -> dict[str, str]:
    environ = {k: v for k, v in child_env().items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(command, cwd=ROOT, env={**environ, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    settings = dict(re.findall(r"^\s+(\w+) = '([^']*)'", done.stderr, re.MULTILINE))
    assert "GOMP_SPINCOUNT" in settings, f"libgomp printed no settings: {done.stderr[-2000:]}"
    return settings


def _worker_commands() -> list[list[str]]:
    commands = [[sys.executable, "-m", "worker.main", "--help"]]
    if os.path.exists(SCRIPT):  # the console script a container or a user runs
        commands.append([SCRIPT, "--help"])
    return commands


@pytest.mark.parametrize("command", _worker_commands(), ids=lambda c: os.path.basename(c[0]) + " " + c[1])
def test_blockd_worker_spins_briefly_by_default(command):
    assert _libgomp_settings(command)["GOMP_SPINCOUNT"] == WORKER_SPIN_COUNT


def test_blockd_worker_keeps_a_callers_choice():
    command = _worker_commands()[-1]
    assert _libgomp_settings(command, GOMP_SPINCOUNT="1234")["GOMP_SPINCOUNT"] == "1234"
    passive = _libgomp_settings(command, OMP_WAIT_POLICY="PASSIVE")
    assert passive["OMP_WAIT_POLICY"] == "PASSIVE" and passive["GOMP_SPINCOUNT"] != WORKER_SPIN_COUNT


def test_default_env_leaves_a_callers_choice():
    assert default_env({}) == {"GOMP_SPINCOUNT": WORKER_SPIN_COUNT}
    assert default_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert default_env({"GOMP_SPINCOUNT": "0"}) == {}
