"""Which device the data plane runs on, and how big its attention tiles are.

The kernels are written once in torch; what differs between a CPU and a GPU
is only where tensors live and how much K/V one attention tile gathers
(:func:`default_tile_bytes`). Owns no state. Imports torch only; CuPy is never
needed here (torch on a CUDA device is the CUDA path).
"""

from __future__ import annotations

import torch

__all__ = ["select_device", "default_tile_bytes"]

# A CPU tile's gathered K (and, separately, V) should stay in the last-level
# cache so the matmuls read it from there instead of from DRAM: 4 MiB each
# leaves room for both plus scores in a 16-32 MiB L3 (bench/attention.py
# measured 2-16 MiB; 4 MiB was the knee on a 2-core EPYC with 32 MiB L3).
_CPU_TILE_BYTES = 4 << 20
# A GPU has no cache to fit; bigger tiles only mean fewer kernel launches.
_CUDA_TILE_BYTES = 512 << 20


def select_device(prefer: str | torch.device | None = None) -> torch.device:
    """``prefer`` when given, else CUDA device 0 when ``torch.cuda.is_available()``, else CPU.

    Raises ``ValueError`` when ``prefer`` names CUDA and no GPU is present,
    rather than failing later at the first allocation.
    """
    if prefer is not None:
        device = torch.device(prefer)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} was asked for but torch sees no CUDA GPU")
        return device
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def default_tile_bytes(device: torch.device) -> int:
    """Bytes of K gathered per attention tile on ``device`` (V gets as many again)."""
    return _CUDA_TILE_BYTES if device.type == "cuda" else _CPU_TILE_BYTES
