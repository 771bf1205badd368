"""A pool handed from one engine to another (a move between daemon groups): exact, logged, refused when wrong."""

from __future__ import annotations

import pytest

from blockd.core import Allocate, PoolConfig
from blockd.core.errors import AlreadyExists, InvalidArgument, NotFound
from blockd.core.types import DecodeAppend
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine


def _source() -> Engine:
    engine = Engine()
    engine.create_pool(PoolConfig("m", num_blocks=32, block_size=4))
    first = engine.step("m", [Allocate("a", list(range(9))), Allocate("b", list(range(9)))])
    engine.step("m", [DecodeAppend(["a", "b"], [1, 2])], incarnation=first.incarnation)
    return engine


def test_an_imported_pool_is_the_exported_one_and_survives_a_restart(tmp_path) -> None:
    source = _source()
    state = source.export_pool("m")
    target = Engine(EngineConfig(data_dir=str(tmp_path)))
    stats = target.import_pool("m", state)
    assert stats == source.get_pool("m")
    assert target.get_tables("m", []) == source.get_tables("m", [])
    assert target.export_pool("m") == state
    target.check_invariants()
    incarnation = source.pool_incarnation("m")
    result = target.step("m", [DecodeAppend(["a"], [3])], incarnation=incarnation)  # continues where it was
    assert result.version == stats.version + 1
    target.close()
    again = Engine(EngineConfig(data_dir=str(tmp_path)))  # replayed from the log
    assert again.get_pool("m").version == result.version and again.pool_incarnation("m") == incarnation
    assert again.sequence_info("m", "a").num_tokens == 11
    again.close()


def test_a_bad_import_is_refused_and_changes_nothing() -> None:
    source, target = _source(), Engine()
    state = source.export_pool("m")
    target.import_pool("m", state)
    with pytest.raises(AlreadyExists):
        target.import_pool("m", state)
    with pytest.raises(InvalidArgument, match="snapshot form"):
        target.import_pool("x", {"config": {"name": "x"}})
    with pytest.raises(InvalidArgument, match="pool 'm'"):
        target.import_pool("y", state)
    with pytest.raises(InvalidArgument, match="JSON object"):
        target.import_pool("z", [])  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        source.export_pool("nope")
    assert [s.name for s in target.list_pools()] == ["m"]


def test_the_request_ids_of_a_pool_move_with_it() -> None:
    source = Engine()
    source.create_pool(PoolConfig("m", num_blocks=8, block_size=4))
    source.create_pool(PoolConfig("o", num_blocks=8, block_size=4))
    first = source.step("m", [Allocate("a", [1, 2])], "rid-m")
    source.step("o", [Allocate("a", [1, 2])], "rid-o")
    state = source.export_pool("m")
    assert [row[0] for row in state["requests"]] == ["rid-m"]  # only this pool's answers
    with pytest.raises(InvalidArgument, match="request ids"):
        Engine().import_pool("m", {**state, "requests": [["rid-m"]]})
    target = Engine()
    target.import_pool("m", state)
    again = target.step("m", [Allocate("a", [1, 2])], "rid-m")  # answered, not applied again
    assert again.version == first.version and target.get_pool("m").version == first.version
