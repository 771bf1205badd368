"""The series a run report draws, from plain recorded samples (no plotting)."""

from __future__ import annotations

from dataclasses import replace

from blockd.core.types import PoolConfig, PoolStats
from client.report.series import RunRecord, RunRecorder, increase, prefix_intervals, totals

POOL = PoolConfig("p", 10, 4)


def stats(queried: int, hit: int, never_stored: int, seqs: int = 1) -> PoolStats:
    return PoolStats("p", 10, 4, num_free_blocks=8, num_used_blocks=2, num_evictable_blocks=0, num_seqs=seqs,
                     num_tokens=6, tail_waste_slots=2, tail_waste_bytes=2, prefix_queried_tokens=queried,
                     prefix_hit_tokens=hit, num_evictions=0, num_copies=0, version=1, last_event_seq_no=0,
                     prefix_miss_tokens=(never_stored, 0, 0, 0, 0))


def record(samples: list[PoolStats]) -> RunRecord:
    return RunRecord("r", POOL, tuple(float(i) for i in range(len(samples))), tuple(samples), (), (), (),
                     seconds=len(samples) - 1.0)


def test_a_counter_that_starts_again_counts_its_new_value() -> None:
    # queried 10, 30, then the daemon restarted with no data dir: 5, 25
    run = record([stats(10, 4, 6), stats(30, 14, 16), stats(5, 1, 4), stats(25, 11, 14)])
    assert increase(run, lambda s: s.prefix_queried_tokens) == [0, 20, 25, 45]
    spans = prefix_intervals(run, num_bins=3)
    assert spans.queried == [20, 5, 20] and spans.hit == [10, 1, 10]
    assert spans.missed["never_stored"] == [10, 4, 10]
    assert totals(run)["prefix_hit_rate"] == 21 / 45


def test_spans_gather_the_samples_that_end_in_them() -> None:
    run = record([stats(0, 0, 0), stats(10, 5, 5), stats(20, 10, 10), stats(40, 30, 10), stats(40, 30, 10)])
    spans = prefix_intervals(run, num_bins=2)  # (0, 2] and (2, 4]: a sample closes the span it ends
    assert spans.ends_s == [2.0, 4.0] and spans.queried == [20, 20] and spans.hit == [10, 20]
    assert spans.hit_rate() == [0.5, 1.0]


def test_the_recorder_samples_at_most_once_per_interval_on_its_clock() -> None:
    now = [0.0]
    reads = []

    def read() -> PoolStats:
        reads.append(now[0])
        return replace(stats(0, 0, 0), version=len(reads))

    recorder = RunRecorder("r", read, interval_s=1.0, clock=lambda: now[0])
    for t in (0.0, 0.5, 1.0, 1.2, 2.5):
        now[0] = t
        recorder.sample()
    now[0] = 2.6
    done = recorder.record(POOL)
    assert reads == [0.0, 1.0, 2.5, 2.6] and done.times_s == (0.0, 1.0, 2.5, 2.6) and done.seconds == 2.6
