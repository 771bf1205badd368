"""The seed arithmetic: blocks, tail waste and slots for any position."""

import pytest

from blockd.core import locate, num_blocks_for, slot_at, slot_mapping, slot_of, tail_waste


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "blocks", "unused"),
    [(0, 4, 0, 0), (8, 4, 2, 0), (10, 4, 3, 2), (1, 4, 1, 3), (1, 1, 1, 0), (17, 16, 2, 15)],
)
def test_blocks_and_tail_waste(num_tokens, block_size, blocks, unused):
    assert num_blocks_for(num_tokens, block_size) == blocks
    assert tail_waste(num_tokens, block_size) == unused


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 16])
def test_tail_waste_is_below_block_size(block_size):
    for num_tokens in range(100):
        unused = tail_waste(num_tokens, block_size)
        assert 0 <= unused < block_size
        assert num_blocks_for(num_tokens, block_size) * block_size == num_tokens + unused


def test_position_to_block_and_offset():
    assert locate([5, 1, 7], 9, 4) == (7, 1)
    assert slot_of([5, 1, 7], 9, 4) == 29
    assert locate([5, 1, 7], 0, 4) == (5, 0)
    with pytest.raises(IndexError):
        locate([5, 1, 7], 12, 4)
    with pytest.raises(IndexError):
        locate([5, 1, 7], -1, 4)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_slot_mapping_matches_per_position_slots(block_size):
    table = [9, 2, 14, 0, 5, 11][: num_blocks_for(6 * block_size, block_size)]
    end_max = len(table) * block_size
    for start in range(0, end_max + 1, max(1, block_size // 2)):
        for end in range(start, end_max + 1):
            expect = [table[t // block_size] * block_size + t % block_size for t in range(start, end)]
            assert slot_mapping(table, start, end, block_size) == expect
    with pytest.raises(IndexError):
        slot_mapping(table, 0, end_max + 1, block_size)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_slot_at_agrees_with_slot_of(block_size):
    table = [9, 2, 14]
    for position in range(len(table) * block_size):
        block, offset = locate(table, position, block_size)
        assert slot_at(block, offset, block_size) == slot_of(table, position, block_size)
    assert slot_at(7, 1, 4) == 29
