"""The block-size advisor's recommendation against a brute-force sweep.

The sweep does not use the advisor's arithmetic: it lays each sequence's
tokens into blocks one token at a time, counts the blocks and the slots
they hold, and prices them as the advisor's stated cost does (KV bytes of
every slot of every block + table bytes per block). The recommended size
must be one that minimises that cost over every candidate.
"""

from __future__ import annotations

import math
import random

import pytest

from client.report.advisor import CANDIDATES, advise, size_cost, table_bytes_per_block


def brute_force_bytes(lengths: list[int], block_size: int, kv_bytes_per_slot: int, table_bytes: int) -> float:
    total = 0
    for length in lengths:
        blocks, free_in_last = 0, 0
        for _ in range(length):
            if free_in_last == 0:  # a token past a block boundary takes a new block
                blocks += 1
                free_in_last = block_size
            free_in_last -= 1
        total += blocks * block_size * kv_bytes_per_slot + blocks * table_bytes
    return total / len(lengths)


def lognormal(seed: int, n: int, mean: float, sigma: float, max_len: int) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(mean) - sigma ** 2 / 2
    return [min(max_len, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


#: (lengths, KV bytes per slot, table bytes per block): a real model's geometry (SmolLM2-135M in
#: float32: 30 layers x 2 x 3 KV heads x 64 x 4 B), and made-up tiny KV where the table decides
CASES = [
    (lognormal(0, 400, 60, 0.9, 256), 30 * 2 * 3 * 64 * 4, table_bytes_per_block(1)),
    (lognormal(1, 400, 300, 0.6, 2048), 1, 64),
    (lognormal(2, 300, 40, 0.3, 200), 2, 48),
    ([31, 32, 33, 64, 65, 1, 17], 3, 40),
    ([128] * 10, 1, 1000),
]


@pytest.mark.parametrize(("lengths", "kv_bytes", "table_bytes"), CASES)
def test_the_recommended_size_minimises_the_stated_cost(lengths, kv_bytes, table_bytes) -> None:
    candidates = list(range(1, 257))
    advice = advise(lengths, kv_bytes, table_bytes, candidates)
    swept = {b: brute_force_bytes(lengths, b, kv_bytes, table_bytes) for b in candidates}
    best = min(swept.values())
    assert swept[advice.recommended.block_size] == pytest.approx(best, rel=1e-12)
    # ties go to the larger block
    tied = [b for b, cost in swept.items() if cost == pytest.approx(best, rel=1e-12)]
    assert advice.recommended.block_size == max(tied)
    for cost in advice.costs:  # and every row the table shows is the swept cost
        assert cost.total_bytes == pytest.approx(swept[cost.block_size], rel=1e-12)


def test_the_default_candidates_and_the_tail_waste_bound() -> None:
    lengths = lognormal(3, 200, 80, 0.8, 512)
    advice = advise(lengths, 1024, 8)
    assert [c.block_size for c in advice.costs] == list(CANDIDATES)
    assert advice.recommended.block_size == min(CANDIDATES)  # real KV per slot: tail waste decides
    assert "tail waste decides" in advice.reason
    for c in advice.costs:  # the seed's bound: 0 to b-1 unused slots per sequence
        assert 0 <= c.tail_waste_slots <= c.block_size - 1


def test_where_the_table_weighs_the_optimum_is_inside_the_range() -> None:
    advice = advise(lognormal(4, 300, 300, 0.6, 2048), 1, 64, range(1, 257))
    assert 1 < advice.recommended.block_size < 256
    assert "push towards larger blocks" in advice.reason


def test_bad_input_is_refused_with_a_message() -> None:
    with pytest.raises(ValueError, match="no sequence lengths"):
        advise([], 1, 1)
    with pytest.raises(ValueError, match="block size must be >= 1"):
        size_cost([3], 0, 1, 1)
    with pytest.raises(ValueError, match="no candidate"):
        advise([3], 1, 1, ())
