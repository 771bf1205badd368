"""Which slots of a worker's KV shard hold K/V written in its current incarnation.

A worker never answers over KV it cannot vouch for: after a restart its pool is
zeros, and after its replica moves to a new pool incarnation the memory holds
the old pool's data under the new pool's block ids. So the runtime records,
per layer, every slot that ``write_kv`` stored, carries the record along with
``copy_blocks`` and with the host tier's offloads and restores, and clears it
when the pool incarnation changes; attention
whose context reaches a slot not recorded is refused
(:class:`~blockd.core.incarnations.KVNotWritten`) instead of computed.

Kept as a bitmap ``[layers, blocks, block_size]`` (one byte per slot and
layer: next to ``2 * heads * head_dim`` elements of KV, noise) plus, per layer
and block, the number of *leading* slots written, so the check of a batch is
one gather over the blocks it reads (vectorised, on the CPU: no device sync)::

    block 7, block_size 4:  written  1 1 0 1   -> leading 2
    a sequence whose context ends 3 slots into block 7 needs leading >= 3: refused

The host tier's blocks have rows of their own after the device blocks (host
block ``h`` is row ``num_blocks + h``): an offload copies a device block's row
to its host row and a restore copies it back, so a restored block is written
exactly where its offloaded source was, and a host block nothing was offloaded
to restores as unwritten (refused, never answered over).

Imports torch and :mod:`blockd.core.incarnations` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockd.core.incarnations import KVNotWritten, listed


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int64 ``[rows, longest]`` tensor, zero-padded."""
    # one tensor from padded lists: a tensor per row took ~25 us a row, 1.6 ms
    # for a 64-sequence decode step, twice a step
    width = max(map(len, tables), default=0) or 1
    return torch.tensor([[*table, *[0] * (width - len(table))] for table in tables],
                        dtype=torch.int64).reshape(len(tables), width)


@dataclass(frozen=True)
class ContextBlocks:
    """The blocks a batch reads and how many leading slots of each it needs.

    ``blocks``, ``need`` and ``rows`` (the batch row of each entry) are flat,
    row after row; a row of ``n`` context tokens needs ``block_size`` slots of
    each of its first ``n // block_size`` blocks and ``n % block_size`` of
    the next.
    """

    blocks: torch.Tensor  # int64 [K]
    need: torch.Tensor  # int32 [K]
    rows: torch.Tensor  # int64 [K]

    @classmethod
    def of(cls, tables: torch.Tensor, lengths: torch.Tensor, block_size: int) -> ContextBlocks:
        """``tables``: int64 ``[rows, width]`` (padded), ``lengths``: ``[rows]`` tokens."""
        offsets = torch.arange(tables.shape[1], dtype=torch.int64) * block_size
        need = (lengths.to(torch.int64)[:, None] - offsets[None, :]).clamp_(0, block_size)
        used = need > 0
        rows = torch.arange(tables.shape[0], dtype=torch.int64)[:, None].expand_as(tables)
        return cls(tables[used], need[used].to(torch.int32), rows[used])


