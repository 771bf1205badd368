"""The continuous-batching scheduler against a real in-process blockd and a fake
model that computes on what the pool's slots hold (:mod:`tests.support.slot_model`).
"""

from __future__ import annotations

import random

import pytest

from blockd.core import PoolConfig
from blockd.core.types import WorkerInfo
from client.backends import ModelBatch
from client.scheduler import Scheduler, SchedulerConfig
from client.serving import GenerationRequest, ReservationAdmission, percentile
from tests.support.slot_model import BLOCK, VOCAB, SlotModel, StepThrough, check_outputs, make, reference

pytest_plugins = ["tests.support.grpc_fixtures"]


def workload(seed: int, count: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    shared = [tuple(rng.randrange(VOCAB) for _ in range(rng.randint(9, 23))) for _ in range(2)]
    requests = []
    for i in range(count):
        prefix = rng.choice([*shared, ()])
        prompt = prefix + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 12)))
        requests.append(GenerationRequest(f"r{i}", prompt, rng.randint(1, 14), n=rng.choice((1, 1, 2, 3))))
    return requests


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_tokens_survive_chunking_prefix_reuse_forks_and_preemption(client, seed):
    requests = workload(seed, 16)
    sched, _ = make(client, 24, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=12), watermark=1)
    for req in requests:
        sched.add_request(req)
    check_outputs(sched.run(), requests)
    c = sched.counters
    assert c.num_preemptions > 0 and c.num_refused_batches > 0, "the small pool must force preemption"
    # a request preempted between its prompt's end and the fork allocates its samples instead
    assert 0 < c.num_forks <= sum(req.n - 1 for req in requests if req.max_new_tokens > 1)
    assert c.num_cached_tokens > 0, "shared prefixes must hit the prefix cache"
    stats = client.get_pool("p")
    assert stats.num_seqs == 0 and stats.num_used_blocks == 0, "every sequence is freed at the end"


def test_one_step_call_per_scheduler_step_when_room_suffices(client):
    requests = workload(3, 8)
    sched, model = make(client, 400, SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=32))
    calls = []
    original = model.step
    model.step = lambda *a, **k: calls.append(1) or original(*a, **k)
    for req in requests:
        sched.add_request(req)
    check_outputs(sched.run(), requests)
    assert sched.counters.num_refused_batches == 0 and sched.counters.num_preemptions == 0
    assert len(calls) == sched.counters.num_steps
    assert model.num_steps <= sched.counters.num_steps  # one model step per scheduler step at most


def test_chunked_prefill_respects_the_token_budget(client):
    sched, model = make(client, 100, SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4))
    sizes = []
    original = model.run
    model.run = lambda version, batch, **kw: sizes.append(batch.num_tokens) or original(version, batch, **kw)
    req = GenerationRequest("long", tuple(range(1, 30)), 3)
    sched.add_request(req)
    check_outputs(sched.run(), [req])
    assert max(sizes) <= 8 and sizes[:4] == [8, 8, 8, 5]
    out = sched.counters
    assert out.num_prefill_tokens == 29 and out.num_output_tokens == 3


@pytest.mark.parametrize("prefix_block_size", [0, BLOCK, None])
def test_a_burst_sharing_a_prompt_prefix_computes_it_once(client, prefix_block_size):
    """Requests arriving together with one 9-token system prompt (two full
    blocks and a token): with ``prefix_block_size`` the first computes it and
    the others, admitted in the same step, share both blocks with it and copy
    the K/V of the ninth token from its new tokens; without it all of them
    compute it. The tokens are the same either way. None (the
    default) is the pool's block size, asked of blockd before the first step."""
    system = tuple(range(100, 109))
    requests = [GenerationRequest("other", (7, 7, 7, 7, 7), 3)]
    requests += [GenerationRequest(f"r{i}", (*system, i + 1, i + 2), 3) for i in range(5)]
    requests.append(GenerationRequest("late", (9, 9, 9, 9, 9), 3))
    sched, model = make(client, 100, SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=16,
                                                     prefix_block_size=prefix_block_size))
    sizes = []
    original = model.run
    model.run = lambda version, batch, **kw: sizes.append(batch.num_tokens) or original(version, batch, **kw)
    for req in requests:
        sched.add_request(req)
    check_outputs(sched.run(), requests)
    c = sched.counters
    assert sched.config.prefix_block_size == (BLOCK if prefix_block_size is None else prefix_block_size)
    if prefix_block_size != 0:  # and the 9th token, past the full blocks, copied from the first's
        assert c.num_cached_tokens == 4 * 8 and c.num_prefill_tokens == 5 + 11 + 4 * 2 + 5
        assert c.num_copied_tokens == 4
        assert sizes[0] == 5 + 11 + 4 * 2 + 5, "one step: the others compute only their last 2 tokens"
        assert model.batches[0].copy_lens == [0, 0, 1, 1, 1, 1, 0]
    else:
        assert c.num_cached_tokens == c.num_copied_tokens == 0 and c.num_prefill_tokens == 5 + 5 * 11 + 5
        assert sizes[0] == 5 + 5 * 11 + 5


