"""The daemon's engine without gRPC: durability, idempotency, followers, workers."""

import json
import os
import threading

import pytest

from blockd.core import (
    Allocate,
    Append,
    Commit,
    Fork,
    Free,
    InvalidArgument,
    InvariantViolation,
    NoRoom,
    NotFound,
    PoolConfig,
    WrongState,
)
from blockd.core.state import dump_pool
from blockd.core.types import DecodeAppend, Snapshot, VersionDelta, WorkerInfo
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine


def pool_state(engine: Engine, name: str) -> str:
    data = dump_pool(engine._state.pools[name].pool)
    return json.dumps(data, sort_keys=True)


def drive(engine: Engine, rounds: int = 6) -> list:
    engine.create_pool(PoolConfig("a", num_blocks=40, block_size=4, num_layers=2, num_kv_heads=2,
                                  head_dim=8), request_id="create-a")
    engine.create_pool(PoolConfig("b", num_blocks=10, block_size=2), request_id="create-b")
    results = []
    for r in range(rounds):
        results.append(engine.step("a", [Allocate(f"s{r}", list(range(9))), Commit(f"s{r}", 9)], f"a{r}"))
        results.append(engine.step("a", [Fork(f"s{r}", f"f{r}"), DecodeAppend([f"s{r}", f"f{r}"], [r, r])],
                                   f"k{r}"))
        if r % 2:
            results.append(engine.step("a", [Free(f"s{r - 1}")], f"x{r}"))
        results.append(engine.step("b", [Allocate(f"b{r}", [r, r + 1, r + 2])], f"b{r}"))
        # a prompt taking blocks of one allocated beside it (Allocate.share_seq_id), then both done
        shared = [100 + r] * 8
        results.append(engine.step("a", [Allocate(f"p{r}", [*shared, 1]),
                                         Allocate(f"q{r}", [*shared, 2], share_seq_id=f"p{r}", share_tokens=8)],
                                   f"sh{r}"))
        assert results[-1].results[1].num_cached_tokens == 8
        results.append(engine.step("a", [Commit(f"q{r}", 9), Free(f"p{r}"), Free(f"q{r}")], f"shf{r}"))
        if r == 3:
            engine.reset_prefix_cache("a", request_id="reset")
            engine.step("b", [Free("b0"), Free("b1")], "bfree")
    return results


@pytest.mark.parametrize("snapshot_every", [3, 10_000])
@pytest.mark.parametrize("fsync", ["always", "interval", "never"])
def test_restart_restores_everything_exactly(tmp_path, fsync, snapshot_every):
    config = EngineConfig(data_dir=str(tmp_path), fsync=fsync, snapshot_every=snapshot_every, snapshot_log_ratio=0)
    engine = Engine(config)
    results = drive(engine)
    before = {name: pool_state(engine, name) for name in ("a", "b")}
    events = {name: list(engine._state.pools[name].events) for name in ("a", "b")}
    engine.close()

    again = Engine(EngineConfig(data_dir=str(tmp_path), fsync=fsync, snapshot_every=snapshot_every))
    assert {name: pool_state(again, name) for name in ("a", "b")} == before
    assert {name: list(again._state.pools[name].events) for name in ("a", "b")} == events
    again.check_invariants()
    # the idempotency table came back: a retried step returns its first result, changes nothing
    assert again.step("a", [Allocate("s0", list(range(9))), Commit("s0", 9)], "a0") == results[0]
    assert pool_state(again, "a") == before["a"]
    # and the engine keeps going where it left off
    nxt = again.step("a", [Append("s5", [1])], "next")
    assert nxt.version == again.get_pool("a").version
    again.close()


def test_torn_tail_record_is_dropped(tmp_path):
    engine = Engine(EngineConfig(data_dir=str(tmp_path)))
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4), request_id="c")
    engine.step("p", [Allocate("x", [1, 2, 3])], "s1")
    state = pool_state(engine, "p")
    engine.step("p", [Allocate("y", [4, 5])], "s2")
    engine.close()
    (wal,) = [n for n in os.listdir(tmp_path) if n.startswith("wal-")]
    path = tmp_path / wal
    path.write_bytes(path.read_bytes()[:-5])  # the last record was cut short by a crash
    again = Engine(EngineConfig(data_dir=str(tmp_path)))
    assert pool_state(again, "p") == state
    again.step("p", [Allocate("y", [4, 5])], "s2-retry")
    again.close()
    assert "y" in Engine(EngineConfig(data_dir=str(tmp_path))).get_tables("p", [])[1]


def test_a_retried_create_pool_after_restart_gets_its_first_answer(tmp_path):
    engine = Engine(EngineConfig(data_dir=str(tmp_path)))
    first = engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4), request_id="make-p")
    engine.close()
    again = Engine(EngineConfig(data_dir=str(tmp_path)))
    assert again.create_pool(PoolConfig("p", num_blocks=8, block_size=4), request_id="make-p") == first
    again.close()


def test_request_id_reuse_for_another_request_is_refused():
    engine = Engine()
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4), request_id="r1")
    assert engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4), request_id="r1").name == "p"
    with pytest.raises(InvalidArgument):
        engine.step("p", [Allocate("x", [1])], "r1")
    assert engine.get_pool("p").num_seqs == 0


