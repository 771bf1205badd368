"""Which device the data plane runs on, and the per-device tuning of attention.

The kernels are written once in torch; what differs between a CPU and a GPU
is only where tensors live, how much K/V one attention tile gathers
(:func:`default_tile_bytes`) and whether ``probs @ V`` may run as an
``embedding_bag`` (:func:`default_bag_rows`). Owns no state. Imports torch only; CuPy is never
needed here (torch on a CUDA device is the CUDA path).
"""

from __future__ import annotations

import torch

__all__ = ["default_bag_rows", "default_tile_bytes", "select_device"]

# A CPU tile's gathered K (and, separately, V) should stay in cache so the
# matmuls read it back from there instead of from DRAM. Measured with
# bench/attention.py (--tile-bytes) on a 2-core EPYC (1 MiB L2/core, 32 MiB L3),
# batch 32 x 4096 tokens, fp32: 1-8 MiB within 10% of each other, 4 MiB the
# fastest; 16 MiB and up 20-80% slower as tiles spill out of cache.
_CPU_TILE_BYTES = 4 << 20
# A GPU has no cache to fit; bigger tiles only mean fewer kernel launches.
_CUDA_TILE_BYTES = 512 << 20
# Up to this many query rows per (sequence, KV head), probs @ V runs as one
# embedding_bag over the pool instead of gather + bmm. Measured on the CPU
# above (batch 32 x 4096 tokens): 3x faster at 1 row, 2x at 4, 1.1x at 8,
# 0.8x at 16. On CUDA the gather + bmm path is kept (no measurement yet).
_CPU_BAG_ROWS = 8
_CUDA_BAG_ROWS = 0


def select_device(prefer: str | torch.device | None = None) -> torch.device:
    """``prefer`` when given, else CUDA device 0 when ``torch.cuda.is_available()``, else CPU.

    Raises ``ValueError`` when ``prefer`` names CUDA and no GPU is present,
    rather than failing later at the first allocation.
    """
    if prefer is not None:
        device = torch.device(prefer)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} was asked for but torch sees no CUDA GPU")
        if device.type == "cuda" and device.index is None:
            # Tensors always carry an index; compare like with like later on.
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def default_tile_bytes(device: torch.device) -> int:
    """Bytes of K gathered per attention tile on ``device`` (V gets as many again)."""
    return _CUDA_TILE_BYTES if device.type == "cuda" else _CPU_TILE_BYTES


def default_bag_rows(device: torch.device) -> int:
    """Most query rows per (sequence, KV head) for which ``probs @ V`` uses ``embedding_bag``."""
    return _CUDA_BAG_ROWS if device.type == "cuda" else _CPU_BAG_ROWS
