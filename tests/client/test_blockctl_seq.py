"""``blockctl seq list POOL`` against a live daemon: a table, JSON lines, a missing pool."""

from __future__ import annotations

import json

import pytest

from blockd.core import Allocate, Commit, Fork, PoolConfig
from tests.support.cli import run

pytest_plugins = ["tests.support.grpc_fixtures"]


@pytest.fixture
def target(blockd_server, client) -> str:
    client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
    client.step("p", [Allocate("b", [1, 2, 3, 4, 5, 6]), Allocate("a", list(range(10, 19))), Commit("a", 9)])
    client.step("p", [Fork("a", "a2")])
    client.create_pool(PoolConfig("empty", num_blocks=4, block_size=4))
    return blockd_server.address


def test_seq_list_prints_one_line_per_sequence_by_id(target, client, capsys) -> None:
    code, out, err = run(capsys, "--target", target, "seq", "list", "p")
    assert code == 0 and err == ""
    header, *rows = out.splitlines()
    assert header.split() == ["SEQ_ID", "NUM_TOKENS", "NUM_COMMITTED", "NUM_BLOCKS", "KV_LOST"]
    assert [r.split() for r in rows] == [["a", "9", "9", "3", "False"], ["a2", "9", "9", "3", "False"],
                                         ["b", "6", "0", "2", "False"]]


def test_seq_list_json_is_one_object_per_line_with_the_block_table(target, client, capsys) -> None:
    code, out, _ = run(capsys, "--target", target, "seq", "list", "p", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [s["seq_id"] for s in lines] == ["a", "a2", "b"]
    for line in lines:
        info = client.get_sequence("p", line["seq_id"])
        assert line == {"seq_id": info.seq_id, "num_tokens": info.num_tokens, "num_committed": info.num_committed,
                        "num_blocks": len(info.block_table), "block_table": info.block_table,
                        "kv_lost": info.kv_lost}
    assert lines[0]["block_table"][:2] == lines[1]["block_table"][:2]  # the fork shares the full blocks


def test_seq_list_of_an_empty_pool_prints_only_the_header(target, capsys) -> None:
    code, out, _ = run(capsys, "--target", target, "seq", "list", "empty")
    assert code == 0 and out.split() == ["SEQ_ID", "NUM_TOKENS", "NUM_COMMITTED", "NUM_BLOCKS", "KV_LOST"]
    assert run(capsys, "--target", target, "seq", "list", "empty", "--json")[:2] == (0, "")


def test_seq_list_of_a_missing_pool_exits_3_with_one_line(target, capsys) -> None:
    code, out, err = run(capsys, "--target", target, "seq", "list", "nope")
    assert code == 3 and out == "" and err.count("\n") == 1
    assert err.startswith("blockctl: NOT_FOUND: ") and "nope" in err
