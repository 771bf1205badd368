"""The workers' sampler (:mod:`worker.sampling`) and ``ModelStep``'s sampling
fields over gRPC.

The sampler is checked against a plain reference that sorts every row (the
fast path looks at the most likely tokens first), for its distribution on a
small vocabulary, for the cuts (top-k, top-p), for greedy equivalences, and
for the property the whole design rests on: a draw depends on the logits and
on (seed, sample index, position) only -- not on the batch around it.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from blockd.core import Allocate
from blockd.core.errors import InvalidArgument
from client.backends import SamplingSpec
from client.errors import InvalidArgumentError
from client.worker import WorkerClient
from tests.worker.test_model_runner import Local
from worker.sampling import HEAD_TOKENS, check_spec, next_tokens, uniform
from worker.service import WorkerServer


def plain_draw(logits: torch.Tensor, spec: SamplingSpec, position: int, sample_index: int) -> int:
    """The documented rule over a whole sorted row, in float64."""
    scaled = logits.double() / spec.temperature
    values, ids = torch.sort(scaled, descending=True, stable=True)
    probs = torch.softmax(values, dim=0)
    if 0 < spec.top_k < len(probs):
        probs[spec.top_k:] = 0.0
    before = torch.cumsum(probs, 0) - probs
    cut = before >= spec.top_p
    cut[0] = False
    probs[cut] = 0.0
    cdf = torch.cumsum(probs, 0)
    cut_anything = bool(cut.any()) or 0 < spec.top_k < len(probs)
    target = uniform(spec.seed, sample_index, position) * (float(cdf[-1]) if cut_anything else 1.0)
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    return int(ids[min(index, len(ids) - 1)])


def test_uniform_is_a_function_of_its_key_alone():
    assert uniform(1, 2, 3) == uniform(1, 2, 3)
    values = {uniform(seed, index, pos) for seed in range(20) for index in range(5) for pos in range(20)}
    assert len(values) == 2000 and all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.02


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    trials = 8000  # one row per seed, drawn as one batch

    def freqs(spec_of_seed):
        specs = [spec_of_seed(seed) for seed in range(trials)]
        drawn = Counter(next_tokens(logits.expand(trials, 4), specs, [5] * trials))
        return {token: count / trials for token, count in drawn.items()}

    want = torch.softmax(logits[0], 0).tolist()
    got = freqs(lambda seed: SamplingSpec(1.0, seed=seed))
    assert all(abs(got.get(t, 0.0) - want[t]) < 0.015 for t in range(4)), got
    # top-p 0.7: token 3 (0.64) and token 2 (mass before it 0.64 < 0.7) stay, renormalised
    got = freqs(lambda seed: SamplingSpec(1.0, top_p=0.7, seed=seed))
    assert set(got) == {2, 3} and abs(got[3] - want[3] / (want[2] + want[3])) < 0.015, got
    got = freqs(lambda seed: SamplingSpec(1.0, top_k=2, seed=seed))
    assert set(got) == {2, 3}
    # a low temperature sharpens the distribution
    got = freqs(lambda seed: SamplingSpec(0.25, seed=seed))
    assert got[3] > 0.97


@pytest.mark.parametrize("spec", [SamplingSpec(1.0), SamplingSpec(0.7, top_p=0.9), SamplingSpec(1.3, top_k=700),
                                  SamplingSpec(1.0, top_k=40, top_p=0.8), SamplingSpec(2.0, top_p=0.999)])
def test_the_fast_path_draws_what_a_full_sort_draws(spec):
    """A vocabulary larger than the head the fast path looks at first, with flat
    and peaked rows, so both the head and the whole-row fallback decide draws."""
    vocab = 3 * HEAD_TOKENS
    gen = torch.Generator().manual_seed(1)
    rows = torch.cat([torch.randn(4, vocab, generator=gen), 8 * torch.randn(4, vocab, generator=gen)])
    for position in range(40):
        specs = [SamplingSpec(spec.temperature, spec.top_p, spec.top_k, seed=row, sample_index=2)
                 for row in range(len(rows))]
        got = next_tokens(rows, specs, [position] * len(rows))
        want = [plain_draw(rows[row], specs[row], position, 2) for row in range(len(rows))]
        assert got == want


def test_a_draw_does_not_depend_on_the_batch_around_it():
    gen = torch.Generator().manual_seed(2)
    rows = 4 * torch.randn(6, 2000, generator=gen)
    spec = SamplingSpec(0.8, top_p=0.95, seed=42, sample_index=1)
    alone = [next_tokens(rows[i : i + 1], [spec], [17])[0] for i in range(6)]
    others = [SamplingSpec(1.0, seed=s) for s in range(6)]
    for i in range(6):
        specs = [spec if j == i else others[j] for j in range(6)]
        assert next_tokens(rows, specs, [17] * 6)[i] == alone[i]
    # and it does depend on the key
    keyed = {next_tokens(rows[:1], [SamplingSpec(1.0, seed=seed)], [17])[0] for seed in range(30)}
    assert len(keyed) > 5


def test_greedy_and_top_k_1_are_the_argmax():
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(8, 1000, generator=gen)
    rows[0, 10] = rows[0, 20] = rows[0].max() + 1  # a tie: the argmax takes the lower id
    argmax = rows.argmax(-1).tolist()
    assert argmax[0] == 10
    assert next_tokens(rows, None, [0] * 8) == argmax
    assert next_tokens(rows, [SamplingSpec()] * 8, [0] * 8) == argmax
    assert next_tokens(rows, [SamplingSpec(1.5, top_k=1, seed=s) for s in range(8)], [0] * 8) == argmax
    assert next_tokens(rows, [SamplingSpec(0.0, num_samples=3)] + [SamplingSpec()] * 7, [0] * 8) == \
        [argmax[0]] * 3 + argmax[1:]


def test_several_draws_are_the_draws_of_consecutive_sample_indices():
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(2, 500, generator=gen)
    many = next_tokens(rows, [SamplingSpec(1.0, seed=9, sample_index=0, num_samples=4), SamplingSpec()], [30, 8])
    one_by_one = [next_tokens(rows[:1], [SamplingSpec(1.0, seed=9, sample_index=i)], [30])[0] for i in range(4)]
    assert many == [*one_by_one, int(rows[1].argmax())]
    assert len(set(one_by_one)) > 1


def test_specs_are_validated():
    assert check_spec(0.5, 0.0, 0, 1, 0, 0) == SamplingSpec(0.5, 1.0, 0, 1, 0, 1)  # proto defaults
    for args, match in [((-1.0, 1, 0, 0, 0, 1), "temperature"), ((math.nan, 1, 0, 0, 0, 1), "temperature"),
                        ((1.0, 1.5, 0, 0, 0, 1), "top_p"), ((1.0, 1, -1, 0, 0, 1), "non-negative"),
                        ((1.0, 1, 0, 0, 0, 5000), "num_samples")]:
        with pytest.raises(InvalidArgument, match=match):
            check_spec(*args)
    with pytest.raises(InvalidArgument, match="one sampling spec"):
        next_tokens(torch.zeros(2, 4), [SamplingSpec()], [0, 0])


@pytest.mark.parametrize("head", ["float32", "bf16-screen"])
def test_model_step_samples_as_asked_over_grpc(head):
    """Also with the greedy head's screen: a step without logits splits its rows
    (the greedy ones by the screen, the sampled ones from their own float32 logits)."""
    if head == "bf16-screen" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("the screen needs oneDNN with bfloat16 on this CPU")
    local = Local("tiny-llama", greedy_head=head)
    assert local.runner.screening == (head == "bf16-screen")
    local.runtime.mirror.adopt("pool-life-1")
    server = WorkerServer(local.runtime, "w", runner=local.runner)
    server.start()
    try:
        prompt = [5, 6, 7, 8, 9, 10]
        r = local.step([Allocate("a", prompt), Allocate("b", prompt[:3])])
        slots = list(r.results[0].slot_mapping) + list(r.results[1].slot_mapping)
        args = ("m", r.version, ["a", "b"], [6, 3], [6, 3], prompt + prompt[:3], slots)
        sampled = [SamplingSpec(0.9, 0.95, 0, seed=11, sample_index=0, num_samples=3), SamplingSpec()]
        with WorkerClient(server.address, timeout_s=30) as worker:
            tokens, logits = worker.model_step(*args, return_logits=True, pool_incarnation="pool-life-1",
                                               sampling=sampled)
            specs = [SamplingSpec(0.9, 0.95, 0, 11, 0, 3), SamplingSpec()]
            assert tokens == next_tokens(logits, specs, [6, 3])
            assert len(tokens) == 4 and tokens[3] == int(logits[1].argmax())
            greedy, _ = worker.model_step(*args, pool_incarnation="pool-life-1")
            assert greedy == logits.argmax(-1).tolist()
            mixed, none = worker.model_step(*args, pool_incarnation="pool-life-1", sampling=sampled)
            assert none is None and mixed == tokens
            drawn, _ = worker.model_step(*args, pool_incarnation="pool-life-1", sampling=sampled[:1] * 2)
            assert drawn == next_tokens(logits, sampled[:1] * 2, [6, 3]), "no greedy row: the whole float32 head"
            for bad, match in [([SamplingSpec()], "one entry per sequence"),
                               ([SamplingSpec(temperature=-1.0), SamplingSpec()], "temperature"),
                               ([SamplingSpec(num_samples=5000), SamplingSpec()], "num_samples")]:
                with pytest.raises(InvalidArgumentError, match=match):
                    worker.model_step(*args, pool_incarnation="pool-life-1", sampling=bad)
    finally:
        server.stop(0)


def test_model_steps_run_on_one_thread_whichever_rpc_thread_takes_them():
    """An OpenMP team belongs to the thread that opens its regions: steps on
    many RPC threads kept a team each, which spin into each other's steps
    (worker/service.py). Concurrent callers' steps all run on one thread."""
    local = Local("tiny-llama")
    local.runtime.mirror.adopt("pool-life-1")
    seen: list[str] = []
    step = local.runner._step  # behind step and split_step both

    def recording_step(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return step(*args, **kwargs)

    local.runner._step = recording_step
    server = WorkerServer(local.runtime, "w", runner=local.runner)
    server.start()
    try:
        prompt = [5, 6, 7, 8, 9, 10]
        r = local.step([Allocate("a", prompt)])
        args = ("m", r.version, ["a"], [6], [6], prompt, list(r.results[0].slot_mapping))
        start = threading.Barrier(4)

        def caller() -> list[list[int]]:
            with WorkerClient(server.address, timeout_s=30) as worker:
                start.wait()
                return [worker.model_step(*args, pool_incarnation="pool-life-1")[0] for _ in range(3)]

        with ThreadPoolExecutor(4) as pool:
            results = [f.result() for f in [pool.submit(caller) for _ in range(4)]]
    finally:
        server.stop(0)
    assert len(seen) == 12 and len(set(seen)) == 1 and seen[0].startswith("worker-model")
    assert all(tokens == results[0][0] for calls in results for tokens in calls)
