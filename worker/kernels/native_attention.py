"""The compiled CPU backend of :class:`worker.kernels.PagedAttention`: plan and run.

:func:`plan_native` turns a validated batch into the kernel's work list (its
C++ ``plan`` op; see ``csrc/paged_attention.cpp``): one item per (sequence,
KV head, chunk of query tokens), decode items of long sequences split along
the keys when the batch alone cannot keep every thread busy. Each item reads
its K/V rows once for the whole query group, so planning is O(items) and
nothing per key is materialised (no index or bias tensors).
:func:`run_native` runs one layer.

Decode, prefill, chunked prefill / prefix hits (causal over cached + new
tokens) and mixed batches all go through the same kernel; fp32, bf16 and
fp16 pools, logits and softmax in float32, the output rounded once.

Imports torch, :mod:`worker.kernels.batch` and :mod:`worker.kernels.native` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels import native
from worker.kernels.batch import Batch, PlanShape

__all__ = ["NativePlan", "plan_native", "run_native"]

# Query rows (tokens x query heads of one KV head) per prefill item: K/V are
# read once per item, so more rows mean less K/V traffic; 64 rows of Q and O
# at head_dim 128 are 64 KiB, which stays in a core's L2.
_ROWS_PER_ITEM = 64
# A decode item is split along the keys only into pieces of at least this many keys.
_SPLIT_KEYS = 512


@dataclass
class NativePlan(PlanShape):
    """What :func:`run_native` needs; the shape fields match :class:`worker.kernels.plan.AttentionPlan`.

    * ``seq_meta``: int32 ``[batch, 3]`` = (context length, first query row, query tokens).
    * ``tables``: int32 ``[batch, max_blocks]``, contiguous.
    * ``work``: int32 ``[items, 8]``; ``merges``: int32 ``[splits, 4]`` (see the C++ source).
    * ``partial``: float32 ``[partials * g * (head_dim + 2)]``, the split items' (O, m, l).
    """

    seq_meta: torch.Tensor
    tables: torch.Tensor
    work: torch.Tensor
    merges: torch.Tensor
    partial: torch.Tensor
    isa: int


def plan_native(batch: Batch, *, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                kv_dtype: torch.dtype, scale: float | None, isa: int,
                partial: torch.Tensor | None = None) -> NativePlan:
    """Plan a validated batch for the compiled kernel (:func:`worker.kernels.native.load` first).

    ``partial``: the previous plan's split buffer, reused when large enough.
    """
    if kv_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the compiled kernel handles float32, bfloat16 and float16 pools, not {kv_dtype}")
    if batch.max_block_id >= 2**31 or batch.q_start[-1] >= 2**31:
        raise ValueError("the compiled kernel indexes blocks and query rows with int32; this batch needs more")
    group = num_q_heads // num_kv_heads
    q_start = batch.q_start_t
    seq_meta = torch.stack((batch.ctx_t, q_start[:-1], q_start[1:] - q_start[:-1]), dim=1).to(torch.int32)
    rows = max(1, _ROWS_PER_ITEM // group)
    work, merges, num_partials = native.ops().plan(seq_meta, num_kv_heads, group, rows, _SPLIT_KEYS,
                                                   torch.get_num_threads())
    need = num_partials * group * (head_dim + 2)
    if partial is None or partial.numel() < need:
        partial = torch.empty(max(need, 1), dtype=torch.float32)
    return NativePlan(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        kv_dtype=kv_dtype, scale=float(scale) if scale is not None else head_dim ** -0.5,
        total_q=batch.q_start[-1], max_block_id=batch.max_block_id, seq_meta=seq_meta,
        tables=batch.tables.to(torch.int32).contiguous(), work=work, merges=merges, partial=partial, isa=isa)


def run_native(plan: NativePlan, query: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor) -> None:
    """One layer into ``out``; the caller checked shapes, dtypes and block ids against the plan."""
    native.ops().run(query.contiguous(), kv_layer, plan.tables, plan.seq_meta, plan.work, plan.merges,
                     plan.partial, plan.scale, plan.isa, out)
