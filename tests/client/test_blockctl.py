"""``blockctl``'s operator commands against a live daemon: pools delete and
apply, prefix-cache reset, workers list, health; global flags after the
command; an exit status per failure class, as ``--help`` documents it."""

from __future__ import annotations

import io
import json
import re
import socket

import grpc
import pytest

from blockd.core import Allocate, Commit, ExtraKeys, PoolConfig
from blockd.core.types import WorkerInfo
from client.cli import main as blockctl
from client.cli.common import EPILOG, EXIT_CODES, Exit
from client.sdk import BlockdClient
from tests.support.cli import run

pytest_plugins = ["tests.support.grpc_fixtures"]

POOLS = {"pools": [{"name": "a", "num_blocks": 32, "block_size": 8, "num_layers": 2},
                   {"name": "b", "num_blocks": 16, "block_size": 4}]}


@pytest.fixture
def target(blockd_server) -> str:
    return blockd_server.address


def test_pools_delete(target, client, capsys) -> None:
    client.create_pool(PoolConfig("gone", num_blocks=8, block_size=4))
    code, out, _ = run(capsys, "--target", target, "pools", "delete", "gone")
    assert code == 0 and out == "deleted pool gone\n"
    assert client.list_pools() == []
    code, _, err = run(capsys, "--target", target, "pools", "delete", "gone")
    assert code == Exit.NOT_FOUND == 3 and "NOT_FOUND" in err


def test_prefix_cache_reset(target, client, capsys) -> None:
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=2))
    client.step("p", [Allocate("s", [1, 2, 3, 4, 5]), Commit("s", 5)])
    client.free("p", "s")
    assert client.lookup_prefix([1, 2, 3, 4, 5])["p"] == 4
    code, out, _ = run(capsys, "--target", target, "prefix-cache", "reset", "p", "--json")
    assert code == 0 and json.loads(out) == {"reset": "p"}
    assert client.lookup_prefix([1, 2, 3, 4, 5])["p"] == 0
    assert run(capsys, "--target", target, "prefix-cache", "reset", "nope")[0] == 3


def test_workers_list(target, client, capsys) -> None:
    client.create_pool(PoolConfig("m", num_blocks=8, block_size=4, num_layers=2, num_kv_heads=4))
    client.register_worker(WorkerInfo("w1", "m", "10.1.2.3:50061", 0, 2, 2, 4, pool_bytes=64, device="cuda:1",
                                      incarnation="i1"))
    client.register_worker(WorkerInfo("w0", "m", "10.1.2.4:50061", 0, 2, 0, 2, pool_bytes=64, incarnation="i0"))
    code, out, _ = run(capsys, "--target", target, "workers", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:4] == ["WORKER_ID", "POOL", "ADDRESS", "LAYERS"]
    assert [line.split()[:6] for line in lines[1:]] == [["w0", "m", "10.1.2.4:50061", "0:2", "0:2", "cpu"],
                                                         ["w1", "m", "10.1.2.3:50061", "0:2", "2:4", "cuda:1"]]
    assert all(line.split()[6] == "up" for line in lines[1:])
    code, out, _ = run(capsys, "--target", target, "workers", "list", "--pool", "m", "--json")
    assert [w["info"]["worker_id"] for w in json.loads(out)] == ["w0", "w1"]
    assert run(capsys, "--target", target, "workers", "list", "--pool", "other")[1].splitlines()[1:] == []


def test_health(blockd_server, capsys) -> None:
    target = blockd_server.address
    code, out, _ = run(capsys, "--target", target, "health")
    assert code == 0 and out == f"{target} (server): SERVING\n"
    code, out, _ = run(capsys, "--target", target, "health", "--service", "blockd.v1.BlockService", "--json")
    assert code == 0 and json.loads(out)["status"] == "SERVING"
    code, _, err = run(capsys, "--target", target, "health", "--service", "no.such.Service")
    assert code == Exit.NOT_FOUND and "NOT_FOUND" in err
    blockd_server.health.enter_graceful_shutdown()  # what SIGTERM does first
    code, out, err = run(capsys, "--target", target, "health")
    assert code == Exit.UNAVAILABLE == 69 and "NOT_SERVING" in out and "NOT_SERVING" in err


def test_a_daemon_that_is_down_exits_69(capsys) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    for argv in (("pools", "list"), ("health",)):
        code, out, err = run(capsys, "--target", dead, "--timeout-s", "2", *argv)
        assert code == 69 and out == "" and "UNAVAILABLE" in err, (argv, err)
        assert f"is blockd serving at {dead}?" in err or argv == ("health",)


def test_pools_apply_creates_what_is_missing_and_is_idempotent(target, client, capsys, tmp_path) -> None:
    client.create_pool(PoolConfig("b", num_blocks=16, block_size=4, watermark_blocks=2))  # unstated field
    path = tmp_path / "pools.json"
    path.write_text(json.dumps(POOLS))
    code, out, _ = run(capsys, "--target", target, "pools", "apply", str(path))
    assert code == 0 and out.splitlines() == ["created pool a", "unchanged pool b"]
    assert client.pool_config("a") == PoolConfig("a", num_blocks=32, block_size=8, num_layers=2, tenant="default")
    versions = {p.name: p.version for p in client.list_pools()}
    code, out, _ = run(capsys, "--target", target, "pools", "apply", str(path), "--json")
    assert code == 0 and [o["action"] for o in json.loads(out)] == ["unchanged", "unchanged"]
    assert {p.name: p.version for p in client.list_pools()} == versions


def test_pools_apply_reports_a_pool_that_differs_and_changes_nothing(target, client, capsys, tmp_path,
                                                                    monkeypatch) -> None:
    client.create_pool(PoolConfig("a", num_blocks=64, block_size=8))
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(POOLS["pools"])))
    code, out, err = run(capsys, "--target", target, "pools", "apply", "-")
    assert code == Exit.CONFLICT == 4
    assert out.splitlines() == [("pool a differs from the file: num_blocks is 64, the file says 32; "
                                "num_layers is 1, the file says 2 (left as it is)"), "created pool b"]
    assert "pool(s) a exist with another config" in err
    assert client.pool_config("a").num_blocks == 64


@pytest.mark.parametrize(("text", "message"), [
    ("not json", "is not JSON"),
    ('{"pools": [{"name": "x", "num_blocks": 8}]}', "missing field(s) block_size"),
    ('[{"name": "x", "num_blocks": 8, "block_size": 4, "colour": "red"}]', "unknown field(s) colour"),
    ('[{"name": "x", "num_blocks": 8, "block_size": 0}]', "block_size must be"),
    ('[{"name": "x", "num_blocks": 8, "block_size": 4}, {"name": "x", "num_blocks": 8, "block_size": 4}]',
     "more than once"),
])
def test_pools_apply_refuses_a_bad_file_before_any_call(target, client, capsys, tmp_path, text, message) -> None:
    path = tmp_path / "pools.json"
    path.write_text('[{"name": "first", "num_blocks": 8, "block_size": 4},' + text[1:]
                    if text.startswith("[") else text)
    code, out, err = run(capsys, "--target", target, "pools", "apply", str(path))
    assert code == 2 and out == "" and message in err and err.count("\n") == 1
    assert client.list_pools() == []  # not even the valid first entry
    assert run(capsys, "--target", target, "pools", "apply", str(tmp_path / "missing.json"))[0] == 2


def test_global_flags_before_or_after_the_command(target, client, capsys) -> None:
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    before = run(capsys, "--target", target, "--json", "pools", "list")
    after = run(capsys, "pools", "list", "--json", "--target", target)
    assert before == after and json.loads(after[1])[0]["name"] == "p"
    assert run(capsys, "--json", "pools", "show", "p", "--target", target)[0] == 0


