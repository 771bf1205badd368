"""A worker's host-memory tier: the blocks beside its device pool, and the
running of each version's tier ops on them.

blockd owns the allocation (which host block holds which cached block, when
one is offloaded or restored); the worker holds the memory
(``num_host_blocks`` blocks of the device shard's layout,
:func:`worker.layout.allocate_host_pool`) and copies whole blocks when its
table mirror applies a version's tier ops: OFFLOAD device -> host, RESTORE
host -> device, in the order blockd listed them, before that version's copy
ops (:mod:`worker.tables`).

The ops run as few copies as the order allows: consecutive ops of one kind
form one batch (one gather, one scatter: :func:`~worker.kernels.move_blocks`),
split where a destination repeats, so the later copy still lands last. Within
a batch no op reads what another writes: an offload reads device blocks and
writes host blocks, a restore the reverse. Every op of a version is checked
before any copies, so a bad one changes nothing.

The written-slot record (:mod:`worker.written`) follows each batch, so a
restored block counts as written exactly where its offloaded source was.
Imports torch, the core's types and the worker's kernels and record only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from blockd.core.errors import WrongState
from blockd.core.types import OFFLOAD, RESTORE, TierOp
from worker.kernels import move_blocks
from worker.written import WrittenSlots

#: a batch: its kind, its device blocks and its host blocks (parallel lists)
Batch = tuple[str, list[int], list[int]]
_KERNELS = {OFFLOAD: "offload_blocks", RESTORE: "restore_blocks"}


def batches(ops: Sequence[TierOp]) -> list[Batch]:
    """``ops`` as batches: a run of consecutive ops of one kind, cut before an op
    whose destination (host block of an offload, device block of a restore)
    the run already writes."""
    out: list[Batch] = []
    written: set[int] = set()
    for op in ops:
        dst = op.host_block if op.kind == OFFLOAD else op.device_block
        if not out or out[-1][0] != op.kind or dst in written:
            out.append((op.kind, [], []))
            written = set()
        out[-1][1].append(op.device_block)
        out[-1][2].append(op.host_block)
        written.add(dst)
    return out


class HostTier:
    """The host tier of one shard whose device pool is ``kv`` (see the module docstring)."""

    def __init__(self, kv: torch.Tensor, host_kv: torch.Tensor, written: WrittenSlots, metrics) -> None:
        self.kv = kv
        self.host_kv = host_kv
        self.written = written
        self.metrics = metrics
        self.num_offloads = 0
        self.num_restores = 0

    @property
    def num_blocks(self) -> int:
        return self.host_kv.shape[2]

    @property
    def nbytes(self) -> int:
        return self.host_kv.numel() * self.host_kv.element_size()

    def check(self, ops: Sequence[TierOp]) -> None:
        """Refuse (WrongState, naming the op) a kind or block this shard does not have."""
        num_device = self.kv.shape[2]
        for i, op in enumerate(ops):
            if op.kind not in _KERNELS:
                raise WrongState(f"tier op {i} has kind {op.kind!r}, not {OFFLOAD!r} or {RESTORE!r}")
            if not (0 <= op.device_block < num_device and 0 <= op.host_block < self.num_blocks):
                raise WrongState(f"tier op {i} ({op.kind} device block {op.device_block}, host block "
                                 f"{op.host_block}) is outside this worker's {num_device} device and "
                                 f"{self.num_blocks} host blocks")

    def run(self, ops: Sequence[TierOp]) -> None:
        """Run one version's tier ops, in order (the table mirror calls this)."""
        self.check(ops)
        for kind, device, host in batches(ops):
            start = time.perf_counter()
            device_ids = torch.tensor(device, dtype=torch.int64)
            host_ids = torch.tensor(host, dtype=torch.int64)
            if kind == OFFLOAD:
                move_blocks(self.kv, self.host_kv, device_ids, host_ids)
                self.written.offload(device_ids, host_ids)
                self.num_offloads += len(device)
            else:
                move_blocks(self.host_kv, self.kv, host_ids, device_ids)
                self.written.restore(host_ids, device_ids)
                self.num_restores += len(device)
            self.metrics.observe_kernel(_KERNELS[kind], time.perf_counter() - start)
            self.metrics.add_tier_ops(kind, len(device))
