"""The ground truth a paged cluster's greedy outputs are checked against: the
same model generating in-process with transformers' own ``generate`` and its
contiguous KV cache, one prompt at a time (no padding, so nothing but the
cache layout differs from the workers' computation).

The model comes from :func:`worker.model.build_model` with the same spec and
seed the workers were started with (so the same weights), with its attention
switched from the paged implementation back to PyTorch's SDPA.
Imports torch, transformers and :mod:`worker.model`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from worker.model import build_model

REFERENCE_ATTENTION = "sdpa"


class ContiguousReference:
    """Greedy continuations of prompts by ``model_spec`` (weights from ``seed``)."""

    def __init__(self, model_spec: str, *, seed: int = 0, dtype: str = "float32") -> None:
        # Any: transformers' generate() reaches mypy through nn.Module.__getattr__ (a Tensor)
        self.model: Any = build_model(model_spec, seed=seed, dtype=dtype)
        self.model.set_attn_implementation(REFERENCE_ATTENTION)
        self._cache: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}

    def generate(self, prompt_token_ids: Iterable[int], max_new_tokens: int) -> tuple[int, ...]:
        """The ``max_new_tokens`` tokens ``generate(do_sample=False)`` appends."""
        prompt = tuple(prompt_token_ids)
        if not prompt or max_new_tokens < 1:
            raise ValueError("the reference needs a non-empty prompt and max_new_tokens >= 1")
        key = (prompt, max_new_tokens)
        if key not in self._cache:
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                          min_new_tokens=max_new_tokens, do_sample=False, use_cache=True)
            self._cache[key] = tuple(out[0, len(prompt):].tolist())
        return self._cache[key]

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
            want = self.generate(req.prompt_token_ids, req.max_new_tokens)
            for index, got in enumerate(out.output_token_ids):
                if got != want:
                    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                                 min(len(got), len(want)))
                    problems.append(f"{req.request_id} sample {index}: differs from token {first} on (got "
                                    f"{list(got[first:first + 4])}, reference {list(want[first:first + 4])})")
        return problems
