"""Pins in the engine: records in the log, replayed and snapshotted exactly;
deadlines stamped once and let go by a logged unpin (never by the clock on
replay); the tenant's pinned-blocks quota; retried request ids; refusals
that change nothing."""

from __future__ import annotations

import json
import time

import pytest

from blockd.auth import Identity, acting_as
from blockd.auth.identity import AccessDenied
from blockd.auth.quotas import Quota
from blockd.core import Allocate, Commit, ExtraKeys, Free, InvalidArgument, NotFound, PoolConfig, WrongState
from blockd.core.errors import QuotaExceeded
from blockd.engine import records
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.engine.pools import PoolEntry
from blockd.engine.retention.pins import PinExpiry
from blockd.storage.reader import Reader

ACME = Identity("router-a", "acme", frozenset({"scheduler"}), "token")
GLOBEX = Identity("router-g", "globex", frozenset({"scheduler"}), "token")
PROMPT = list(range(1, 10))  # two full blocks of 4, and one token
NONE = ExtraKeys()


class WallClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _engine(tmp_path=None, clock: WallClock | None = None, quotas: dict[str, Quota] | None = None) -> Engine:
    table = quotas or {}
    config = EngineConfig(data_dir=str(tmp_path) if tmp_path is not None else None,
                          wall_clock=clock or WallClock(), quotas=lambda tenant: table.get(tenant, Quota()))
    return Engine(config)


def _cached(engine: Engine, pool: str, seq_id: str, prompt: list[int]) -> None:
    engine.step(pool, [Allocate(seq_id, prompt)])
    engine.step(pool, [Commit(seq_id, len(prompt)), Free(seq_id)])


def _state(engine: Engine) -> str:
    return json.dumps(engine.capture(), sort_keys=True)


def test_pins_and_unpins_survive_a_restart_from_the_log_and_from_a_snapshot(tmp_path) -> None:
    clock = WallClock()
    engine = _engine(tmp_path, clock)
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    _cached(engine, "p", "a", PROMPT)
    first = engine.pin_prefix("p", PROMPT, NONE, ttl_s=30)
    second = engine.pin_prefix("p", PROMPT[:4], NONE)
    assert (first.pin_id, first.block_ids, first.num_tokens, first.expires_at) == ("pin-1", (0, 1), 8, clock.now + 30)
    assert second.expires_at == 0.0
    engine.unpin_prefix("p", "pin-2")
    state = _state(engine)
    engine.close()
    clock.now += 3600  # replay reads no clock: the expired pin is still there until the timer logs its unpin
    again = _engine(tmp_path, clock)
    assert _state(again) == state and again.list_pins("p") == [first]
    again.check_invariants()
    again.snapshot()
    again.close()
    third = _engine(tmp_path, clock)
    assert third.list_pins("p") == [first] and third.get_pool("p").num_pinned_blocks == 2
    assert third.expire_pins() == 1 and third.list_pins("p") == []
    third.close()
    fourth = _engine(tmp_path, clock)
    assert fourth.list_pins("p") == [] and fourth.get_pool("p").num_evictable_blocks == 2
    assert fourth.pin_prefix("p", PROMPT, NONE).pin_id == "pin-3"
    fourth.close()


def test_the_log_holds_the_deadline_and_the_expiry_as_records(tmp_path) -> None:
    clock = WallClock()
    engine = _engine(tmp_path, clock)
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    _cached(engine, "p", "a", PROMPT)
    engine.pin_prefix("p", PROMPT, NONE, ttl_s=1.5)
    clock.now += 1.0
    assert engine.expire_pins() == 0
    clock.now += 0.5
    assert engine.expire_pins() == 1 and engine.expire_pins() == 0
    engine.close()
    pin, unpin = [record.body for record in Reader(str(tmp_path)).records()][-2:]
    assert (pin["kind"], pin["ttl_s"], pin["expires_at"]) == ("pin_prefix", 1.5, 1_000_001.5)
    assert records.decode(unpin)[0] == records.UnpinPrefix("p", "pin-1", expired=True)


