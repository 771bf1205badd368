"""The baselines bench/attention.py times blockd's paged attention against, on the same K/V.

* :func:`contiguous`: the same K/V copied into contiguous ``[batch, kv_heads,
  context, D]`` tensors and torch's SDPA over them (decode: query groups folded
  into the query length, the fastest form on a CPU; prefill: K/V expanded to
  every query head, the causal mask aligned to the last keys), plus a float32
  reference output.
* :class:`VllmKernel`: vLLM's fused CPU kernel (``cpu_attention_with_kv_cache``)
  on the pool's blocks and block tables, repacked into vLLM's own cache layout
  where its kernel needs one; imported only when ``vllm`` is installed.

CPU copies live on transparent huge pages like blockd's pool
(:func:`worker.layout.empty_huge_pages`), so no side gets a TLB advantage.

All batches here are uniform: every sequence has the same context length and
the same number of new tokens (what bench/attention.py builds).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from worker.layout import as_rows, empty_huge_pages, gather_rows

__all__ = ["VllmKernel", "contiguous", "vllm_available"]


def _contiguous_kv(layer: torch.Tensor, tables: torch.Tensor, context: int):
    """K and V of every sequence as ``[batch, kv_heads, context, D]``."""
    heads = layer.shape[2]
    rows = gather_rows(tables.long()[:, None, :].to(layer.device),
                       torch.arange(heads, device=layer.device)[None, :, None], heads).reshape(-1)
    batch, head_dim = tables.shape[0], layer.shape[4]
    padded = tables.shape[1] * layer.shape[3]
    kv = []
    for i in (0, 1):  # on huge pages when on a CPU, like the pool and vLLM's caches: same TLB cost
        gathered = as_rows(layer[i]).index_select(0, rows).view(batch, heads, padded, head_dim)[:, :, :context]
        dst = empty_huge_pages(gathered.shape, layer.dtype) if layer.device.type == "cpu" else None
        kv.append(gathered.contiguous() if dst is None else dst.copy_(gathered))
    return kv[0], kv[1]


def contiguous(layer: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
               starts: torch.Tensor | None, query: torch.Tensor):
    """``(reference [total_q, Hq, D] float32, fn)``: ``fn()`` runs contiguous SDPA once."""
    batch, context = tables.shape[0], int(context_lens[0])
    k, v = _contiguous_kv(layer, tables, context)
    heads, q_heads, head_dim = k.shape[1], query.shape[1], query.shape[2]
    if starts is None:  # decode: [B, Hkv, G, D] against [B, Hkv, L, D]
        q = query.view(batch, heads, q_heads // heads, head_dim)
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).reshape(query.shape)
        return reference, lambda: F.scaled_dot_product_attention(q, k, v)
    new = query.shape[0] // batch
    q = query.view(batch, new, q_heads, head_dim).transpose(1, 2)  # [B, Hq, new, D]
    k = k.repeat_interleave(q_heads // heads, dim=1)
    v = v.repeat_interleave(q_heads // heads, dim=1)
    visible = torch.arange(context, device=k.device)[None, :] <= torch.arange(
        context - new, context, device=k.device)[:, None]
    mask = None if new == context else visible
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible)
    reference = reference.transpose(1, 2).reshape(query.shape)
    return reference, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


@functools.cache
def vllm_available() -> bool:
    try:
        from vllm import _custom_ops  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or built for another torch: no vLLM rows
        return False
    return True


class VllmKernel:
    """vLLM's CPU paged attention, planned once for a batch; :meth:`run` is one layer."""

    def __init__(self, layer: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
                 starts: torch.Tensor | None, query: torch.Tensor) -> None:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self._ops = ops
        block_size, head_dim = layer.shape[3], layer.shape[4]
        self.isa = _get_attn_isa(layer.dtype, block_size, head_dim)
        self.k_cache, self.v_cache = layer[0], layer[1]  # [N, H, b, D]: vLLM's plain layout
        if self.isa in ("amx", "vec16"):  # these kernels read their own packed layout
            self._repack(layer)
        batch = tables.shape[0]
        self.query, self.tables = query, tables.to(torch.int32)
        self.seq_lens = context_lens.to(torch.int32)
        self.qsl = (torch.arange(batch + 1) if starts is None else starts).to(torch.int32)
        self.out = torch.empty_like(query)
        self.scale = head_dim ** -0.5
        self.metadata = min((self._metadata(split, query, layer) for split in (False, True)),
                            key=self._seconds)

    def _repack(self, layer: torch.Tensor, step: int = 1024) -> None:
        ops, heads, block_size, head_dim = self._ops, layer.shape[2], layer.shape[3], layer.shape[4]
        # on huge pages, like blockd's pool, so the comparison is between kernels
        self.k_cache, self.v_cache = (empty_huge_pages(layer.shape[1:], layer.dtype) for _ in (0, 1))
        for lo in range(0, layer.shape[1], step):  # block slices bound the token-major temporaries
            hi = min(lo + step, layer.shape[1])
            tokens = [layer[i, lo:hi].permute(0, 2, 1, 3).reshape(-1, heads, head_dim) for i in (0, 1)]
            slots = torch.arange(lo * block_size, hi * block_size, dtype=torch.int64)
            ops.cpu_attn_reshape_and_cache(tokens[0], tokens[1], self.k_cache, self.v_cache, slots, self.isa)

    def _metadata(self, split: bool, query: torch.Tensor, layer: torch.Tensor):
        return self._ops.cpu_attn_get_scheduler_metadata(
            num_reqs=self.tables.shape[0], num_heads=query.shape[1], num_kv_heads=layer.shape[2],
            head_dim=layer.shape[4], seq_lens=self.seq_lens, dtype=layer.dtype, query_start_loc=self.qsl,
            causal=True, sliding_window_size=-1, isa=self.isa, enable_kv_split=split)

    def _seconds(self, metadata) -> float:
        self.metadata = metadata
        self.run()
        start = time.perf_counter()
        self.run()
        return time.perf_counter() - start

    def run(self) -> torch.Tensor:
        self._ops.cpu_attention_with_kv_cache(
            query=self.query, key_cache=self.k_cache, value_cache=self.v_cache, output=self.out,
            query_start_loc=self.qsl, seq_lens=self.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=self.tables, softcap=0.0,
            scheduler_metadata=self.metadata, s_aux=None)
        return self.out
