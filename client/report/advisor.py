"""The block-size advisor: which block size holds observed sequences in the fewest bytes.

Pure functions over plain numbers (no I/O, no plotting), so a test can check
the recommendation against a brute-force sweep.

The cost it minimises, for block size ``b`` over the observed sequence
lengths ``T`` (prompt + output tokens of each sequence at its longest)::

    bytes(b) = mean over T of  ceil(T/b) * b * kv_bytes_per_slot      (KV memory of its blocks)
                             + ceil(T/b)     * table_bytes_per_block  (its block-table entries)

``ceil(T/b) * b - T`` of those slots are the tail waste (the seed's bound:
0 to ``b - 1`` per sequence). ``kv_bytes_per_slot`` comes from the model:
``layers * 2 (K and V) * KV heads * head dim * dtype bytes``.
``table_bytes_per_block``: one int32 block id per block in every copy of a
sequence's table, the daemon's and each worker's mirror
(:func:`table_bytes_per_block`). Smaller blocks waste fewer tail slots but
need more table entries; with a real model's KV (tens of KiB per slot) the
tail dominates and the smallest candidate wins, with a tiny one the table
can tip it. Ties go to the larger block (fewer blocks per step for the
daemon and the kernels at the same memory).

What this cost leaves out is said in the panel: kernel speed per block size
and prefix-cache granularity (only full blocks are shared, which also
favours small blocks) are not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from blockd.core.arith import num_blocks_for, tail_waste

#: the block sizes the panel compares: multiples of 8 up to 128, what paged
#: kernels (FlashInfer, vLLM's) are built and tuned for
CANDIDATES = (8, 16, 32, 64, 128)
#: a block id in a table, as the workers' mirrors and the attention kernels hold it
TABLE_ENTRY_BYTES = 4


def table_bytes_per_block(num_workers: int) -> int:
    """Table bytes one block costs: its id in the daemon's copy and in each worker's mirror."""
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, not {num_workers}")
    return TABLE_ENTRY_BYTES * (1 + num_workers)


@dataclass(frozen=True)
class SizeCost:
    """The expected cost of one block size, per sequence (means over the observed lengths)."""

    block_size: int
    blocks: float
    tail_waste_slots: float
    kv_bytes: float
    tail_waste_bytes: float
    table_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.kv_bytes + self.table_bytes


@dataclass(frozen=True)
class Advice:
    costs: tuple[SizeCost, ...]
    recommended: SizeCost
    #: why, in a sentence or two a person reads under the table
    reason: str
    kv_bytes_per_slot: int
    table_bytes_per_block: int
    num_sequences: int


def size_cost(lengths: Sequence[int], block_size: int, kv_bytes_per_slot: int, table_bytes: int) -> SizeCost:
    """The cost of ``block_size`` (see the module docstring) over ``lengths``."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, not {block_size}")
    if not lengths:
        raise ValueError("no sequence lengths to advise on")
    n = len(lengths)
    blocks = sum(num_blocks_for(t, block_size) for t in lengths) / n
    waste = sum(tail_waste(t, block_size) for t in lengths) / n
    return SizeCost(block_size, blocks, waste, blocks * block_size * kv_bytes_per_slot,
                    waste * kv_bytes_per_slot, blocks * table_bytes)


def advise(lengths: Sequence[int], kv_bytes_per_slot: int, table_bytes: int,
           candidates: Sequence[int] = CANDIDATES) -> Advice:
    """Each candidate's cost over ``lengths`` and the one with the fewest bytes per sequence."""
    if kv_bytes_per_slot < 1 or table_bytes < 0:
        raise ValueError("kv_bytes_per_slot must be >= 1 and table_bytes >= 0")
    if not candidates:
        raise ValueError("no candidate block sizes")
    costs = tuple(size_cost(lengths, b, kv_bytes_per_slot, table_bytes) for b in sorted(set(candidates)))
    best = min(costs, key=lambda c: (c.total_bytes, -c.block_size))
    return Advice(costs, best, _reason(costs, best, kv_bytes_per_slot, table_bytes), kv_bytes_per_slot,
                  table_bytes, len(lengths))


def _reason(costs: tuple[SizeCost, ...], best: SizeCost, kv_bytes_per_slot: int, table_bytes: int) -> str:
    others = [c for c in costs if c is not best]
    text = (f"block size {best.block_size}: {_size(best.total_bytes)} per sequence, the least of the candidates "
            f"(tail waste {best.tail_waste_slots:.1f} slots = {_size(best.tail_waste_bytes)}, "
            f"table {_size(best.table_bytes)}).")
    if others:
        nearest = min(others, key=lambda c: c.total_bytes)
        extra = nearest.total_bytes / best.total_bytes - 1
        text += (f" The next best, {nearest.block_size}, holds {extra:.1%} more"
                 f" ({_size(nearest.total_bytes - best.total_bytes)} per sequence).")
    if table_bytes * 8 < kv_bytes_per_slot:
        text += (f" A slot's KV ({_size(kv_bytes_per_slot)}) outweighs a block's table entries "
                 f"({table_bytes} B), so tail waste decides.")
    else:
        text += " The table entries weigh as much as several slots' KV here, so they push towards larger blocks."
    return text


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"
