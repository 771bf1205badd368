"""The client side of the hash spec: the SDK's and the scheduler's check of
blockd's spec id against their own, and ``blockctl hash-spec``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.sim.backend import InProcessBlockd
from bench.sim.model import StubModel
from blockd.core import PoolConfig
from blockd.core.hashing import HASH_SPEC_ID, HashSpec
from client.errors import FailedPreconditionError
from client.scheduler import Scheduler
from client.sdk import BlockdClient
from client.serving import GenerationRequest
from tests.support.cli import run

pytest_plugins = ["tests.support.grpc_fixtures"]

OTHER = "blockd.block-hash.v0"


class OlderDaemon(BlockdClient):
    """A client whose daemon answers another spec id (as one of an older release would)."""

    def get_hash_spec(self, pool: str | None = None) -> HashSpec:
        return replace(super().get_hash_spec(pool), spec_id=OTHER)


def _request(i: int = 0) -> GenerationRequest:
    return GenerationRequest(f"r{i}", tuple(range(1, 20)), 3)


def test_the_scheduler_refuses_a_daemon_of_another_spec_before_its_first_step(blockd_server) -> None:
    with OlderDaemon(blockd_server.address, timeout_s=5.0) as client:
        client.create_pool(PoolConfig("p", num_blocks=32, block_size=4))
        scheduler = Scheduler(client, "p", StubModel())
        scheduler.add_request(_request())
        for _ in range(2):  # refused again, not only once
            with pytest.raises(FailedPreconditionError) as raised:
                scheduler.step()
        err = raised.value
        assert err.reason == "HASH_SPEC_MISMATCH" and err.metadata == {"hash_spec": HASH_SPEC_ID,
                                                                       "blockd_hash_spec": OTHER}
        assert repr(OTHER) in err.message and repr(HASH_SPEC_ID) in err.message
        assert blockd_server.address in err.message and "upgrade the client" in err.message
        assert client.get_pool("p").version == 0 and client.get_tables("p")[1] == {}  # nothing stepped
        assert scheduler.counters.num_steps == 0


class Counting(InProcessBlockd):
    checks = 0

    def check_hash_spec(self) -> HashSpec:
        self.checks += 1
        return super().check_hash_spec()


class WithoutCheck:
    """A BlockdBackend with only the protocol's methods: the check is optional."""

    def __init__(self, inner: InProcessBlockd) -> None:
        self.step, self.reset_prefix_cache, self.get_tables = inner.step, inner.reset_prefix_cache, inner.get_tables


def test_the_in_process_backend_passes_the_check_once_and_a_backend_without_it_runs() -> None:
    blockd = Counting()
    blockd.create_pool(PoolConfig("p", num_blocks=64, block_size=4, tenant="acme"))
    assert blockd.get_hash_spec("p") == replace(blockd.check_hash_spec(), block_size=4, pool_tenant="acme")
    blockd.checks = 0
    scheduler = Scheduler(blockd, "p", StubModel())
    scheduler.add_request(_request())
    assert len(scheduler.run()) == 1 and blockd.checks == 1
    plain = InProcessBlockd()
    plain.create_pool(PoolConfig("p", num_blocks=64, block_size=4))
    bare = Scheduler(WithoutCheck(plain), "p", StubModel())  # type: ignore[arg-type]
    bare.add_request(_request(1))
    assert len(bare.run()) == 1


def test_the_sdk_check_passes_against_this_build(client) -> None:
    assert client.check_hash_spec().spec_id == HASH_SPEC_ID


def test_blockctl_hash_spec(blockd_server, client, capsys) -> None:
    target = blockd_server.address
    client.create_pool(PoolConfig("chat", num_blocks=8, block_size=16, tenant="acme"))
    code, out, _ = run(capsys, "--target", target, "hash-spec")
    assert code == 0
    head = [line.split() for line in out.split("\n\n")[0].splitlines()]
    assert head == [["FIELD", "VALUE"], ["spec_id", HASH_SPEC_ID], ["algorithm", "blake2b-128", "chained"]]
    for title in ("block hash:", "token ids:", "parent hash:", "extra keys:", "tenant:", "test vector 1:"):
        assert f"\n{title}" in out, title
    spec = client.get_hash_spec()
    for vector in spec.test_vectors:
        for i, block_hash in enumerate(vector.block_hashes):
            assert f"block {i}     {block_hash}" in out
    code, out, _ = run(capsys, "--target", target, "hash-spec", "--pool", "chat")
    head = [line.split() for line in out.split("\n\n")[0].splitlines()]
    assert code == 0 and head[3:] == [["pool", "chat"], ["block_size", "16"], ["pool_tenant", "acme"]]
    code, out, _ = run(capsys, "--target", target, "hash-spec", "--pool", "chat", "--json")
    data = json.loads(out)
    assert code == 0 and data["spec_id"] == HASH_SPEC_ID and (data["block_size"], data["pool_tenant"]) == (16, "acme")
    assert data["test_vectors"][0]["block_hashes"] == list(spec.test_vectors[0].block_hashes)
    assert data["test_vectors"][1]["extra_keys"]["mm_hashes"] == ["img0", "img1"]
    code, out, err = run(capsys, "--target", target, "hash-spec", "--pool", "nope")
    assert code == 3 and out == "" and "NOT_FOUND" in err and "'nope'" in err
