"""Group commit under ``--fsync always``: records written while an fsync runs
share the next one, each writer returns only once its own record is fsynced,
and the engine's steps of unrelated pools fsync outside its lock, together.

The disk here is made slow (each ``os.fsync`` also sleeps), so that writers
meet while an fsync runs whatever this machine's disk is like; the fsyncs are
real and the records are read back from the directory."""

from __future__ import annotations

import os
import threading
import time

import pytest

from blockd.core import Allocate, PoolConfig
from blockd.core.types import DecodeAppend
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.storage import wal as wal_module
from blockd.storage.reader import Reader
from blockd.storage.wal import WriteAheadLog

SLOW_S = 0.01


@pytest.fixture
def slow_disk(monkeypatch):
    """os.fsync as the WAL calls it, SLOW_S slower; the LSNs each one covered."""
    covered: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        time.sleep(SLOW_S)
        real(fd)
        covered.append(1)

    monkeypatch.setattr(wal_module.os, "fsync", fsync)
    return covered


def _together(work, count: int) -> None:
    """``work(n)`` for n in range(count), each on its own thread, all at once."""
    threads = [threading.Thread(target=work, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def test_writers_share_fsyncs_and_each_returns_after_its_own(tmp_path, slow_disk):
    log = WriteAheadLog(str(tmp_path), 0, "always")
    log.open_for_append()
    writers, each = 8, 25
    late: list[tuple[int, int]] = []
    engine_lock = threading.Lock()  # appends are serialised (the engine's lock), the fsyncs are not

    def write(n: int) -> None:
        for i in range(each):
            with engine_lock:
                lsn = log.append(f'{{"w":{n},"i":{i}}}'.encode(), defer_sync=True)
            log.sync_to(lsn)
            if log.durable_lsn < lsn:
                late.append((lsn, log.durable_lsn))

    before = len(slow_disk)
    _together(write, writers)
    fsyncs = len(slow_disk) - before
    log.close()
    assert not late, "a writer returned before its record was fsynced"
    assert log.durable_lsn == log.lsn == writers * each
    # while one fsync runs the other writers write: far fewer fsyncs than records
    assert fsyncs <= writers * each // 2, fsyncs
    records = list(Reader(str(tmp_path)).records())
    assert [r.lsn for r in records] == list(range(1, writers * each + 1))
    assert sorted((r.body["w"], r.body["i"]) for r in records) == [(n, i) for n in range(writers) for i in range(each)]


def test_a_record_written_without_deferring_is_fsynced_at_once(tmp_path, slow_disk):
    log = WriteAheadLog(str(tmp_path), 0, "always")
    log.open_for_append()
    lsn = log.append(b'{"a":1}')
    assert log.durable_lsn == lsn
    deferred = log.append(b'{"a":2}', defer_sync=True)
    assert log.durable_lsn == lsn < deferred
    log.rotate()  # a rotation fsyncs what it closes
    assert log.durable_lsn == deferred
    log.close()


def test_steps_of_unrelated_pools_share_fsyncs(tmp_path, slow_disk):
    engine = Engine(EngineConfig(data_dir=str(tmp_path), fsync="always"))
    pools, steps = 4, 15
    for n in range(pools):
        engine.create_pool(PoolConfig(f"p{n}", num_blocks=256, block_size=4))
        engine.step(f"p{n}", [Allocate("s", [1, 2, 3])])
    versions: dict[int, list[int]] = {n: [] for n in range(pools)}

    def scheduler(n: int) -> None:
        for _ in range(steps):
            versions[n].append(engine.step(f"p{n}", [DecodeAppend(["s"], [7])]).version)

    before = len(slow_disk)
    _together(scheduler, pools)
    fsyncs = len(slow_disk) - before
    assert all(len(v) == steps for v in versions.values())
    # one fsync per step would be pools * steps; the schedulers met while fsyncs ran
    assert fsyncs < pools * steps * 3 // 4, fsyncs
    expected = engine.capture()
    engine.close()
    # every acknowledged step is in the log: the directory replays to the same state
    again = Engine(EngineConfig(data_dir=str(tmp_path), fsync="always"))
    try:
        assert again.capture() == expected
    finally:
        again.close()
