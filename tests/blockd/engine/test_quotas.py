"""Per-tenant quotas: one test per limit, each refusal RESOURCE_EXHAUSTED that
changes nothing; the google.rpc details over real gRPC; a CreatePool far over
the block quota costs no memory."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from blockd.auth import Identity, acting_as, tokens
from blockd.auth.quotas import Quota, parse_quotas, quota_for
from blockd.auth.tokens import IdentitiesFileError, parse_identities
from blockd.core import Allocate, DecodeAppend, Fork, Free, PoolConfig
from blockd.core.errors import QuotaExceeded
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from client.errors import ResourceExhaustedError
from client.sdk import BlockdClient

pytest_plugins = ["tests.support.auth_fixtures"]

ACME = Identity("router-a", "acme", frozenset({"scheduler"}), "token")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(quota: Quota, clock: Clock | None = None) -> Engine:
    quotas = {"acme": quota}
    return Engine(EngineConfig(quotas=lambda tenant: quotas.get(tenant, Quota()), clock=clock or Clock()))


def _refused(call, limit: str) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as err:
        call()
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert [subject for subject, _ in err.value.violations] == [f"tenant:acme/{limit}"]
    return err.value


def test_pools_blocks_and_bytes_are_bounded_per_tenant() -> None:
    engine = _engine(Quota(pools=2, blocks=100, bytes=101 * 16))  # 16 bytes a block: 4 slots of fp16 K and V
    with acting_as(ACME):
        engine.create_pool(PoolConfig("a", num_blocks=60, block_size=4))
        _refused(lambda: engine.create_pool(PoolConfig("b", num_blocks=41, block_size=4)), "blocks")
        _refused(lambda: engine.create_pool(PoolConfig("b", num_blocks=40, block_size=4, head_dim=2)), "bytes")
        engine.create_pool(PoolConfig("b", num_blocks=39, block_size=4))
        _refused(lambda: engine.create_pool(PoolConfig("c", num_blocks=1, block_size=4)), "pools")
        assert sorted(s.name for s in engine.list_pools()) == ["a", "b"]
        engine.delete_pool("b")
        engine.create_pool(PoolConfig("c", num_blocks=1, block_size=4))  # room again
    # another tenant has its own (here: no) quota
    engine.create_pool(PoolConfig("big", num_blocks=4096, block_size=4, tenant="globex"))


def test_a_create_far_over_the_block_quota_is_refused_at_once_without_memory() -> None:
    engine = _engine(Quota(blocks=1024))
    with acting_as(ACME):
        tracemalloc.start()
        try:
            start = time.perf_counter()
            _refused(lambda: engine.create_pool(PoolConfig("huge", num_blocks=1 << 22, block_size=16)), "blocks")
            elapsed = time.perf_counter() - start
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 1 << 20, f"the refusal allocated {peak} bytes"  # a pool of 2^22 blocks is over 100 MB
    assert elapsed < 10.0  # generous: the point is that nothing of the pool's size was built
    assert engine.list_pools() == []


def test_sequences_ops_and_tokens_per_step_are_bounded() -> None:
    engine = _engine(Quota(sequences=2, ops_per_step=3, tokens_per_step=10))
    with acting_as(ACME):
        engine.create_pool(PoolConfig("p", num_blocks=64, block_size=4))
        engine.step("p", [Allocate("a", [1, 2, 3])])
        before = engine.capture()
        _refused(lambda: engine.step("p", [Allocate("b", [1]), Allocate("c", [2])]), "sequences")
        _refused(lambda: engine.step("p", [Fork("a", "b"), Fork("a", "c")]), "sequences")
        _refused(lambda: engine.step("p", [Allocate("b", list(range(11)))]), "tokens_per_step")
        _refused(lambda: engine.step("p", [DecodeAppend(["a"], [5])] * 4), "ops_per_step")
        _refused(lambda: engine.step("p", [Allocate("b", [1]), Allocate("c", [2])], dry_run=True), "sequences")
        assert engine.capture() == before
        engine.step("p", [Free("a"), Allocate("b", [1]), Allocate("c", [2])])  # frees make room in the batch
        assert engine.get_pool("p").num_seqs == 2


def test_the_step_rate_is_a_bucket_of_one_seconds_steps_with_a_retry_delay() -> None:
    clock = Clock()
    engine = _engine(Quota(steps_per_s=2), clock)
    with acting_as(ACME):
        engine.create_pool(PoolConfig("p", num_blocks=64, block_size=4))
        engine.step("p", [Allocate("a", [1])])
        engine.step("p", [Allocate("b", [1])])
        before = engine.capture()
        err = _refused(lambda: engine.step("p", [Allocate("c", [1])]), "steps_per_s")
        assert err.retry_after_s == pytest.approx(0.5)
        assert engine.capture() == before
        engine.step("p", [Allocate("c", [1])], dry_run=True)  # a dry run takes nothing from the bucket
        clock.now += 0.5
        engine.step("p", [Allocate("c", [1])])
        assert engine.get_pool("p").num_seqs == 3


def test_the_quota_section_of_the_identities_file() -> None:
    quotas = parse_quotas({"*": {"pools": 1}, "acme": {"pools": 3, "steps_per_s": 2.5}}, "f")
    assert quota_for(quotas, "acme") == Quota(pools=3, steps_per_s=2.5)
    assert quota_for(quotas, "other") == Quota(pools=1)
    assert quota_for(parse_quotas(None, "f"), "x") == Quota()
    for bad, message in [({"acme": {"pool": 1}}, "unknown limits"), ({"acme": {"pools": -1}}, "non-negative"),
                         ({"acme": {"blocks": 1.5}}, "integer"), ({"acme": []}, "object"),
                         ({"acme": {"pools": True}}, "non-negative")]:
        with pytest.raises(IdentitiesFileError, match=message):
            parse_identities({"version": 1, "quotas": bad}, "f")


def test_quota_refusals_over_grpc_carry_quota_failure_and_retry_info(secure_server, tmp_path) -> None:
    path = str(tmp_path / "ids.json")
    admin = tokens.add_token(path, "root", "ops", ["admin"])
    router = tokens.add_token(path, "router-a", "acme", ["scheduler"])
    data = tokens.read_for_edit(path)
    data["quotas"] = {"acme": {"blocks": 64, "steps_per_s": 1}}
    tokens.write_atomically(path, data)
    server = secure_server(None, path)
    with BlockdClient(server.address, timeout_s=10.0, max_attempts=1, token=admin) as root, \
            BlockdClient(server.address, timeout_s=10.0, max_attempts=1, token=router) as a:
        with pytest.raises(ResourceExhaustedError) as err:
            root.create_pool(PoolConfig("p", num_blocks=1 << 22, block_size=16, tenant="acme"))
        assert err.value.reason == "QUOTA_EXCEEDED" and err.value.retry_after_s is None
        assert err.value.quota_violations[0][0] == "tenant:acme/blocks"
        root.create_pool(PoolConfig("p", num_blocks=64, block_size=4, tenant="acme"))
        a.step("p", [Allocate("a", [1])])
        with pytest.raises(ResourceExhaustedError) as err:
            a.step("p", [Allocate("b", [1])])
        assert err.value.quota_violations[0][0] == "tenant:acme/steps_per_s"
        assert 0 < err.value.retry_after_s <= 1.0
        assert a.get_pool("p").num_seqs == 1
        # quotas reload with the identities file (SIGHUP)
        data["quotas"] = {}
        tokens.write_atomically(path, data)
        assert server.security.registry.reload()
        a.step("p", [Allocate("b", [1])])
        a.step("p", [Allocate("c", [1])])
