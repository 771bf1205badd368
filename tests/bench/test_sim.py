"""The simulation package: blockd in process answers as blockd over gRPC does,
the one scheduler serves on it, and the workload is deterministic.

The in-process backend is compared against a real daemon over real gRPC
(the ``client`` fixture): the same batches must give the same results and
the same failures (status class, reason, failing operation, message), since
the scheduler's reactions depend on exactly these.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from bench.sim.backend import InProcessBlockd
from bench.sim.model import StubModel, stub_token
from bench.sim.workload import ALPACA, TraceSpec, UniformDist, request_stream, system_prompts, with_bare
from blockd.core import Allocate, Append, DecodeAppend, Free, PoolConfig
from blockd.core.types import WorkerInfo
from client import errors as ce
from client.scheduler import Scheduler, SchedulerConfig

pytest_plugins = ["tests.support.grpc_fixtures"]

CONFIG = PoolConfig("p", num_blocks=6, block_size=4, watermark_blocks=1)


def _outcome(backend, ops, **kwargs):
    """What a step answers: its result without the random incarnation, or its error's face."""
    try:
        result = backend.step("p", ops, **kwargs)
    except ce.BlockdClientError as err:
        return type(err).__name__, err.reason, err.op_index, err.message, err.seq_ids
    return dataclasses.replace(result, incarnation="")


BATCHES = [
    [Allocate("a", list(range(9)))],
    [Allocate("b", list(range(9))), Allocate("c", list(range(100, 140)))],  # no room: op 1
    [Append("a", [7, 8, 9]), Free("zz")],  # unknown sequence: op 1
    [DecodeAppend(["a"], [1])],
    [Allocate("a", [1])],  # exists already
    [Append("a", [])],  # nothing to append: invalid
    [Free("a")],
]


def test_in_process_answers_and_fails_as_grpc_does(client) -> None:
    local = InProcessBlockd()
    local.create_pool(CONFIG)
    client.create_pool(CONFIG)
    for ops in BATCHES:
        assert _outcome(local, ops) == _outcome(client, ops), ops
    with pytest.raises(ce.NotFoundError) as over_grpc:
        client.step("nope", [Free("a")])
    with pytest.raises(ce.NotFoundError) as in_process:
        local.step("nope", [Free("a")])
    assert in_process.value.message == over_grpc.value.message and in_process.value.op_index is None


def test_kv_lost_names_the_sequences_in_process_too(client) -> None:
    for backend in (InProcessBlockd(), client):
        backend.create_pool(CONFIG)
        backend.step("p", [Allocate("a", [1, 2, 3])])
        register = backend.engine.register_worker if isinstance(backend, InProcessBlockd) else \
            backend.register_worker
        register(WorkerInfo("w", "p", "", 0, 1, 0, 1, incarnation="i0"))
        register(WorkerInfo("w", "p", "", 0, 1, 0, 1, incarnation="i1"))  # restarted: the KV is gone
        with pytest.raises(ce.FailedPreconditionError) as lost:
            backend.step("p", [Append("a", [4])])
        assert lost.value.reason == "KV_LOST" and lost.value.seq_ids == ["a"]


def test_the_scheduler_serves_on_the_in_process_backend() -> None:
    """Outputs are the stub's tokens, whatever the preemptions: a small pool forces them."""
    backend = InProcessBlockd()
    backend.create_pool(PoolConfig("m", num_blocks=12, block_size=4))
    sched = Scheduler(backend, "m", StubModel(vocab_size=97), SchedulerConfig(32, 8))
    spec = TraceSpec("t", UniformDist(3, 12), UniformDist(2, 9), max_len=24)
    requests = [t.request for t in request_stream(spec, random.Random(3), limit=12, vocab_size=97,
                                                  n_choices=((1, 0.5), (2, 0.5)))]
    for request in requests:
        sched.add_request(request)
    outputs = {o.request_id: o for o in sched.run()}
    assert sched.counters.num_preemptions > 0 and sched.counters.num_forks > 0
    for request in requests:
        out = outputs[request.request_id]
        assert out.error is None and len(out.output_token_ids) == request.n
        # sample 0 continues its own prompt; every token is the stub's at its position
        tokens = list(request.prompt_token_ids)
        for token in out.output_token_ids[0]:
            assert token == stub_token(f"{request.request_id}.0", len(tokens), 97)
            tokens.append(token)
    stats = backend.get_pool("m")
    assert stats.num_seqs == 0 and stats.num_used_blocks == 0
    backend.check_invariants()


def test_workload_is_deterministic_and_shares_prefixes() -> None:
    def draw(seed: int):
        rng = random.Random(seed)
        prefixes = with_bare(system_prompts(rng, 3, (10, 20)), 0.75)
        return list(request_stream(ALPACA, rng, prefixes=prefixes, rate=0.5, limit=50))

    first, again = draw(5), draw(5)
    assert first == again and first != draw(6)
    arrivals = [t.arrival for t in first]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert all(len(t.request.prompt_token_ids) + t.request.max_new_tokens <= ALPACA.max_len for t in first)
    heads = [t.request.prompt_token_ids[:10] for t in first]
    assert max(heads.count(h) for h in heads) > 5  # many requests start with one shared system prompt
