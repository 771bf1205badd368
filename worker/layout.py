"""The KV pool layout of a worker shard: documented here, and only here.

One shard of a pool is ONE contiguous tensor ``kv``::

    kv: [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
         index 0 of dim 1 = K, index 1 = V

    kv[layer]            [2, num_blocks, num_kv_heads, block_size, head_dim]   one layer
    kv[layer, 0]         [num_blocks, num_kv_heads, block_size, head_dim]      its keys
    kv[layer, 0, blk, h] [block_size, head_dim]   one (block, head) "row": contiguous

Strides, in elements (row-major, contiguous): ``head_dim`` = 1,
``block_size`` = D, ``num_kv_heads`` = b*D, ``num_blocks`` = H*b*D,
K/V = N*H*b*D, layer = 2*N*H*b*D. Token slot ``s`` of the pool (see
:mod:`blockd.core.arith`) lives at block ``s // b``, offset ``s % b``; its key
for head ``h`` is ``kv[layer, 0, s // b, h, s % b, :]``.

Bytes: ``num_blocks * block_size * num_layers * 2 * num_kv_heads * head_dim *
dtype_bytes`` (:meth:`KVGeometry.pool_bytes`), the formula of the design.

Why heads sit *outside* the tokens of a block (FlashInfer's "HND", vLLM's CPU
layout) rather than the "NHD" ``[.., block_size, num_kv_heads, head_dim]``:
attention works per (sequence, KV head), and with HND the ``block_size x
head_dim`` keys of one (block, head) are one contiguous row. Viewing a layer's
K as ``[num_blocks * num_kv_heads, block_size * head_dim]``
(:func:`as_rows`), a single ``index_select`` of rows ``block * H + head``
(:func:`gather_rows`) yields ``[pairs, context, head_dim]`` blocks that a
batched matmul reads as they are. With NHD the same gather needs a transpose
copy of every gathered byte, which on a CPU costs more than the gather itself
(measured: see ``bench/attention.py``). Each block still occupies one
contiguous ``H*b*D`` span per (layer, K/V), so copy-on-write and transfers
move whole blocks.

The pool is zero-initialised: attention gathers whole blocks, so keys past a
sequence's length (masked to probability 0) must be finite, or ``0 * NaN``
would poison the output.

The host tier (a pool's ``num_host_blocks``) is a second tensor of exactly
this layout with ``num_host_blocks`` in place of ``num_blocks``
(:func:`allocate_host_pool`): a block moves between the tiers as the same
``H*b*D`` spans per (layer, K/V), so an offload and a restore are gathers and
scatters of whole rows of ``kv.view(L * 2, N, H*b*D)``, and a restored block
holds the very bytes that were offloaded. Beside a CUDA pool it is pinned
host memory (page-locked: the copies go by DMA, and may overlap compute);
beside a CPU pool, a plain tensor.

A CPU pool asks Linux for transparent huge pages (:func:`empty_huge_pages`)
before its first touch: attention jumps between blocks scattered over the
whole pool, and with 4 KiB pages nearly every block costs a TLB miss and a page
walk (measured: decode attention 10-20% faster with 2 MiB pages). Where THP is
off or not Linux, the advice is a no-op.

Imports torch (and ctypes, for ``madvise``) only. Token -> slot arithmetic is not here: it lives in
``blockd.core.arith``; this module only splits a slot back into (block, offset).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, replace

import torch

__all__ = [
    "KVGeometry",
    "allocate_host_pool",
    "allocate_kv_pool",
    "as_rows",
    "as_token_rows",
    "empty_huge_pages",
    "gather_rows",
    "split_slots",
    "token_rows",
]

@dataclass(frozen=True)
class KVGeometry:
    """Shape of one worker's pool shard (its layers and KV heads only)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVGeometry.{name} must be a positive int, got {value!r}")

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """``(num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)``."""
        return (self.num_layers, 2, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def pool_bytes(self, dtype: torch.dtype) -> int:
        """``num_blocks * block_size * num_layers * 2 * num_kv_heads * head_dim * dtype bytes``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (
            self.num_blocks * self.block_size * self.num_layers * 2
            * self.num_kv_heads * self.head_dim * itemsize
        )

    @classmethod
    def of(cls, kv: torch.Tensor) -> KVGeometry:
        """Geometry of an allocated pool ``kv`` (6-d, see the module docstring)."""
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(
                "a KV pool is [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]; "
                f"got shape {tuple(kv.shape)}"
            )
        layers, _, blocks, heads, block_size, head_dim = kv.shape
        return cls(layers, blocks, block_size, heads, head_dim)


def allocate_kv_pool(
    geometry: KVGeometry, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zeroed pool shard of shape :attr:`KVGeometry.shape` (dtype ``dtype``, on ``device``)."""
    if not dtype.is_floating_point:
        raise ValueError(f"KV pools hold floating-point keys and values, not {dtype}")
    if torch.device(device).type != "cpu":
        return torch.zeros(geometry.shape, dtype=dtype, device=device)
    return empty_huge_pages(geometry.shape, dtype).zero_()


def allocate_host_pool(geometry: KVGeometry, num_host_blocks: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The zeroed host tier of a shard whose device pool is ``geometry`` on ``device``:
    ``geometry.shape`` with ``num_host_blocks`` blocks, in host memory (pinned when
    ``device`` is CUDA). None for ``num_host_blocks == 0`` (no tier)."""
    if type(num_host_blocks) is not int or num_host_blocks < 0:
        raise ValueError(f"num_host_blocks must be an int >= 0, got {num_host_blocks!r}")
    if not num_host_blocks:
        return None
    if not dtype.is_floating_point:
        raise ValueError(f"KV pools hold floating-point keys and values, not {dtype}")
    shape = replace(geometry, num_blocks=num_host_blocks).shape
    if torch.device(device).type == "cuda":
        return torch.empty(shape, dtype=dtype, pin_memory=True).zero_()
    return empty_huge_pages(shape, dtype).zero_()


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on the CPU, its 2 MiB-aligned interior advised ``MADV_HUGEPAGE`` before first touch."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if sys.platform.startswith("linux") and end - start >= _HUGE_PAGE:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass  # only advice: 4 KiB pages work, a little slower
    return tensor


def as_rows(kv_half: torch.Tensor) -> torch.Tensor:
    """View one layer's K or V ``[N, H, b, D]`` as rows ``[N * H, b * D]`` (no copy).

    Row ``block * H + head`` holds the ``b`` keys (or values) of that block
    and head, in token order.
    """
    if kv_half.dim() != 4 or not kv_half.is_contiguous():
        raise ValueError(
            "expected one contiguous [num_blocks, num_kv_heads, block_size, head_dim] "
            f"half of a layer, got shape {tuple(kv_half.shape)} (contiguous={kv_half.is_contiguous()})"
        )
    blocks, heads, block_size, head_dim = kv_half.shape
    return kv_half.view(blocks * heads, block_size * head_dim)


def gather_rows(block_ids: torch.Tensor, heads: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Row numbers in :func:`as_rows` of (block, head): ``block * H + head``, int64.

    ``block_ids`` and ``heads`` broadcast against each other.
    """
    return block_ids.to(torch.int64) * num_kv_heads + heads.to(torch.int64)


def as_token_rows(kv_half: torch.Tensor) -> torch.Tensor:
    """View one layer's K or V ``[N, H, b, D]`` as one row per (block, head, offset): ``[N*H*b, D]``."""
    as_rows(kv_half)  # same validation
    return kv_half.view(-1, kv_half.shape[-1])


def token_rows(pair_rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows in :func:`as_token_rows` of every token of :func:`gather_rows` rows: ``[..., b]`` int64.

    Row ``block * H + head`` of :func:`as_rows` holds tokens
    ``(block * H + head) * b + offset`` for ``offset`` in ``[0, b)``.
    """
    offsets = torch.arange(block_size, dtype=torch.int64, device=pair_rows.device)
    return pair_rows.to(torch.int64)[..., None] * block_size + offsets


def split_slots(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` of physical slots: the inverse of ``block * b + offset``."""
    return torch.div(slots, block_size, rounding_mode="floor"), torch.remainder(slots, block_size)
