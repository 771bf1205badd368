"""What ``blockctl`` and ``blockd-worker`` print when the input or the peer is
wrong: one line of their own on stderr and an exit status by failure class,
never gRPC's C-core log lines or a traceback."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from client.sdk import BlockdClient
from tests.support.grpc_fixtures import ROOT, child_env, start_daemon

pytest_plugins = ["tests.support.auth_fixtures"]

#: a C-core (absl) log line, ``I1202 17:30:39.830559    8631 ssl_transport_security.cc:2563] ...``,
#: or absl's notice that logging was not set up
CORE_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|absl::InitializeLog", re.MULTILINE)

#: the console script ``blockctl`` (``client.cli:main`` in pyproject.toml) and ``python -m``
BLOCKCTL_FORMS = {"script": ["-c", "import sys; from client.cli import main; sys.exit(main())"],
                  "module": ["-m", "client.cli"]}


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.fixture(scope="module")
def plain_daemon():
    d = start_daemon()
    yield d
    d.kill()


@pytest.mark.parametrize("form", sorted(BLOCKCTL_FORMS))
def test_a_tls_handshake_failure_is_one_blockctl_line_without_grpc_log_lines(plain_daemon, pki, form, monkeypatch):
    """A TLS client against a plain-text blockd: the C core logs every failed
    handshake (at INFO, to stderr) unless GRPC_VERBOSITY says otherwise."""
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    monkeypatch.delenv("GRPC_TRACE", raising=False)
    argv = [*BLOCKCTL_FORMS[form], "--target", plain_daemon.address, "--tls-ca", pki.ca, "--timeout-s", "1",
            "pools", "list"]
    done = _run(argv)
    assert done.returncode == 69, done.stderr
    assert not CORE_LOG_LINE.search(done.stderr), done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("blockctl: UNAVAILABLE: "), done.stderr
    # the user's own GRPC_VERBOSITY still wins (and shows the command does make the core log)
    loud = _run(argv, GRPC_VERBOSITY="INFO")
    assert loud.returncode == 69 and CORE_LOG_LINE.search(loud.stderr), loud.stderr


def test_blockd_worker_prints_no_grpc_log_lines_either(plain_daemon, pki, monkeypatch):
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    monkeypatch.delenv("GRPC_TRACE", raising=False)
    done = _run(["-m", "worker.main", "--blockd", plain_daemon.address, "--tls-ca", pki.ca, "--pool", "p"])
    assert done.returncode == 69, done.stderr
    assert not CORE_LOG_LINE.search(done.stderr), done.stderr
    assert "blockd-worker: cannot start: UNAVAILABLE: " in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(("target", "says"), [
    ("etcd://", "names no etcd endpoint"), ("etcd://10.0.0.1:2379", "names no group"),
    ("etcd:///main", "names no etcd endpoint"), ("etcd://10.0.0.1:2379/a/b", "'/' in its group 'a/b'"),
    (" , ", "names no address")])
def test_a_malformed_group_target_is_the_sdks_invalid_argument_and_blockctl_exits_2(target, says):
    from client import errors as ce

    with pytest.raises(ce.InvalidArgumentError, match=says) as caught:
        BlockdClient(target)
    if target.startswith("etcd://"):  # it names the form it wants
        assert "etcd://HOST:PORT[,HOST:PORT...]/GROUP" in str(caught.value)
    for command in (["pools", "list"], ["cluster", "status"]):
        done = _run([*BLOCKCTL_FORMS["module"], "--target", target, "--timeout-s", "2", *command])
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("blockctl: INVALID_ARGUMENT: ") and says in done.stderr, done.stderr


CREATE = ("pools", "create", "p", "--num-blocks", "8", "--block-size", "16")


@pytest.mark.parametrize(("argv", "says"), [
    ((*CREATE, "--num-blocks", "0"), "argument --num-blocks: must be an integer >= 1"),
    ((*CREATE, "--block-size", "-4"), "argument --block-size: must be an integer >= 1"),
    ((*CREATE, "--num-layers", "0"), "argument --num-layers: must be an integer >= 1"),
    ((*CREATE, "--head-dim", "1.5"), "argument --head-dim: must be an integer >= 1"),
    ((*CREATE, "--watermark-blocks", "-1"), "argument --watermark-blocks: must be an integer >= 0"),
    ((*CREATE, "--host-blocks", "-1"), "argument --host-blocks: must be an integer >= 0"),
    (("--timeout-s", "-1", "pools", "list"), "argument --timeout-s: must be a number > 0"),
    (("pools", "list", "--timeout-s", "inf"), "argument --timeout-s: must be a number > 0"),
])
def test_a_numeric_flag_out_of_its_range_is_refused_while_parsing(capsys, argv, says):
    """Refused by argparse with the range, before any call (the target is
    closed: a flag that got through would make the command exit 69)."""
    from client.cli import main as blockctl

    with pytest.raises(SystemExit) as exited:
        blockctl(["--target", "127.0.0.1:1", "--timeout-s", "0.5", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.splitlines()[-1].endswith(f"error: {says}"), err


def test_a_numeric_variable_out_of_its_range_is_one_line(capsys, monkeypatch):
    from client.cli import main as blockctl

    monkeypatch.setenv("BLOCKCTL_TIMEOUT_S", "0")
    with pytest.raises(SystemExit) as exited:
        blockctl(["--target", "127.0.0.1:1", "pools", "list"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "blockctl: BLOCKCTL_TIMEOUT_S must be a number > 0, got '0'\n"


@pytest.mark.parametrize("flag", ["--num-blocks", "--block-size"])
def test_the_pool_config_of_a_model_refuses_a_size_below_1(capsys, flag):
    """``python -m worker.model pool-config`` printed a pool of 0 blocks."""
    from worker.model.__main__ import main as model_tool

    with pytest.raises(SystemExit) as exited:
        model_tool(["pool-config", "--model", "tiny-llama", flag, "0"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.splitlines()[-1].endswith(f"argument {flag}: must be an integer >= 1"), err
