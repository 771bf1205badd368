"""The live segment is zero-filled ahead of its records (blockd.storage.wal.PREALLOCATE):
while the log is open its file ends in zeros, which a reader takes as the last
segment's torn tail; a closed or rotated segment ends at its last record; a log
left without a close (a kill) recovers every record and drops only the zeros."""

from __future__ import annotations

import logging
import os

import pytest

from blockd.core import Allocate, PoolConfig
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.storage import bodies
from blockd.storage.reader import ZERO_TAIL, DataDirError, Reader
from blockd.storage.wal import PREALLOCATE, SEGMENT_HEADER, WriteAheadLog, encode_frame, segment_name


def _body(n: int, size: int = 40) -> bytes:
    return bodies.encode({"kind": "x", "n": n, "pad": "p" * size})


def test_an_open_segment_ends_in_zeros_and_a_closed_one_at_its_last_record(tmp_path):
    log = WriteAheadLog(str(tmp_path), 0, "always")
    log.open_for_append()
    path = tmp_path / segment_name(1)
    frames = [encode_frame(n, _body(n), 0) for n in range(1, 6)]
    for n in range(1, 6):
        log.append(_body(n))
    ends = SEGMENT_HEADER.size + sum(map(len, frames))
    # zero-filled once, at the first record, a chunk past it; the next four fit
    assert path.stat().st_size == SEGMENT_HEADER.size + len(frames[0]) + PREALLOCATE
    assert not any(path.read_bytes()[ends:])
    reader = Reader(str(tmp_path))  # as the compactor or `blockd check-data` reads a live log
    assert [r.lsn for r in reader.records()] == [1, 2, 3, 4, 5]
    assert reader.torn is not None and (reader.torn.offset, reader.torn.why) == (ends, ZERO_TAIL)
    log.close()
    assert path.stat().st_size == ends
    reader = Reader(str(tmp_path))
    assert [r.lsn for r in reader.records()] == [1, 2, 3, 4, 5] and reader.torn is None


def test_rotation_cuts_the_closed_segment_and_records_past_a_chunk_are_whole(tmp_path):
    log = WriteAheadLog(str(tmp_path), 0, "always")
    log.open_for_append()
    big = _body(1, size=PREALLOCATE + 1000)  # one record larger than a chunk of zeros
    log.append(big)
    log.append(_body(2))
    assert log.rotate() == 2
    first = tmp_path / segment_name(1)
    assert first.stat().st_size == SEGMENT_HEADER.size + len(encode_frame(1, big)) + len(encode_frame(2, _body(2)))
    for n in range(3, 3 + 3 * PREALLOCATE // 4096):  # past several chunks of the new segment
        log.append(_body(n, size=4000))
    last = log.lsn
    reader = Reader(str(tmp_path))
    records = list(reader.records())
    assert [r.lsn for r in records] == list(range(1, last + 1))
    assert records[0].raw == big and reader.torn is not None and reader.torn.why == ZERO_TAIL
    log.close()


def test_a_log_left_without_a_close_recovers_every_record_and_drops_only_the_zeros(tmp_path, caplog):
    engine = Engine(EngineConfig(data_dir=str(tmp_path), fsync="always"))
    engine.create_pool(PoolConfig("p", num_blocks=64, block_size=4))
    for n in range(20):
        engine.step("p", [Allocate(f"s{n}", [1, 2, 3])])
    wal = engine._durability._wal
    # what a kill leaves: the records on disk, the zeros ahead of them, no close
    os.close(wal._fd)
    wal._fd = None
    engine._durability._lock.release()
    path = tmp_path / segment_name(wal._segment_first)
    assert path.stat().st_size > wal._end
    with caplog.at_level(logging.INFO, logger="blockd.storage.reader"):
        again = Engine(EngineConfig(data_dir=str(tmp_path), fsync="always"))
    try:
        assert all(again.sequence_info("p", f"s{n}").num_tokens == 3 for n in range(20))
        assert path.stat().st_size == wal._end  # cut to its records, before the next segment started
        (line,) = [r for r in caplog.records if "truncating a torn tail" in r.getMessage()]
        assert line.levelno == logging.INFO and ZERO_TAIL in line.getMessage()
        again.step("p", [Allocate("after", [1])])
    finally:
        again.close()
    assert Reader(str(tmp_path)).torn is None


def _killed_log(tmp_path, records: int = 6) -> tuple[str, int, list[int]]:
    """A log of ``records`` left open as a kill leaves it: its path, the end of its records, each frame's offset."""
    log = WriteAheadLog(str(tmp_path), 0, "always")
    log.open_for_append()
    offsets = []
    for n in range(1, records + 1):
        offsets.append(log._end)
        log.append(_body(n, size=6000))  # records across page boundaries
    end = log._end
    os.close(log._fd)
    return str(tmp_path / segment_name(1)), end, offsets


def _zero(path: str, start: int, stop: int) -> None:
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(bytes(stop - start))


def test_a_write_stopped_part_way_in_the_zeros_is_a_torn_tail(tmp_path):
    """A kill or a crash can stop the last record's write at a page: its body (or
    even its header) ends in zeros, followed by the zero-filled rest of the segment."""
    path, end, offsets = _killed_log(tmp_path / "body")
    _zero(path, end - 3000, end)  # the last record's last page never written
    reader = Reader(os.path.dirname(path))
    assert [r.lsn for r in reader.records()] == [1, 2, 3, 4, 5]
    assert reader.torn is not None and reader.torn.offset == offsets[-1] and "unwritten page" in reader.torn.why
    path, end, offsets = _killed_log(tmp_path / "header")
    _zero(path, offsets[-1] + 10, end)  # the write stopped inside the last record's header
    reader = Reader(os.path.dirname(path))
    assert [r.lsn for r in reader.records()] == [1, 2, 3, 4, 5]
    assert reader.torn is not None and "header cut short" in reader.torn.why


def test_damage_before_the_zeros_is_still_damage(tmp_path):
    """A flipped byte in the last record, whose body still ends in ``}``, is not a
    torn write: reading refuses it, naming it (a start then changes nothing:
    test_wal_integrity.py); nor is a flipped header with its body after it."""
    path, _, offsets = _killed_log(tmp_path)
    with open(path, "r+b") as f:
        f.seek(offsets[-1] + 100)
        byte = f.read(1)
        f.seek(offsets[-1] + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(DataDirError, match="record checksum mismatch"):
        list(Reader(os.path.dirname(path)).records())
    with open(path, "r+b") as f:  # a flipped header with a body after it, too
        f.seek(offsets[-2] + 2)
        f.write(b"\xff")
    with pytest.raises(DataDirError, match="header checksum mismatch"):
        list(Reader(os.path.dirname(path)).records())
