"""The daemon's default guardrails (issue 26, item 2): bounds on ops and
tokens per step, blocks per pool and pool names, each with a flag and an
environment variable, refused with INVALID_ARGUMENT and no change; and a
failing batch that fails at its first failing op without paying first for
the whole batch (a 30,000-op batch once held every caller for seconds)."""

from __future__ import annotations

import pytest

from blockd.core import Allocate, DecodeAppend, InvalidArgument, NoRoom, PoolConfig
from blockd.engine import state as engine_module
from blockd.engine.config import EngineConfig
from blockd.engine.guardrails import Guardrails
from blockd.engine.machine import Engine
from client import errors as ce
from client.sdk import BlockdClient
from tests.support.procs import start_blockd

pytest_plugins = ["tests.support.grpc_fixtures"]


def test_defaults_hold_without_any_quota():
    engine = Engine()
    engine.create_pool(PoolConfig("demo", num_blocks=64, block_size=16))
    big = [Allocate(f"s{i}", [1, 2, 3]) for i in range(30_000)]
    with pytest.raises(InvalidArgument, match=r"at most 8192 operations \(blockd serve --max-ops-per-step\), "
                                              r"got 30000"):
        engine.step("demo", big, "rid-big")
    with pytest.raises(InvalidArgument, match="at most 1048576 token ids"):
        engine.step("demo", [Allocate("long", [*range(1 << 20), 1])])
    with pytest.raises(InvalidArgument, match=r"at most 4194304 blocks \(blockd serve --max-blocks-per-pool\)"):
        engine.create_pool(PoolConfig("huge", num_blocks=(1 << 22) + 1, block_size=16))
    for bad in ("a b", "a/b", "-lead", "x" * 129, "é"):
        with pytest.raises(InvalidArgument, match="pool name"):
            engine.create_pool(PoolConfig(bad, num_blocks=8, block_size=16))
    assert [p.name for p in engine.list_pools()] == ["demo"]
    assert engine.get_pool("demo").version == 0  # nothing applied
    engine.create_pool(PoolConfig("ok.name_1-2", num_blocks=8, block_size=16))


def test_the_bounds_are_settings_and_checked():
    engine = Engine(EngineConfig(guardrails=Guardrails(max_ops_per_step=3, max_tokens_per_step=5)))
    engine.create_pool(PoolConfig("p", num_blocks=64, block_size=4))
    engine.step("p", [Allocate("a", [1, 2]), Allocate("b", [3, 4, 5])])
    with pytest.raises(InvalidArgument, match="at most 3 operations"):
        engine.step("p", [DecodeAppend(["a"], [1])] * 4)
    with pytest.raises(InvalidArgument, match="at most 5 token ids"):
        engine.step("p", [DecodeAppend(["a", "b"], [1, 2]), Allocate("c", [1, 2, 3, 4])], dry_run=True)
    for bad in ({"max_ops_per_step": 0}, {"max_tokens_per_step": -1}, {"max_name_length": 1000},
                {"max_blocks_per_pool": 1.5}):
        with pytest.raises(ValueError, match="must be an integer in"):
            Guardrails(**bad)


def test_a_failing_batch_stops_at_its_failing_op_and_is_never_fingerprinted(monkeypatch):
    """The request id's fingerprint (a hash of every op) is computed only for
    a batch that succeeded, or for an id already held: a failing batch costs
    the ops it ran, not the whole batch."""
    calls = []
    real = engine_module.fingerprint
    monkeypatch.setattr(engine_module, "fingerprint", lambda *a: calls.append(a) or real(*a))
    engine = Engine()
    engine.create_pool(PoolConfig("demo", num_blocks=64, block_size=16))
    calls.clear()
    with pytest.raises(NoRoom) as err:
        engine.step("demo", [Allocate(f"s{i}", list(range(20))) for i in range(8000)], "rid-1")
    assert err.value.op_index == 32 and not calls
    engine.step("demo", [Allocate("a", [1])], "rid-2")
    assert len(calls) == 1
    engine.step("demo", [Allocate("a", [1])], "rid-2")  # the retry: fingerprinted to compare
    assert len(calls) == 2


def test_flags_and_environment_reach_a_real_daemon():
    d = start_blockd("--max-ops-per-step", "4", "--max-name-length", "5",
                     env={"BLOCKD_MAX_BLOCKS_PER_POOL": "100", "BLOCKD_MAX_TOKENS_PER_STEP": "6"})
    try:
        with BlockdClient(d.address, timeout_s=10) as client:
            with pytest.raises(ce.InvalidArgumentError, match="--max-name-length"):
                client.create_pool(PoolConfig("toolong", num_blocks=8, block_size=4))
            with pytest.raises(ce.InvalidArgumentError, match="--max-blocks-per-pool"):
                client.create_pool(PoolConfig("p", num_blocks=101, block_size=4))
            client.create_pool(PoolConfig("p", num_blocks=100, block_size=4))
            with pytest.raises(ce.InvalidArgumentError, match=r"--max-ops-per-step\), got 5"):
                client.step("p", [Allocate(f"s{i}", [1]) for i in range(5)])
            with pytest.raises(ce.InvalidArgumentError, match="--max-tokens-per-step"):
                client.step("p", [Allocate("s", list(range(7)))])
            assert client.get_pool("p").version == 0
    finally:
        d.kill()


def test_a_large_step_is_skimmed_refused_unread_when_oversized_and_served_otherwise(client, blockd_server):
    from blockd.service import skim

    client.create_pool(PoolConfig("wide", num_blocks=1 << 14, block_size=16))
    within = [Allocate(f"w{i}", list(range(20))) for i in range(3000)]
    from blockd.rpc import convert
    assert convert.step_request_to_proto("wide", within, "").ByteSize() > skim.SKIM_BYTES
    result = client.step("wide", within)  # skimmed, then parsed and run
    assert len(result.results) == 3000
    with pytest.raises(ce.InvalidArgumentError, match=r"^INVALID_ARGUMENT: ops: a step holds at most 8192 "
                                                      r"operations .*got 9000"):
        client.step("wide", [Allocate(f"x{i}", [1]) for i in range(9000)])
    parse = skim.step_parser(Guardrails())
    junk = b"\x12\xff\xff\xff\xff\x0f" + b"\0" * (skim.SKIM_BYTES + 10)  # an op longer than the bytes
    refused = parse(junk)
    assert isinstance(refused, InvalidArgument) and "do not parse" in str(refused)
    assert client.get_pool("wide").version == 1
