"""Planning cross-pool transfers in the engine (issue 28 item 3): which of a
source pool's cached blocks stand in for an allocation's missed ones, from
which tier, for which destination blocks; what changes nothing (a bad
source); and that tenants never see or receive each other's blocks through a
transfer.

The real engine, in process; workers are registrations only (the plan names
them, the data plane is tests/worker/test_transfer.py and
tests/blockd/test_cluster_transfer.py)."""

from __future__ import annotations

import pytest

from blockd.auth import AccessDenied, Identity, acting_as
from blockd.core import PoolConfig
from blockd.core.errors import InvalidArgument, NotFound
from blockd.core.types import Allocate, Commit, Free, WorkerInfo
from blockd.engine.machine import Engine

B = 4


def _engine(num_host_blocks: int = 0, tenants=("", "")) -> Engine:
    engine = Engine()
    for name, tenant in zip(("a", "b"), tenants, strict=True):
        engine.create_pool(PoolConfig(name, 8, B, num_host_blocks=num_host_blocks, tenant=tenant))
        engine.register_worker(WorkerInfo(f"w-{name}", name, f"127.0.0.1:{9000 + ord(name)}", 0, 1, 0, 1,
                                          incarnation=f"inc-{name}"))
    return engine


def _cache(engine: Engine, pool: str, prompt: list[int], seq: str = "s") -> None:
    """``prompt``'s full blocks cached in ``pool``: allocated, committed, freed."""
    engine.step(pool, [Allocate(seq, prompt), Commit(seq, len(prompt))])
    engine.step(pool, [Free(seq)])


def test_the_missed_blocks_cached_in_the_source_are_planned_in_order():
    engine = _engine()
    prompt = list(range(3 * B + 2))  # three full blocks and a tail
    _cache(engine, "a", prompt)
    result = engine.step("b", [Allocate("x", prompt, source_pool="a")])
    allocated = result.results[0]
    plan = allocated.transfer
    assert allocated.num_cached_tokens == 0 and plan is not None
    assert (plan.source_pool, plan.first_token, plan.num_tokens) == ("a", 0, 3 * B)
    assert plan.src_tiers == ("device",) * 3
    assert plan.dst_blocks == allocated.new_block_ids[:3]
    assert plan.source_version == engine.get_pool("a").version
    assert plan.source_incarnation == engine.pool_incarnation("a")
    assert plan.source_workers == ((0, "127.0.0.1:9097", "inc-a"),)
    # the tokens stay uncached in b: nothing is in b's index until the caller commits them
    assert engine.lookup_prefix(prompt, None, ["b"]) == {"b": 0}
    engine.step("b", [Commit("x", len(prompt)), Free("x")])
    assert engine.lookup_prefix(prompt, None, ["b"]) == {"b": 3 * B}


def test_a_plan_starts_after_the_pools_own_hits_and_reaches_the_host_tier():
    engine = _engine(num_host_blocks=8)
    prompt = list(range(4 * B + 1))
    _cache(engine, "a", prompt)
    _cache(engine, "b", prompt[: B + 1])  # b caches the first block itself
    # a's blocks go to its host tier: a burst of other prompts takes every device block
    engine.step("a", [Allocate("fill", [7] * (8 * B))])
    engine.step("a", [Free("fill")])
    allocated = engine.step("b", [Allocate("x", prompt, source_pool="a")]).results[0]
    plan = allocated.transfer
    assert allocated.num_cached_tokens == B
    assert (plan.first_token, plan.num_tokens) == (B, 3 * B)
    assert plan.src_tiers == ("host",) * 3
    assert plan.dst_blocks == allocated.new_block_ids[:3]


def test_no_plan_when_the_source_has_nothing_or_no_worker_is_up():
    engine = _engine()
    prompt = list(range(2 * B + 1))
    assert engine.step("b", [Allocate("x", prompt, source_pool="a")]).results[0].transfer is None
    # a prompt of exactly one block: its last token is always computed, so nothing to fetch
    _cache(engine, "a", list(range(B)))
    assert engine.step("b", [Allocate("y", list(range(B)), source_pool="a")]).results[0].transfer is None
    # a source with the blocks but no worker registered to serve them
    engine.create_pool(PoolConfig("d", 8, B))
    _cache(engine, "d", prompt)
    assert engine.step("b", [Allocate("z", prompt, source_pool="d")]).results[0].transfer is None


def test_bad_sources_are_refused_and_change_nothing():
    engine = _engine()
    engine.create_pool(PoolConfig("c", 8, 2 * B))
    before = engine.get_pool("b")
    prompt = list(range(2 * B + 1))
    with pytest.raises(NotFound, match="op 1: source_pool 'nope' names no pool of this daemon") as gone:
        engine.step("b", [Allocate("ok", prompt), Allocate("x", prompt, source_pool="nope")])
    # its own reason and the op: a caller tells a source gone from its own pool gone
    assert gone.value.reason == "SOURCE_POOL_NOT_FOUND" and gone.value.op_index == 1
    with pytest.raises(InvalidArgument, match="is the allocating pool itself"):
        engine.step("b", [Allocate("x", prompt, source_pool="b")])
    with pytest.raises(InvalidArgument, match="block_size 8 != 4"):
        engine.step("b", [Allocate("x", prompt, source_pool="c")])
    with pytest.raises(InvalidArgument, match="op 1: source_pool"):
        engine.step("b", [Allocate("ok", prompt), Allocate("x", prompt, source_pool="b")])
    # the dry run refuses the same way
    with pytest.raises(InvalidArgument, match="is the allocating pool itself"):
        engine.step("b", [Allocate("x", prompt, source_pool="b")], dry_run=True)
    after = engine.get_pool("b")
    assert (after.version, after.num_seqs, after.num_used_blocks) == (before.version, 0, before.num_used_blocks)


def test_tenants_never_receive_each_others_blocks():
    engine = _engine(tenants=("acme", "globex"))
    prompt = list(range(3 * B + 1))
    acme = Identity("s-acme", "acme", frozenset({"scheduler"}))
    globex = Identity("s-globex", "globex", frozenset({"scheduler"}))
    with acting_as(acme):
        _cache(engine, "a", prompt)
    with acting_as(globex):
        # another tenant's pool as the source: refused as any other access to it, nothing changed
        with pytest.raises(AccessDenied):
            engine.step("b", [Allocate("x", prompt, source_pool="a")])
        assert engine.get_pool("b").num_seqs == 0
        assert "a" not in engine.lookup_prefix(prompt, None, [])
    # even an admin cannot move blocks between tenants: the hashes fold the tenant in
    with acting_as(Identity("ops", "ops", frozenset({"admin"}))), \
            pytest.raises(InvalidArgument, match="belongs to another tenant"):
        engine.step("b", [Allocate("x", prompt, source_pool="a")])


def test_lookup_prefix_says_which_tier_holds_the_prefix():
    engine = _engine(num_host_blocks=8)
    prompt = list(range(3 * B + 1))
    _cache(engine, "a", prompt)
    assert engine.lookup_prefix(prompt, None, ["a", "b"], tiers=True) == {"a": (3 * B, 0), "b": (0, 0)}
    engine.step("a", [Allocate("fill", [7] * (8 * B))])  # every device block: the prefix moves to the host tier
    engine.step("a", [Free("fill")])
    assert engine.lookup_prefix(prompt, None, ["a"], tiers=True) == {"a": (3 * B, 3 * B)}
    assert engine.lookup_prefix(prompt, None, ["a"]) == {"a": 3 * B}
