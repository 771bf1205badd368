"""The bfloat16 screen of the greedy LM head (worker/model/greedy_head.py):
its tokens are the argmax of the exact logits, also where tokens are closer
than bfloat16 can tell apart; it refuses rows it cannot screen; and a model
runner's greedy steps give the tokens of its float32 logits, eager and
compiled, over the same scenario as tests/worker/test_model_runner.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from blockd.core.errors import InvalidArgument
from tests.worker.test_model_runner import Local, Scenario, reference
from worker.kernels import native
from worker.model.greedy_head import greedy_head
from worker.sampling import greedy_tokens

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available()
                                or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="the screen needs oneDNN with bfloat16 on this CPU")


def head(weight: torch.Tensor):
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    screen = greedy_head(linear)
    assert screen is not None, "a float32 CPU linear without bias must be screenable here"
    return screen


def exact_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden.double() @ weight.double().T).argmax(dim=-1)


def test_near_ties_below_bfloat16_resolution_go_to_the_exact_maximum():
    """Rows that differ by 1e-6 relative look the same in bfloat16 (8 bits): the
    screen must keep all of them and rank them exactly; equal rows: the lowest index."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(64, generator=gen)
    noise = torch.randn(200, 64, generator=gen) * 0.05
    weight = torch.cat([base + 1e-6 * torch.randn(40, 64, generator=gen), noise, base.expand(3, 64)])
    hidden = torch.stack([base * s for s in (1.0, 3.0, 0.01, 40.0)]) + 1e-7 * torch.randn(4, 64, generator=gen)
    screen = head(weight)
    tokens = screen.tokens(hidden)
    assert tokens is not None
    assert tokens.tolist() == exact_argmax(hidden, weight).tolist()
    # three identical rows at the end hold the maximum when the near copies are moved off it
    tied = torch.cat([noise, base.expand(3, 64)])
    assert head(tied).tokens(base.unsqueeze(0)).tolist() == [200]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 300), width=st.integers(1, 80),
       scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]), seed=st.integers(0, 2**31 - 1),
       clones=st.integers(0, 4))
def test_the_screen_picks_the_exact_argmax(rows, vocab, width, scale, seed, clones):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, width, generator=gen)
    clones = min(clones, vocab - 1)
    if clones:  # near copies of the last row: near ties the bfloat16 pass cannot order
        weight[:clones] = weight[-1] * (1 + 1e-5 * torch.randn(clones, 1, generator=gen))
    hidden = torch.randn(rows, width, generator=gen) * scale
    tokens = head(weight).tokens(hidden)
    assert tokens is not None
    assert tokens.tolist() == exact_argmax(hidden, weight).tolist()


def test_a_row_it_cannot_screen_is_refused_and_the_runner_falls_back():
    weight = torch.randn(50, 16)
    screen = head(weight)
    for bad in (float("nan"), float("inf")):
        hidden = torch.randn(3, 16)
        hidden[1, 4] = bad
        assert screen.tokens(hidden) is None
    with pytest.raises(RuntimeError, match="disagree in shape"):
        native.head_ops().screen_argmax(torch.zeros(2, 50, dtype=torch.bfloat16), torch.zeros(2, 15), weight,
                                        screen._norms, screen.coef, screen.rel)
    local = Local("tiny-llama", greedy_head="bf16-screen")
    assert local.runner.screening
    with pytest.raises(InvalidArgument, match="greedy needs one entry per sequence"):
        local.runner.split_step(0, ["a"], [1], [1], [3], [0], greedy=[True, False])
    hidden = torch.randn(2, local.runner.model.config.hidden_size)
    hidden[0, 0] = float("nan")
    want = greedy_tokens(local.runner.model.lm_head(hidden).float())
    assert local.runner._screened(hidden).tolist() == want.tolist()


def test_the_screen_applies_only_where_it_is_exact_to_do_so():
    assert greedy_head(nn.Linear(8, 4, bias=True)) is None, "a bias is not in the bound"
    assert greedy_head(nn.Linear(8, 4, bias=False).to(torch.bfloat16)) is None
    assert Local("tiny-gpt2", greedy_head="bf16-screen").runner.greedy_head is None
    local = Local("tiny-llama", greedy_head="float32")
    assert local.runner.greedy_head is None and not local.runner.screening
    assert "float32" in local.runner.warm_head()
    with pytest.raises(ValueError, match="greedy_head must be one of"):
        Local("tiny-llama", greedy_head="fast")
    auto = Local("tiny-qwen2")
    assert not auto.runner.screening, "auto screens only once warm_head measured it"
    said = auto.runner.warm_head()
    assert ("bfloat16 screen" in said) == auto.runner.screening and "ms at 64 rows" in said


class GreedyChecked:
    """``runner.step``'s logits for the scenario, and on every step ``split_step``
    over the same batch (it writes the same K/V again) must give their argmax."""

    def __init__(self, runner) -> None:
        self.runner, self.steps = runner, 0

    def __call__(self, *args):
        logits = self.runner.step(*args)
        tokens, _ = self.runner.split_step(*args)  # every row greedy
        want = greedy_tokens(logits).tolist()
        assert tokens.tolist() == want
        # a step of greedy and sampled rows: the greedy rows' tokens, the others' logits
        mask = [i % 2 == 0 for i in range(len(args[1]))]
        chosen, others = self.runner.split_step(*args, greedy=mask)
        assert chosen.tolist() == [t if g else -1 for t, g in zip(want, mask)]
        torch.testing.assert_close(others, logits[[i for i, g in enumerate(mask) if not g]], atol=1e-5, rtol=1e-5)
        self.steps += 1
        return logits


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("compiled", [False, True])
def test_greedy_steps_give_the_float32_logits_argmax(spec, compiled, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    extra = {"compile_buckets": (4, 8), "compile_kernel": "onednn"} if compiled else {}
    local = Local(spec, greedy_head="bf16-screen", **extra)
    assert local.runner.screening
    if compiled:
        local.runner.warm()
    checked = GreedyChecked(local.runner)
    scenario = Scenario(local.step, checked, reference(spec))
    scenario.drive()
    assert checked.steps >= 10
