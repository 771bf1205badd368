"""blockctl's rough edges from a new user's first hour (issue 26, items 5
and 7), run as real commands against a real daemon: ``events tail`` without
``-f`` always ends, a bad ``--limit`` is a usage error, ``-f`` on a pool that
is deleted says so, ``top --json`` prints JSON, ``q`` quits ``top`` and
Ctrl-C exits 130."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest

from blockd.cluster.local import child_env
from blockd.core import Allocate, PoolConfig
from client.sdk import BlockdClient
from tests.support.grpc_fixtures import ROOT
from tests.support.procs import start_blockd


@pytest.fixture
def target():
    d = start_blockd()
    try:
        with BlockdClient(d.address) as client:
            client.create_pool(PoolConfig("demo", num_blocks=64, block_size=4))
            client.step("demo", [Allocate("s", [1, 2, 3, 4, 5])])  # no committed full block: no events
        yield d.address
    finally:
        d.kill()


def blockctl(target: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client.cli", "--target", target, *args], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=timeout, check=False)


def test_events_tail_without_follow_ends_with_fewer_events_than_its_limit(target):
    start = time.monotonic()
    done = blockctl(target, "events", "tail", "demo", "--limit", "1", "--json", timeout=20)
    assert done.returncode == 0 and done.stdout == "", done.stderr
    assert time.monotonic() - start < 15
    for bad in ("-1", "x"):
        done = blockctl(target, "events", "tail", "demo", "--limit", bad)
        assert done.returncode == 2 and "--limit: must be an integer >= 0" in done.stderr, done.stderr


def test_events_follow_on_a_pool_that_is_deleted_says_so(target):
    proc = subprocess.Popen([sys.executable, "-m", "client.cli", "--target", target, "events", "tail", "demo",
                             "-f"], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        time.sleep(2)
        with BlockdClient(target) as client:
            client.delete_pool("demo")
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 3 and "pool 'demo' was deleted" in err, err


def test_top_once_json_prints_one_json_object_per_frame(target):
    for args in (("top", "--once", "--json"), ("--json", "top", "--once")):
        done = blockctl(target, *args)
        assert done.returncode == 0, done.stderr
        frame = json.loads(done.stdout)
        assert [p["name"] for p in frame["pools"]] == ["demo"]
    env = {**child_env(), "BLOCKCTL_JSON": "1"}
    done = subprocess.run([sys.executable, "-m", "client.cli", "--target", target, "top", "--once"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=30, check=False)
    assert json.loads(done.stdout)["pools"][0]["name"] == "demo"


def _top_in_a_terminal(target: str) -> tuple[int, int]:
    pid, fd = pty.fork()
    if pid == 0:  # the child: blockctl top on the terminal
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "client.cli", "--target", target, "top",
                                   "--interval", "0.2"], child_env())
    return pid, fd


def _read_until(fd: int, marker: bytes, timeout: float) -> bytes:
    seen, end = b"", time.monotonic() + timeout
    while marker not in seen and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                seen += os.read(fd, 4096)
            except OSError:
                break
    return seen


def _exit_status(pid: int, timeout: float) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("blockctl top did not end")


def test_q_quits_top_and_ctrl_c_exits_130(target):
    pid, fd = _top_in_a_terminal(target)
    try:
        assert b"demo" in _read_until(fd, b"demo", 20)
        os.write(fd, b"q")
        assert _exit_status(pid, 10) == 0
    finally:
        os.close(fd)
    pid, fd = _top_in_a_terminal(target)
    try:
        assert b"demo" in _read_until(fd, b"demo", 20)
        os.kill(pid, signal.SIGINT)
        assert _exit_status(pid, 10) == 130
    finally:
        os.close(fd)


def test_bad_input_ends_in_one_line_not_a_traceback(target, tmp_path):
    worker = subprocess.run([sys.executable, "-m", "worker.main", "--blockd", target, "--pool", "nope"], cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert worker.returncode == 3, worker.stderr
    assert "Traceback" not in worker.stderr and "blockd-worker: cannot start: NOT_FOUND: no pool named 'nope'" in \
        worker.stderr
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    done = blockctl(target, "pools", "apply", str(deep))
    assert done.returncode == 2 and "Traceback" not in done.stderr and "nests too deeply" in done.stderr, done.stderr


@pytest.mark.parametrize(("target", "dialed"), [
    ("127.0.0.1:50051", "127.0.0.1:50051"), ("127.0.0.1", "127.0.0.1:50051"), ("localhost", "localhost:50051"),
    ("[::1]", "[::1]:50051"), (" [::1]:7 ", "[::1]:7"), ("dns:///localhost:5", "dns:///localhost:5"),
    ("unix:/run/blockd.sock", "unix:/run/blockd.sock")])
def test_a_target_is_parsed_in_one_place_and_a_missing_port_means_50051(target, dialed):
    from blockd.rpc.addresses import dial_target

    assert dial_target(target) == dialed


@pytest.mark.parametrize(("target", "says"), [
    ("127.0.0.1:99999", "0..65535"), ("127.0.0.1:0", "1..65535"), ("http://127.0.0.1:50051", "not a URL"),
    (":5", "names no host"), ("127.0.0.1:abc", "must be a number")])
def test_a_bad_target_is_a_usage_error_and_the_sdks_invalid_argument(target, says):
    from client import errors as ce

    done = subprocess.run([sys.executable, "-m", "client.cli", "--target", target, "--timeout-s", "2", "pools",
                           "list"], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    with pytest.raises(ce.InvalidArgumentError, match=says), BlockdClient(target) as client:
        client.list_pools()
    with pytest.raises(ValueError, match=says), BlockdClient(target) as client:  # still a ValueError too
        client.list_pools()


def test_the_sdk_refuses_values_protobuf_cannot_hold_with_its_own_error_naming_the_op():
    from blockd.core import Commit
    from client import errors as ce

    with BlockdClient("127.0.0.1:1") as client:  # refused before anything is sent
        with pytest.raises(ce.InvalidArgumentError, match=r"ops\[1\] \(Commit\): Value out of range: -16; token "):
            client.step("p", [Allocate("a", [1]), Commit("s", -16)])
        with pytest.raises(ce.InvalidArgumentError, match=r"ops\[0\] \(object\): not a blockd operation"):
            client.step("p", [object()])
        with pytest.raises(ce.InvalidArgumentError, match="ops must be a list"):
            client.step("p", "ops")


@pytest.mark.parametrize("module", ["client.cli", "worker.main", "blockd.cli"])
def test_every_program_says_its_version(module):
    done = subprocess.run([sys.executable, "-m", module, "--version"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    program = {"client.cli": "blockctl", "worker.main": "blockd-worker", "blockd.cli": "blockd"}[module]
    assert done.returncode == 0 and done.stdout.startswith(f"{program} "), done.stderr


def test_pools_apply_help_is_plain_whole_sentences():
    done = subprocess.run([sys.executable, "-m", "client.cli", "pools", "apply", "--help"], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0
    description = done.stdout.split("positional arguments:")[0]
    assert "``" not in done.stdout and ":class:" not in done.stdout
    assert description.rstrip().endswith("same end state.")
