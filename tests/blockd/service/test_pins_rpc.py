"""PinPrefix, UnpinPrefix and ListPins over real gRPC: a `blockd serve`
process for what a daemon keeps (a pin survives a restart from its data dir,
a TTL lets it go, pressure evicts the unpinned prefix and not the pinned one,
bad input is refused with a clear status and changes nothing), and an
in-process server with an identities file for tenants and the pinned-blocks
quota."""

from __future__ import annotations

import json
import time

import pytest

from blockd.auth import tokens
from blockd.core import Allocate, Commit, Free, PoolConfig
from client.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from client.sdk import BlockdClient
from tests.support.procs import free_port, start_blockd

pytest_plugins = ["tests.support.auth_fixtures", "tests.support.grpc_fixtures"]

PROMPT = list(range(1, 18))  # four full blocks of 4, and one token
OTHER = list(range(100, 117))


def _cached(client: BlockdClient, pool: str, seq_id: str, prompt: list[int]) -> None:
    client.step(pool, [Allocate(seq_id, prompt)])
    client.step(pool, [Commit(seq_id, len(prompt)), Free(seq_id)])


def _state(client: BlockdClient, pool: str) -> str:
    stats = client.get_pool(pool)
    return json.dumps([stats.num_used_blocks, stats.num_evictable_blocks, stats.num_pinned_blocks,
                       stats.version, [p.pin_id for p in client.list_pins(pool)]])


def test_a_pin_survives_pressure_and_a_restart_and_bad_input_changes_nothing(tmp_path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    args = ("--data-dir", str(tmp_path), "--fsync", "always", "--listen", listen)
    proc = start_blockd(*args)
    try:
        with BlockdClient(listen, timeout_s=10.0, max_attempts=1) as client:
            client.create_pool(PoolConfig("p", num_blocks=10, block_size=4))
            _cached(client, "p", "a", PROMPT)
            _cached(client, "p", "b", OTHER)
            pin = client.pin_prefix("p", PROMPT)
            assert (pin.pin_id, pin.num_tokens, len(pin.block_ids), pin.expires_at) == ("pin-1", 16, 4, 0.0)
            assert client.get_pool("p").num_pinned_blocks == 4
            # pressure: a prompt needing every block not pinned evicts the other prefix, never the pinned one
            client.step("p", [Allocate("big", list(range(200, 224)))])
            client.step("p", [Free("big")])
            assert client.lookup_prefix(PROMPT, None, ["p"]) == {"p": 16}
            assert client.lookup_prefix(OTHER, None, ["p"]) == {"p": 0}
            before = _state(client, "p")
            for call, error in [
                (lambda: client.pin_prefix("nope", PROMPT), NotFoundError),
                (lambda: client.unpin_prefix("p", "pin-9"), NotFoundError),
                (lambda: client.list_pins("nope"), NotFoundError),
                (lambda: client.pin_prefix("p", PROMPT, ttl_s=-1), InvalidArgumentError),
                (lambda: client.pin_prefix("p", [1, 2, 3, 2**32]), InvalidArgumentError),
                (lambda: client.pin_prefix("p", OTHER), FailedPreconditionError),
            ]:
                with pytest.raises(error) as err:
                    call()
                assert err.value.message
            assert _state(client, "p") == before
        assert proc.stop() == 0
        proc = start_blockd(*args)
        with BlockdClient(listen, timeout_s=10.0, max_attempts=1) as client:
            assert client.list_pins("p") == [pin]
            assert client.get_pool("p").num_pinned_blocks == 4
            assert client.unpin_prefix("p", "pin-1") == pin
            assert client.get_pool("p").num_evictable_blocks >= 4
    finally:
        proc.kill()


def test_a_ttl_lets_the_pin_go(tmp_path) -> None:
    proc = start_blockd()
    try:
        with BlockdClient(proc.address, timeout_s=10.0, max_attempts=1) as client:
            client.create_pool(PoolConfig("p", num_blocks=10, block_size=4))
            _cached(client, "p", "a", PROMPT)
            start = time.time()
            pin = client.pin_prefix("p", PROMPT, ttl_s=0.5)
            assert start + 0.5 <= pin.expires_at <= time.time() + 0.5
            kept = client.pin_prefix("p", PROMPT[:8])
            deadline = time.monotonic() + 20
            while len(client.list_pins("p")) > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.list_pins("p") == [kept]
            assert time.time() >= pin.expires_at
            assert client.get_pool("p").num_pinned_blocks == 2
    finally:
        proc.kill()


def test_tenants_pin_only_their_own_pools_within_their_quota(secure_server, tmp_path) -> None:
    path = str(tmp_path / "ids.json")
    admin = tokens.add_token(path, "root", "ops", ["admin"])
    router = tokens.add_token(path, "router-a", "acme", ["scheduler"])
    other = tokens.add_token(path, "router-g", "globex", ["scheduler"])
    data = tokens.read_for_edit(path)
    data["quotas"] = {"acme": {"pinned_blocks": 5}}
    tokens.write_atomically(path, data)
    server = secure_server(None, path)

    def connect(token: str) -> BlockdClient:
        return BlockdClient(server.address, timeout_s=10.0, max_attempts=1, token=token)

    with connect(admin) as root, connect(router) as a, connect(other) as g:
        root.create_pool(PoolConfig("pa", num_blocks=16, block_size=4, tenant="acme"))
        root.create_pool(PoolConfig("pb", num_blocks=16, block_size=4, tenant="acme"))
        _cached(a, "pa", "s", PROMPT)
        _cached(a, "pb", "s", PROMPT)
        pin = a.pin_prefix("pa", PROMPT)
        assert (pin.tenant, pin.pool) == ("acme", "pa")
        before = _state(a, "pa") + _state(a, "pb")
        for call in (lambda: g.pin_prefix("pa", PROMPT), lambda: g.unpin_prefix("pa", "pin-1"),
                     lambda: g.list_pins("pa")):
            with pytest.raises(PermissionDeniedError) as err:
                call()
            assert "acme" not in err.value.message
        with pytest.raises(ResourceExhaustedError) as quota:
            a.pin_prefix("pb", PROMPT[:8])  # 4 pinned + 2 > 5
        assert quota.value.quota_violations[0][0] == "tenant:acme/pinned_blocks"
        assert _state(a, "pa") + _state(a, "pb") == before
        a.pin_prefix("pb", PROMPT[:4])  # 4 + 1: within it
        assert [p.pin_id for p in root.list_pins("pb")] == ["pin-1"]


def test_an_allocate_asks_to_retain_its_prompt_over_grpc(client, blockd_server) -> None:
    client.create_pool(PoolConfig("p", num_blocks=10, block_size=4))
    client.allocate("p", "s", PROMPT, retain_ttl_s=120)
    assert client.list_pins("p") == []
    start = time.time()
    client.commit("p", "s", len(PROMPT))
    [pin] = client.list_pins("p")
    assert pin.num_tokens == 16 and start + 120 <= pin.expires_at <= time.time() + 120
    with pytest.raises(InvalidArgumentError) as err:
        client.allocate("p", "t", PROMPT, retain_ttl_s=-5)
    assert "retain_ttl_s" in err.value.message and client.get_pool("p").num_seqs == 1
