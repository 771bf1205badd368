"""The host tier through the whole cluster: real ``blockd serve`` and
``blockd-worker --model`` processes, the scheduler, a model.

Multi-turn chat in miniature: every conversation's first turn runs, with so
many other conversations between that its prefix leaves the small device
pool; then every conversation's second turn resends the first turn's prompt
plus a new question. With a host tier the evicted prefixes were offloaded
and come back as restores (cached tokens the scheduler does not compute, the
workers copy back before attention); without one they are computed again.
Either way every output token must be what transformers' own ``generate``
gives for the same prompts (greedy).
"""

from __future__ import annotations

import random

from blockd.cluster.local import ClusterSpec, LocalCluster
from client.model_group import WorkerGroup
from client.scheduler import Scheduler, SchedulerConfig
from client.sdk import BlockdClient
from client.serving import GREEDY, GenerationRequest
from worker.model.reference import ContiguousReference

VOCAB = 512  # the tiny models' vocabulary
MODEL = "tiny-llama"
BLOCK = 8


def turns(seed: int = 7, conversations: int = 6) -> tuple[list[GenerationRequest], list[GenerationRequest]]:
    rng = random.Random(seed)
    first, second = [], []
    for c in range(conversations):
        history = tuple(rng.randrange(VOCAB) for _ in range(5 * BLOCK + 3))  # 5 full blocks and a tail
        question = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(3, 9)))
        first.append(GenerationRequest(f"c{c}-t1", history, 4, sampling=GREEDY))
        second.append(GenerationRequest(f"c{c}-t2", history + question, 4, sampling=GREEDY))
    return first, second


def serve(num_host_blocks: int) -> tuple[list, list, dict]:
    first, second = turns()
    spec = ClusterSpec(MODEL, 1, "m", num_blocks=16, block_size=BLOCK, num_host_blocks=num_host_blocks)
    with LocalCluster(spec) as cluster, BlockdClient(cluster.blockd_address) as client, \
            WorkerGroup("m", cluster.worker_addresses) as group:
        # one conversation at a time: the others' prefixes push each one out of 16 device blocks
        sched = Scheduler(client, "m", group, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1))
        outputs = []
        for wave in (first, second):
            before = client.get_pool("m")  # the last wave's, the second turn, is what is compared
            for req in wave:
                sched.add_request(req)
            outputs += sched.run()
        after = client.get_pool("m")
    figures = {"second_turn_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
               "restores": after.num_restores, "offloads": after.num_offloads,
               "host_cached": after.num_host_cached_blocks, "used": after.num_used_blocks}
    return first + second, outputs, figures


def test_evicted_prefixes_come_back_from_the_host_tier_and_the_tokens_stay_exact():
    requests, outputs, tiered = serve(num_host_blocks=64)
    assert ContiguousReference(MODEL).mismatches(requests, outputs) == []
    # every second turn finds its 5-block history: offloaded while the others ran, restored now
    assert tiered["offloads"] > 0 and tiered["restores"] >= 5 * 5, tiered
    assert tiered["second_turn_hit_tokens"] >= 6 * 5 * BLOCK - BLOCK * 5, tiered
    assert tiered["used"] == 0, tiered

    requests, outputs, plain = serve(num_host_blocks=0)
    assert ContiguousReference(MODEL).mismatches(requests, outputs) == []
    assert plain["restores"] == plain["offloads"] == 0
    # without the tier the histories were evicted and computed again
    assert plain["second_turn_hit_tokens"] < tiered["second_turn_hit_tokens"] / 2, (plain, tiered)
