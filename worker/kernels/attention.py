"""Paged attention over a pool layer: decode, prefill/extend and mixed batches.

After FlashInfer's wrappers: :meth:`PagedAttention.plan` does the host-side
work once per batch, and :meth:`PagedAttention.run` is called once per layer
on the caller's query and the pool's layer tensor. The wrapper validates the
batch (:mod:`worker.kernels.batch`) and hands it to its backend: the compiled
CPU kernel (:mod:`worker.kernels.native_attention`), FlashInfer on CUDA
(:mod:`worker.kernels.flashinfer_attention`), or the tiled torch kernels of
this module (tiling, gather and mask indices, workspace sizing in
:mod:`worker.kernels.plan`), the fallback on every device.

How a torch tile runs (all on buffers owned by the wrapper, grown only at plan
time, so a run allocates nothing proportional to the context)::

    K tile  <- index_select(as_rows(kv_layer[0]), kv_rows)     [pairs, T, D]
    scores  <- bmm(q * scale, K^T)                            [pairs, m*g, T]  float32
    scores  += bias (causal / padding); probs <- softmax      float32
    out     <- embedding_bag(as_token_rows(kv_layer[1]),       [pairs * m*g, D]
                             bag_rows, probs)                  (few rows: decode)
            or bmm(probs, index_select(as_rows(kv_layer[1])))  [pairs, m*g, D]

One ``index_select`` per tile reads the scattered K blocks into a cache-sized
buffer that the following matmul reads back from cache, so on a CPU the paged
kernel reads each K byte from memory about once, like attention over
contiguous K/V does. For V, when a pair has few query rows, ``embedding_bag``
(a weighted sum of scattered rows; its CPU kernel prefetches them) does
gather and sum in one pass with no V tile at all: on the decode benchmark it
is 2-3x faster than gather + bmm (bench/attention.py measures the result).
Low-precision pools (bf16, fp16) are widened to float32 tile by tile, so
logits and softmax are float32. The weighted sum is float32 on the bmm path;
on the bag path the probabilities are rounded to the pool's dtype to weigh
its values (as flash attention rounds P before P @ V) and torch accumulates
in float32. The output is rounded to the query's dtype once, at the end.

Allocation: none of the wrapper's own per run, beyond ``out`` when the caller
passes none; ``embedding_bag`` returns a fresh ``[bags, D]`` result per tile
(and for bf16/fp16 builds an index map as long as the tile's bag rows), both
bounded by the tile size, never by the context.

The same code runs on CUDA tensors (with larger tiles); imports torch and the
worker's layout and plan modules only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from worker.kernels import flashinfer_attention, native
from worker.kernels.batch import check_geometry, validate_batch
from worker.kernels.device import default_bag_rows, default_tile_bytes, select_device
from worker.kernels.flashinfer_attention import FlashInferPlan, FlashInferRunner
from worker.kernels.native_attention import NativePlan, plan_native, run_native
from worker.kernels.plan import AttentionPlan, Tile, build_plan
from worker.layout import as_rows, as_token_rows

__all__ = ["PagedAttention", "paged_decode_attention", "paged_prefill_attention"]

_COMPUTE_DTYPE = torch.float32
# softmax with out=: writes probabilities into a workspace instead of allocating.
_softmax_out = torch.ops.aten._softmax.out


class _Workspace:
    """Grow-only flat buffers, one per (name, dtype); slices of them back every tile."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def reserve(self, name: str, numel: int, dtype: torch.dtype) -> None:
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.numel() < numel:
            self._buffers[(name, dtype)] = torch.empty(max(numel, 1), dtype=dtype, device=self.device)

    def take(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._buffers[(name, dtype)][:numel]

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self._buffers.values())


