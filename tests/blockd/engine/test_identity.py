"""Pool incarnations and lost KV in the engine (no gRPC): a re-created pool is
told apart from the old one, a new worker incarnation marks the pool's KV
lost, steps naming lost sequences are refused naming them, and all of it
survives a restart from the log and from a snapshot."""

import json

import pytest

from blockd.core import ALL_BLOCKS_CLEARED, Allocate, Append, Commit, DecodeAppend, Fork, Free, PoolConfig
from blockd.core.incarnations import KVLost, PoolIncarnationMismatch
from blockd.core.types import Snapshot, WorkerInfo
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.rpc.errors import blockd_status

CONFIG = PoolConfig("p", num_blocks=16, block_size=2)


def worker(incarnation: str, worker_id: str = "w") -> WorkerInfo:
    return WorkerInfo(worker_id, "p", "", 0, 1, 0, 1, incarnation=incarnation)


def test_a_recreated_pool_is_a_new_incarnation_and_old_plans_are_refused():
    engine = Engine()
    first = engine.create_pool(CONFIG).incarnation
    r = engine.step("p", [Allocate("a", [1, 2, 3])])
    assert first and r.incarnation == first and engine.get_pool("p").incarnation == first
    engine.delete_pool("p")
    second = engine.create_pool(CONFIG).incarnation
    assert second != first and [s.incarnation for s in engine.list_pools()] == [second]
    for dry_run in (False, True):
        with pytest.raises(PoolIncarnationMismatch, match="deleted and re-created") as err:
            engine.step("p", [Allocate("b", [1])], incarnation=first, dry_run=dry_run)
        assert err.value.code == "FAILED_PRECONDITION"
        assert err.value.metadata["pool_incarnation"] == second
    assert engine.get_pool("p").version == 0, "a refused step changes nothing"
    assert engine.step("p", [Allocate("b", [1])], incarnation=second).incarnation == second


def test_watch_naming_another_incarnation_starts_with_a_snapshot():
    engine = Engine()
    old = engine.create_pool(CONFIG).incarnation
    engine.step("p", [Allocate("a", [1, 2, 3])])
    engine.delete_pool("p")
    new = engine.create_pool(CONFIG).incarnation
    engine.step("p", [Allocate("x", [5])])
    first = next(engine.watch("p", 7, lambda: True, incarnation=old))  # version 7 of the old pool
    assert first == Snapshot(1, {"x": [0]}, new)
    same = list(engine.watch("p", 0, lambda: True, incarnation=new))
    assert [d.version for d in same] == [1], "the current incarnation resumes from its version"


def test_a_new_worker_incarnation_loses_the_pools_kv():
    engine = Engine()
    engine.create_pool(CONFIG)
    engine.register_worker(worker("life-1"))  # an empty pool: nothing to lose
    assert engine.get_pool("p").last_event_seq_no == 0
    engine.step("p", [Allocate("a", [1, 2, 3, 4]), Commit("a", 4), Allocate("b", [7, 8, 9])])
    engine.register_worker(worker("life-1"))  # the same process again (a blockd restart): nothing lost
    assert engine.get_pool("p").num_kv_lost_seqs == 0
    stored = engine.get_pool("p").last_event_seq_no
    engine.register_worker(worker("life-2"))  # the worker restarted
    stats = engine.get_pool("p")
    assert stats.num_kv_lost_seqs == 2 and stats.last_event_seq_no == stored + 1
    assert list(engine._state.pools["p"].events)[-1].kind == ALL_BLOCKS_CLEARED
    assert engine.sequence_info("p", "a").kv_lost
    assert engine.lookup_prefix([1, 2, 3, 4, 5], None, ["p"]) == {"p": 0}, "lost blocks leave the prefix cache"
    for ops in ([Append("a", [5])], [Commit("b", 2)], [Fork("a", "c")],
                [Allocate("n", [1]), DecodeAppend(["b", "a"], [1, 2])]):
        with pytest.raises(KVLost) as err:
            engine.step("p", ops)
        assert err.value.code == "FAILED_PRECONDITION" and "life-2" in err.value.message
    assert err.value.op_index == 1 and json.loads(err.value.metadata["seq_ids"]) == ["b", "a"]
    status = blockd_status(err.value, "Step")
    assert "KV_LOST" in str(status.trailing_metadata)  # the reason travels in the ErrorInfo detail
    assert engine.get_pool("p").version == 1, "refused steps change nothing"
    # a lost sequence can be freed, and its id allocated afresh in the same batch
    engine.step("p", [Free("a"), Allocate("a", [1, 2, 3, 4]), Append("a", [5])])
    assert engine.get_pool("p").num_kv_lost_seqs == 1
    assert engine.step("p", [Free("b")]).version == 3
    assert engine.get_pool("p").num_kv_lost_seqs == 0
    engine.check_invariants()


def test_lost_listing_is_capped_to_fit_the_trailers():
    engine = Engine()
    engine.create_pool(PoolConfig("p", num_blocks=2000, block_size=1))
    ids = [f"{i:04d}" + "x" * 60 for i in range(600)]
    engine.step("p", [Allocate(s, [1]) for s in ids])
    engine.register_worker(worker("again"))
    with pytest.raises(KVLost) as err:
        engine.step("p", [DecodeAppend(ids, [1] * len(ids))])
    listed = json.loads(err.value.metadata["seq_ids"])
    assert 0 < len(listed) < len(ids) and listed == ids[: len(listed)]
    assert err.value.metadata["num_seq_ids"] == "600"
    assert len(err.value.metadata["seq_ids"]) <= 2048


@pytest.mark.parametrize("snapshot", [False, True])
def test_identity_and_lost_kv_survive_a_restart(tmp_path, snapshot):
    engine = Engine(EngineConfig(data_dir=str(tmp_path)))
    incarnation = engine.create_pool(CONFIG).incarnation
    engine.register_worker(worker("life-1"))
    engine.step("p", [Allocate("a", [1, 2, 3, 4]), Commit("a", 4)])
    engine.register_worker(worker("life-2"))
    engine.step("p", [Allocate("b", [9])])
    if snapshot:
        engine.snapshot()
    engine.close()

    again = Engine(EngineConfig(data_dir=str(tmp_path)))
    stats = again.get_pool("p")
    assert stats.incarnation == incarnation and stats.num_kv_lost_seqs == 1
    with pytest.raises(KVLost, match="'a'"):
        again.step("p", [Append("a", [5])])
    again.register_worker(worker("life-2"))  # the worker re-registers with the restarted daemon
    assert again.get_pool("p").num_kv_lost_seqs == 1 and not again.sequence_info("p", "b").kv_lost
    again.step("p", [Free("a")])
    again.close()
    assert Engine(EngineConfig(data_dir=str(tmp_path))).get_pool("p").num_kv_lost_seqs == 0
