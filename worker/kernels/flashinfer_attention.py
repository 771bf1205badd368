"""The CUDA backend of :class:`worker.kernels.PagedAttention`: FlashInfer's paged wrappers.

UNTESTED on a GPU so far (no GPU was available where it was written); it is
written against FlashInfer's documented API (``flashinfer-python`` >= 0.2.5,
the ``flashinfer`` extra) and checked by ``tests/worker/test_kernels.py`` and
``scripts/gpu_check.sh`` on a CUDA machine.

The pool layer ``[2, N, H, b, D]`` is FlashInfer's "HND" paged cache as the
tuple ``(kv_layer[0], kv_layer[1])`` (each ``[N, H, b, D]``, a page = a
block), so nothing is copied. Per batch, :meth:`FlashInferRunner.plan` builds
the CSR page lists (``indptr``, ``indices``, ``last_page_len``) from the
block tables and plans one wrapper, reused by every layer's :meth:`run`:

* all sequences decoding (one query token each): ``BatchDecodeWithPagedKVCacheWrapper``
  (tensor cores for query groups larger than 4, as vLLM does);
* anything else (prefill, chunked prefill, prefix hits, mixed):
  ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``, whose mask
  aligns each sequence's queries with the *last* keys, our convention.

FlashInfer has no float32 kernels and a fixed set of head sizes, so
:func:`supports` says which plans it takes; the others stay on the torch
kernels. Sequences without query tokens are left out of the page lists (they
produce no output rows). ``flashinfer`` is imported lazily.

Imports torch and :mod:`worker.kernels.batch` only (flashinfer when used).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from worker.kernels.batch import Batch, PlanShape

__all__ = ["FlashInferPlan", "FlashInferRunner", "available", "supports"]

_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128, 256)
# FlashInfer's recommended float workspace (split-k partial results).
_WORKSPACE_BYTES = 128 << 20
# Query groups above this size decode on tensor cores (FlashInfer's own advice).
_TENSOR_CORE_GROUP = 4


@functools.cache
def available() -> bool:
    """``flashinfer`` imports and torch sees a CUDA GPU."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a wheel built for another torch/CUDA
        return False
    return True


def supports(kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FlashInfer's prebuilt paged kernels take this pool."""
    return kv_dtype in _DTYPES and head_dim in _HEAD_DIMS


@dataclass
class FlashInferPlan(PlanShape):
    """The planned wrapper, with the shape it was planned for."""

    wrapper: Any
    decode: bool


class FlashInferRunner:
    """One float workspace and lazily made wrappers, reused across plans (they hold pinned buffers)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple[str, bool], Any] = {}

    def _wrapper(self, kind: str, tensor_cores: bool = False):
        import flashinfer

        key = (kind, tensor_cores)
        if key not in self._wrappers:
            if kind == "decode":
                self._wrappers[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "HND", use_tensor_cores=tensor_cores)
            else:
                self._wrappers[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND")
        return self._wrappers[key]

    def plan(self, batch: Batch, *, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
             kv_dtype: torch.dtype, scale: float | None) -> FlashInferPlan:
        """Page lists of the sequences with query tokens, and the planned wrapper."""
        scale = float(scale) if scale is not None else head_dim ** -0.5
        q_len = torch.tensor(batch.q_len, dtype=torch.int64)
        keep = (q_len > 0).nonzero().flatten()
        ctx = batch.ctx_t[keep]
        pages = torch.div(ctx + (block_size - 1), block_size, rounding_mode="floor")
        in_use = torch.arange(batch.tables.shape[1])[None, :] < pages[:, None]
        indices = batch.tables[keep][in_use].to(torch.int32)  # row-major: each sequence's pages in order
        indptr = torch.zeros(len(keep) + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=indptr[1:])
        last_page_len = (ctx - (pages - 1) * block_size).to(torch.int32)
        qo_indptr = torch.zeros(len(keep) + 1, dtype=torch.int32)
        torch.cumsum(q_len[keep], 0, out=qo_indptr[1:])
        decode = bool((q_len[keep] == 1).all())
        common = {"sm_scale": scale, "q_data_type": kv_dtype, "kv_data_type": kv_dtype}
        indices = indices.to(self.device)
        if decode:
            wrapper = self._wrapper("decode", num_q_heads // num_kv_heads > _TENSOR_CORE_GROUP)
            wrapper.plan(indptr, indices, last_page_len, num_q_heads, num_kv_heads, head_dim, block_size,
                         **common)
        else:
            wrapper = self._wrapper("prefill")
            wrapper.plan(qo_indptr, indptr, indices, last_page_len, num_q_heads, num_kv_heads, head_dim,
                         block_size, causal=True, **common)
        return FlashInferPlan(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              block_size=block_size, kv_dtype=kv_dtype, scale=scale,
                              total_q=batch.q_start[-1], max_block_id=batch.max_block_id, wrapper=wrapper,
                              decode=decode)

    @staticmethod
    def run(plan: FlashInferPlan, query: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor) -> None:
        """One layer into ``out`` (``[total_q, Hq, D]``; rows of query-less sequences: none exist)."""
        plan.wrapper.run(query.contiguous(), (kv_layer[0], kv_layer[1]), out=out)
