"""Prefixes shared across pools through the whole cluster: real ``blockd serve``
and two pools of ``blockd-worker --model`` processes, the scheduler, a model.

Each conversation's first turn runs on pool ``m``; its second turn (the first
turn's prompt plus a question) runs on pool ``m-1``, whose scheduler names
``m`` as its source pool: blockd plans the transfer of the history's cached
blocks, ``m-1``'s worker fetches them from ``m``'s worker (``FetchBlocks`` ->
``ReadBlocks``), and the scheduler computes only the rest. The outputs must
be what transformers' own ``generate`` gives (greedy): attention over the
transferred blocks is attention over the originals. The faults: a source
worker that restarted since the plan, and a source block reassigned since
the planned version, are refused by the source, and the tokens are computed
(still exact).
"""

from __future__ import annotations

import dataclasses

import pytest

from blockd.cluster.local import ClusterSpec, LocalCluster
from blockd.core.types import Allocate, Free
from client.errors import InvalidArgumentError, NotFoundError
from client.model_group import WorkerGroup
from client.scheduler import Scheduler, SchedulerConfig
from client.sdk import BlockdClient
from client.serving import GREEDY, GenerationRequest
from client.worker import WorkerClient
from tests.blockd.test_cluster_host_tier import BLOCK, MODEL, turns
from worker.model.reference import ContiguousReference


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(MODEL, 1, "m", num_blocks=64, block_size=BLOCK, num_pools=2)
    with LocalCluster(spec) as c:
        yield c


def _scheduler(client, cluster, pool: str, source: str = ""):
    group = WorkerGroup(pool, cluster.pool_worker_addresses(pool))
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, source_pool=source)
    return Scheduler(client, pool, group, config), group


def test_a_second_turn_on_another_pool_fetches_the_history_and_stays_exact(cluster):
    first, second = turns(seed=11, conversations=4)
    with BlockdClient(cluster.blockd_address) as client:
        a, group_a = _scheduler(client, cluster, "m")
        b, group_b = _scheduler(client, cluster, "m-1", source="m")
        with group_a, group_b:
            for req in first:
                a.add_request(req)
            outputs = a.run()
            # where the histories live: m's device tier, nowhere in m-1 (LookupPrefix over gRPC)
            assert client.lookup_prefix(first[0].prompt_token_ids, pools=["m", "m-1"], tiers=True) == {
                "m": (5 * BLOCK, 0), "m-1": (0, 0)}
            for req in second:
                b.add_request(req)
            outputs += b.run()
    assert ContiguousReference(MODEL).mismatches(first + second, outputs) == []
    # every second turn fetched its 5-block history (the last prompt token is always computed)
    assert b.counters.num_transferred_tokens == 4 * 5 * BLOCK, b.counters
    assert b.counters.num_failed_transfers == 0
    assert b.counters.num_prefill_tokens == sum(len(r.prompt_token_ids) for r in second) - 4 * 5 * BLOCK


def _served_then_planned(client, a, first, second, seq_id: str):
    """``first`` served on pool m by ``a``; then ``second``'s Allocate on m-1
    naming m as its source: its step result and the transfer plan."""
    a.add_request(first)
    a.run()
    result = client.step("m-1", [Allocate(seq_id, list(second.prompt_token_ids), source_pool="m")])
    plan = result.results[0].transfer
    assert plan is not None and len(plan.dst_blocks) == 5 and plan.source_pool == "m"
    return result, plan


def test_a_source_block_reassigned_after_the_plan_is_refused_and_computed(cluster):
    first, second = turns(seed=12, conversations=1)
    with BlockdClient(cluster.blockd_address) as client, \
            WorkerGroup("m-1", cluster.pool_worker_addresses("m-1")) as group_b:
        a, group_a = _scheduler(client, cluster, "m")
        with group_a:
            # plan a transfer, then let pool m reuse every block before the fetch:
            # prompts of 100 blocks in all through its 64 evict the cached history
            result, plan = _served_then_planned(client, a, first[0], second[0], "probe")
            for i in range(4):
                a.add_request(GenerationRequest(f"fill{i}", tuple((i * 37 + k) % 500 for k in range(25 * BLOCK)),
                                                2, sampling=GREEDY))
            a.run()
        why = group_b.fetch_blocks(result.version, plan, pool_incarnation=result.incarnation)
        assert "got other contents at version" in why, why
        client.step("m-1", [Free("probe")])


def test_bad_sources_are_refused_and_change_nothing(cluster):
    with BlockdClient(cluster.blockd_address) as client:
        before = client.get_pool("m-1")
        prompt = list(range(3 * BLOCK))
        with pytest.raises(NotFoundError, match="source_pool 'nope' names no pool of this daemon") as gone:
            client.step("m-1", [Allocate("x", prompt, source_pool="nope")])
        assert gone.value.reason == "SOURCE_POOL_NOT_FOUND" and gone.value.op_index == 0
        with pytest.raises(InvalidArgumentError, match="is the allocating pool itself"):
            client.step("m-1", [Allocate("x", prompt, source_pool="m-1")])
        other = dataclasses.replace(cluster.pool_config, name="other-geometry",
                                    head_dim=cluster.pool_config.head_dim * 2)
        client.create_pool(other)
        try:
            with pytest.raises(InvalidArgumentError, match="head_dim"):
                client.step("m-1", [Allocate("x", prompt, source_pool="other-geometry")])
        finally:
            client.delete_pool("other-geometry")
        after = client.get_pool("m-1")
        assert (after.version, after.num_seqs, after.num_used_blocks) == (before.version, before.num_seqs,
                                                                          before.num_used_blocks)


def test_a_source_worker_that_restarted_is_refused_and_the_tokens_are_computed(cluster):
    first, second = turns(seed=13, conversations=1)
    with BlockdClient(cluster.blockd_address) as client:
        a, group_a = _scheduler(client, cluster, "m")
        with group_a:
            result, plan = _served_then_planned(client, a, first[0], second[0], "probe2")
        cluster.restart_worker(0)  # pool m's only worker: a new incarnation, its KV gone
        with WorkerGroup("m-1", cluster.pool_worker_addresses("m-1")) as group_b:
            why = group_b.fetch_blocks(result.version, plan, pool_incarnation=result.incarnation)
        assert "restarted since you planned" in why, why
        # a direct read naming the old incarnation is refused the same way
        with WorkerClient(cluster.pool_worker_addresses("m")[0]) as source:
            assert source.refresh() != plan.source_workers[0][2]
        client.step("m-1", [Free("probe2")])


def test_tensor_parallel_groups_fetch_shard_to_shard_and_stay_exact():
    """Two pools of two ranks each: rank r of the second fetches from rank r of the
    first (the KV heads it holds), and the outputs are still transformers' own."""
    first, second = turns(seed=14, conversations=2)
    spec = ClusterSpec(MODEL, 2, "m", num_blocks=64, block_size=BLOCK, num_pools=2)
    with LocalCluster(spec) as cluster, BlockdClient(cluster.blockd_address) as client:
        a, group_a = _scheduler(client, cluster, "m")
        b, group_b = _scheduler(client, cluster, "m-1", source="m")
        with group_a, group_b:
            for req in first:
                a.add_request(req)
            outputs = a.run()
            for req in second:
                b.add_request(req)
            outputs += b.run()
    assert ContiguousReference(MODEL).mismatches(first + second, outputs) == []
    assert b.counters.num_transferred_tokens == 2 * 5 * BLOCK and b.counters.num_failed_transfers == 0
