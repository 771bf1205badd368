"""Validation of one attention batch, shared by every backend's ``plan``.

A batch is ``block_tables`` ``[batch, max_blocks]``, ``context_lens``
``[batch]`` (cached + new tokens) and ``query_start_loc`` ``[batch + 1]``
(``None`` = decode, one query token each); sequence ``i``'s query tokens are
the last ``q_len[i]`` of its ``ctx[i]`` tokens. :func:`validate_batch` checks
it once, vectorised (it runs once per scheduler step, so it must stay well
under a millisecond for a few dozen sequences), and returns it on the CPU.
Errors are ``ValueError`` naming the first offending sequence.

Imports torch and :mod:`blockd.core.arith` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockd.core.arith import num_blocks_for

__all__ = ["Batch", "PlanShape", "check_geometry", "validate_batch"]


@dataclass
class Batch:
    """A validated batch, on the CPU."""

    tables: torch.Tensor  # int64 [B, M]
    ctx: list[int]
    q_start: list[int]  # [B + 1]
    q_len: list[int]
    max_block_id: int  # largest block id any sequence uses; -1 when none
    ctx_t: torch.Tensor  # int64 [B]
    q_start_t: torch.Tensor  # int64 [B + 1]


def check_geometry(*, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   kv_dtype: torch.dtype) -> None:
    """Positive ints, a floating-point pool, and whole query groups per KV head."""
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("block_size", block_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not kv_dtype.is_floating_point:
        raise ValueError(f"kv_dtype must be a floating-point dtype (float32, bfloat16, float16), got {kv_dtype}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def _as_cpu_int64(name: str, value: torch.Tensor, dims: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-d integer tensor, got {getattr(value, 'shape', value)!r}")
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers (int32/int64), got {value.dtype}")
    return value.detach().to("cpu", torch.int64)


def _explain(i: int, ctx: int, q_len: int, width: int, block_size: int) -> str:
    """The message for sequence ``i``, known to break one of the rules below."""
    if ctx < 0:
        return f"sequence {i}: context_lens must be >= 0, got {ctx}"
    if q_len < 0:
        return f"query_start_loc must not decrease (sequence {i} has {q_len} query tokens)"
    if q_len > ctx:
        return (f"sequence {i}: context_lens ({ctx}) counts cached + new tokens, so it must be "
                f">= its {q_len} query tokens")
    return f"sequence {i}: {ctx} tokens need {num_blocks_for(ctx, block_size)} blocks, table has {width}"


def validate_batch(block_tables: torch.Tensor, context_lens: torch.Tensor,
                   query_start_loc: torch.Tensor | None, block_size: int) -> Batch:
    """Check the batch (see the module docstring); table entries past a sequence's blocks are ignored."""
    tables = _as_cpu_int64("block_tables", block_tables, 2)
    ctx_t = _as_cpu_int64("context_lens", context_lens, 1)
    batch, width = tables.shape
    if ctx_t.shape[0] != batch:
        raise ValueError(f"context_lens has {ctx_t.shape[0]} entries for {batch} block tables")
    if query_start_loc is None:  # decode: one query token per sequence
        qsl = torch.arange(batch + 1, dtype=torch.int64)
    else:
        qsl = _as_cpu_int64("query_start_loc", query_start_loc, 1)
        if qsl.shape[0] != batch + 1 or qsl[0] != 0:
            raise ValueError(f"query_start_loc must be [batch + 1] = [{batch + 1}] starting at 0, got {qsl.tolist()}")
    q_len_t = qsl[1:] - qsl[:-1]
    needed = torch.div(ctx_t + (block_size - 1), block_size, rounding_mode="floor")
    bad = (ctx_t < 0) | (q_len_t < 0) | (q_len_t > ctx_t) | (needed > width)
    ctx, q_start, q_len = ctx_t.tolist(), qsl.tolist(), q_len_t.tolist()
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(_explain(i, ctx[i], q_len[i], width, block_size))
    in_use = torch.arange(width)[None, :] < needed[:, None]
    used = torch.where(in_use, tables, 0)
    if batch and width and int(used.min()) < 0:
        i = int((used < 0).any(dim=1).nonzero()[0])
        raise ValueError(f"sequence {i}: negative block id among its first {int(needed[i])} table entries")
    max_block_id = int(torch.where(in_use, tables, -1).max()) if batch and width else -1
    return Batch(tables, ctx, q_start, q_len, max_block_id, ctx_t, qsl)


@dataclass
class PlanShape:
    """What every attention plan (tiled torch, native, FlashInfer) was made
    for; :meth:`worker.kernels.attention.PagedAttention.run` checks each
    layer's tensors against it."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: torch.dtype
    scale: float
    total_q: int
    max_block_id: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads
