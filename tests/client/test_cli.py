"""``blockctl`` against a live daemon (tables and --json), and ``blockd serve``
as a process: the ready line, env settings, SIGTERM, recovery from a data dir."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from blockd.core import PoolConfig
from client.sdk import BlockdClient
from tests.support.cli import run

pytest_plugins = ["tests.support.grpc_fixtures"]


@pytest.fixture
def target(blockd_server) -> str:
    return blockd_server.address


def test_pools_create_list_show(target, capsys) -> None:
    code, out, _ = run(capsys, "--target", target, "pools", "create", "llama", "--num-blocks", "64",
                       "--block-size", "16", "--num-layers", "4")
    assert code == 0 and "created pool llama: 64 blocks of 16" in out
    run(capsys, "--target", target, "pools", "create", "tiny", "--num-blocks", "8", "--block-size", "4",
        "--tenant", "acme")
    code, out, _ = run(capsys, "--target", target, "pools", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["NAME", "NUM_BLOCKS", "BLOCK_SIZE"]
    assert [line.split()[0] for line in lines[1:]] == ["llama", "tiny"]
    assert [line.split()[-1] for line in lines] == ["TENANT", "default", "acme"]  # no auth: anyone names one
    assert lines[1].split()[1:3] == ["64", "16"]
    code, out, _ = run(capsys, "--target", target, "--json", "pools", "list")
    assert [p["name"] for p in json.loads(out)] == ["llama", "tiny"]
    code, out, _ = run(capsys, "--target", target, "pools", "show", "llama")
    fields = dict(line.split(None, 1) for line in out.splitlines()[1:])
    assert fields["num_layers"] == "4" and fields["num_free_blocks"] == "64"
    assert fields["utilisation_ratio"] == "0.000"
    code, out, _ = run(capsys, "--target", target, "--json", "pools", "show", "llama")
    data = json.loads(out)
    assert data["config"]["num_layers"] == 4 and data["stats"]["num_blocks"] == 64


def test_pools_create_with_a_host_tier(target, capsys) -> None:
    code, out, _ = run(capsys, "--target", target, "pools", "create", "tiered", "--num-blocks", "16",
                       "--block-size", "4", "--host-blocks", "64")
    assert code == 0, out
    code, out, _ = run(capsys, "--target", target, "--json", "pools", "show", "tiered")
    assert json.loads(out)["config"]["num_host_blocks"] == 64
    code, out, _ = run(capsys, "--target", target, "pools", "list")
    header = out.splitlines()[0].split()
    assert "NUM_HOST_BLOCKS" in header and "NUM_HOST_CACHED_BLOCKS" in header


def test_seq_show(target, capsys) -> None:
    with BlockdClient(target) as c:
        c.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
        c.allocate("p", "req-1", list(range(10)))
    code, out, _ = run(capsys, "--target", target, "seq", "show", "p", "req-1")
    assert code == 0 and "block_table: 0 1 2" in out
    assert dict(line.split(None, 1) for line in out.splitlines()[1:4])["num_tokens"] == "10"
    code, out, _ = run(capsys, "--target", target, "--json", "seq", "show", "p", "req-1")
    assert json.loads(out) == {"seq_id": "req-1", "num_tokens": 10, "num_committed": 0,
                               "block_table": [0, 1, 2], "kv_lost": False}


def test_events_tail(target, capsys) -> None:
    with BlockdClient(target) as c:
        c.create_pool(PoolConfig("p", num_blocks=16, block_size=2))
        c.allocate("p", "a", list(range(9)))
        c.commit("p", "a", 9)  # four full blocks: events 1..4
    code, out, _ = run(capsys, "--target", target, "events", "tail", "p")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["SEQ_NO", "KIND", "MEDIUM", "BLOCK", "HASH", "PARENT", "TOKENS"]
    assert [line.split()[0] for line in lines[1:]] == ["1", "2", "3", "4"]
    assert lines[1].split()[1:4] == ["BlockStored", "device", "0"] and lines[1].split()[5] == "-"
    code, out, _ = run(capsys, "--target", target, "--json", "events", "tail", "p", "--from", "1", "--limit", "2")
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["seq_no"] for e in events] == [2, 3] and events[0]["token_ids"] == [2, 3]
    assert len(events[0]["block_hash"]) == 32
    code, out, _ = run(capsys, "--target", target, "events", "tail", "p", "--from", "4")
    assert code == 0 and out == ""


def test_events_tail_says_which_tier_a_removed_block_left(target, capsys) -> None:
    with BlockdClient(target) as c:
        # two device blocks and one host block: the second offload pushes the first out of the host tier
        c.create_pool(PoolConfig("h", num_blocks=2, block_size=2, num_host_blocks=1))
        c.allocate("h", "a", [1, 2, 3, 4])
        c.commit("h", "a", 4)
        c.free("h", "a")
        c.allocate("h", "b", [5, 6, 7, 8])
    code, out, _ = run(capsys, "--target", target, "events", "tail", "h")
    removed = [line.split() for line in out.splitlines()[1:] if line.split()[1] == "BlockRemoved"]
    assert code == 0 and [row[2] for row in removed] == ["host"], out


def test_errors_exit_with_their_class_and_the_status(target, capsys) -> None:
    code, out, err = run(capsys, "--target", target, "pools", "show", "nope")
    assert code == 3 and out == "" and err.startswith("blockctl: NOT_FOUND: no pool named 'nope'")
    code, _, err = run(capsys, "--target", target, "pools", "create", "x", "--num-blocks", "4",
                       "--block-size", "4", "--watermark-blocks", "5")
    assert code == 2 and "INVALID_ARGUMENT" in err and "watermark_blocks" in err


def test_serve_process_blockctl_and_sigterm(daemon, run_module, tmp_path) -> None:
    data_dir = tmp_path / "data"
    d = daemon(env={"BLOCKD_LISTEN": "127.0.0.1:0", "BLOCKD_DATA_DIR": str(data_dir),
                    "BLOCKD_FSYNC": "never"})
    made = run_module("client.cli", "--target", d.address, "pools", "create", "kept", "--num-blocks", "32",
                      "--block-size", "8")
    assert made.returncode == 0, made.stderr
    with BlockdClient(d.address) as c:
        c.allocate("kept", "s", list(range(20)))
    listed = run_module("client.cli", "--target", d.address, "--json", "pools", "list")
    assert json.loads(listed.stdout)[0]["num_seqs"] == 1
    assert d.stop() == 0
    assert "listening" in d.stderr.lower() or "serving" in d.stderr.lower()
    assert str(data_dir) in d.stderr and "shutting down" in d.stderr
    again = daemon("--listen", "127.0.0.1:0", "--data-dir", str(data_dir), "--fsync", "never")
    with BlockdClient(again.address) as c:
        assert c.get_tables("kept") == (1, {"s": [0, 1, 2]})
    assert again.stop() == 0
    assert "pool kept: 32 blocks of 8, 1 sequences, version 1" in again.stderr


def test_serve_refuses_a_bad_fsync_policy(run_module) -> None:
    proc = run_module("blockd.cli", "serve", "--listen", "127.0.0.1:0", env={"BLOCKD_FSYNC": "sometimes"})
    assert proc.returncode == 2
    assert proc.stderr == "blockd: BLOCKD_FSYNC must be one of always, interval, never, got 'sometimes'\n"


def test_serve_passes_the_metrics_port_through(daemon) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = daemon("--listen", "127.0.0.1:0", env={"BLOCKD_METRICS_PORT": str(port)})
    with BlockdClient(d.address) as c:
        c.create_pool(PoolConfig("m", num_blocks=8, block_size=4))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert 'blockd_rpc_duration_seconds_count{code="OK",method="blockd.v1.PoolService/CreatePool"} 1.0' in text
    assert d.stop() == 0