def _choose_backend(device: torch.device, requested: str | None) -> str:
    """``native`` / ``flashinfer`` / ``torch`` for ``device``; see :class:`PagedAttention`."""
    setting = requested if requested is not None else native.backend_setting()
    if setting not in ("auto", "native", "torch", "flashinfer"):
        raise ValueError(f"backend must be auto, native, flashinfer or torch, got {setting!r}")
    if setting == "torch":
        return "torch"
    if device.type == "cpu":
        if setting == "flashinfer":
            raise ValueError("the flashinfer backend runs on CUDA devices only")
        return "native" if native.load(required=setting == "native") else "torch"
    if device.type == "cuda" and setting in ("auto", "flashinfer"):
        if flashinfer_attention.available():
            return "flashinfer"
        if setting == "flashinfer":
            raise ValueError("the flashinfer backend needs the flashinfer-python package (extra 'flashinfer')")
        return "torch"
    raise ValueError(f"the {setting} backend does not run on {device.type} devices")


class PagedAttention:
    """Attention of query tokens against their sequences' paged K/V, one layer per :meth:`run`.

    Handles decode (one query token per sequence), prefill and chunked
    prefill / prefix-cache hits (several new tokens, causal over cached + new
    tokens) and mixed batches of both, with grouped- and multi-query attention
    (``num_q_heads`` a multiple of ``num_kv_heads``).

    Backends (``backend``, else ``$BLOCKD_ATTENTION_BACKEND``, default ``auto``):
    ``native``, the compiled CPU kernel (:mod:`worker.kernels.native_attention`,
    chosen by ``auto`` on a CPU whenever it builds); ``flashinfer``, FlashInfer's
    paged wrappers (chosen by ``auto`` on CUDA when installed; float32 pools and
    unusual head sizes fall back to torch per plan); ``torch``, the tiled torch
    kernels of this module (everywhere, and the fallback).
    """

    def __init__(self, device: torch.device | str | None = None, tile_bytes: int | None = None,
                 bag_rows: int | None = None, backend: str | None = None) -> None:
        """``device``: see :func:`select_device`; ``tile_bytes`` / ``bag_rows``: tuning of the
        torch kernels (defaults per device in :mod:`worker.kernels.device`; ``bag_rows=0``
        never uses ``embedding_bag``); ``backend``: ``auto`` / ``native`` / ``flashinfer`` /
        ``torch`` (``native`` raises :class:`worker.kernels.native.KernelUnavailable` when the
        kernel cannot be built)."""
        self.device = select_device(device)
        self.backend = _choose_backend(self.device, backend)
        self.isa = native.isa_setting()
        self.tile_bytes = tile_bytes if tile_bytes is not None else default_tile_bytes(self.device)
        self.bag_rows = bag_rows if bag_rows is not None else default_bag_rows(self.device)
        self._workspace = _Workspace(self.device)
        self._flashinfer = FlashInferRunner(self.device) if self.backend == "flashinfer" else None
        self._plan: AttentionPlan | NativePlan | FlashInferPlan | None = None

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the tile and query buffers this wrapper holds (they only grow, at plan time)."""
        return self._workspace.nbytes

    @property
    def plan_info(self) -> AttentionPlan | NativePlan | FlashInferPlan:
        """The current plan (for the torch backend: tiles and index tensors), for inspection and tests."""
        if self._plan is None:
            raise ValueError("PagedAttention.run/plan_info called before plan()")
        return self._plan

    def plan(self, block_tables: torch.Tensor, context_lens: torch.Tensor,
             query_start_loc: torch.Tensor | None = None, *, num_q_heads: int, num_kv_heads: int,
             head_dim: int, block_size: int, kv_dtype: torch.dtype, scale: float | None = None) -> None:
        """Plan one batch; valid for every layer until the next ``plan``.

        * ``block_tables``: int32/int64 ``[batch, max_blocks]``, physical block
          ids in logical order; entries past a sequence's blocks are ignored.
        * ``context_lens``: int32/int64 ``[batch]``, cached + new tokens per sequence.
        * ``query_start_loc``: int32/int64 ``[batch + 1]``, sequence ``i``'s query
          tokens are rows ``query_start_loc[i] : query_start_loc[i + 1]`` of the
          query and are the *last* tokens of its context. ``None`` = decode
          (one query token per sequence).
        * ``scale``: logit scale, default ``head_dim ** -0.5``.

        Raises ``ValueError`` naming the offending sequence for an inconsistent batch.
        """
        shape: dict[str, Any] = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                 "block_size": block_size, "kv_dtype": kv_dtype}
        check_geometry(**shape)
        batch = validate_batch(block_tables, context_lens, query_start_loc, block_size)
        if self.backend == "native":
            previous = self._plan.partial if isinstance(self._plan, NativePlan) else None
            self._plan = plan_native(batch, **shape, scale=scale, isa=self.isa, partial=previous)
            return
        if self._flashinfer is not None and flashinfer_attention.supports(kv_dtype, head_dim):
            self._plan = self._flashinfer.plan(batch, **shape, scale=scale)
            return
        plan = build_plan(batch, **shape, scale=scale, device=self.device, tile_bytes=self.tile_bytes,
                          max_bag_rows=self.bag_rows)
        ws, rows = self._workspace, plan.total_q * num_q_heads * head_dim
        ws.reserve("k", plan.max_kv_elems, kv_dtype)
        ws.reserve("v", plan.max_v_elems, kv_dtype)
        ws.reserve("scores", plan.max_score_elems, _COMPUTE_DTYPE)
        ws.reserve("probs", plan.max_score_elems, _COMPUTE_DTYPE)
        ws.reserve("q", rows, _COMPUTE_DTYPE)
        ws.reserve("o", rows, _COMPUTE_DTYPE)
        if kv_dtype != _COMPUTE_DTYPE:  # widened tiles; native-width q/out rows and bag weights
            ws.reserve("k_wide", plan.max_kv_elems, _COMPUTE_DTYPE)
            ws.reserve("v_wide", plan.max_v_elems, _COMPUTE_DTYPE)
            ws.reserve("native_rows", rows, kv_dtype)
            ws.reserve("probs_native", plan.max_score_elems, kv_dtype)
        self._plan = plan

    def run(self, query: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output for one layer.

        * ``query``: ``[total_q, num_q_heads, head_dim]``, the pool's dtype (fp32/bf16/fp16).
        * ``kv_layer``: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``,
          contiguous (``pool[layer]`` of :mod:`worker.layout`).
        * ``out``: optional contiguous ``[total_q, num_q_heads, head_dim]`` of ``query.dtype``.

        Returns ``out`` (or a new tensor): ``[total_q, num_q_heads, head_dim]``, ``query.dtype``.
        """
        plan = self.plan_info
        self._check_run(plan, query, kv_layer, out)
        if out is None:  # contiguous whatever the query's strides (both kernels write rows)
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if plan.total_q == 0:
            return out
        if isinstance(plan, NativePlan):
            run_native(plan, query, kv_layer, out)
            return out
        if isinstance(plan, FlashInferPlan):
            FlashInferRunner.run(plan, query, kv_layer, out)
            return out
        ws, group_width = self._workspace, plan.group_size * plan.head_dim
        rows = plan.total_q * plan.num_kv_heads
        q = self._gather_queries(plan, query, rows * group_width)
        o = ws.take("o", rows * group_width, _COMPUTE_DTYPE)
        k_rows, v_rows, v_tokens = as_rows(kv_layer[0]), as_rows(kv_layer[1]), as_token_rows(kv_layer[1])
        for tile in plan.tiles:
            probs, o_tile = self._attention_weights(plan, tile, q, o, k_rows)
            if tile.bag_offset >= 0:
                self._weigh_values_by_bag(plan, tile, probs, o_tile, v_tokens)
            else:
                idx = plan.kv_rows[tile.kv_offset: tile.kv_offset + tile.num_pairs * tile.num_blocks]
                v_tile = self._gather(v_rows, idx, "v", tile.num_pairs, probs.shape[2], plan.head_dim)
                torch.bmm(probs, v_tile, out=o_tile)
        # Tile order back to token order, straight into the caller's buffer.
        out_rows = out.view(rows, group_width)
        if out.dtype == _COMPUTE_DTYPE:
            torch.index_select(o.view(rows, group_width), 0, plan.inverse_q_rows, out=out_rows)
        else:
            native = ws.take("native_rows", rows * group_width, out.dtype).view(rows, group_width)
            native.copy_(o.view(rows, group_width))
            torch.index_select(native, 0, plan.inverse_q_rows, out=out_rows)
        return out

    def _gather_queries(self, plan: AttentionPlan, query: torch.Tensor, numel: int) -> torch.Tensor:
        """Scaled float32 queries in tile order: ``[total_q * Hkv * g * D]`` (flat)."""
        ws, width = self._workspace, plan.group_size * plan.head_dim
        q_rows_view = query.reshape(-1, width)  # row = token * Hkv + kv_head
        q = ws.take("q", numel, _COMPUTE_DTYPE)
        if query.dtype == _COMPUTE_DTYPE:
            torch.index_select(q_rows_view, 0, plan.q_rows, out=q.view(-1, width))
        else:
            native = ws.take("native_rows", numel, query.dtype)
            torch.index_select(q_rows_view, 0, plan.q_rows, out=native.view(-1, width))
            q.copy_(native)
        return q.mul_(plan.scale)

    def _attention_weights(self, plan: AttentionPlan, tile: Tile, q: torch.Tensor, o: torch.Tensor,
                           k_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K, scores, mask, softmax: ``(probs [pairs, m*g, T], o_tile [pairs, m*g, D])``."""
        pairs, keys, d = tile.num_pairs, tile.num_blocks * plan.block_size, plan.head_dim
        q_height = tile.q_rows * plan.group_size
        idx = plan.kv_rows[tile.kv_offset: tile.kv_offset + pairs * tile.num_blocks]
        q_off = tile.q_offset * plan.group_size * d
        q_tile = q[q_off: q_off + pairs * q_height * d].view(pairs, q_height, d)
        o_tile = o[q_off: q_off + pairs * q_height * d].view(pairs, q_height, d)
        scores = self._workspace.take("scores", pairs * q_height * keys, _COMPUTE_DTYPE)
        scores = scores.view(pairs, q_height, keys)
        torch.bmm(q_tile, self._gather(k_rows, idx, "k", pairs, keys, d).transpose(1, 2), out=scores)
        if tile.bias_offset >= 0:
            n_seq, m = tile.num_seqs, tile.q_rows
            bias = plan.bias[tile.bias_offset: tile.bias_offset + n_seq * m * keys]
            scores.view(n_seq, tile.num_heads, m, plan.group_size, keys).add_(bias.view(n_seq, 1, m, 1, keys))
        probs = self._workspace.take("probs", scores.numel(), _COMPUTE_DTYPE).view(scores.shape)
        _softmax_out(scores, -1, False, out=probs)
        return probs, o_tile

    def _weigh_values_by_bag(self, plan: AttentionPlan, tile: Tile, probs: torch.Tensor,
                             o_tile: torch.Tensor, v_tokens: torch.Tensor) -> None:
        """``o_tile = probs @ V`` as one ``embedding_bag`` over the pool's value rows (no V tile).

        Each (pair, query row) is a bag of the pair's ``T`` value rows weighted
        by its probabilities; a bf16/fp16 pool needs the weights in its dtype.
        """
        bags, keys = o_tile.shape[0] * o_tile.shape[1], probs.shape[2]
        rows = plan.bag_rows[tile.bag_offset: tile.bag_offset + bags * keys]
        starts = plan.bag_starts[tile.bag_starts_offset: tile.bag_starts_offset + bags]
        weights = probs.view(-1)
        if v_tokens.dtype != _COMPUTE_DTYPE:
            weights = self._workspace.take("probs_native", weights.numel(), v_tokens.dtype).copy_(weights)
        summed = F.embedding_bag(rows, v_tokens, starts, mode="sum", per_sample_weights=weights)
        o_tile.copy_(summed.view(o_tile.shape))

    def _gather(self, src_rows: torch.Tensor, idx: torch.Tensor, name: str, pairs: int, keys: int,
                head_dim: int) -> torch.Tensor:
        """Rows ``idx`` of a layer half into the tile buffer, widened to float32: ``[pairs, keys, D]``."""
        numel = pairs * keys * head_dim
        native = self._workspace.take(name, numel, src_rows.dtype)
        torch.index_select(src_rows, 0, idx, out=native.view(idx.numel(), src_rows.shape[1]))
        if src_rows.dtype == _COMPUTE_DTYPE:
            return native.view(pairs, keys, head_dim)
        wide = self._workspace.take(name + "_wide", numel, _COMPUTE_DTYPE)
        return wide.copy_(native).view(pairs, keys, head_dim)

    def _check_run(self, plan: AttentionPlan | NativePlan | FlashInferPlan, query: torch.Tensor,
                   kv_layer: torch.Tensor, out: torch.Tensor | None) -> None:
        want_q = (plan.total_q, plan.num_q_heads, plan.head_dim)
        if tuple(query.shape) != want_q or query.dtype != plan.kv_dtype:
            raise ValueError(f"query must be {list(want_q)} of {plan.kv_dtype} (as planned); "
                             f"got {list(query.shape)} of {query.dtype}")
        if kv_layer.dim() != 5 or kv_layer.shape[0] != 2 or tuple(kv_layer.shape[2:]) != (
                plan.num_kv_heads, plan.block_size, plan.head_dim):
            raise ValueError("kv_layer must be [2, num_blocks, num_kv_heads, block_size, head_dim] = "
                             f"[2, N, {plan.num_kv_heads}, {plan.block_size}, {plan.head_dim}]; "
                             f"got {list(kv_layer.shape)}")
        if kv_layer.dtype != plan.kv_dtype or not kv_layer.is_contiguous():
            raise ValueError(f"kv_layer must be contiguous {plan.kv_dtype}, got {kv_layer.dtype} "
                             f"(contiguous={kv_layer.is_contiguous()})")
        if plan.max_block_id >= kv_layer.shape[1]:
            raise ValueError(f"block tables name block {plan.max_block_id}, but the layer has "
                             f"{kv_layer.shape[1]} blocks")
        for name, tensor in (("query", query), ("kv_layer", kv_layer), ("out", out)):
            if tensor is not None and tensor.device != self.device:
                raise ValueError(f"{name} is on {tensor.device}; this wrapper was planned for {self.device}")
        if out is not None and (out.shape != query.shape or out.dtype != query.dtype
                                or not out.is_contiguous()):
            raise ValueError(f"out must be contiguous {list(want_q)} of {query.dtype}")


def paged_decode_attention(query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One-shot decode (plans and runs once): ``query`` ``[batch, Hq, D]`` -> ``[batch, Hq, D]``.

    ``kv_layer`` ``[2, N, Hkv, b, D]``; ``block_tables`` int ``[batch, max_blocks]``;
    ``context_lens`` int ``[batch]``. For many layers, keep a :class:`PagedAttention`.
    """
    return paged_prefill_attention(query, kv_layer, None, block_tables, context_lens, scale)


def paged_prefill_attention(query: torch.Tensor, kv_layer: torch.Tensor,
                            query_start_loc: torch.Tensor | None, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One-shot varlen prefill/extend: ``query`` ``[total_q, Hq, D]`` -> ``[total_q, Hq, D]``.

    ``query_start_loc`` int ``[batch + 1]`` (``None`` = decode); the rest as
    :meth:`PagedAttention.plan`.
    """
    if query.dim() != 3 or kv_layer.dim() != 5:
        raise ValueError(f"query must be [total_q, Hq, D] and kv_layer [2, N, Hkv, b, D]; "
                         f"got {list(query.shape)} and {list(kv_layer.shape)}")
    wrapper = PagedAttention(device=query.device)
    wrapper.plan(block_tables, context_lens, query_start_loc, num_q_heads=query.shape[1],
                 num_kv_heads=kv_layer.shape[2], head_dim=kv_layer.shape[4],
                 block_size=kv_layer.shape[3], kv_dtype=kv_layer.dtype, scale=scale)
    return wrapper.run(query, kv_layer)