def test_failed_step_is_not_logged(tmp_path):
    engine = Engine(EngineConfig(data_dir=str(tmp_path)))
    engine.create_pool(PoolConfig("p", num_blocks=2, block_size=4))
    with pytest.raises(NoRoom):
        engine.step("p", [Allocate("x", [1] * 4), Allocate("y", [1] * 9)], "bad")
    with pytest.raises(NotFound):
        engine.step("nope", [Free("x")])
    engine.close()
    again = Engine(EngineConfig(data_dir=str(tmp_path)))
    assert again.get_pool("p").version == 0
    # the failed request id was not remembered: the same id may now succeed
    again.step("p", [Allocate("x", [1] * 4)], "bad")
    assert again.get_tables("p", []) == (1, {"x": [0]})


def test_watch_sends_deltas_then_snapshot_when_too_old():
    engine = Engine()
    engine.create_pool(PoolConfig("p", num_blocks=16, block_size=2, max_retained_versions=2))
    for i in range(4):
        engine.step("p", [Allocate(f"s{i}", [i, i])])
    stop = threading.Event()
    items = engine.watch("p", 0, stop.is_set)
    first = next(items)
    assert isinstance(first, Snapshot) and first.version == 4 and len(first.tables) == 4
    got = []

    def follow():
        for item in items:
            got.append(item)
            if item.version == 5:
                stop.set()

    thread = threading.Thread(target=follow)
    thread.start()
    engine.step("p", [Append("s0", [9])])
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert [type(i) for i in got] == [VersionDelta] and got[0].version == 5
    recent = list(engine.watch("p", 3, lambda: True))
    assert [d.version for d in recent] == [4, 5]
    with pytest.raises(WrongState):
        list(engine.watch("p", 99, lambda: True))


def test_events_resume_by_sequence_number():
    engine = Engine()
    engine.create_pool(PoolConfig("p", num_blocks=16, block_size=2))
    engine.step("p", [Allocate("a", [1, 2, 3, 4, 5]), Commit("a", 5)])  # stores 2 blocks
    engine.step("p", [Free("a")])
    engine.reset_prefix_cache("p")
    events = []
    for event in engine.events("p", 1, lambda: len(events) >= 2):
        events.append(event)  # noqa: PERF402 - the stop condition reads the list as it grows
    assert [(e.seq_no, e.kind) for e in events] == [(2, "BlockStored"), (3, "AllBlocksCleared")]
    with pytest.raises(WrongState):
        next(engine.events("p", 10, lambda: True))


def test_worker_registry_marks_silent_workers_down():
    now = [100.0]
    engine = Engine(EngineConfig(clock=lambda: now[0], worker_timeout_s=5))
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4, num_layers=4, num_kv_heads=8))
    info = WorkerInfo("w0", "p", "127.0.0.1:1", 0, 4, 0, 4, pool_bytes=1024, incarnation="i0")
    assert engine.register_worker(info).is_up
    with pytest.raises(InvalidArgument):
        engine.register_worker(WorkerInfo("w1", "p", "", 0, 5, 0, 4, incarnation="i1"))
    now[0] += 6
    assert not engine.list_workers("p")[0].is_up
    status = engine.heartbeat("w0", 3)
    assert status.is_up and status.applied_version == 3
    with pytest.raises(NotFound):
        engine.heartbeat("ghost", 0)


def test_a_failing_log_stops_writes_until_restart(tmp_path):
    engine = Engine(EngineConfig(data_dir=str(tmp_path)))
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    os.close(engine._durability._wal._fd)  # the disk goes away under the log
    with pytest.raises(InvariantViolation, match="write-ahead log failed"):
        engine.step("p", [Allocate("x", [1])])
    with pytest.raises(WrongState, match="restart blockd"):
        engine.step("p", [Allocate("y", [1])])
    engine._durability._wal._fd = None
    engine.close()  # as the daemon's exit would: it releases the data dir's lock
    again = Engine(EngineConfig(data_dir=str(tmp_path)))
    assert again.get_tables("p", []) == (0, {})  # the unlogged batch never happened


def test_all_tables_come_in_seq_id_order_as_the_protocol_says():
    """GetTables with no ids answers by seq_id (blockd.proto), not in creation order."""
    engine = Engine()
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    engine.step("p", [Allocate(s, [1]) for s in ("c", "a", "b")])
    assert list(engine.get_tables("p", [])[1]) == ["a", "b", "c"]


def test_answers_held_back_wait_for_one_acknowledgement(tmp_path):
    """Engine.hold (the step lane's rounds): steps answer at once without
    their fsync, and acknowledge() makes every one of them durable together."""
    assert Engine().hold() is None  # nothing to wait for: nothing held
    syncs: list[float] = []
    engine = Engine(EngineConfig(data_dir=str(tmp_path), observe_wal_sync=syncs.append))
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    wal, before = engine._durability._wal, len(syncs)
    durable = wal.durable_lsn
    assert not engine.waits(durable)
    held = engine.hold()
    try:
        for seq in ("a", "b", "c"):
            assert engine.step("p", [Allocate(seq, [1, 2])]).term == 0
        with pytest.raises(AssertionError, match="before the last one was released"):
            engine.hold()
    finally:
        lsn = held.release()
    assert lsn == durable + 3 and wal.durable_lsn == durable and len(syncs) == before  # nothing fsynced yet
    assert engine.waits(lsn)
    assert engine.acknowledge(lsn) == 0
    assert wal.durable_lsn >= lsn and len(syncs) == before + 1  # one fsync for the three
    assert not engine.waits(lsn)
    engine.step("p", [Allocate("d", [1])])  # not held: its own fsync, as before
    assert len(syncs) == before + 2 and wal.durable_lsn == lsn + 1
    engine.close()
