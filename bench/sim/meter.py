"""Pool statistics averaged over scheduler steps (what the simulations and the
demos report as utilisation and tail waste).

``utilisation`` = slots holding tokens / all slots of the pool (a block
shared by several tables counts once); ``tail_waste_ratio`` = tail waste /
slots of used blocks; ``free_ratio`` = free + evictable blocks / all.
Imports only the core's :class:`~blockd.core.types.PoolStats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blockd.core.types import PoolStats


@dataclass
class Meter:
    """Means of pool statistics over the steps it was given (see the module docstring)."""

    num_samples: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    peak_utilisation: float = 0.0

    def add(self, stats: PoolStats) -> None:
        b = stats.block_size
        total = stats.num_blocks * b
        allocated = stats.num_used_blocks * b
        utilisation = (allocated - stats.tail_waste_slots) / total
        sample = {
            "utilisation": utilisation,
            "allocated_ratio": stats.num_used_blocks / stats.num_blocks,
            "free_ratio": (stats.num_free_blocks + stats.num_evictable_blocks) / stats.num_blocks,
            "tail_waste_slots": stats.tail_waste_slots,
            "tail_waste_ratio": stats.tail_waste_slots / allocated if allocated else 0.0,
            "num_seqs": stats.num_seqs,
            "num_used_blocks": stats.num_used_blocks,
        }
        for key, value in sample.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.num_samples += 1
        self.peak_utilisation = max(self.peak_utilisation, utilisation)

    def means(self) -> dict[str, float]:
        return {key: value / self.num_samples for key, value in self.sums.items()} if self.num_samples else {}
