"""The next token of each sequence, from the logits of its last new token:
greedy (argmax), or one draw from the temperature / top-k / top-p filtered
distribution, with a uniform number that is a pure function of
``(seed, sample index, position)``.

Why keyed and not a generator's stream: a stream's next number depends on
everything drawn before it -- on which sequences shared the batch, on how
often a preempted sequence was recomputed, on the process. A counter-based
draw does not: the token a seeded sample takes at position ``p`` is the same
on every run, after any preemption, on every rank of a tensor-parallel group
(each rank computes the same logits and the same number, so no broadcast is
needed) and on any worker. ``position`` is the index the new token takes in
the sequence (``context_len``), so a recomputed prompt continues exactly
where it stopped.

How a draw is made (in float64, per row, so rounding cannot depend on the
batch): the probabilities ``softmax(logits / temperature)`` in descending
order (ties by vocabulary index, so ``top_k = 1`` is the argmax); ranks
``>= top_k`` cut; tokens whose preceding probability mass already reaches
``top_p`` cut (the most likely token always stays); the draw is the first
token at which the cumulative mass exceeds ``u * kept mass`` (inverse CDF;
the kept mass is 1 when nothing is cut). Temperature 0 is the argmax of the
float32 logits, exactly what transformers' greedy ``generate`` picks (torch's
``argmax``, or the compiled row argmax of ``csrc/layer_ops.cpp`` with the same
answer when the kernel library is loaded: ~0.2 ms instead of ~0.85 ms on a
64-row SmolLM2 step). The greedy rows of a step that returns no logits may
not come here at all: the model runner's bfloat16 screen
(:mod:`worker.model.greedy_head`) gives the exact logits' argmax without
the float32 logits.

Imports torch, :mod:`blockd.core.errors` and :mod:`worker.kernels.native`
(which never builds the library from here; no transformers: a worker without
a model imports its service, which imports this); no worker state.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence

import torch

from blockd.core.errors import InvalidArgument
from client.backends import SamplingSpec
from worker.kernels import native

#: draws one sequence may ask for in one step (the samples forked from it)
MAX_SAMPLES_PER_SEQ = 1024
#: tokens looked at before a draw sorts its whole row (see _draw)
HEAD_TOKENS = 512
_UINT64 = (1 << 64) - 1
_PERSON = b"blockd-sample-v1"  # domain separation: these numbers are used for nothing else


def check_spec(temperature: float, top_p: float, top_k: int, seed: int, sample_index: int,
               num_samples: int) -> SamplingSpec:
    """A validated spec; proto defaults (``top_p`` 0, ``num_samples`` 0) mean "off" and 1."""
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise InvalidArgument(f"sampling temperature must be a finite number >= 0, got {temperature!r}")
    if not 0.0 <= top_p <= 1.0:
        raise InvalidArgument(f"sampling top_p must be in [0, 1], got {top_p!r}")
    if top_k < 0 or not 0 <= seed <= _UINT64 or sample_index < 0:
        raise InvalidArgument("sampling top_k, seed and sample_index must be non-negative")
    num_samples = num_samples or 1
    if not 1 <= num_samples <= MAX_SAMPLES_PER_SEQ:
        raise InvalidArgument(f"sampling num_samples must be in [1, {MAX_SAMPLES_PER_SEQ}], got {num_samples}")
    if top_p == 0.0:
        top_p = 1.0
    return SamplingSpec(float(temperature), float(top_p), int(top_k), int(seed), int(sample_index),
                        num_samples)


def uniform(seed: int, sample_index: int, position: int) -> float:
    """A number in [0, 1) that depends on nothing but its three arguments
    (53 bits of BLAKE2b over them)."""
    key = struct.pack("<QQQ", seed & _UINT64, sample_index & _UINT64, position & _UINT64)
    digest = hashlib.blake2b(key, digest_size=8, person=_PERSON).digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / (1 << 53))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64 ``[batch]``): by the compiled row argmax
    for contiguous float32 CPU logits when the kernel library is loaded
    (the model runner loads it), else by torch; the two give the same answer."""
    if (native.loaded() and logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and logits.is_contiguous() and logits.shape[1] > 0):
        return native.layer_ops().argmax_rows(logits)
    return logits.argmax(dim=-1)