def test_a_prompt_copies_from_the_admission_agreeing_longest_even_one_that_copies_itself(client):
    """``c`` agrees with ``a`` through 9 tokens and ``d`` with ``c`` through 14
    (blocks of 4): ``c`` copies token 8 from ``a``, and ``d``, holding three
    full blocks, copies tokens 12 and 13 from ``c``'s new tokens, not from
    ``a``, which disagrees there. The slot model checks every token's K/V."""
    base = tuple(range(100, 109))
    requests = [GenerationRequest("a", (*base, 1, 1, 1, 1, 1, 1, 1), 2),
                GenerationRequest("c", (*base, 2, 3, 4, 5, 6, 7, 8), 2),
                GenerationRequest("d", (*base, 2, 3, 4, 5, 6, 9, 9), 2)]
    sched, model = make(client, 100, SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=16,
                                                     prefix_block_size=BLOCK))
    for req in requests:
        sched.add_request(req)
    check_outputs(sched.run(), requests)
    first = model.batches[0]
    assert first.copy_lens == [0, 1, 2] and first.copy_from == [0, 0, 1]
    assert first.query_lens == [16, 16 - 9, 16 - 14] and sched.counters.num_copied_tokens == 3


def test_reservation_admission_bounds_concurrency(client):
    requests = [GenerationRequest(f"r{i}", (i + 1,) * 5, 6) for i in range(6)]
    policy = ReservationAdmission(40, BLOCK, max_len=32)  # 8 blocks a sequence: 5 at once
    sched, _ = make(client, 40, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16), admission=policy)
    for req in requests:
        sched.add_request(req)
    check_outputs(sched.run(), requests)
    assert sched.counters.peak_running_requests == 5 and policy.num_reserved_blocks == 0


def test_requests_that_can_never_fit_are_rejected_not_waited_on(client):
    sched, _ = make(client, 6, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    fits = GenerationRequest("fits", (1, 2, 3), 4)
    sched.add_request(GenerationRequest("huge", tuple(range(1, 40)), 2))
    sched.add_request(GenerationRequest("wide", (5, 6), 2, n=9))
    sched.add_request(fits)
    outputs = {out.request_id: out for out in sched.run()}
    assert "blocks" in outputs["huge"].error and "max_num_seqs" in outputs["wide"].error
    assert outputs["fits"].output_token_ids == (reference(fits.prompt_token_ids, 4),)
    assert sched.counters.num_rejected == 2


def test_one_new_token_with_several_samples(client):
    req = GenerationRequest("one", (9, 8, 7, 6, 5), 1, n=3)
    sched, _ = make(client, 20, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8))
    sched.add_request(req)
    check_outputs(sched.run(), [req])
    assert sched.counters.num_forks == 0


def test_timings_come_from_the_injected_clock(client):
    ticks = iter(range(1000))
    client.create_pool(PoolConfig("p", 50, BLOCK))
    model = SlotModel(client, "p")
    sched = Scheduler(StepThrough(client, model), "p", model, SchedulerConfig(16, 4),
                      clock=lambda: float(next(ticks)))
    sched.add_request(GenerationRequest("a", (1, 2, 3), 4))
    (out,) = sched.run()
    assert out.ttft_s == 1.0 and out.tpot_s == 1.0 and out.e2e_s == 4.0 and out.tokens_per_s == 1.0


def test_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationRequest("a", (1,), 0)
    with pytest.raises(ValueError, match="prompt"):
        GenerationRequest("a", (), 1)
    with pytest.raises(ValueError, match=r"without '\.'"):
        GenerationRequest("a.b", (1,), 1)
    with pytest.raises(ValueError, match="n must"):
        GenerationRequest("a", (1,), 1, n=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(ValueError, match="prefix_block_size"):
        SchedulerConfig(prefix_block_size=-1)
    with pytest.raises(ValueError, match="prefix_block_size"):
        SchedulerConfig(prefix_block_size="16")
    with pytest.raises(ValueError, match="ReservationAdmission needs"):
        ReservationAdmission(0, 16, 100)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 99) == 0.0


def test_duplicate_request_ids_are_refused(client):
    sched, _ = make(client, 10, SchedulerConfig(8, 4))
    sched.add_request(GenerationRequest("a", (1,), 1))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(GenerationRequest("a", (2,), 1))


