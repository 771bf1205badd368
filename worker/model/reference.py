"""The ground truth a paged cluster's outputs are checked against: the same
model generating in-process with transformers' own ``generate`` and its
contiguous KV cache, one prompt at a time (no padding, so nothing but the
cache layout differs from the workers' computation).

Greedy requests are ``generate(do_sample=False)`` as it is, stopping at the
same end tokens (EOS unless ignored, stop token ids; the end token is kept).
Seeded sampled requests are the same greedy loop with a logits processor that
makes the workers' sampler's draw (:mod:`worker.sampling`, keyed by seed,
sample index and position) the only token left: the same rule applied to
transformers' logits, so a paged cluster and the contiguous cache must draw
the same tokens.

The model comes from :func:`worker.model.build_model` with the same spec and
seed the workers were started with (so the same weights), with its attention
switched from the paged implementation back to PyTorch's SDPA.
Imports torch, transformers and :mod:`worker.model`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from client.backends import SamplingSpec
from client.serving import GREEDY, SamplingParams
from worker.model import build_model
from worker.sampling import next_tokens

REFERENCE_ATTENTION = "sdpa"


class ContiguousReference:
    """Continuations of prompts by ``model_spec`` (weights from ``seed``)
    that stop at ``eos_token_ids`` (the model's EOS, as the scheduler's
    ``SchedulerConfig.eos_token_ids``)."""

    def __init__(self, model_spec: str, *, seed: int = 0, dtype: str = "float32",
                 eos_token_ids: Iterable[int] = ()) -> None:
        # Any: transformers' generate() reaches mypy through nn.Module.__getattr__ (a Tensor)
        self.model: Any = build_model(model_spec, seed=seed, dtype=dtype)
        self.model.set_attn_implementation(REFERENCE_ATTENTION)
        self.eos_token_ids = tuple(eos_token_ids)
        self._cache: dict[tuple, list[tuple[int, ...]]] = {}

    def generate(self, prompt_token_ids: Iterable[int], max_new_tokens: int,
                 sampling: SamplingParams = GREEDY, *, sample_index: int = 0) -> tuple[int, ...]:
        """The tokens ``generate`` appends: greedy, or sample ``sample_index`` of a seeded request."""
        return self.generate_samples(prompt_token_ids, max_new_tokens, sampling, sample_index + 1)[sample_index]

    def generate_samples(self, prompt_token_ids: Iterable[int], max_new_tokens: int,
                         sampling: SamplingParams = GREEDY, n: int = 1) -> list[tuple[int, ...]]:
        """Samples ``0 .. n-1`` of a request, generated as one batch (greedy: one, copied)."""
        prompt = tuple(prompt_token_ids)
        if not prompt or max_new_tokens < 1 or n < 1:
            raise ValueError("the reference needs a non-empty prompt, max_new_tokens >= 1 and n >= 1")
        if not sampling.is_greedy and sampling.seed is None:
            raise ValueError("only a seeded sampled request has a reference")
        stops = sorted(set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids)))
        rows = 1 if sampling.is_greedy else n
        key = (prompt, max_new_tokens, tuple(stops), None if sampling.is_greedy else sampling)
        cached = self._cache.get(key, [])
        if len(cached) < rows:
            # No stops: an end token must neither end the row nor be masked (min_new_tokens
            # would mask it, unlike the workers), and generate fills in the model's own EOS
            # for None, so the row ends only at an id no model produces.
            kwargs = {"eos_token_id": stops, "pad_token_id": stops[0]} if stops else \
                {"eos_token_id": self.model.config.vocab_size, "pad_token_id": 0}
            processors = [] if sampling.is_greedy else [_ForceDraw(sampling, rows)]
            inputs = torch.tensor([prompt] * rows)
            with torch.inference_mode():
                out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                          max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                          logits_processor=LogitsProcessorList(processors), **kwargs)
            cached = [_until_stop(row[len(prompt):].tolist(), stops) for row in out]
            self._cache[key] = cached
        return cached * n if sampling.is_greedy else cached[:n]

    def mismatches(self, requests, outputs) -> list[str]:
        """One line per :class:`~client.serving.GenerationRequest` whose output
        (a :class:`~client.serving.RequestOutput`) is missing, failed, or has a
        sample that differs from the reference; empty when all match."""
        by_id = {out.request_id: out for out in outputs}
        problems = []
        for req in requests:
            out = by_id.get(req.request_id)
            if out is None or out.error is not None:
                problems.append(f"{req.request_id}: {'no output' if out is None else out.error}")
                continue
            if len(out.output_token_ids) != req.n:
                problems.append(f"{req.request_id}: {len(out.output_token_ids)} samples, asked for {req.n}")
            wants = self.generate_samples(req.prompt_token_ids, req.max_new_tokens, req.sampling, req.n)
            for index, (got, want) in enumerate(zip(out.output_token_ids, wants)):
                if got != want:
                    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                                 min(len(got), len(want)))
                    problems.append(f"{req.request_id} sample {index}: differs from token {first} on (got "
                                    f"{list(got[first:first + 4])}, reference {list(want[first:first + 4])})")
        return problems


def _until_stop(tokens: list[int], stops: list[int]) -> tuple[int, ...]:
    """A batch row up to its first end token (included): later ones are padding."""
    ends = [i for i, token in enumerate(tokens) if token in stops]
    return tuple(tokens[: ends[0] + 1] if ends else tokens)


class _ForceDraw(LogitsProcessor):
    """Leaves only the token the workers' sampler draws from these logits
    (row ``i`` is sample ``i``)."""

    def __init__(self, sampling: SamplingParams, num_samples: int) -> None:
        if sampling.seed is None:  # generate_samples refuses these first
            raise ValueError("only a seeded sampled request has a reference")
        self.specs = [SamplingSpec(sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed, index)
                      for index in range(num_samples)]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1]  # the index the next token takes
        tokens = next_tokens(scores.float(), self.specs, [position] * len(scores))
        forced = torch.full_like(scores, -math.inf)
        forced[torch.arange(len(scores)), torch.tensor(tokens)] = 0.0
        return forced