def test_refusals_change_nothing() -> None:
    engine = _engine()
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    _cached(engine, "p", "a", PROMPT)
    before = _state(engine)
    for call, error in [
        (lambda: engine.pin_prefix("nope", PROMPT, NONE), NotFound),
        (lambda: engine.pin_prefix("p", PROMPT, NONE, ttl_s=-1), InvalidArgument),
        (lambda: engine.pin_prefix("p", PROMPT, NONE, ttl_s=float("nan")), InvalidArgument),
        (lambda: engine.pin_prefix("p", PROMPT, NONE, ttl_s=2e9), InvalidArgument),
        (lambda: engine.pin_prefix("p", [1, 2, 3, 2**40], NONE), InvalidArgument),
        (lambda: engine.pin_prefix("p", [5, 5, 5, 5], NONE), WrongState),
        (lambda: engine.unpin_prefix("p", "pin-9"), NotFound),
        (lambda: engine.unpin_prefix("p", ""), InvalidArgument),
        (lambda: engine.list_pins("nope"), NotFound),
    ]:
        with pytest.raises(error):
            call()
    assert _state(engine) == before


def test_a_tenant_pins_only_its_own_pools() -> None:
    engine = _engine()
    engine.create_pool(PoolConfig("pa", num_blocks=8, block_size=4, tenant="acme"))
    with acting_as(ACME):
        _cached(engine, "pa", "a", PROMPT)
        pin = engine.pin_prefix("pa", PROMPT, NONE)
        assert pin.tenant == "acme"
    before = _state(engine)
    with acting_as(GLOBEX):
        for call in (lambda: engine.pin_prefix("pa", PROMPT, NONE), lambda: engine.unpin_prefix("pa", pin.pin_id),
                     lambda: engine.list_pins("pa")):
            with pytest.raises(AccessDenied):
                call()
    assert _state(engine) == before


def test_pinned_blocks_count_against_the_tenants_quota() -> None:
    engine = _engine(quotas={"acme": Quota(pinned_blocks=3)})
    with acting_as(ACME):
        engine.create_pool(PoolConfig("a", num_blocks=8, block_size=4))
        engine.create_pool(PoolConfig("b", num_blocks=8, block_size=4))
        _cached(engine, "a", "s", PROMPT)
        _cached(engine, "b", "s", PROMPT)
        engine.pin_prefix("a", PROMPT, NONE)  # 2 blocks
        engine.pin_prefix("a", PROMPT[:4], NONE)  # a block pinned already: counted once
        before = _state(engine)
        with pytest.raises(QuotaExceeded) as err:
            engine.pin_prefix("b", PROMPT, NONE)  # 2 more: 4 > 3
        assert [subject for subject, _ in err.value.violations] == ["tenant:acme/pinned_blocks"]
        assert _state(engine) == before
        engine.pin_prefix("b", PROMPT[:4], NONE)  # 1 more: 3
        engine.unpin_prefix("a", "pin-1")
        engine.unpin_prefix("a", "pin-2")
        engine.pin_prefix("b", PROMPT, NONE)  # the room came back
    assert engine.get_pool("b").num_pinned_blocks == 2
    # pinned blocks are used blocks: the pool's free room shrinks by them
    stats = engine.get_pool("b")
    assert (stats.num_used_blocks, stats.num_evictable_blocks) == (2, 0)


def test_a_retried_request_id_gets_the_first_pin() -> None:
    clock = WallClock()
    engine = _engine(clock=clock)
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    _cached(engine, "p", "a", PROMPT)
    first = engine.pin_prefix("p", PROMPT, NONE, ttl_s=5, request_id="r1")
    clock.now += 1  # another deadline, the same request
    assert engine.pin_prefix("p", PROMPT, NONE, ttl_s=5, request_id="r1") == first
    assert len(engine.list_pins("p")) == 1
    with pytest.raises(InvalidArgument):
        engine.pin_prefix("p", PROMPT[:4], NONE, ttl_s=5, request_id="r1")
    assert engine.unpin_prefix("p", "pin-1", request_id="r2") == engine.unpin_prefix("p", "pin-1", request_id="r2")


def test_a_reset_of_the_prefix_cache_drops_the_pins() -> None:
    engine = _engine()
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    _cached(engine, "p", "a", PROMPT)
    engine.pin_prefix("p", PROMPT, NONE)
    engine.reset_prefix_cache("p")
    assert engine.list_pins("p") == [] and engine.get_pool("p").num_pinned_blocks == 0
    engine.check_invariants()


def test_the_expiry_thread_lets_a_pin_go() -> None:
    clock = WallClock()
    engine = _engine(clock=clock)
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    _cached(engine, "p", "a", PROMPT)
    engine.pin_prefix("p", PROMPT, NONE, ttl_s=0.5)
    expiry = PinExpiry(engine.expire_pins, interval_s=0.01)
    expiry.start()
    try:
        clock.now += 1
        for _ in range(500):
            if not engine.list_pins("p"):
                break
            time.sleep(0.01)
        assert engine.list_pins("p") == []
    finally:
        expiry.stop()


