"""Retention priorities in the engine: an Allocate's priority and
SetPrefixPriority are in the log and in snapshots, so replay rebuilds each
priority's LRU order in both tiers exactly; retried request ids; refusals
that change nothing (another tenant's pool included)."""

from __future__ import annotations

import json

import pytest

from blockd.auth import Identity, acting_as
from blockd.auth.identity import AccessDenied
from blockd.core import Allocate, Commit, ExtraKeys, Free, InvalidArgument, NotFound, PoolConfig, WrongState
from blockd.engine import records
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.storage.reader import Reader

ACME = Identity("router-a", "acme", frozenset({"scheduler"}), "token")
GLOBEX = Identity("router-g", "globex", frozenset({"scheduler"}), "token")
NONE = ExtraKeys()


def _engine(tmp_path=None) -> Engine:
    return Engine(EngineConfig(data_dir=str(tmp_path) if tmp_path is not None else None))


def _state(engine: Engine) -> str:
    return json.dumps(engine.capture(), sort_keys=True)


def _levels(engine: Engine, pool: str) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Each priority's LRU list, device and host tier, front first."""
    blocks = engine._state.pools[pool].pool.blocks
    device = {p: list(blocks.lru.at(p)) for p in range(8) if list(blocks.lru.at(p))}
    host = {p: list(blocks.host.lru.at(p)) for p in range(8) if list(blocks.host.lru.at(p))}
    return device, host


def _fill(engine: Engine) -> None:
    """Prefixes at several priorities in both tiers of pool ``p``."""
    engine.create_pool(PoolConfig("p", num_blocks=6, block_size=2, num_host_blocks=3))
    for seq_id, prompt, priority in [("a", [1, 2, 3, 4, 5], 1), ("b", [6, 6, 7, 7, 8], 6), ("c", [9, 9, 8], 4)]:
        engine.step("p", [Allocate(seq_id, prompt, priority=priority)])
        engine.step("p", [Commit(seq_id, len(prompt)), Free(seq_id)])
    engine.step("p", [Allocate("d", [5] * 5, priority=0)])  # evicts into the host tier, lowest first
    engine.set_prefix_priority("p", [6, 6, 7, 7], NONE, 2)


def test_priorities_survive_a_restart_from_the_log_and_from_a_snapshot(tmp_path) -> None:
    engine = _engine(tmp_path)
    _fill(engine)
    levels, state = _levels(engine, "p"), _state(engine)
    assert levels == ({2: [4, 3], 4: [2]}, {1: [0, 1]})  # b set to 2 moved before c; a offloaded at 1
    engine.close()
    bodies = [record.body for record in Reader(str(tmp_path)).records()]
    assert records.decode(bodies[-1])[0] == records.SetPrefixPriority("p", [6, 6, 7, 7], NONE, 2)
    assert [op[5:] for body in bodies if body["kind"] == "step" for op in body["ops"] if op[0] == "A"] == [
        [1], [6], [], [0]]  # a default priority is not written (the log form of older daemons)
    again = _engine(tmp_path)  # from the log
    assert _state(again) == state and _levels(again, "p") == levels
    again.check_invariants()
    again.snapshot()
    again.close()
    third = _engine(tmp_path)  # from the snapshot
    assert _state(third) == state and _levels(third, "p") == levels
    assert third._state.pools["p"].pool.seqs["d"].priority == 0
    third.close()


def test_a_retried_request_id_gets_the_first_answer() -> None:
    engine = _engine()
    _fill(engine)
    first = engine.set_prefix_priority("p", [9, 9], NONE, 7, request_id="r1")
    assert (first.priority, first.num_tokens) == (7, 2)
    before = _state(engine)
    assert engine.set_prefix_priority("p", [9, 9], NONE, 7, request_id="r1") == first
    assert _state(engine) == before
    with pytest.raises(InvalidArgument):
        engine.set_prefix_priority("p", [9, 9], NONE, 3, request_id="r1")  # the same id for another request


def test_refusals_change_nothing() -> None:
    engine = _engine()
    _fill(engine)
    before = _state(engine)
    for call, error in [
        (lambda: engine.set_prefix_priority("nope", [1, 2], NONE, 1), NotFound),
        (lambda: engine.set_prefix_priority("p", [1, 2], NONE, 8), InvalidArgument),
        (lambda: engine.set_prefix_priority("p", [1, 2], NONE, -1), InvalidArgument),
        (lambda: engine.set_prefix_priority("p", [1, 2, 2**40], NONE, 1), InvalidArgument),
        (lambda: engine.set_prefix_priority("p", [4, 4, 4], NONE, 1), WrongState),
        (lambda: engine.step("p", [Allocate("e", [1]), Allocate("f", [2], priority=9)]), InvalidArgument),
    ]:
        with pytest.raises(error):
            call()
    assert _state(engine) == before


def test_a_tenant_sets_priorities_only_in_its_own_pools() -> None:
    engine = _engine()
    engine.create_pool(PoolConfig("pa", num_blocks=8, block_size=2, tenant="acme"))
    with acting_as(ACME):
        engine.step("pa", [Allocate("a", [1, 2, 3]), Commit("a", 3), Free("a")])
        assert engine.set_prefix_priority("pa", [1, 2], NONE, 0).tenant == "acme"
    before = _state(engine)
    with acting_as(GLOBEX), pytest.raises(AccessDenied):
        engine.set_prefix_priority("pa", [1, 2], NONE, 7)
    assert _state(engine) == before
