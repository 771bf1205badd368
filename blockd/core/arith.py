"""Token -> block -> slot arithmetic: the one place that does it.

Every layer (allocator core, daemon, workers, SDK) turns token positions into
block-table entries and physical slots through these functions, so the
arithmetic cannot drift between the control plane and the data plane.

A sequence of ``T`` tokens with block size ``b`` occupies ``ceil(T / b)``
blocks. Token position ``t`` lives in logical block ``t // b`` at offset
``t % b``; its physical slot is ``table[t // b] * b + t % b``::

    block size b = 4, table = [5, 1, 7]
    position:  0 1 2 3 | 4 5 6 7 | 8 9
    block:     5 5 5 5 | 1 1 1 1 | 7 7 . .      <- 2 unused slots (tail waste)
    slot:     20 ...23 | 4 ... 7 |28 29

Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(T / b)``; 0 for T = 0."""
    return -(-num_tokens // block_size)


def tail_waste(num_tokens: int, block_size: int) -> int:
    """Unused slots in the last block of one unshared sequence: in ``[0, b)``."""
    return num_blocks_for(num_tokens, block_size) * block_size - num_tokens


def locate(block_table: Sequence[int], position: int, block_size: int) -> tuple[int, int]:
    """``(physical block, offset)`` of token ``position``.

    Raises ``IndexError`` when the position lies beyond the table.
    """
    if position < 0:
        raise IndexError(f"token position {position} is negative")
    logical, offset = divmod(position, block_size)
    if logical >= len(block_table):
        raise IndexError(
            f"token position {position} needs logical block {logical}, "
            f"but the table has {len(block_table)} blocks"
        )
    return block_table[logical], offset


def slot_at(block: int, offset: int, block_size: int) -> int:
    """Physical slot of the token at ``offset`` inside physical ``block``."""
    return block * block_size + offset


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Physical slot number of token ``position``: ``table[t // b] * b + t % b``."""
    block, offset = locate(block_table, position, block_size)
    return slot_at(block, offset, block_size)


def slot_mapping(
    block_table: Sequence[int], start: int, end: int, block_size: int
) -> list[int]:
    """Physical slots of token positions ``[start, end)``, in order."""
    if not 0 <= start <= end:
        raise IndexError(f"bad token range [{start}, {end})")
    if end > len(block_table) * block_size:
        raise IndexError(
            f"token range [{start}, {end}) runs past the table's "
            f"{len(block_table)} blocks of {block_size}"
        )
    slots: list[int] = []
    for logical in range(start // block_size, num_blocks_for(end, block_size)):
        base = block_table[logical] * block_size
        lo = max(start, logical * block_size) - logical * block_size
        hi = min(end, (logical + 1) * block_size) - logical * block_size
        slots.extend(range(base + lo, base + hi))
    return slots
