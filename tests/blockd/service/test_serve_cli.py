"""``blockd`` as a user runs it: bad arguments to ``serve`` are named as what
they are (one line, exit 2), ``--version``, ``python -m blockd``, and
``--log-format json``. Real processes (:func:`tests.support.grpc_fixtures.run_module`)."""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import os
import platform
import re
import time

import pytest

import blockd.core
from blockd.auth import tokens
from blockd.core import PoolConfig
from blockd.logs import JSON_KEYS, JsonFormatter
from client.errors import UnauthenticatedError
from client.sdk import BlockdClient

pytest_plugins = ["tests.support.grpc_fixtures"]


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1", "host:port", "[::1", "127.0.0.1:70000"])
def test_a_malformed_listen_address_is_named_malformed(run_module, listen) -> None:
    proc = run_module("blockd.cli", "serve", "--listen", listen)
    assert proc.returncode == 2 and proc.stdout == ""
    line = _last_line(proc.stderr)
    assert line.startswith(f"blockd serve: error: argument --listen: malformed address {listen!r}: expected "
                           "HOST:PORT"), line
    assert "TLS" not in line


def test_a_malformed_listen_address_from_the_environment(run_module) -> None:
    proc = run_module("blockd.cli", "serve", env={"BLOCKD_LISTEN": "nonsense"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("blockd: BLOCKD_LISTEN: malformed address 'nonsense': expected HOST:PORT")


def test_a_data_dir_that_is_a_file_is_named_a_file(run_module, tmp_path) -> None:
    path = tmp_path / "state"
    path.write_text("not a directory\n")
    for data_dir in (path, path / "below"):
        proc = run_module("blockd.cli", "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir))
        assert proc.returncode == 2 and proc.stdout == ""
        line = _last_line(proc.stderr)
        assert line.startswith("blockd serve: error: argument --data-dir: ") and \
            f"{str(path)!r}" in line and line.endswith("is a file, not a directory"), line
        assert "Errno" not in proc.stderr
    assert path.read_text() == "not a directory\n"
    proc = run_module("blockd.cli", "serve", env={"BLOCKD_DATA_DIR": str(path)})
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"blockd: BLOCKD_DATA_DIR: {str(path)!r} is a file, not a directory")


@pytest.mark.parametrize("module", ["blockd", "blockd.cli"])
def test_version(run_module, module) -> None:
    proc = run_module(module, "--version")
    assert proc.returncode == 0 and proc.stderr == ""
    core = "compiled" if blockd.core.BUILD == "compiled" else "python"
    assert proc.stdout == (f"blockd {importlib.metadata.version('blockd')} (Python {platform.python_version()}, "
                           f"{core} core)\n")


def test_python_dash_m_blockd_is_the_cli(run_module) -> None:
    proc = run_module("blockd", "serve", "--fsync-interval-s", "0")
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith("blockd serve: error: argument")


def _json_lines(output: str) -> list[dict]:
    """Every log line of ``output`` as an object (the ``listening on`` lines are stdout's, not the log's)."""
    lines = [line for line in output.splitlines() if line and not line.startswith(("blockd listening",
                                                                                     "blockd advertising",
                                                                                     "blockd-worker listening"))]
    return [json.loads(line) for line in lines]


def test_log_format_json_is_one_object_per_line_with_the_audit_fields_merged(daemon, tmp_path) -> None:
    path = str(tmp_path / "ids.json")
    token = tokens.add_token(path, "ops", "acme", ["admin"])
    d = daemon("--tokens-file", path, env={"BLOCKD_LOG_FORMAT": "json"})
    with BlockdClient(d.address, token=token, timeout_s=10) as c:
        c.create_pool(PoolConfig("p", num_blocks=8, block_size=4))  # an admin action: an audit line
    with BlockdClient(d.address, token="not-a-token", timeout_s=10) as c, pytest.raises(UnauthenticatedError):
        c.list_pools()  # a refused call: another
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and d.output().count('"logger":"blockd.audit"') < 2:
        time.sleep(0.05)
    records = _json_lines(d.output())
    assert records and all(list(r)[:4] == list(JSON_KEYS) for r in records), records
    assert all(r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") for r in records)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["time"]) for r in records)
    audit = {r["event"]: r for r in records if r["logger"] == "blockd.audit"}
    admin, denied = audit["admin"], audit["denied"]
    assert admin["method"] == "/blockd.v1.PoolService/CreatePool" and admin["outcome"] == "OK"
    assert admin["identity"] == "ops" and admin["tenant"] == "acme" and admin["roles"] == ["admin"]
    assert admin["message"] == "audit admin /blockd.v1.PoolService/CreatePool OK"
    assert denied["outcome"] == "UNAUTHENTICATED" and denied["identity"] is None and denied["reason"]
    assert "not-a-token" not in d.output()


def test_json_formatter_keeps_tracebacks_and_plain_messages() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("blockd.test_json")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("a %s message", "plain")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("it failed")
    finally:
        log.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "a plain message" and first["level"] == "WARNING" and "exception" not in first
    assert second["message"] == "it failed" and "RuntimeError: boom" in second["exception"]


def test_a_worker_logs_json_too(daemon) -> None:
    from tests.support.procs import start_worker

    d = daemon()
    with BlockdClient(d.address, timeout_s=10) as c:
        c.create_pool(PoolConfig("p", num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4,
                                 dtype="float32"))
    worker = start_worker(d.address, "p", "--device", "cpu", "--log-format", "json")
    try:
        records = _json_lines(worker.output())
    finally:
        worker.kill()
    assert any(r["logger"] == "blockd.worker" and "holds layers" in r["message"] for r in records), records


def _allowed_cpus(status_file: str) -> str | None:
    """A thread's allowed CPUs; None when it ended between listing and reading (it runs nowhere)."""
    try:
        with open(status_file) as f:
            return re.search(r"^Cpus_allowed_list:\s*(\S+)$", f.read(), re.M).group(1)
    except FileNotFoundError:
        return None


def test_cpus_runs_every_thread_of_the_daemon_on_those_cpus(daemon) -> None:
    first = min(os.sched_getaffinity(0))
    d = daemon("--cpus", str(first), "--step-lane-port", "0")
    with BlockdClient(d.address) as client, client.step_stream() as steps:
        client.create_pool(PoolConfig("pinned", num_blocks=16, block_size=4))
        steps.step("pinned", [])  # a lane connection's thread is started after the pinning too
        tasks = f"/proc/{d.proc.pid}/task"
        cpus = {_allowed_cpus(f"{tasks}/{tid}/status") for tid in os.listdir(tasks)} - {None}
    assert cpus == {str(first)}, cpus


@pytest.mark.parametrize(("cpus", "says"), [
    ("4096", "blockd: cannot serve: --cpus names CPU 4096, which this process may not use (it may use "),
    ("1-0", "blockd serve: error: argument --cpus: must be CPU numbers such as 0, 0-3 or 0,2-3"),
    ("0,3-1", "blockd serve: error: argument --cpus: must be CPU numbers such as 0, 0-3 or 0,2-3; '3-1' is not one"),
    ("zero", "blockd serve: error: argument --cpus: must be CPU numbers such as 0, 0-3 or 0,2-3"),
])
def test_cpus_it_cannot_use_are_refused_in_one_line(run_module, cpus, says) -> None:
    proc = run_module("blockd.cli", "serve", "--listen", "127.0.0.1:0", "--cpus", cpus)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert says in _last_line(proc.stderr), proc.stderr
