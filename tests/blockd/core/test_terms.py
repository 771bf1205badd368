"""Leader terms in the log (docs/ha.md 2.2): every record's WAL frame carries
the term that wrote it, recovery refuses a log whose terms go down, older
formats read as term 0, snapshots keep the term history, and a replica's log
can be cut after an LSN with a copy kept."""

from __future__ import annotations

import os
import struct
import zlib

import pytest

from blockd.core.terms import TermHistory, common_prefix
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.storage import cut as log_cut
from blockd.storage.reader import DataDirError, Reader
from blockd.storage.wal import FRAME, FRAME_V2, SEGMENT_HEADER, encode_frame, segment_header, segment_name
from tests.support.datadirs import build, digest, reference, segments, state, workload


class FixedTerm:
    """The engine's replication gate for a replica that leads in one term
    (what blockd.ha's gate answers once elected): writes allowed, committed at once."""

    def __init__(self, term: int) -> None:
        self.term = term

    def writable(self) -> None:
        return None

    def committed(self, lsn: int) -> None:
        return None


def engine_in(data_dir: str, term: int = 0) -> Engine:
    return Engine(EngineConfig(data_dir=data_dir, snapshot_every=1 << 30,
                               replication=FixedTerm(term) if term else None))


def frames(path: str) -> list[tuple[int, int]]:
    """(lsn, term) of every format-3 frame of a segment."""
    with open(path, "rb") as f:
        data = f.read()
    pos, out = SEGMENT_HEADER.size, []
    while pos < len(data):
        length, lsn, term, _crc, _head = FRAME.unpack_from(data, pos)
        out.append((lsn, term))
        pos += FRAME.size + length
    return out


def to_format_2(path: str) -> None:
    """Rewrite a format-3 segment as the format-2 writer wrote it (no term)."""
    with open(path, "rb") as f:
        data = f.read()
    magic, _version, first, _crc = SEGMENT_HEADER.unpack_from(data)
    head = struct.pack("<8sIQ", magic, 2, first)
    out, pos = bytearray(head + struct.pack("<I", zlib.crc32(head))), SEGMENT_HEADER.size
    while pos < len(data):
        length, lsn, _term, crc, _head = FRAME.unpack_from(data, pos)
        body = data[pos + FRAME.size:pos + FRAME.size + length]
        fh = struct.pack("<IQI", length, lsn, crc)
        out += fh + struct.pack("<I", zlib.crc32(fh)) + body
        pos += FRAME.size + length
    assert FRAME_V2.size == 20
    with open(path, "wb") as f:
        f.write(out)


# --- TermHistory --------------------------------------------------------------------------
def test_term_history_answers_by_position_and_refuses_going_down():
    h = TermHistory([(3, 10), (5, 20)])
    assert [h.term_at(p) for p in (1, 9, 10, 19, 20, 99)] == [0, 0, 3, 3, 5, 5]
    assert [h.run_start(p) for p in (4, 10, 15, 25)] == [1, 10, 10, 20]
    h.observe(5, 30)  # same term: no new run
    assert h.runs() == [(3, 10), (5, 20)] and h.last_term == 5
    with pytest.raises(ValueError, match="never go down"):
        h.observe(4, 40)
    with pytest.raises(ValueError, match="not after"):
        h.observe(6, 20)
    assert TermHistory.load(h.dump()).runs() == h.runs()
    with pytest.raises(ValueError, match="pairs"):
        TermHistory.load([[1, 2, 3]])
    h.truncate_after(19)
    assert h.runs() == [(3, 10)]


def test_common_prefix_is_where_two_logs_stop_agreeing():
    leader = TermHistory([(2, 1), (4, 11), (7, 21)])
    assert common_prefix(leader, 30, TermHistory([(2, 1), (4, 11)]), 25) == 20  # a deposed term-4 tail
    assert common_prefix(leader, 30, TermHistory([(2, 1), (4, 11)]), 15) == 15  # behind, no divergence
    assert common_prefix(leader, 30, TermHistory([(2, 1), (3, 8)]), 12) == 7
    assert common_prefix(leader, 30, TermHistory([(9, 1)]), 5) == 0
    assert common_prefix(leader, 30, TermHistory(), 0) == 0


# --- the log --------------------------------------------------------------------------------
def test_records_carry_their_term_and_recovery_reads_them(tmp_path):
    data_dir = str(tmp_path / "d")
    engine = engine_in(data_dir)
    workload(engine, 0)
    engine.close()
    engine = engine_in(data_dir, term=7)
    assert engine.begin_term(7, 0, "r1", lambda: True) > 0
    workload(engine, 1)
    engine.close()
    first, second = segments(data_dir)
    assert {t for _, t in frames(os.path.join(data_dir, first))} == {0}
    second_frames = frames(os.path.join(data_dir, second))
    assert {t for _, t in second_frames} == {7}
    reader = Reader(data_dir)
    reader.load_snapshot()
    assert [(r.lsn, r.term) for r in reader.records()][-1] == second_frames[-1]
    assert reader.terms.runs() == [(7, second_frames[0][0])]
    again = engine_in(data_dir)
    assert state(again) == state(reference(2))  # term_start changes no state
    assert again.log_state()[1].runs() == reader.terms.runs()
    again.close()


