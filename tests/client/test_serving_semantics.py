"""Serving semantics of the scheduler, against a real in-process blockd and the
fake model of :mod:`tests.support.slot_model` (which chooses tokens with the workers'
own sampler): end tokens and token limits, seeded sampling that reproduces
across runs and preemption, samples that differ, and streams that deliver
tokens while their request runs.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from client.scheduler import SchedulerConfig
from client.serving import FINISH_LENGTH, FINISH_STOP, GenerationRequest, SamplingParams
from client.streaming import ServingLoop
from tests.support.slot_model import VOCAB, make, reference

pytest_plugins = ["tests.support.grpc_fixtures"]

SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
ROOMY = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16)


def prompts(count: int, length: int = 9) -> list[tuple[int, ...]]:
    return [tuple((7 * i + 3 * j + 1) % VOCAB for j in range(length + i % 5)) for i in range(count)]


def requests(sampling: SamplingParams, n: int = 1, max_new: int = 12, count: int = 6) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, max_new, n=n, sampling=sampling) for i, p in enumerate(prompts(count))]


def serve(client, reqs, num_blocks: int = 200, config: SchedulerConfig = ROOMY, watermark: int = 0):
    sched, model = make(client, num_blocks, config, watermark=watermark)
    for req in reqs:
        sched.add_request(req)
    outputs = {out.request_id: out for out in sched.run()}
    stats = client.get_pool("p")
    assert stats.num_seqs == 0 and stats.num_used_blocks == 0, "every sequence is freed"
    return outputs, sched, model


def expected(req: GenerationRequest, eos=()) -> tuple[tuple[int, ...], ...]:
    seed = req.sampling.seed or 0
    return tuple(reference(req.prompt_token_ids, req.max_new_tokens, req.sampling, seed=seed, sample_index=i,
                           eos=eos) for i in range(req.n))


def test_eos_and_stop_token_ids_end_samples_and_free_their_blocks(client):
    reqs = requests(SamplingParams(), max_new=12)
    # each request's own 4th greedy token is a stop id for it; a 3rd greedy token is the model's EOS
    eos = reference(reqs[0].prompt_token_ids, 12)[2]
    stopped = []
    for req in reqs[1:]:
        stop = reference(req.prompt_token_ids, 12)[3]
        stopped.append(GenerationRequest(req.request_id, req.prompt_token_ids, 12,
                                         sampling=SamplingParams(stop_token_ids=(stop,))))
    ignoring = GenerationRequest("ign", reqs[0].prompt_token_ids, 12, sampling=SamplingParams(ignore_eos=True))
    config = SchedulerConfig(32, 16, eos_token_ids=(eos,))
    outputs, sched, _ = serve(client, [reqs[0], *stopped, ignoring], config=config)
    assert outputs["r0"].output_token_ids[0][-1] == eos and len(outputs["r0"].output_token_ids[0]) <= 3
    assert outputs["r0"].finish_reasons == (FINISH_STOP,)
    for req in stopped:
        out = outputs[req.request_id]
        assert out.output_token_ids == expected(req, (eos,)) and out.finish_reasons == (FINISH_STOP,)
        assert out.output_token_ids[0][-1] in (eos, *req.sampling.stop_token_ids)
        assert len(out.output_token_ids[0]) <= 4
    assert outputs["ign"].output_token_ids == (reference(reqs[0].prompt_token_ids, 12),)
    assert outputs["ign"].finish_reasons == (FINISH_LENGTH,)
    assert sched.counters.num_output_tokens == sum(len(s) for o in outputs.values() for s in o.output_token_ids)


def test_max_new_tokens_ends_a_sample_with_reason_length(client):
    outputs, _, _ = serve(client, requests(SamplingParams(), max_new=5))
    assert all(out.finish_reasons == (FINISH_LENGTH,) and len(out.output_token_ids[0]) == 5
               for out in outputs.values())


def test_seeded_samples_reproduce_across_runs_and_preemption(client):
    reqs = requests(SAMPLED, n=3, max_new=10, count=8)
    first, _, _ = serve(client, reqs)
    client.delete_pool("p")
    # a pool too small for all of them: preemptions recompute sequences mid-way
    second, sched, _ = serve(client, reqs, num_blocks=30,
                             config=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=12), watermark=1)
    assert sched.counters.num_preemptions > 0
    for req in reqs:
        assert first[req.request_id].output_token_ids == second[req.request_id].output_token_ids == expected(req)


def test_samples_of_one_request_differ_and_share_the_prompt_blocks(client):
    reqs = requests(SAMPLED, n=4, max_new=8, count=3)
    outputs, sched, _ = serve(client, reqs)
    for req in reqs:
        samples = outputs[req.request_id].output_token_ids
        assert len(set(samples)) == 4, samples
        assert len({s[0] for s in samples}) > 1, "the first tokens already differ"
        assert samples == expected(req)
    assert sched.counters.num_forks == 3 * 3 and client.get_pool("p").num_copies > 0


def test_sample_zero_may_end_at_its_first_token_while_the_others_go_on(client):
    base = GenerationRequest("x", prompts(1)[0], 6, n=4, sampling=SAMPLED)
    first_of_zero = expected(base)[0][0]
    req = GenerationRequest("x", base.prompt_token_ids, 6, n=4,
                            sampling=SamplingParams(1.0, 0.95, seed=1234, stop_token_ids=(first_of_zero,)))
    outputs, sched, _ = serve(client, [req])
    samples = outputs["x"].output_token_ids
    assert samples[0] == (first_of_zero,) and outputs["x"].finish_reasons[0] == FINISH_STOP
    assert samples == expected(req) and max(map(len, samples)) > 1
    assert sched.counters.num_forks == sum(s[0] != first_of_zero for s in samples[1:])


def test_top_k_1_and_temperature_0_are_greedy(client):
    greedy = requests(SamplingParams(), n=2)
    top1 = [GenerationRequest(f"k{r.request_id}", r.prompt_token_ids, r.max_new_tokens, n=2,
                              sampling=SamplingParams(temperature=1.7, top_k=1, seed=5)) for r in greedy]
    outputs, _, _ = serve(client, greedy + top1)
    for g, k in zip(greedy, top1):
        want = (reference(g.prompt_token_ids, g.max_new_tokens),) * 2
        assert outputs[g.request_id].output_token_ids == outputs[k.request_id].output_token_ids == want


def test_unseeded_requests_get_seeds_of_their_own(client):
    reqs = [GenerationRequest(f"u{i}", prompts(1)[0], 8, sampling=SamplingParams(temperature=1.0))
            for i in range(4)]
    outputs, _, _ = serve(client, reqs)
    assert len({out.output_token_ids for out in outputs.values()}) > 1


def test_a_stream_yields_tokens_in_order_before_its_request_ends(client):
    sched, _ = make(client, 200, ROOMY)
    reqs = requests(SAMPLED, n=2, max_new=6, count=3)
    streams = {req.request_id: sched.submit(req) for req in reqs}
    seen, unfinished_when_first = [], None
    for token in streams["r1"]:  # consuming one stream steps the scheduler for all
        if unfinished_when_first is None:
            unfinished_when_first = not streams["r1"].is_finished
        seen.append(token)
    assert unfinished_when_first, "the first token arrived while the request still ran"
    out = streams["r1"].result()
    for index, sample in enumerate(out.output_token_ids):
        assert [t.token_id for t in seen if t.sample_index == index] == list(sample)
    assert [t.finish_reason for t in seen if t.finish_reason] == ["length", "length"]
    for req in reqs:
        assert streams[req.request_id].result().output_token_ids == expected(req)
    assert sched.take_finished() == [], "streamed outputs go to their streams only"


def test_streams_from_threads_and_asyncio_with_a_serving_loop(client):
    sched, _ = make(client, 200, ROOMY)
    reqs = requests(SAMPLED, n=2, max_new=6, count=4)
    got: dict[str, list] = {}
    with ServingLoop(sched) as loop:
        def consume(req):
            got[req.request_id] = list(loop.submit(req))

        threads = [threading.Thread(target=consume, args=(req,)) for req in reqs[:2]]
        for thread in threads:
            thread.start()

        async def consume_async(req):
            stream = loop.submit(req)
            tokens = [token async for token in stream]
            return req.request_id, tokens, stream.result()

        async def both():
            return await asyncio.gather(*(consume_async(req) for req in reqs[2:]))

        results = asyncio.run(both())
        for thread in threads:
            thread.join(60)
    for request_id, tokens, output in results:
        got[request_id] = tokens
        assert output.output_token_ids == expected(next(r for r in reqs if r.request_id == request_id))
    for req in reqs:
        want = expected(req)
        for index in range(req.n):
            assert tuple(t.token_id for t in got[req.request_id] if t.sample_index == index) == want[index]
    assert sched.is_idle and client.get_pool("p").num_seqs == 0


def test_sampling_params_are_validated():
    for kwargs, match in [({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"top_k": -1}, "top_k"), ({"seed": 2**64}, "seed"),
                          ({"stop_token_ids": (-1,)}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    with pytest.raises(TypeError, match="SamplingParams"):
        GenerationRequest("a", (1,), 1, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="eos_token_ids"):
        SchedulerConfig(eos_token_ids=(-2,))
