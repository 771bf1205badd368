"""Tenants: who owns a pool, what other tenants may see of it, and the
prefix cache's isolation (equal prompts of two tenants never share or reveal
a cached block).

In-process engine checks run "as" an identity (:func:`blockd.auth.acting_as`,
what the interceptor binds for a call); the isolation test runs over real
gRPC with bearer tokens of two tenants.
"""

from __future__ import annotations

import itertools
import json

import pytest

from blockd.auth import AccessDenied, Identity, acting_as, tokens
from blockd.core import Allocate, Commit, Free, Pool, PoolConfig
from blockd.core.hashing import ExtraKeys
from blockd.engine import records
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from client.errors import NotFoundError, PermissionDeniedError
from client.sdk import BlockdClient

pytest_plugins = ["tests.support.auth_fixtures"]

ADMIN = Identity("root", "ops", frozenset({"admin"}), "token")
ACME = Identity("router-a", "acme", frozenset({"scheduler"}), "token")
GLOBEX = Identity("router-g", "globex", frozenset({"scheduler"}), "token")
PROMPT = list(range(100, 117))  # 4 full blocks of 4 and one token


def _engine_with_pools() -> Engine:
    engine = Engine()
    with acting_as(ACME):
        engine.create_pool(PoolConfig("a", num_blocks=32, block_size=4))
    with acting_as(GLOBEX):
        engine.create_pool(PoolConfig("g", num_blocks=32, block_size=4))
    return engine


def test_a_pool_belongs_to_its_creators_tenant_and_only_an_admin_names_another() -> None:
    engine = _engine_with_pools()
    assert engine.pool_config("a").tenant == "acme" and engine.get_pool("g").tenant == "globex"
    with acting_as(ACME), pytest.raises(AccessDenied, match="own tenant"):
        engine.create_pool(PoolConfig("x", num_blocks=8, block_size=4, tenant="globex"))
    with acting_as(ADMIN):
        assert engine.create_pool(PoolConfig("x", num_blocks=8, block_size=4, tenant="globex")).tenant == "globex"
        assert engine.create_pool(PoolConfig("y", num_blocks=8, block_size=4)).tenant == "ops"
    assert Engine().create_pool(PoolConfig("z", num_blocks=8, block_size=4)).tenant == "default"  # no auth


def test_another_tenants_pool_is_invisible_in_listings_and_refused_by_name() -> None:
    engine = _engine_with_pools()
    engine.step("a", [Allocate("s", PROMPT), Commit("s", len(PROMPT))])
    before = engine.capture()
    with acting_as(GLOBEX):
        assert [s.name for s in engine.list_pools()] == ["g"]
        assert engine.lookup_prefix(PROMPT, ExtraKeys(), []) == {"g": 0}
        refused = [lambda: engine.get_pool("a"), lambda: engine.get_tables("a", []),
                   lambda: engine.sequence_info("a", "s"), lambda: engine.lookup_prefix(PROMPT, ExtraKeys(), ["a"]),
                   lambda: engine.step("a", [Free("s")]), lambda: engine.step("a", [Free("s")], dry_run=True),
                   lambda: engine.delete_pool("a"), lambda: engine.reset_prefix_cache("a"),
                   lambda: engine.events("a", 0, lambda: True), lambda: engine.watch("a", 0, lambda: True),
                   lambda: engine.list_workers("a")]
        for call in refused:
            with pytest.raises(AccessDenied) as err:
                call()
            assert "globex" in err.value.message and "acme" not in err.value.message  # never names the owner
    assert engine.capture() == before
    with acting_as(ADMIN):
        assert sorted(s.name for s in engine.list_pools()) == ["a", "g"]


def test_a_retried_request_id_gives_another_tenant_nothing() -> None:
    engine = _engine_with_pools()
    with acting_as(ACME):
        engine.step("a", [Allocate("s", PROMPT)], request_id="r1")
    with acting_as(GLOBEX), pytest.raises(AccessDenied):
        engine.step("a", [Allocate("s", PROMPT)], request_id="r1")


