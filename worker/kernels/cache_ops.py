"""Writes into the KV pool: ``write_kv`` (new tokens' K/V into their slots),
``copy_blocks`` (copy-on-write of whole blocks) and ``move_blocks`` (whole
blocks between the device pool and its host tier: offload and restore).

Both take the pool of :mod:`worker.layout` (or one layer of it) and change it in
place; neither allocates anything proportional to the pool. Slots come from
the control plane's slot mappings (``blockd.core.arith``); this module only
splits them into (block, offset) via :func:`worker.layout.split_slots`.
Imports torch and :mod:`worker.layout` only.
"""

from __future__ import annotations

import torch

from worker.layout import split_slots

__all__ = ["copy_blocks", "move_blocks", "write_kv"]


def write_kv(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's key and value in its slot; negative slots are padding, skipped.

    * ``kv``: one layer ``[2, N, H, b, D]``, or the whole pool ``[L, 2, N, H, b, D]``.
    * ``key``, ``value``: ``[num_tokens, H, D]`` for a layer, ``[L, num_tokens, H, D]``
      for the pool; ``kv.dtype``.
    * ``slot_mapping``: int32/int64 ``[num_tokens]``, physical slot
      ``block * b + offset`` of each token, or negative for a padding token.

    Slots must be distinct (blockd never hands one slot to two tokens); with
    duplicates, which write lands is unspecified.
    """
    per_layer = kv.dim() == 5
    _check_write(kv, key, value, slot_mapping, per_layer)
    half = kv[0] if per_layer else kv[:, 0]  # [N, H, b, D] or [L, N, H, b, D]
    token_dim = 0 if per_layer else 1
    slots = slot_mapping.to(device=kv.device, dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        kept = keep.nonzero()[:, 0]
        slots = slots[kept]
        key, value = key.index_select(token_dim, kept), value.index_select(token_dim, kept)
    if slots.numel() == 0:
        return
    num_slots = half.shape[-4] * half.shape[-2]
    if int(slots.max()) >= num_slots:
        raise ValueError(f"slot {int(slots.max())} is past the pool's {num_slots} slots "
                         f"({half.shape[-4]} blocks of {half.shape[-2]})")
    block, offset = split_slots(slots, half.shape[-2])
    if per_layer:
        # Advanced indices around a slice put the token dim first: [T, H, D], as key is.
        kv[0][block, :, offset] = key
        kv[1][block, :, offset] = value
    else:
        # [L, N, H, b, D][:, block, :, offset] -> [T, L, H, D]; key is [L, T, H, D].
        kv[:, 0][:, block, :, offset] = key.transpose(0, token_dim)
        kv[:, 1][:, block, :, offset] = value.transpose(0, token_dim)


def _check_write(kv, key, value, slot_mapping, per_layer: bool) -> None:
    if kv.dim() not in (5, 6) or kv.shape[-5] != 2:
        raise ValueError("kv must be a layer [2, N, H, b, D] or a pool [L, 2, N, H, b, D]; "
                         f"got {list(kv.shape)}")
    heads, head_dim = kv.shape[-3], kv.shape[-1]
    want = [heads, head_dim] if per_layer else [kv.shape[0], heads, head_dim]
    for name, tensor in (("key", key), ("value", value)):
        shape = list(tensor.shape)
        got = shape[1:] if per_layer else [shape[0], *shape[2:]] if len(shape) == 4 else None
        if tensor.dim() != len(want) + 1 or got != want:
            layout = "[num_tokens, H, D]" if per_layer else "[L, num_tokens, H, D]"
            raise ValueError(f"{name} must be {layout} with H={heads}, D={head_dim}"
                             f"{'' if per_layer else f', L={kv.shape[0]}'}; got {shape}")
        if tensor.dtype != kv.dtype:
            raise ValueError(f"{name} is {tensor.dtype} but the pool holds {kv.dtype}; cast it first")
    if key.shape != value.shape:
        raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} differ in shape")
    num_tokens = key.shape[0] if per_layer else key.shape[1]
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must be [num_tokens] = [{num_tokens}], got {list(slot_mapping.shape)}")
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise ValueError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")


def copy_blocks(kv: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole blocks ``src -> dst`` in every layer, K and V (copy-on-write).

    * ``kv``: the pool ``[L, 2, N, H, b, D]`` (or one layer ``[2, N, H, b, D]``).
    * ``pairs``: int32/int64 ``[n, 2]`` rows of ``(src_block, dst_block)``.

    All sources are read before any destination is written, so a block that
    is both a destination and a later source yields its *old* contents.
    Destinations must be distinct.
    """
    if kv.dim() not in (5, 6) or kv.shape[-5] != 2 or not kv.is_contiguous():
        raise ValueError(f"kv must be a contiguous pool [L, 2, N, H, b, D] or layer; got {list(kv.shape)}")
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype.is_floating_point:
        raise ValueError(f"pairs must be an integer [n, 2] tensor of (src, dst), got {list(pairs.shape)} "
                         f"of {pairs.dtype}")
    if pairs.shape[0] == 0:
        return
    pairs = pairs.to(device=kv.device, dtype=torch.int64)
    num_blocks = kv.shape[-4]
    low, high = int(pairs.min()), int(pairs.max())
    if low < 0 or high >= num_blocks:
        raise ValueError(f"block ids must be in [0, {num_blocks}), got ids from {low} to {high}")
    src, dst = pairs[:, 0], pairs[:, 1]
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError("copy_blocks destinations must be distinct: two copies into one block")
    # Every (layer, K/V) slab is [N, H*b*D] with one block per row.
    block_elems = kv.shape[-3] * kv.shape[-2] * kv.shape[-1]
    slabs = kv.view(-1, num_blocks, block_elems)
    slabs.index_copy_(1, dst, slabs.index_select(1, src))


def move_blocks(src: torch.Tensor, dst: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    """Copy whole blocks ``src_blocks[i]`` of pool ``src`` to ``dst_blocks[i]`` of
    pool ``dst``, every layer, K and V: an offload (device pool -> host tier) or a
    restore (host tier -> device pool), as one gather and one scatter.

    * ``src``, ``dst``: contiguous pools ``[L, 2, N, H, b, D]`` that differ only
      in ``N`` (:func:`worker.layout.allocate_host_pool`), of one dtype, on any
      devices (the gathered blocks cross once).
    * ``src_blocks``, ``dst_blocks``: integer ``[n]``; destinations distinct.

    The bytes are copied as they are, so a block moved there and back is equal
    bit for bit.
    """
    for name, kv in (("src", src), ("dst", dst)):
        if kv.dim() != 6 or kv.shape[1] != 2 or not kv.is_contiguous():
            raise ValueError(f"{name} must be a contiguous pool [L, 2, N, H, b, D]; got {list(kv.shape)}")
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:] or src.dtype != dst.dtype:
        raise ValueError(f"pools {list(src.shape)} {src.dtype} and {list(dst.shape)} {dst.dtype} differ in more "
                         "than their number of blocks")
    ids = []
    for name, given, kv in (("src_blocks", src_blocks, src), ("dst_blocks", dst_blocks, dst)):
        if given.dim() != 1 or given.dtype.is_floating_point or given.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer [n] tensor, got {list(given.shape)} of {given.dtype}")
        blocks = given.to(torch.int64)
        if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= kv.shape[2]):
            raise ValueError(f"{name} must be in [0, {kv.shape[2]}), got ids from {int(blocks.min())} to "
                             f"{int(blocks.max())}")
        ids.append(blocks)
    src_ids, dst_ids = ids
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"{src_ids.numel()} source blocks but {dst_ids.numel()} destinations")
    if torch.unique(dst_ids).numel() != dst_ids.numel():
        raise ValueError("move_blocks destinations must be distinct: two blocks into one")
    if not src_ids.numel():
        return
    block_elems = src.shape[3] * src.shape[4] * src.shape[5]
    gathered = src.view(-1, src.shape[2], block_elems).index_select(1, src_ids.to(src.device))
    dst.view(-1, dst.shape[2], block_elems).index_copy_(1, dst_ids.to(dst.device), gathered.to(dst.device))
