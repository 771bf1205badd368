"""Dense reference attention for worker tests: explicit softmax(QK^T)V, causal."""

from __future__ import annotations

import torch


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """query ``[q, Hq, D]`` for the LAST q of ``keys``/``values`` ``[T, Hkv, D]``'s
    tokens; causal; float32 math. Returns ``[q, Hq, D]`` float32."""
    q_len, num_q_heads, head_dim = query.shape
    total, num_kv_heads, _ = keys.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    k = keys.float().repeat_interleave(group, dim=1)  # [T, Hq, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,thd->hqt", query.float(), k) * scale
    positions = torch.arange(total - q_len, total).unsqueeze(1)  # [q, 1]
    mask = torch.arange(total).unsqueeze(0) > positions  # key after the query token
    scores.masked_fill_(mask.unsqueeze(0), float("-inf"))
    return torch.einsum("hqt,thd->qhd", scores.softmax(-1), v)