def test_equal_prompts_of_two_tenants_hash_apart_and_the_default_tenant_keeps_old_hashes() -> None:
    def stored(tenant: str) -> list[bytes]:
        pool = Pool(PoolConfig("p", num_blocks=16, block_size=4, tenant=tenant))
        pool.step([Allocate("s", PROMPT), Commit("s", len(PROMPT))])
        return [e.block_hash for e in pool.take_events() if e.kind == "BlockStored"]

    acme, globex, default, legacy = stored("acme"), stored("globex"), stored("default"), stored("")
    assert len(acme) == 4 and not set(acme) & set(globex) and not set(acme) & set(default)
    assert default == legacy  # pools made before tenants keep their cache keys


def test_create_records_and_snapshots_without_a_tenant_read_as_the_default_tenant() -> None:
    engine = Engine()
    body = records.encode(records.CreatePool(PoolConfig("old", num_blocks=8, block_size=4), "inc-1"))
    del body["config"]["tenant"]
    engine.apply_record(body)
    assert engine.get_pool("old").tenant == "default"
    snapshot = engine.capture()
    del snapshot["pools"][0]["config"]["tenant"]
    fresh = Engine()
    fresh.load_snapshot({**snapshot, "lsn": 1})
    assert fresh.pool_config("old").tenant == "default"
    with acting_as(ACME), pytest.raises(AccessDenied):
        fresh.get_pool("old")


def test_the_tenant_survives_a_restart_from_the_data_dir(tmp_path) -> None:
    engine = Engine(EngineConfig(data_dir=str(tmp_path)))
    with acting_as(ACME):
        engine.create_pool(PoolConfig("a", num_blocks=8, block_size=4))
    engine.close()
    again = Engine(EngineConfig(data_dir=str(tmp_path)))
    try:
        assert again.pool_config("a").tenant == "acme"
    finally:
        again.close()


# --- over gRPC: two tenants' schedulers on one blockd --------------------------------------
@pytest.fixture
def two_tenants(secure_server, tmp_path):
    path = str(tmp_path / "ids.json")
    secrets = {name: tokens.add_token(path, name, tenant, roles) for name, tenant, roles in [
        ("root", "ops", ["admin"]), ("router-a", "acme", ["scheduler"]), ("router-g", "globex", ["scheduler"])]}
    server = secure_server(None, path)

    def connect(name: str) -> BlockdClient:
        return BlockdClient(server.address, timeout_s=10.0, max_attempts=1, token=secrets[name])

    with connect("router-a") as a, connect("router-g") as g, connect("root") as root:
        yield server, a, g, root


def test_tenant_b_never_hits_or_sees_tenant_as_cached_prefix(two_tenants) -> None:
    _, a, g, root = two_tenants
    root.create_pool(PoolConfig("pa", num_blocks=32, block_size=4, tenant="acme"))  # pools: an admin's job
    root.create_pool(PoolConfig("pg", num_blocks=32, block_size=4, tenant="globex"))
    a.step("pa", [Allocate("s", PROMPT), Commit("s", len(PROMPT))])
    assert a.lookup_prefix(PROMPT) == {"pa": 16}
    # B's identical prompt: no cached tokens anywhere it can look, and A's pool is not even listed
    assert g.lookup_prefix(PROMPT) == {"pg": 0}
    assert g.allocate("pg", "s", PROMPT).num_cached_tokens == 0
    g.commit("pg", "s", len(PROMPT))
    assert [s.name for s in g.list_pools()] == ["pg"]
    for call in (lambda: g.lookup_prefix(PROMPT, None, ["pa"]), lambda: next(g.events("pa", 0, timeout_s=5)),
                 lambda: g.get_tables("pa"), lambda: g.get_pool("pa"), lambda: next(g.watch("pa", timeout_s=5))):
        with pytest.raises(PermissionDeniedError) as err:
            call()
        assert "acme" not in err.value.message
    with pytest.raises(NotFoundError):  # a name nobody has is still NOT_FOUND
        g.get_pool("nope")
    # the admin sees both: the same tokens stored under different block hashes
    hashes = {pool: {e.block_hash for e in itertools.islice(root.events(pool, 0, timeout_s=10), 4)}
              for pool in ("pa", "pg")}
    assert len(hashes["pa"]) == 4 and not hashes["pa"] & hashes["pg"]
    assert json.dumps(sorted(s.tenant for s in root.list_pools())) == '["acme", "globex"]'
