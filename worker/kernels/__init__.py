"""The worker's data-plane kernels (CPU, or CUDA when present).

* :func:`write_kv`, :func:`copy_blocks`, :func:`move_blocks` (:mod:`.cache_ops`): writes into
  the pool, and blocks between it and its host tier.
* :class:`PagedAttention` (:mod:`.attention`): paged decode, prefill/extend and
  mixed-batch attention, grouped-query included, with a batch validated once
  (:mod:`.batch`) and one of three backends: the compiled CPU kernel
  (:mod:`.native_attention`, built by :mod:`.native` from ``csrc/``),
  FlashInfer on CUDA (:mod:`.flashinfer_attention`), or tiled torch
  (:mod:`.attention`, planned by :mod:`.plan`), the fallback everywhere.
  :func:`paged_decode_attention` / :func:`paged_prefill_attention` plan and run once.
* :func:`select_device` (:mod:`.device`).

The pool layout they all read is documented once, in :mod:`worker.layout`.
"""

from worker.kernels.attention import PagedAttention, paged_decode_attention, paged_prefill_attention
from worker.kernels.cache_ops import copy_blocks, move_blocks, write_kv
from worker.kernels.device import default_tile_bytes, select_device

__all__ = [
    "PagedAttention",
    "copy_blocks",
    "default_tile_bytes",
    "move_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "select_device",
    "write_kv",
]