def test_tensor_parallel_ranks_must_agree(monkeypatch):
    from client.model_group import TensorParallelMismatch, WorkerGroup

    batch = ModelBatch()
    batch.add("a", 3, [1, 2], [10, 11])
    batch.add("b", 1, [5], [20])
    with WorkerGroup("p", ["127.0.0.1:1", "127.0.0.1:2"]) as group:  # channels connect lazily
        answers = {group.workers[0].target: [7, 8], group.workers[1].target: [7, 8]}
        monkeypatch.setattr(group, "_step", lambda worker, version, b, incarnation, term=0: answers[worker.target])
        assert group.run(3, batch) == [7, 8]
        answers[group.workers[1].target] = [7, 9]
        with pytest.raises(TensorParallelMismatch, match=r"rank 1 .* sequence 'b'"):
            group.run(3, batch)
    with pytest.raises(ValueError, match="one slot each"):
        batch.add("c", 4, [1, 2], [3])


@pytest.mark.parametrize("registers", [True, False])
def test_a_worker_restart_is_recovered_by_recomputing(client, registers):
    """The model's memory is wiped mid-run. With a new worker incarnation
    registered, blockd reports the lost sequences (KV_LOST); without, only the
    model's refusal (KV_NOT_WRITTEN) tells. Either way the scheduler recomputes
    and the tokens still equal the reference."""
    requests = workload(4, 12)
    sched, model = make(client, 60, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=12))
    client.register_worker(WorkerInfo("w", "p", "", 0, 1, 0, 1, incarnation="life-0"))
    for req in requests:
        sched.add_request(req)
    restarts_at = [3, 9]

    def restart(s):
        if restarts_at and s.counters.num_steps == restarts_at[0]:
            restarts_at.pop(0)
            model.slots.clear()
            if registers:
                client.register_worker(WorkerInfo("w", "p", "", 0, 1, 0, 1,
                                                  incarnation=f"life-{s.counters.num_steps}"))

    check_outputs(sched.run(on_step=restart), requests)
    assert restarts_at == [], "both restarts happened while requests ran"
    c = sched.counters
    assert c.num_kv_loss_preemptions > 0 and c.num_finished == len(requests)
    assert (c.num_worker_faults > 0) != registers  # blockd told first, or the model refused
    assert client.get_pool("p").num_seqs == 0 and client.get_pool("p").num_kv_lost_seqs == 0


def test_a_pool_recreated_underneath_fails_its_requests_clearly(client):
    requests = workload(5, 6)
    sched, model = make(client, 60, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=12))
    for req in requests:
        sched.add_request(req)
    for _ in range(3):
        sched.step()
    client.delete_pool("p")
    client.create_pool(PoolConfig("p", 60, BLOCK))
    model.slots.clear()
    outputs = sched.run()
    assert {out.request_id for out in outputs} == {req.request_id for req in requests}
    assert all("deleted or re-created" in out.error for out in outputs)
    assert sched.counters.num_failed == len(requests) and sched.is_idle
    later = GenerationRequest("later", (4, 5, 6), 3)
    sched.add_request(later)
    check_outputs(sched.run(), [later])  # the new pool serves new requests


def test_a_source_pool_gone_turns_sharing_off_for_a_while_and_the_prompts_are_computed(client, caplog):
    """``SOURCE_POOL_NOT_FOUND`` (nothing applied) is not the scheduler's own pool
    gone: it steps on naming no source for SOURCE_RETRY_S, then names it again."""
    import dataclasses

    from blockd.core.types import Allocate
    from client.faults import SOURCE_RETRY_S

    now = [0.0]
    client.create_pool(PoolConfig("src", 60, BLOCK))
    sched, model = make(client, 60, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=12, source_pool="src"),
                        clock=lambda: now[0])
    named: list[str] = []
    stepped = model.step

    def recording(pool, ops, **kwargs):
        named.extend(op.source_pool for op in ops if isinstance(op, Allocate))
        return stepped(pool, ops, **kwargs)

    model.step = recording
    first = workload(6, 3)
    for req in first:
        sched.add_request(req)
    sched.step()
    assert named and set(named) == {"src"}  # the source named while it exists
    client.delete_pool("src")
    later = [dataclasses.replace(req, request_id=f"later-{req.request_id}") for req in workload(7, 4)]
    for req in later:
        sched.add_request(req)
    named.clear()
    check_outputs(sched.run(), first + later)  # every request served right: the prompts were computed
    assert named[0] == "src" and set(named[1:]) == {""}, named  # refused once, then no source
    assert any("admissions name no source pool" in r.getMessage() and "'src'" in r.getMessage()
               for r in caplog.records)
    now[0] += SOURCE_RETRY_S + 1  # then the source is tried again
    again = GenerationRequest("again", (4, 5, 6, 7), 2)
    sched.add_request(again)
    named.clear()
    check_outputs(sched.run(), [again])
    assert named[0] == "src"  # named again (and, gone still, off again)
