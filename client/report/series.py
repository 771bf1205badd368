"""What a run report is drawn from: a pool's statistics over time and the requests' outcomes.

:class:`RunRecorder` samples a pool's :class:`~blockd.core.types.PoolStats`
(from ``BlockdClient.get_pool``, or any callable returning them: the
in-process backend's, a test's) as a run goes, at most once per
``interval_s`` of its clock, and keeps the finished requests' timings and
lengths. :meth:`RunRecorder.record` hands back a :class:`RunRecord`, plain
data the renderer (:mod:`client.report.render`) draws; the series here are
derived from it without I/O. The counters in ``PoolStats`` (prefix tokens,
misses by reason) are cumulative since the pool was made, so rates are
differences between samples. Imports no plotting library.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from blockd.core.types import MISS_REASONS, PoolConfig, PoolStats
from client.serving import RequestOutput


@dataclass(frozen=True)
class RunRecord:
    """One run: ``stats[i]`` was read at ``times_s[i]`` seconds after the run began."""

    name: str
    pool: PoolConfig
    times_s: tuple[float, ...]
    stats: tuple[PoolStats, ...]
    ttft_s: tuple[float, ...]
    #: requests with more than one output token only (TPOT is undefined for one)
    tpot_s: tuple[float, ...]
    #: ``(prompt tokens, output tokens)`` of every finished sample (one sequence each)
    lengths: tuple[tuple[int, int], ...]
    seconds: float
    #: workers holding the pool (each keeps a mirror of the block tables)
    num_workers: int = 1
    #: free-form lines the report shows with the run (model, scheme, settings)
    notes: tuple[str, ...] = ()

    @property
    def output_tokens(self) -> int:
        return sum(out for _, out in self.lengths)


@dataclass
class RunRecorder:
    """Samples ``read_stats`` as a run goes and collects its finished requests."""

    name: str
    read_stats: Callable[[], PoolStats]
    interval_s: float = 0.0
    clock: Callable[[], float] = time.perf_counter
    _start: float = field(init=False)
    _last: float | None = field(init=False, default=None)
    _times: list[float] = field(init=False, default_factory=list)
    _stats: list[PoolStats] = field(init=False, default_factory=list)
    _outputs: list[RequestOutput] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._start = self.clock()

    def sample(self, *, force: bool = False) -> PoolStats | None:
        """Read the pool's statistics if ``interval_s`` has passed since the last read (or ``force``)."""
        now = self.clock()
        if not force and self._last is not None and now - self._last < self.interval_s:
            return None
        self._last = now
        stats = self.read_stats()
        self._times.append(now - self._start)
        self._stats.append(stats)
        return stats

    def add_outputs(self, outputs: Iterable[RequestOutput]) -> None:
        self._outputs.extend(o for o in outputs if o.error is None)

    def record(self, pool: PoolConfig, *, num_workers: int = 1, notes: Iterable[str] = ()) -> RunRecord:
        """The run so far, with a last sample taken now."""
        self.sample(force=True)
        outs = self._outputs
        return RunRecord(
            self.name, pool, tuple(self._times), tuple(self._stats),
            ttft_s=tuple(o.ttft_s for o in outs),
            tpot_s=tuple(o.tpot_s for o in outs if max(map(len, o.output_token_ids)) > 1),
            lengths=tuple((len(o.prompt_token_ids), len(s)) for o in outs for s in o.output_token_ids),
            seconds=self._times[-1], num_workers=num_workers, notes=tuple(notes))


# --- series derived from a record (no I/O) -------------------------------------------


def utilisation(record: RunRecord) -> tuple[list[float], list[float]]:
    """``(slots holding tokens / all slots, used blocks / all blocks)`` at each sample."""
    slots, blocks = [], []
    for s in record.stats:
        total = s.num_blocks * s.block_size
        slots.append((s.num_used_blocks * s.block_size - s.tail_waste_slots) / total)
        blocks.append(s.num_used_blocks / s.num_blocks)
    return slots, blocks