def test_recovery_refuses_a_record_whose_term_goes_down(tmp_path):
    data_dir = str(tmp_path / "d")
    engine = engine_in(data_dir, term=5)
    workload(engine, 0)
    last = engine.log_state()[0]
    engine.close()
    path = os.path.join(data_dir, segment_name(last + 1))
    with open(path, "wb") as f:
        f.write(segment_header(last + 1))
        f.write(encode_frame(last + 1, b'{"kind":"reset_prefix_cache","pool":"a"}', term=4))
    before = digest(data_dir)
    with pytest.raises(DataDirError, match="term 4 after one of term 5"):
        engine_in(data_dir)
    assert digest(data_dir) == before


def test_format_2_segments_read_as_term_0_and_the_log_continues_in_format_3(tmp_path):
    data_dir = str(tmp_path / "d")
    ref = build(data_dir)
    for name in segments(data_dir):
        to_format_2(os.path.join(data_dir, name))
    reader = Reader(data_dir)
    reader.load_snapshot()
    assert all(r.term == 0 for r in reader.records()) and {s.format for s in reader.segments} == {2}
    engine = engine_in(data_dir, term=3)
    assert state(engine) == state(ref)
    workload(engine, 3)
    engine.close()
    reader = Reader(data_dir)
    reader.load_snapshot()
    records = list(reader.records())
    assert [s.format for s in reader.segments] == [2, 2, 3]
    assert {r.term for r in records if r.lsn > 23} == {3} and reader.terms.runs() == [(3, 24)]
    again = engine_in(data_dir)
    assert state(again) == state(reference(4))
    again.close()


def test_a_snapshot_keeps_the_term_history(tmp_path):
    data_dir = str(tmp_path / "d")
    engine = engine_in(data_dir, term=2)
    workload(engine, 0)
    engine.close()
    engine = engine_in(data_dir, term=6)
    workload(engine, 1)
    runs = engine.log_state()[1].runs()
    engine.snapshot()  # covers every record: the history must come from the snapshot alone
    engine.close()
    assert segments(data_dir) and all(frames(os.path.join(data_dir, n)) == [] for n in segments(data_dir))
    reader = Reader(data_dir)
    snap = reader.load_snapshot()
    assert snap is not None and snap["terms"] == [list(r) for r in runs] and runs[0] == (2, 1)
    assert reader.terms.runs() == runs
    again = engine_in(data_dir)
    assert again.log_state()[1].runs() == runs
    again.close()


def test_truncate_after_cuts_the_tail_and_keeps_a_copy(tmp_path):
    data_dir = str(tmp_path / "d")
    engine = engine_in(data_dir)
    workload(engine, 0)
    engine.close()
    engine = engine_in(data_dir, term=4)
    keep = engine.log_state()[0]
    workload(engine, 1)
    engine.close()
    cut = log_cut.truncate_after(data_dir, keep, "a test")
    assert cut.move  # the whole second segment (its first record is keep + 1)
    quarantined = [n for n in os.listdir(data_dir) if n.startswith("quarantine-")]
    assert len(quarantined) == 1 and set(cut.move) <= set(os.listdir(os.path.join(data_dir, quarantined[0])))
    again = engine_in(data_dir)
    assert again.log_state()[0] == keep and again.log_state()[1].runs() == []
    assert state(again) == state(reference(1))
    again.close()
    assert log_cut.truncate_after(data_dir, keep + 5, "nothing to cut").describe() == "nothing"


def test_truncate_inside_a_segment_and_not_inside_the_snapshot(tmp_path):
    data_dir = str(tmp_path / "d")
    engine = engine_in(data_dir, term=1)
    workload(engine, 0)
    middle = engine.log_state()[0]
    workload(engine, 1)
    engine.close()
    cut = log_cut.truncate_after(data_dir, middle, "a deposed leader's tail")
    assert cut.truncate and not cut.move
    reader = Reader(data_dir)
    reader.load_snapshot()
    assert [r.lsn for r in reader.records()][-1] == middle
    engine = engine_in(data_dir, term=1)
    engine.snapshot()
    engine.close()
    before = digest(data_dir)
    with pytest.raises(log_cut.CannotTruncate):
        log_cut.truncate_after(data_dir, middle - 1, "inside the snapshot")
    assert digest(data_dir) == before
