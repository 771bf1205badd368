"""Retention priorities over real gRPC: an Allocate's priority and
SetPrefixPriority decide what pressure evicts first; bad input (a priority
out of range, an unknown pool, nothing cached, another tenant's pool) is
refused with a clear status and changes nothing."""

from __future__ import annotations

import asyncio
import json

import pytest

from blockd.auth import tokens
from blockd.core import Allocate, Commit, Free, PoolConfig
from client import AsyncBlockdClient
from client.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, PermissionDeniedError
from client.sdk import BlockdClient

pytest_plugins = ["tests.support.auth_fixtures", "tests.support.grpc_fixtures"]

OLD = list(range(1, 10))  # two full blocks of 4, and one token
NEW = list(range(100, 109))


def _cached(client: BlockdClient, pool: str, seq_id: str, prompt: list[int], priority: int = 4) -> None:
    client.allocate(pool, seq_id, prompt, priority=priority)
    client.step(pool, [Commit(seq_id, len(prompt)), Free(seq_id)])


def _state(client: BlockdClient, pool: str) -> str:
    stats = client.get_pool(pool)
    return json.dumps([stats.num_used_blocks, stats.num_evictable_blocks, stats.version,
                       client.lookup_prefix(OLD, None, [pool]), client.lookup_prefix(NEW, None, [pool])])


def test_pressure_evicts_the_lowest_priority_first_and_bad_input_changes_nothing(client, blockd_server) -> None:
    client.create_pool(PoolConfig("p", num_blocks=6, block_size=4))
    _cached(client, "p", "a", OLD)  # older, at the default
    _cached(client, "p", "b", NEW, priority=0)  # newer, less important
    client.step("p", [Allocate("big", list(range(200, 213)))])  # 4 blocks: the free two, then b's two
    assert client.lookup_prefix(OLD, None, ["p"]) == {"p": 8} and client.lookup_prefix(NEW, None, ["p"]) == {"p": 0}
    client.step("p", [Free("big")])
    _cached(client, "p", "b", NEW)
    done = client.set_prefix_priority("p", OLD, 1)  # now a goes first, though b is newer
    assert (done.pool, done.priority, done.num_tokens, done.num_device_blocks, done.num_host_blocks) == (
        "p", 1, 8, 2, 0)
    client.step("p", [Allocate("big", list(range(200, 213)))])
    assert client.lookup_prefix(OLD, None, ["p"]) == {"p": 0} and client.lookup_prefix(NEW, None, ["p"]) == {"p": 8}
    before = _state(client, "p")
    for call, error, words in [
        (lambda: client.set_prefix_priority("p", NEW, 8), InvalidArgumentError, "priority must be an integer"),
        (lambda: client.set_prefix_priority("p", NEW, -1), InvalidArgumentError, "priority must be an integer"),
        (lambda: client.set_prefix_priority("nope", NEW, 1), NotFoundError, "no pool named"),
        (lambda: client.set_prefix_priority("p", OLD, 1), FailedPreconditionError, "no full block"),
        (lambda: client.allocate("p", "c", NEW, priority=9), InvalidArgumentError, "priority must be an integer"),
    ]:
        with pytest.raises(error) as err:
            call()
        assert words in err.value.message, err.value.message
    assert _state(client, "p") == before


def test_a_tenant_sets_priorities_only_in_its_own_pools(secure_server, tmp_path) -> None:
    path = str(tmp_path / "ids.json")
    admin = tokens.add_token(path, "root", "ops", ["admin"])
    router = tokens.add_token(path, "router-a", "acme", ["scheduler"])
    other = tokens.add_token(path, "router-g", "globex", ["scheduler"])
    server = secure_server(None, path)

    def connect(token: str) -> BlockdClient:
        return BlockdClient(server.address, timeout_s=10.0, max_attempts=1, token=token)

    with connect(admin) as root, connect(router) as a, connect(other) as g:
        root.create_pool(PoolConfig("pa", num_blocks=8, block_size=4, tenant="acme"))
        _cached(a, "pa", "s", OLD)
        assert a.set_prefix_priority("pa", OLD, 6).tenant == "acme"
        before = _state(a, "pa")
        with pytest.raises(PermissionDeniedError):
            g.set_prefix_priority("pa", OLD, 0)
        assert _state(a, "pa") == before


def test_the_async_client_allocates_at_a_priority_and_sets_one(client, blockd_server) -> None:
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=4))

    async def scenario() -> None:
        async with AsyncBlockdClient(blockd_server.address, timeout_s=5.0) as c:
            await c.allocate("p", "s", OLD, priority=7)
            await c.step("p", [Commit("s", len(OLD)), Free("s")])
            done = await c.set_prefix_priority("p", OLD, 2)
            assert (done.priority, done.num_tokens, done.num_device_blocks) == (2, 8, 2)
            with pytest.raises(FailedPreconditionError):
                await c.set_prefix_priority("p", NEW, 2)
            pins = await c.list_pins("p")  # the pins' conversions live beside the priority's
            assert pins == []

    asyncio.run(scenario())