class WrittenSlots:
    """The written-slot record of one shard (see the module docstring)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        rows = num_blocks + num_host_blocks  # device blocks, then the host tier's
        self.bits = torch.zeros(num_layers, rows, block_size, dtype=torch.bool)
        self.lead = torch.zeros(num_layers, rows, dtype=torch.int32)

    def clear(self) -> None:
        self.bits.zero_()
        self.lead.zero_()

    def mark(self, layer: int, slots: torch.Tensor) -> None:
        """``slots`` (int64, negatives are padding) of local ``layer`` were written."""
        slots = slots.to("cpu", torch.int64)
        if slots.numel() and bool((slots < 0).any()):
            slots = slots[slots >= 0]
        if not slots.numel():
            return
        self.mark_split(layer, *self._split(slots))

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(blocks, offsets, unique(blocks))`` of int64 CPU ``slots`` (no padding)."""
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        return blocks, slots - blocks * self.block_size, torch.unique(blocks)

    def mark_split(self, layers: int | slice, blocks: torch.Tensor, offsets: torch.Tensor,
                   touched: torch.Tensor) -> None:
        """:meth:`mark` for one local layer or a slice of them, with the slots
        already split (int64 CPU ``blocks``, ``offsets``, no padding) and
        ``touched`` = ``unique(blocks)``: a model step splits its slots once and
        marks every layer at its end."""
        self.bits[layers, blocks, offsets] = True
        rows = self.bits[layers].index_select(-2, touched).to(torch.int32)
        self.lead[layers, touched] = rows.cumprod(-1).sum(-1, dtype=torch.int32)

    def copy(self, pairs: torch.Tensor) -> None:
        """Blocks copied ``src -> dst`` in every layer (``pairs``: ``[n, 2]``);
        as in :func:`~worker.kernels.copy_blocks`, every source is read first."""
        pairs = pairs.to("cpu", torch.int64)
        src, dst = pairs[:, 0], pairs[:, 1]
        self.bits[:, dst] = self.bits[:, src]
        self.lead[:, dst] = self.lead[:, src]

    def forget_host(self) -> None:
        """Nothing in the host tier is vouched for any more (a snapshot skipped tier ops)."""
        self.bits[:, self.num_blocks:] = False
        self.lead[:, self.num_blocks:] = 0

    def offload(self, device_blocks: torch.Tensor, host_blocks: torch.Tensor) -> None:
        """Device blocks were copied to host blocks (int64 ``[n]`` each, CPU)."""
        self.copy(torch.stack((device_blocks, host_blocks + self.num_blocks), 1))

    def restore(self, host_blocks: torch.Tensor, device_blocks: torch.Tensor) -> None:
        """Host blocks were copied to device blocks: each is written as its source was."""
        self.copy(torch.stack((host_blocks + self.num_blocks, device_blocks), 1))

    def check(self, layers: int | slice, context: ContextBlocks, seq_ids: Sequence[str],
              lengths: Sequence[int] | torch.Tensor, writing: torch.Tensor | None = None) -> None:
        """Raise :class:`KVNotWritten` unless every slot ``context`` reads is
        written in ``layers`` (local indices); ``writing`` (int64 CPU slots, no
        padding): slots the same step writes in every layer before any of its
        attention reads (a prompt sharing blocks another prompt of the step computes)."""
        if not context.blocks.numel():
            return
        ok = self.lead[layers].index_select(-1, context.blocks) >= context.need
        if bool(ok.all()):
            return
        if writing is not None and writing.numel():
            ok = self._lead_after(layers, writing).index_select(-1, context.blocks) >= context.need
            if bool(ok.all()):
                return
        if ok.dim() == 2:  # several layers: an entry fails if it fails in any of them
            ok = ok.all(0)
        rows = torch.unique(context.rows[~ok]).tolist()
        names = [seq_ids[r] for r in rows]
        missing = self._missing(layers, context.blocks[context.rows == rows[0]], int(lengths[rows[0]]))
        more = f" (and {len(names) - 1} more sequences)" if len(names) > 1 else ""
        raise KVNotWritten(
            f"sequence {names[0]!r}{more} reads KV this worker has not written in its current incarnation "
            f"(positions {missing} of its {int(lengths[rows[0]])} context tokens; the worker restarted, or "
            "the pool was re-created, since they were computed): recompute them (preempt with recompute)",
            metadata=listed(names))

    def _lead_after(self, layers: int | slice, slots: torch.Tensor) -> torch.Tensor:
        """``lead[layers]`` as it will be once ``slots`` are written too (nothing is recorded)."""
        blocks, offsets, touched = self._split(slots)
        bits = self.bits[layers].index_select(-2, touched)  # a copy: [..., touched, block_size]
        bits[..., torch.searchsorted(touched, blocks), offsets] = True
        lead = self.lead[layers].clone()
        lead[..., touched] = bits.to(torch.int32).cumprod(-1).sum(-1, dtype=torch.int32)
        return lead

    def _missing(self, layers: int | slice, blocks: torch.Tensor, length: int) -> str:
        """The unwritten positions among a sequence's first ``length``, as ranges."""
        bits = self.bits[layers].index_select(-2, blocks)
        written = (bits.all(0) if bits.dim() == 3 else bits).reshape(-1)[:length].tolist()
        ranges: list[list[int]] = []
        for pos, done in enumerate(written):
            if not done:
                if ranges and ranges[-1][1] == pos - 1:
                    ranges[-1][1] = pos
                else:
                    ranges.append([pos, pos])
        text = ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in ranges[:4])
        return text + (", ..." if len(ranges) > 4 else "")
