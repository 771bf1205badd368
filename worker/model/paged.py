"""The bridge between a Hugging Face model's attention layers and the paged KV
pool: an attention implementation registered with transformers under
:data:`ATTN_IMPLEMENTATION`, and the per-step batch it reads.

How a step's metadata reaches the attention function: as a forward keyword
(``blockd_batch=PagedBatch(...)``). transformers passes the model's extra
forward kwargs through every decoder layer down to the attention function, so
the batch travels with the call itself: no global or thread-local state,
nothing to reset after an exception, and two runners in one process (tests,
TP ranks in threads) cannot see each other's batches. Calling the model
without it fails loudly instead of attending over a stale batch.

No mask is built: transformers only builds a dense mask for implementations
present in its ``AttentionMaskInterface``, and this one is deliberately not
registered there (causality and sequence boundaries come from the paged
kernel's per-sequence plan), so the function receives ``attention_mask=None``.
Imports torch, transformers and :mod:`worker.runtime`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from worker.runtime import PreparedStep, WorkerRuntime

ATTN_IMPLEMENTATION = "blockd_paged"
#: a batch over no pool: attention answers zeros and writes no K/V. What
#: :meth:`worker.model.compiled.CompiledDecode.warm` runs the forwards over, to
#: compile them and to time them, before any sequence exists.
NO_POOL = object()


@dataclass(frozen=True)
class PagedBatch:
    """One model step's batch, packed as one row of ``sum(query_lens)`` tokens.

    Sequence ``i``'s new tokens are the last ``query_lens[i]`` of its
    ``context_lens[i]``; ``slot_mapping`` has one physical slot per new token
    (on the CPU: the runtime checks and records slots there, so no layer waits
    on a device-to-host copy).
    """

    runtime: WorkerRuntime
    version: int
    seq_ids: list[str]
    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor
    #: the pool incarnation the step was planned against (None: not checked)
    pool_incarnation: str | None = None
    #: the batch validated and indexed once for every layer (None: each layer validates it)
    prepared: PreparedStep | None = None


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                            scaling: float | None = None, blockd_batch: PagedBatch | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """Write this layer's new K/V into the pool and attend over cached + new.

    * ``query``: ``[1, Hq_local, T, D]``; ``key``, ``value``: ``[1, Hkv_local, T, D]``
      (after RoPE), ``T = sum(query_lens)``; the pool's dtype.
    * returns ``([1, T, Hq_local, D], None)``: no attention weights.

    The runtime advances its replica to exactly ``blockd_batch.version`` and
    plans once per batch; every later layer reuses that plan.
    """
    if blockd_batch is None:
        raise RuntimeError(f"attention implementation {ATTN_IMPLEMENTATION!r} runs only inside "
                           "ModelRunner.step, which passes blockd_batch")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"the paged path packs a batch as one row; got query of shape {list(query.shape)}")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("sliding-window and soft-capped attention are not supported by the paged pool")
    out = attend(blockd_batch, module.layer_idx, query[0].transpose(0, 1).contiguous(),
                 key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous(), scaling)
    return out.unsqueeze(0), None


def attend(batch: PagedBatch | object, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float | None) -> torch.Tensor:
    """Token-major paged attention of one layer: ``query`` ``[T, Hq_local, D]``,
    ``key``, ``value`` ``[T, Hkv_local, D]`` (after RoPE); returns ``[T, Hq_local, D]``.
    The fused decoder layers (:mod:`worker.model.fused`) call this directly."""
    if batch is NO_POOL:
        return torch.zeros_like(query)
    if batch.prepared is not None:
        return batch.runtime.step_attention(batch.prepared, layer_idx, query, key, value, scaling)
    return batch.runtime.attention(
        batch.version, layer_idx, batch.seq_ids, batch.query_lens, batch.context_lens, query, key=key,
        value=value, slot_mapping=batch.slot_mapping, scale=scaling, pool_incarnation=batch.pool_incarnation)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