def test_usage_errors_exit_2(target, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        blockctl(["--target", target, "pools", "frobnicate"])
    assert exc.value.code == 2
    # a value only blockd can check (flags' ranges are argparse's: tests/client/test_blockctl_input.py)
    code, _, err = run(capsys, "--target", target, "pools", "create", "x", "--num-blocks", "4", "--block-size", "4",
                       "--watermark-blocks", "9")
    assert code == 2 and "INVALID_ARGUMENT" in err


def test_already_exists_exits_4(target, client, capsys) -> None:
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    code, _, err = run(capsys, "--target", target, "pools", "create", "p", "--num-blocks", "9", "--block-size", "4")
    assert code == 4 and "ALREADY_EXISTS" in err


def test_help_documents_the_exit_codes_the_code_uses() -> None:
    documented, number = {}, ""
    for line in EPILOG.split("environment:")[0].strip().splitlines()[1:]:
        number, text = line.split(None, 1) if line[:4].strip().isdigit() else (number, line)
        for name in re.findall(r"\b[A-Z][A-Z_]{3,}\b", text):
            documented[name] = int(number)
    assert {code.name: int(status) for code, status in EXIT_CODES.items()} == \
        {name: n for name, n in documented.items() if name in grpc.StatusCode.__members__}
    assert len({int(e) for e in Exit}) == len(Exit)
    assert set(documented.values()) - set(Exit) == set()


def test_blockctl_as_a_command_with_environment_variables(daemon, run_module) -> None:
    d = daemon("--listen", "127.0.0.1:0")
    env = {"BLOCKD_TARGET": d.address, "BLOCKCTL_NUM_BLOCKS": "12", "BLOCKCTL_BLOCK_SIZE": "4",
           "BLOCKCTL_JSON": "true"}
    made = run_module("client.cli", "pools", "create", "envpool", env=env)
    assert made.returncode == 0 and json.loads(made.stdout)["num_blocks"] == 12, made.stderr
    made = run_module("client.cli", "pools", "create", "flagwins", "--num-blocks", "20", env=env)
    assert json.loads(made.stdout)["num_blocks"] == 20
    bad = run_module("client.cli", "pools", "list", env={**env, "BLOCKCTL_TIMEOUT_S": "soon"})
    assert bad.returncode == 2 and bad.stderr == "blockctl: BLOCKCTL_TIMEOUT_S must be a number > 0, got 'soon'\n"
    with BlockdClient(d.address) as c:
        assert sorted(p.name for p in c.list_pools()) == ["envpool", "flagwins"]


def test_pools_misses_shows_the_missed_tokens_by_reason(target, client, capsys) -> None:
    client.create_pool(PoolConfig("mx", num_blocks=16, block_size=4))
    client.step("mx", [Allocate("a", list(range(13)), ExtraKeys(model_id="m")), Commit("a", 13)])
    client.free("mx", "a")
    client.step("mx", [Allocate("b", list(range(13)))])  # the same tokens without the model id
    code, out, _ = run(capsys, "--target", target, "pools", "misses", "mx", "--json")
    assert code == 0 and json.loads(out) == {
        "pool": "mx", "queried_tokens": 26, "hit_tokens": 0, "missed_tokens": 26,
        "miss_tokens": {"never_stored": 12, "evicted_device": 0, "evicted_host": 0, "partial": 2,
                        "other_extra_keys": 12}}
    code, out, _ = run(capsys, "--target", target, "pools", "misses", "mx")
    assert code == 0 and out.startswith("pool mx: 26 prompt tokens queried, 0 hit, 26 missed\n")
    assert re.search(r"other_extra_keys\s+12\s+46\.2%", out) and re.search(r"partial\s+2\s+7\.7%", out)
    code, _, err = run(capsys, "--target", target, "pools", "misses", "nope")
    assert code == Exit.NOT_FOUND and "NOT_FOUND" in err
