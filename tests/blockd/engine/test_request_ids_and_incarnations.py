"""A request id's answer belongs to one pool incarnation (issue 26, item 1).

A step once retried with the same request id after its pool was deleted and
created again returned the deleted pool's answer (old incarnation, old
version) and applied nothing. Now a retry that finds the pool deleted or
re-created since is refused with FAILED_PRECONDITION, across restarts too;
a property test reuses ids across deletes, re-creations and restarts and
checks that no OK answer ever names another incarnation."""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from blockd.core import Allocate, BlockdError, DecodeAppend, Free, NotFound, PoolConfig, WrongState
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from client import errors as ce

pytest_plugins = ["tests.support.grpc_fixtures"]

CONFIG = PoolConfig("demo", num_blocks=16, block_size=4)


def test_a_retry_after_the_pool_was_re_created_is_refused_not_answered_from_the_old_pool():
    engine = Engine()
    first_inc = engine.create_pool(CONFIG).incarnation
    first = engine.step("demo", [Allocate("s", [1, 2, 3])], "rid-1")
    assert engine.step("demo", [Allocate("s", [1, 2, 3])], "rid-1") == first  # a plain retry: the first answer
    engine.delete_pool("demo")
    with pytest.raises(WrongState, match="deleted or re-created since") as err:
        engine.step("demo", [Allocate("s", [1, 2, 3])], "rid-1")
    assert "the pool is now deleted" in str(err.value)
    second_inc = engine.create_pool(CONFIG).incarnation
    assert second_inc != first_inc
    for planned in ("", second_inc):
        with pytest.raises(WrongState, match=f"incarnation was incarnation {first_inc}; the pool is now "
                                             f"incarnation {second_inc}"):
            engine.step("demo", [Allocate("s", [1, 2, 3])], "rid-1", incarnation=planned)
    with pytest.raises(NotFound):  # nothing was applied
        engine.sequence_info("demo", "s")
    fresh = engine.step("demo", [Allocate("s", [1, 2, 3])], "rid-2", incarnation=second_inc)
    assert fresh.incarnation == second_inc and fresh.version == 1
    engine.check_invariants()


def test_create_and_delete_retries_belong_to_their_incarnation():
    engine = Engine()
    created = engine.create_pool(CONFIG, request_id="c1")
    assert engine.create_pool(CONFIG, request_id="c1") == created  # retry: same answer, no second pool
    engine.delete_pool("demo", request_id="d1")
    engine.delete_pool("demo", request_id="d1")  # retry of the delete while the pool is gone: its answer
    with pytest.raises(WrongState, match="re-created since"):
        engine.create_pool(CONFIG, request_id="c1")  # the pool it created is gone
    engine.create_pool(CONFIG)
    with pytest.raises(WrongState, match="re-created since"):
        engine.delete_pool("demo", request_id="d1")  # must not delete the new pool, nor say it did
    assert engine.get_pool("demo").num_blocks == 16


def test_the_scope_survives_a_restart_from_the_log_and_from_a_snapshot(tmp_path):
    config = EngineConfig(data_dir=str(tmp_path), fsync="never")
    engine = Engine(config)
    engine.create_pool(CONFIG)
    engine.step("demo", [Allocate("s", [1, 2, 3])], "rid-1")
    engine.delete_pool("demo")
    engine.create_pool(CONFIG)
    engine.close()
    for snapshot in (False, True):
        engine = Engine(config)
        with pytest.raises(WrongState, match="re-created since"):
            engine.step("demo", [Allocate("s", [1, 2, 3])], "rid-1")
        if snapshot:
            engine.snapshot()
        engine.close()


def test_a_retry_over_grpc_after_re_creation_is_failed_precondition(client):
    client.create_pool(CONFIG)
    client.step("demo", [Allocate("s", [1, 2, 3])], request_id="rid-1")
    client.delete_pool("demo")
    inc = client.create_pool(CONFIG).incarnation
    with pytest.raises(ce.FailedPreconditionError, match="re-created since"):
        client.step("demo", [Allocate("s", [1, 2, 3])], request_id="rid-1", incarnation=inc)
    with pytest.raises(ce.NotFoundError):
        client.get_sequence("demo", "s")


class RequestIdsAcrossIncarnations(RuleBasedStateMachine):
    """Steps with ids from a small set, pools deleted and re-created, the
    daemon restarted from its data dir: every OK step answer names the
    incarnation the pool has now, and a step answered OK is really there."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None

    @initialize()
    def start(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.config = EngineConfig(data_dir=self.dir.name, fsync="never", snapshot_every=7)
        self.engine = Engine(self.config)
        self.engine.create_pool(CONFIG)
        self.n = 0

    @rule(rid=st.sampled_from(["r0", "r1", "r2", "r3"]), seq=st.sampled_from(["a", "b"]),
          kind=st.sampled_from(["alloc", "decode", "free"]))
    def step(self, rid, seq, kind) -> None:
        assert self.engine is not None
        self.n += 1
        op = {"alloc": Allocate(seq, [1, 2, 3]), "decode": DecodeAppend([seq], [self.n]), "free": Free(seq)}[kind]
        try:
            result = self.engine.step("demo", [op], rid)
        except BlockdError:
            return
        assert result.incarnation == self.engine.pool_incarnation("demo")
        assert result.version <= self.engine.get_pool("demo").version

    @rule()
    def recreate(self) -> None:
        assert self.engine is not None
        self.engine.delete_pool("demo")
        self.engine.create_pool(CONFIG)

    @rule()
    def restart(self) -> None:
        assert self.engine is not None
        self.engine.close()
        self.engine = Engine(self.config)

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.dir.cleanup()


RequestIdsAcrossIncarnations.TestCase.settings = settings(
    max_examples=30, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_request_ids_never_see_another_incarnations_answer = RequestIdsAcrossIncarnations.TestCase
