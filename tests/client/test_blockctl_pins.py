"""``blockctl pools pin / unpin / pins`` against a live daemon, and the
pinned-block count in ``pools show``; exit statuses per failure class."""

from __future__ import annotations

import json
import re

import pytest

from blockd.core import Allocate, Commit, PoolConfig
from client.cli.common import Exit
from tests.support.cli import run

pytest_plugins = ["tests.support.grpc_fixtures"]


def test_pin_list_and_unpin_a_prefix(blockd_server, client, capsys) -> None:
    target = blockd_server.address
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=2))
    client.step("p", [Allocate("s", [1, 2, 3, 4, 5]), Commit("s", 5)])
    client.free("p", "s")
    code, out, _ = run(capsys, "--target", target, "pools", "pin", "p", "--tokens", "1,2,3,4,5", "--ttl-s", "600")
    assert code == 0 and re.fullmatch(r"pinned 4 of 5 tokens \(2 blocks\) of pool p as pin-1; expires in "
                                      r"(599|600)\.\d s\n", out), out
    code, out, _ = run(capsys, "--target", target, "pools", "pin", "p", "--tokens", "1 2", "--json")
    assert code == 0 and json.loads(out) == {"pin_id": "pin-2", "pool": "p", "tenant": "default", "block_ids": [0],
                                             "num_tokens": 2, "expires_at": 0.0}
    code, out, _ = run(capsys, "--target", target, "pools", "pins", "p")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["PIN_ID", "NUM_BLOCKS", "NUM_TOKENS", "EXPIRES", "TENANT"]
    assert lines[2].split() == ["pin-2", "1", "2", "never", "default"] and lines[1].split()[:3] == ["pin-1", "2", "4"]
    code, out, _ = run(capsys, "--target", target, "pools", "show", "p")
    assert code == 0 and re.search(r"num_pinned_blocks\s+2\n", out) and re.search(r"num_pins\s+2\n", out)
    code, out, _ = run(capsys, "--target", target, "pools", "unpin", "p", "pin-1")
    assert code == 0 and out == "unpinned pin-1 of pool p: 2 blocks may be evicted\n"
    code, out, _ = run(capsys, "--target", target, "pools", "pins", "p", "--json")
    assert code == 0 and [p["pin_id"] for p in json.loads(out)] == ["pin-2"]


def test_pin_refusals_exit_per_failure_class(blockd_server, client, capsys) -> None:
    target = blockd_server.address
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=2))
    code, _, err = run(capsys, "--target", target, "pools", "pin", "p", "--tokens", "1,2")
    assert code == Exit.PRECONDITION and "FAILED_PRECONDITION" in err and "no full block" in err
    code, _, err = run(capsys, "--target", target, "pools", "unpin", "p", "pin-1")
    assert code == Exit.NOT_FOUND and "no pin 'pin-1'" in err
    assert run(capsys, "--target", target, "pools", "pins", "nope")[0] == Exit.NOT_FOUND
    for flags in (["--tokens", "1,x"], ["--tokens", ""], ["--tokens", "1", "--ttl-s", "-1"]):
        with pytest.raises(SystemExit) as usage:
            run(capsys, "--target", target, "pools", "pin", "p", *flags)
        assert usage.value.code == Exit.USAGE
        assert "blockctl pools pin: error: argument" in capsys.readouterr().err
    code, _, err = run(capsys, "--target", target, "pools", "pin", "p", "--tokens", "1,-2")
    assert code == Exit.USAGE and "INVALID_ARGUMENT" in err, err
