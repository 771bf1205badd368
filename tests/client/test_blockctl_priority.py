"""``blockctl pools priority`` against a live daemon; exit statuses per failure class."""

from __future__ import annotations

import json

import pytest

from blockd.core import Allocate, Commit, PoolConfig
from client.cli.common import Exit
from tests.support.cli import run

pytest_plugins = ["tests.support.grpc_fixtures"]


def test_set_a_prefix_priority_and_its_refusals(blockd_server, client, capsys) -> None:
    target = blockd_server.address
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=2))
    client.step("p", [Allocate("s", [1, 2, 3, 4, 5]), Commit("s", 5)])
    client.free("p", "s")
    code, out, _ = run(capsys, "--target", target, "pools", "priority", "p", "--tokens", "1,2,3,4,5", "--priority", "0")
    assert code == 0 and out == ("kept 4 of 5 tokens of pool p at priority 0 (2 blocks in the device tier, "
                                 "0 in the host tier)\n"), out
    code, out, _ = run(capsys, "--target", target, "pools", "priority", "p", "--tokens", "1 2", "--priority", "7",
                       "--json")
    assert code == 0 and json.loads(out) == {"pool": "p", "tenant": "default", "priority": 7, "num_tokens": 2,
                                             "num_device_blocks": 1, "num_host_blocks": 0}
    code, _, err = run(capsys, "--target", target, "pools", "priority", "p", "--tokens", "9,9", "--priority", "1")
    assert code == Exit.PRECONDITION and "FAILED_PRECONDITION" in err and "no full block" in err
    assert run(capsys, "--target", target, "pools", "priority", "nope", "--tokens", "1,2", "--priority", "1")[0] == (
        Exit.NOT_FOUND)
    for flags in (["--tokens", "1,2", "--priority", "8"], ["--tokens", "1,2", "--priority", "x"], ["--tokens", "1,2"]):
        with pytest.raises(SystemExit) as usage:
            run(capsys, "--target", target, "pools", "priority", "p", *flags)
        assert usage.value.code == Exit.USAGE
        assert "blockctl pools priority: error: " in capsys.readouterr().err
