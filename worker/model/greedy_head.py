"""A greedy step's tokens without the float32 LM head: a bfloat16 screen,
then the exact logits of the few tokens it cannot rule out.

Why: the LM head is a decode step's largest GEMM (SmolLM2-135M: 49,152 x
576; at 64 rows 19.6 ms of a ~120 ms step in float32 on oneDNN, 9.4 ms in
bfloat16 on the AMD EPYC measured, which has AVX512-BF16). A greedy step
needs only each row's argmax, not the logits.

Exactness: with ``x`` the row's hidden state and ``w`` a vocabulary row,
the bfloat16 GEMM rounds both to 8 significant bits (relative error at most
``u = 2^-8`` each), multiplies exactly and sums in float32, then rounds the
sum to bfloat16. So its answer ``a`` is within
``e = coef * |x| * |w| + rel * |a|`` of the exact logit, with
``coef = 2u + u^2 + 2 K 2^-24`` (the two roundings, Cauchy-Schwarz over
the ``K`` products, float32 summation) and ``rel = 2u`` (the output's
rounding, doubled). The exact maximum is at least ``L = max(a - e)``, so
only tokens with ``a + e >= L`` can hold it: about four a row on SmolLM2
(at most 25 over 384 rows of real generations; the observed error was at
most 0.13 of the bound). :func:`~worker.kernels.native.head_ops`'
``screen_argmax`` computes those candidates' logits exactly (float64 sums
of exact float32 products) and takes the largest, the lowest index on a
tie. That is the argmax of the exact logits; the float32 head's argmax can
differ from it only where two tokens are within float32 rounding (~1e-5)
of each other, where the float32 answer is itself an accident of its
summation order (oneDNN's and transformers' already differ there). A row
that cannot be screened (a non-finite value) falls back to the float32 head.

The greedy rows of a step that returns no logits take it
(:meth:`worker.model.runner.ModelRunner.split_step`); its sampled rows, which
need the whole distribution, run the float32 head on their rows alone.
:meth:`GreedyHead.faster` times both heads at start (``--greedy-head
auto``): on a CPU without native bfloat16 the screen is slower and is not
used. Imports torch, :mod:`worker.kernels.native` and
:mod:`worker.model.compiled` (its timing helper).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.kernels import native
from worker.model.compiled import median_ms
from worker.model.linear import BATCH_HINT

__all__ = ["MODES", "GreedyHead", "greedy_head"]

#: ``--greedy-head``: ``auto`` screens where :meth:`GreedyHead.faster` measures it faster,
#: ``bf16-screen`` always where it applies, ``float32`` never
MODES = ("auto", "bf16-screen", "float32")
_U = 2.0 ** -8  # bfloat16's unit roundoff (8 significant bits, round to nearest)
_TIMED_RUNS = 5


def greedy_head(lm_head: nn.Module) -> GreedyHead | None:
    """The screen for ``lm_head``, or None where it does not apply: a float32
    CPU ``nn.Linear`` without bias, oneDNN with bfloat16, the kernel library loaded."""
    if not isinstance(lm_head, nn.Linear) or lm_head.bias is not None:
        return None
    weight = lm_head.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and native.load()):
        return None
    return GreedyHead(lm_head)


class GreedyHead:
    """The screened greedy head of one model's LM head (see the module docstring)."""

    def __init__(self, lm_head: nn.Linear) -> None:
        self.lm_head = lm_head
        with torch.no_grad():
            self._weight = lm_head.weight.detach().contiguous()
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self._weight.to(torch.bfloat16), BATCH_HINT)
            # float64, then float32: the kernel widens the bound by 1e-3, far more than this rounding
            self._norms = self._weight.double().norm(dim=1).float().contiguous()
        k = self._weight.shape[1]
        self.coef = 2 * _U + _U * _U + 2 * k * 2.0 ** -24
        self.rel = 2 * _U

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax token of each row of ``hidden`` (``[rows, hidden]`` float32), or
        None where a row cannot be screened (the caller runs the float32 head)."""
        hidden = hidden.contiguous()
        approx = torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), self._packed, None, "none", [], "")
        out = native.head_ops().screen_argmax(approx.contiguous(), hidden, self._weight, self._norms, self.coef,
                                              self.rel)
        return None if bool((out < 0).any()) else out

    def faster(self, rows: int = BATCH_HINT) -> tuple[bool, float, float]:
        """Whether the screen beats the float32 head at ``rows`` rows, and both times in ms
        (medians; hidden states of a realistic norm, so the candidates are as few as in a step)."""
        hidden = torch.randn(rows, self._weight.shape[1], generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            screen = median_ms(lambda: self.tokens(hidden), _TIMED_RUNS)
            full = median_ms(lambda: self.lm_head(hidden).argmax(dim=-1), _TIMED_RUNS)
        return screen < full, screen, full