def next_tokens(logits: torch.Tensor, specs: Sequence[SamplingSpec] | None,
                positions: Sequence[int], chosen: Sequence[int] | None = None) -> list[int]:
    """The chosen tokens, flattened in batch order: ``specs[i].num_samples``
    for row ``i`` (one per row with ``specs`` None or empty: all greedy).

    * ``logits``: ``[batch, vocab]``, float32 on the CPU;
    * ``positions[i]``: the index row ``i``'s new token takes in its sequence;
    * ``chosen``: the greedy rows' tokens, already picked (one per row, any
      value in the others: ``ModelRunner.split_step``); ``logits`` then holds
      only the other rows, in batch order.
    """
    greedy = greedy_tokens(logits).tolist() if chosen is None else list(chosen)
    if not specs:
        return greedy
    if len(specs) != len(greedy) or len(positions) != len(greedy):
        raise InvalidArgument(f"need one sampling spec and position per sequence ({len(greedy)}), got "
                              f"{len(specs)} and {len(positions)}")
    rows, draws = [], []  # the logits row and the (spec, sample index, position) of every random draw
    sampled = 0  # the sampled rows so far: their logits rows where only they have logits
    for row, (spec, position) in enumerate(zip(specs, positions)):
        if not spec.is_greedy:
            for offset in range(spec.num_samples):
                rows.append(row if chosen is None else sampled)
                draws.append((spec, spec.sample_index + offset, position))
            sampled += 1
    drawn = iter(_draw(logits, rows, draws) if rows else [])
    out: list[int] = []
    for row, spec in enumerate(specs):
        if spec.is_greedy:
            out += [greedy[row]] * spec.num_samples
        else:
            out += [next(drawn) for _ in range(spec.num_samples)]
    return out


def _draw(logits: torch.Tensor, rows: list[int], draws: list[tuple[SamplingSpec, int, int]]) -> list[int]:
    """One inverse-CDF draw per entry of ``draws`` from row ``rows[j]`` of ``logits``.

    Sorting a whole vocabulary costs milliseconds a row, so the candidates
    are first looked for among the ``HEAD_TOKENS`` most likely tokens (in the
    order the full sort gives: descending, ties by vocabulary index); only
    the draws whose candidate list, or whose point on the CDF, reaches past
    them sort their whole rows. The softmax's denominator is summed in
    float32 over the row (relative error ~1e-7), the probabilities and their
    cumulative sums are float64.
    """
    vocab = logits.shape[-1]
    rows32 = logits[torch.tensor(rows)].float()
    temperature = torch.tensor([spec.temperature for spec, _, _ in draws], dtype=torch.float64)[:, None]
    # Dividing by a positive temperature keeps the order, so the raw logits
    # give the order (exactly, without new ties); the probabilities are float64.
    values, ids = _descending(*torch.topk(rows32, min(HEAD_TOKENS, vocab), dim=-1))
    top = values[:, :1]
    total = torch.exp((rows32 - top) / temperature.float()).sum(dim=-1, keepdim=True).double()
    lse = top.double() / temperature + torch.log(total)  # log of the softmax's denominator
    head_probs = torch.exp(values.double() / temperature - lse)
    us = [uniform(spec.seed, index, position) for spec, index, position in draws]
    out = [_pick(head_probs[j], ids[j], spec, us[j], vocab) for j, (spec, _, _) in enumerate(draws)]
    undecided = [j for j, token in enumerate(out) if token is None]
    if undecided:
        ordered, order = torch.sort(rows32[undecided], dim=-1, descending=True, stable=True)
        for row, j in enumerate(undecided):
            probs = torch.exp(ordered[row].double() / temperature[j] - lse[j])
            out[j] = _pick(probs, order[row], draws[j][0], us[j], vocab)
    decided = [token for token in out if token is not None]
    assert len(decided) == len(out), "a whole row always decides a draw"
    return decided


def _descending(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` in descending order, equal ones by ascending vocabulary id."""
    by_id = torch.argsort(ids, dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(-1, by_value), ids.gather(-1, by_value)


def _pick(probs: torch.Tensor, ids: torch.Tensor, spec: SamplingSpec, u: float, vocab: int) -> int | None:
    """The draw ``u`` among the first tokens of a row (``probs`` descending,
    ``ids`` their tokens); None when those tokens do not decide it."""
    top_k = spec.top_k if 0 < spec.top_k < vocab else vocab
    num = min(top_k, len(probs))
    cdf = torch.cumsum(probs[:num], dim=0)
    # the first rank whose more likely tokens already hold top_p (never rank 0: top_p > 0)
    kept = int(torch.searchsorted(cdf - probs[:num], torch.tensor([spec.top_p], dtype=cdf.dtype)))
    if kept < num or top_k <= len(probs):  # the candidate list ends within these tokens
        cdf = cdf[:kept]
        target = u * float(cdf[-1])
    elif top_k == vocab and spec.top_p >= 1.0:  # nothing cut: the whole distribution, of mass 1
        target = u
        if len(probs) < vocab and target >= float(cdf[-1]):
            return None  # the draw lies further down
        # (over a whole row the mass is 1 up to rounding, ~1e-7: a draw past it takes the last token)
    else:
        return None  # a cut further down decides the kept mass
    picked = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    return int(ids[min(picked, len(cdf) - 1)])