# --- per request: an Allocate's retain_ttl_s ---------------------------------------------
def test_an_allocate_with_retain_ttl_s_is_pinned_once_its_prompt_is_committed(tmp_path) -> None:
    clock = WallClock()
    engine = _engine(tmp_path, clock)
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    engine.step("p", [Allocate("s", PROMPT, retain_ttl_s=60)])
    engine.step("p", [Commit("s", 4)])  # one of its two full blocks: not yet
    assert engine.list_pins("p") == []
    clock.now += 5
    engine.step("p", [Commit("s", 8)])
    [pin] = engine.list_pins("p")
    assert (pin.block_ids, pin.num_tokens, pin.expires_at) == ((0, 1), 8, clock.now + 60)
    engine.step("p", [Free("s")])  # the pin outlives the sequence
    assert engine.get_pool("p").num_pinned_blocks == 2 and engine.get_pool("p").num_evictable_blocks == 0
    state = _state(engine)
    engine.close()
    again = _engine(tmp_path, clock)  # replay: the same pin, from the logged record
    assert _state(again) == state and again.list_pins("p") == [pin]
    again.close()


def test_a_retained_sequence_freed_before_its_commit_pins_nothing_and_a_bad_ttl_changes_nothing(tmp_path) -> None:
    engine = _engine(tmp_path)
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    engine.step("p", [Allocate("s", PROMPT, retain_ttl_s=60)])
    snapshot = engine.capture()
    assert snapshot["pools"][0]["retain"] == [["s", 60.0, 8]]
    engine.step("p", [Free("s")])
    engine.step("p", [Allocate("t", PROMPT[:3], retain_ttl_s=60), Allocate("u", PROMPT, retain_ttl_s=60), Free("u")])
    assert "retain" not in engine.capture()["pools"][0]  # under a block: nothing to retain; freed: forgotten
    before = _state(engine)
    for ttl in (-1.0, float("nan"), 2e9):
        with pytest.raises(InvalidArgument, match="retain_ttl_s") as err:
            engine.step("p", [Allocate("v", PROMPT), Allocate("w", PROMPT, retain_ttl_s=ttl)])
        assert err.value.op_index == 1
    assert _state(engine) == before
    engine.snapshot()  # a snapshot keeps what is still to retain
    engine.step("p", [Allocate("x", PROMPT, retain_ttl_s=5)])
    engine.close()
    again = _engine(tmp_path)
    again.step("p", [Commit("x", len(PROMPT))])
    assert [p.num_tokens for p in again.list_pins("p")] == [8]
    again.close()


def test_a_retained_prompt_over_the_quota_is_given_up() -> None:
    engine = _engine(quotas={"acme": Quota(pinned_blocks=1)})
    with acting_as(ACME):
        engine.create_pool(PoolConfig("a", num_blocks=8, block_size=4))
        engine.step("a", [Allocate("s", PROMPT, retain_ttl_s=60)])
        engine.step("a", [Commit("s", 8)])
        assert engine.list_pins("a") == [] and "retain" not in engine.capture()["pools"][0]


def test_a_retained_prompt_committed_and_freed_in_one_batch_is_still_pinned(tmp_path) -> None:
    clock = WallClock()
    engine = _engine(tmp_path, clock)
    engine.create_pool(PoolConfig("p", num_blocks=8, block_size=4, tenant="acme"))
    extra = ExtraKeys(model_id="m")
    engine.step("p", [Allocate("s", PROMPT, extra, retain_ttl_s=30)])
    engine.step("p", [Commit("s", len(PROMPT)), Free("s")])  # a request's last step: commit and free
    [pin] = engine.list_pins("p")
    assert (pin.block_ids, pin.num_tokens, pin.expires_at) == ((0, 1), 8, clock.now + 30)
    assert engine.get_pool("p").num_evictable_blocks == 0 and "retain" not in engine.capture()["pools"][0]
    state = _state(engine)
    engine.close()
    again = _engine(tmp_path, clock)
    assert _state(again) == state
    entry = again._state.pools["p"]  # a request still waiting with its prompt survives a snapshot
    entry.retain["t"] = (5.0, 8, PROMPT[:8], extra)
    assert PoolEntry.load(json.loads(json.dumps(entry.dump())), 1).retain == entry.retain
    again.close()