def tail_waste_per_seq(record: RunRecord) -> list[float | None]:
    """Mean tail waste per sequence at each sample (None with no sequence)."""
    return [s.tail_waste_slots / s.num_seqs if s.num_seqs else None for s in record.stats]


def increase(record: RunRecord, read: Callable[[PoolStats], int]) -> list[int]:
    """A counter's increase since the first sample, at each sample. A drop means it
    started again from 0 (the pool was made again, or a history spans a daemon's
    restart without its data dir), so the increase over that step is its new value,
    as Prometheus' ``increase`` counts it."""
    return grown([read(s) for s in record.stats])


def grown(values: list[int]) -> list[int]:
    """:func:`increase` of a counter's values."""
    total, out = 0, [0]
    for a, b in itertools.pairwise(values):
        total += b - a if b >= a else b
        out.append(total)
    return out


@dataclass(frozen=True)
class PrefixIntervals:
    """The prefix cache over spans of a run: ``ends_s[i]`` closes span ``i``."""

    ends_s: list[float]
    queried: list[int]
    hit: list[int]
    #: missed prompt tokens per interval, by reason (:data:`~blockd.core.types.MISS_REASONS`)
    missed: dict[str, list[int]]

    def hit_rate(self) -> list[float | None]:
        return [h / q if q else None for h, q in zip(self.hit, self.queried)]


#: spans of a run the prefix cache's rates are read over
NUM_BINS = 40


def prefix_intervals(record: RunRecord, num_bins: int = NUM_BINS) -> PrefixIntervals:
    """The prefix cache's counters in at most ``num_bins`` equal spans of the run (a span
    with no sample ending in it is left out): per-sample differences are too few tokens
    each to read a rate from."""
    times = record.times_s
    span = (times[-1] - times[0]) / num_bins or 1.0
    ends: list[float] = []
    marks: list[int] = [0]  # sample indices closing each kept span

    def span_of(t: float) -> int:  # spans are (k * span, (k + 1) * span]: a sample closes the one it ends
        return min(num_bins - 1, max(0, math.ceil((t - times[0]) / span) - 1))

    for i in range(1, len(times)):
        closes = span_of(times[i])
        if i == len(times) - 1 or span_of(times[i + 1]) != closes:
            ends.append(times[0] + (closes + 1) * span)
            marks.append(i)
    pairs = list(itertools.pairwise(marks))

    def spans(values: list[int]) -> list[int]:
        counted = grown(values)
        return [counted[b] - counted[a] for a, b in pairs]

    stats = record.stats
    missed = {reason: spans([s.prefix_miss_tokens[i] for s in stats]) for i, reason in enumerate(MISS_REASONS)}
    return PrefixIntervals(ends, spans([s.prefix_queried_tokens for s in stats]),
                           spans([s.prefix_hit_tokens for s in stats]), missed)


def totals(record: RunRecord) -> dict[str, float]:
    """The run's headline numbers over the whole run (counters: their increase)."""
    busy = [s for s in record.stats if s.num_seqs]
    slots, _ = utilisation(record)
    queried = increase(record, lambda s: s.prefix_queried_tokens)[-1]
    return {
        "requests": len(record.ttft_s), "sequences": len(record.lengths), "seconds": record.seconds,
        "output_tokens_per_s": record.output_tokens / record.seconds if record.seconds else 0.0,
        "mean_utilisation": sum(u for u, s in zip(slots, record.stats) if s.num_seqs) / len(busy) if busy else 0.0,
        "peak_utilisation": max(slots, default=0.0),
        "mean_tail_waste_per_seq": (sum(s.tail_waste_slots / s.num_seqs for s in busy) / len(busy)) if busy else 0.0,
        "prefix_hit_rate": increase(record, lambda s: s.prefix_hit_tokens)[-1] / queried if queried else 0.0,
        "peak_seqs": max((s.num_seqs for s in record.stats), default=0),
        "evictions": increase(record, lambda s: s.num_evictions)[-1],
    }
