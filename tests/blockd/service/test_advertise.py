"""Advertised addresses (:mod:`blockd.rpc.addresses`): parsing, the port taken
from the bound address, registration refusing what nobody can dial (over
real gRPC), and the worker and daemon processes honouring the flag."""

from __future__ import annotations

import pytest

from blockd.core import InvalidArgument, PoolConfig
from blockd.core.types import WorkerInfo
from blockd.engine.machine import Engine
from blockd.rpc.addresses import advertised, split, unroutable_reason
from client.errors import InvalidArgumentError
from client.sdk import BlockdClient
from tests.support.procs import Proc, start_blockd, start_worker

pytest_plugins = ["tests.support.grpc_fixtures"]


@pytest.mark.parametrize(("text", "parts"), [
    ("10.0.0.7:50061", ("10.0.0.7", 50061)),
    ("worker-0.blockd:50061", ("worker-0.blockd", 50061)),
    ("10.0.0.7", ("10.0.0.7", None)),
    ("[fd00::7]:50061", ("fd00::7", 50061)),
    ("fd00::7", ("fd00::7", None)),
    ("[fd00::7]", ("fd00::7", None)),
])
def test_split(text, parts) -> None:
    assert split(text) == parts


@pytest.mark.parametrize("text", ["host:port", "host:70000", "[fd00::1", "[fd00::1]x"])
def test_split_refuses_a_bad_address(text) -> None:
    with pytest.raises(ValueError, match="address"):
        split(text)


def test_advertised_takes_the_bound_port_when_only_a_host_is_given() -> None:
    assert advertised("10.0.0.7", "0.0.0.0:41234") == "10.0.0.7:41234"
    assert advertised("fd00::7", "[::]:41234") == "[fd00::7]:41234"
    assert advertised("10.0.0.7:9000", "0.0.0.0:41234") == "10.0.0.7:9000"
    assert advertised(None, "127.0.0.1:41234") == advertised("", "127.0.0.1:41234") == "127.0.0.1:41234"


@pytest.mark.parametrize(("address", "word"), [("0.0.0.0:50061", "0.0.0.0"), ("[::]:50061", "::"),
                                          (":50061", "empty host"), ("10.0.0.7:0", "port 0"),
                                          ("10.0.0.7", "no port")])
def test_unroutable(address, word) -> None:
    assert word in unroutable_reason(address)


@pytest.mark.parametrize("address", ["10.0.0.7:50061", "127.0.0.1:1", "[fd00::7]:1", "worker-0:50061"])
def test_routable(address) -> None:
    assert unroutable_reason(address) is None


def test_registration_refuses_a_wildcard_address_over_grpc(client) -> None:
    client.create_pool(PoolConfig("m", num_blocks=8, block_size=4))
    for address in ("0.0.0.0:50061", "[::]:50061", "10.0.0.7:0"):
        with pytest.raises(InvalidArgumentError, match="--advertise-address") as refused:
            client.register_worker(WorkerInfo("w", "m", address, 0, 1, 0, 1, incarnation="i0"))
        assert address in str(refused.value)
    assert client.list_workers("m") == []
    client.register_worker(WorkerInfo("w", "m", "10.0.0.7:50061", 0, 1, 0, 1, incarnation="i0"))
    client.register_worker(WorkerInfo("follower", "m", "", 0, 1, 0, 1, incarnation="i1"))  # serves nothing
    assert sorted(w.info.address for w in client.list_workers("m")) == ["", "10.0.0.7:50061"]


def test_the_registry_refuses_it_in_the_engine_too() -> None:
    engine = Engine()
    engine.create_pool(PoolConfig("m", num_blocks=8, block_size=4))
    with pytest.raises(InvalidArgument, match=r"0\.0\.0\.0 is not an address another host can dial"):
        engine.register_worker(WorkerInfo("w", "m", "0.0.0.0:1", 0, 1, 0, 1, incarnation="i0"))


def test_worker_registers_its_advertised_address() -> None:
    d = start_blockd()
    procs = [d]
    try:
        with BlockdClient(d.address) as c:
            c.create_pool(PoolConfig("m", num_blocks=8, block_size=4, num_layers=1, num_kv_heads=2, head_dim=4))
            procs.append(start_worker(d.address, "m", "--worker-id", "w-adv", "--device", "cpu",
                                      "--listen", "0.0.0.0:0", "--advertise-address", "127.0.0.1", "--insecure"))
            bound_port = procs[1].address.rsplit(":", 1)[1]
            (status,) = c.list_workers("m")
            assert status.info.address == f"127.0.0.1:{bound_port}"
    finally:
        for proc in reversed(procs):
            proc.kill()


def test_worker_bound_to_a_wildcard_without_advertise_address_exits_with_one_line(run_module) -> None:
    proc = run_module("worker.main", "--pool", "m", "--listen", "0.0.0.0:0")
    assert proc.returncode == 2 and "set --advertise-address HOST[:PORT]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_blockd_prints_the_address_it_advertises() -> None:
    d = Proc(["-m", "blockd.cli", "serve", "--listen", "0.0.0.0:0", "--insecure", "--advertise-address", "127.0.0.1"],
             "blockd advertising")
    try:
        assert d.address.startswith("127.0.0.1:")
        assert f"blockd listening on 0.0.0.0:{d.address.split(':')[1]}" in d.output()
    finally:
        d.kill()


def test_blockd_refuses_an_advertise_address_nobody_can_dial(run_module) -> None:
    proc = run_module("blockd.cli", "serve", "--listen", "127.0.0.1:0", "--advertise-address", "0.0.0.0")
    assert proc.returncode == 1 and "--advertise-address '0.0.0.0' cannot be used" in proc.stderr
