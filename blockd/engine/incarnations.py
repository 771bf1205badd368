"""Identity of state: pool and worker incarnations, and the KV a worker restart loses.

Owns, for the daemon, one :class:`PoolIncarnations` per pool:

* the pool's **incarnation**, a random id made when the pool is created and
  kept in the create record and in snapshots. A pool deleted and re-created
  under the same name gets a new one, so a follower or a caller holding a
  version of the old pool can tell (versions are comparable only within one
  incarnation);
* the **worker incarnations** that hold the pool's KV. A worker that
  registers with an incarnation the pool has not seen holds none of the KV
  written so far (a restarted process, or a shard nobody held): every
  sequence of the pool is then marked **KV-lost** and the prefix cache is
  cleared (``AllBlocksCleared``), so no prefix hit hands out a block whose KV
  is gone. Registering again with a known incarnation (after a blockd restart)
  changes nothing;
* the lost sequences. A step that extends, commits or forks one is refused
  with :class:`KVLost` (FAILED_PRECONDITION, reason ``KV_LOST``, the sequence
  ids in the ErrorInfo metadata): the scheduler frees it and computes it again,
  as for a preemption. Freeing it clears the mark.

The loss is a logged mutation of the pool (record ``worker_joined``) and
derives from the pool's state at that point, so replaying the log gives the
same lost set. The errors both sides raise, and how an incarnation is made,
are shared with the workers in :mod:`blockd.core.incarnations`. Imports only
the standard library and the core.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import replace

from blockd.core.incarnations import KVLost, PoolIncarnationMismatch, listed, short
from blockd.core.pool import Pool
from blockd.core.types import Allocate, DecodeAppend, Fork, Free, Op, PoolStats, StepResult

#: worker incarnations remembered per pool (a forgotten one re-registering is
#: treated as new: the safe direction)
MAX_KNOWN_WORKERS = 1024
#: loss descriptions kept per pool, by the version at which the loss happened
MAX_LOSS_NOTES = 64


def legacy_incarnation(pool: str, lsn: int) -> str:
    """A stable incarnation for a pool recorded before incarnations existed."""
    return "legacy-" + hashlib.blake2b(f"{pool}@{lsn}".encode(), digest_size=12).hexdigest()


def _named(op: Op) -> tuple[object, ...]:
    """The existing sequences an operation extends, commits or forks from."""
    if type(op) is DecodeAppend:
        return tuple(op.seq_ids) if isinstance(op.seq_ids, (list, tuple)) else ()
    if type(op) is Fork:
        return (op.parent_seq_id,)
    if type(op) is Allocate and op.share_seq_id:  # its blocks stand in for the prompt's
        return (op.seq_id, op.share_seq_id)
    return (getattr(op, "seq_id", None),)


class PoolIncarnations:
    """One pool's incarnation, the worker incarnations holding its KV, and its
    KV-lost sequences (see the module docstring). Not thread-safe: the engine
    calls it under its lock."""

    __slots__ = ("incarnation", "lost", "notes", "workers")

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation
        #: worker incarnation -> worker id, oldest first
        self.workers: OrderedDict[str, str] = OrderedDict()
        #: lost sequence id -> the pool version at which its KV was lost
        self.lost: dict[str, int] = {}
        #: pool version -> what was lost then, for messages
        self.notes: OrderedDict[int, str] = OrderedDict()

    # --- incarnations ---------------------------------------------------------
    def check_planned(self, pool: str, planned: str) -> None:
        """Refuse a call planned against another incarnation (empty: unchecked)."""
        if planned and planned != self.incarnation:
            raise PoolIncarnationMismatch(
                f"pool {pool!r} is incarnation {short(self.incarnation)}, not {short(planned)}: it was "
                "deleted and re-created (or blockd restarted without its data) since you planned; its "
                "sequences are gone, so start them again on the new pool",
                metadata={"pool_incarnation": self.incarnation, "planned_incarnation": planned[:64]})

    def stats(self, stats: PoolStats) -> PoolStats:
        return replace(stats, incarnation=self.incarnation, num_kv_lost_seqs=len(self.lost))

    def result(self, result: StepResult) -> StepResult:
        return replace(result, incarnation=self.incarnation)

    # --- workers and lost KV ------------------------------------------------------
    def knows(self, worker_incarnation: str) -> bool:
        return worker_incarnation in self.workers

    def join(self, pool: Pool, worker_id: str, worker_incarnation: str) -> int:
        """A worker incarnation the pool has not seen registers: every sequence's
        KV is lost and the prefix cache is cleared. Returns how many were lost."""
        self.workers[worker_incarnation] = worker_id
        while len(self.workers) > MAX_KNOWN_WORKERS:
            self.workers.popitem(last=False)
        stats = pool.stats()
        # the host tier is the worker's memory too: its cached blocks are lost with the process
        if not stats.num_seqs and not stats.num_evictable_blocks and not stats.num_host_cached_blocks:
            return 0
        newly = [seq_id for seq_id in pool.seqs if seq_id not in self.lost]
        for seq_id in newly:
            self.lost[seq_id] = pool.version
        self.notes[pool.version] = (f"worker {worker_id!r} registered as a new incarnation "
                                    f"({short(worker_incarnation)}) at version {pool.version}")
        while len(self.notes) > MAX_LOSS_NOTES:
            self.notes.popitem(last=False)
        pool.reset_prefix_cache()
        return len(newly)

    def check_step(self, pool: str, ops: list[Op] | tuple[Op, ...]) -> None:
        """Refuse a batch that extends, commits or forks a lost sequence (one
        freed or allocated anew earlier in the same batch is fine)."""
        lost = self.lost
        if not lost or not isinstance(ops, (list, tuple)):
            return
        fresh: set[str] = set()
        hits: list[str] = []
        first = None
        for index, op in enumerate(ops):
            if type(op) is Free or type(op) is Allocate:
                if type(op.seq_id) is str:
                    fresh.add(op.seq_id)
                continue
            found = [s for s in _named(op) if type(s) is str and s in lost and s not in fresh]
            if found:
                first = index if first is None else first
                hits += found
        if hits:
            note = self.notes.get(lost[hits[0]], f"at version {lost[hits[0]]}")
            raise KVLost(
                f"operation {first}: the KV of {len(hits)} sequence(s) of pool {pool!r} ({hits[0]!r} first) "
                f"was lost: {note}; free them and compute them again (preempt with recompute)",
                op_index=first, metadata=listed(dict.fromkeys(hits)))

    def after_step(self, ops: list[Op] | tuple[Op, ...]) -> None:
        """A committed batch: freed sequences are no longer lost."""
        if self.lost:
            for op in ops:
                if type(op) is Free:
                    self.lost.pop(op.seq_id, None)

    # --- snapshots -------------------------------------------------------------------
    def dump(self) -> dict:
        return {"incarnation": self.incarnation, "workers": [[i, w] for i, w in self.workers.items()],
                "lost": [list(self.lost), list(self.lost.values())],
                "notes": [[v, n] for v, n in self.notes.items()]}

    @classmethod
    def load(cls, data: dict) -> PoolIncarnations:
        identity = cls(data["incarnation"])
        identity.workers.update((i, w) for i, w in data["workers"])
        identity.lost.update(zip(*data["lost"]))
        identity.notes.update((v, n) for v, n in data["notes"])
        return identity


__all__ = ["MAX_KNOWN_WORKERS", "MAX_LOSS_NOTES", "PoolIncarnations", "legacy_incarnation"]
