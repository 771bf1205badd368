"""The background fsync thread (blockd.storage.fsyncer), compiled and Python:
what it says, in what order, on failure, and how the log and the engine take it.

The syncs are real fdatasyncs of files in the test's directory; a failure is a
real one too (fdatasync of a pipe is EINVAL), so the compiled thread's error
path runs without patching anything."""

from __future__ import annotations

import errno
import os
import select

import pytest

from blockd.core import Allocate, InvariantViolation, PoolConfig
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.storage import fsyncer as fsyncer_module
from blockd.storage.fsyncer import Fsyncer
from blockd.storage.reader import Reader
from blockd.storage.wal import WriteAheadLog

COMPILED = fsyncer_module.BUILD == "compiled"


def _build(name: str) -> Fsyncer:
    if name == "compiled" and not COMPILED:
        if os.environ.get("BLOCKD_EXPECT_COMPILED") == "1":
            pytest.fail(f"BLOCKD_EXPECT_COMPILED=1 but the fsyncer runs as {fsyncer_module.BUILD}")
        pytest.skip(f"the fsyncer runs as {fsyncer_module.BUILD}; `make setup` compiles it where a C compiler "
                    "and Python's headers are present (BLOCKD_EXPECT_COMPILED=1 makes this a failure)")
    made = Fsyncer(python=name == "python")
    assert made.build == name
    return made


@pytest.fixture(params=["compiled", "python"])
def fsyncer(request):
    made = _build(request.param)
    yield made
    made.close()


def _wait_done(fsyncer: Fsyncer, until_lsn: int, timeout_s: float = 10.0) -> list[tuple[int, int, float]]:
    said: list[tuple[int, int, float]] = []
    while not said or said[-1][0] < until_lsn:
        ready, _, _ = select.select([fsyncer.fileno()], [], [], timeout_s)
        assert ready, f"the fsyncer said nothing within {timeout_s} s (so far {said})"
        said += fsyncer.done()
    return said


def test_a_request_is_synced_and_said_once(fsyncer, tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"record")
        fsyncer.request(fd, 7)
    finally:
        os.close(fd)  # the fsyncer synced its own dup: closing ours at once is fine
    ((lsn, err, seconds),) = _wait_done(fsyncer, 7)
    assert (lsn, err) == (7, 0) and 0 <= seconds < 10
    assert fsyncer.done() == []  # said once
    assert (tmp_path / "f").read_bytes() == b"record"


def test_requests_coalesce_and_completions_come_in_order(fsyncer, tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for lsn in range(1, 201):
            os.write(fd, b"x" * 64)
            fsyncer.request(fd, lsn)
        said = _wait_done(fsyncer, 200)
    finally:
        os.close(fd)
    lsns = [lsn for lsn, _, _ in said]
    assert lsns == sorted(lsns) and lsns[-1] == 200, lsns
    assert all(err == 0 for _, err, _ in said)
    assert len(lsns) <= 200  # fewer when requests met a sync under way (never more)


def test_a_failed_sync_says_its_errno(fsyncer):
    read, write = os.pipe()  # fdatasync of a pipe fails with EINVAL
    try:
        fsyncer.request(write, 3)
        ((lsn, err, _),) = _wait_done(fsyncer, 3)
    finally:
        os.close(read)
        os.close(write)
    assert (lsn, err) == (3, errno.EINVAL)


def test_bad_requests_are_refused_and_a_closed_one_says_so(fsyncer, tmp_path):
    with pytest.raises(OSError, match="Bad file descriptor") as bad:
        fsyncer.request(987654, 1)  # not an open descriptor
    assert bad.value.errno == errno.EBADF
    assert fsyncer.done() == []  # nothing was asked
    with pytest.raises((TypeError, OverflowError)):
        fsyncer.request("3", 1)  # type: ignore[arg-type]
    fsyncer.close()
    fsyncer.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        fsyncer.request(0, 1)
    with pytest.raises(ValueError, match="closed"):
        fsyncer.fileno()


def test_a_stale_compiled_fsyncer_is_not_used(monkeypatch):
    if not COMPILED:
        pytest.skip(f"the fsyncer runs as {fsyncer_module.BUILD}: there is no compiled build to find stale")
    from blockd.storage import _fsyncer  # type: ignore[attr-defined]

    monkeypatch.setattr(_fsyncer, "SOURCE_SHA256", "0" * 64)
    native, why = fsyncer_module._native()
    assert native is None and "_fsyncer.c changed since it was compiled" in why
    monkeypatch.setenv("BLOCKD_PURE_PYTHON", "1")
    assert fsyncer_module._native() == (None, "BLOCKD_PURE_PYTHON=1")


def test_the_log_syncs_behind_and_counts_only_what_was_said(fsyncer, tmp_path):
    syncs: list[float] = []
    log = WriteAheadLog(str(tmp_path), 0, "always", observe_sync=syncs.append)
    log.open_for_append()
    try:
        for _ in range(3):
            log.append(b'{"kind":"x"}', defer_sync=True)
        assert log.durable_lsn == 0
        assert log.sync_behind(2, fsyncer)
        assert log.durable_lsn == 0  # asked, not yet said
        ((lsn, err, seconds),) = _wait_done(fsyncer, 3)
        assert (lsn, err) == (3, 0)  # it synced everything written when asked
        log.synced_behind(lsn, seconds)
        assert log.durable_lsn == 3 and syncs == [seconds]
        assert not log.sync_behind(3, fsyncer)  # durable already: nothing asked
        assert fsyncer.done() == []
    finally:
        log.close()


def _engine(tmp_path) -> Engine:
    engine = Engine(EngineConfig(data_dir=str(tmp_path), fsync="always"))
    engine.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
    return engine


def _held_step(engine: Engine, seq: str) -> int:
    held = engine.hold()
    assert held is not None
    try:
        engine.step("p", [Allocate(seq, [1, 2, 3])])
    finally:
        lsn = held.release()
    return lsn


def test_the_engine_acknowledges_behind_and_the_records_read_back(fsyncer, tmp_path):
    engine = _engine(tmp_path)
    try:
        assert engine.syncs_behind
        lsn = _held_step(engine, "a")
        assert engine.waits(lsn)
        assert engine.acknowledge_behind(lsn, fsyncer)
        for said in _wait_done(fsyncer, lsn):
            engine.acknowledged_behind(*said)
        assert not engine.waits(lsn)
    finally:
        engine.close()
    assert any(record.body.get("kind") == "step" for record in Reader(str(tmp_path)).records())


def test_a_failed_sync_behind_breaks_the_log_and_refuses_what_follows(fsyncer, tmp_path):
    engine = _engine(tmp_path)
    try:
        lsn = _held_step(engine, "a")
        assert engine.acknowledge_behind(lsn, fsyncer)
        for said in _wait_done(fsyncer, lsn):
            engine.acknowledged_behind(*said)
        lsn = _held_step(engine, "b")
        with pytest.raises(InvariantViolation, match="write-ahead log failed"):
            engine.acknowledged_behind(lsn, errno.EIO, 0.001)  # what a failed fdatasync says
        assert engine.waits(lsn)  # never durable now
        with pytest.raises(InvariantViolation, match="write-ahead log failed"):
            engine.acknowledge_behind(lsn, fsyncer)
        with pytest.raises(InvariantViolation, match="write-ahead log failed"):
            engine.acknowledged_behind(lsn, 0, 0.001)  # a later sync that succeeds vouches for nothing
        with pytest.raises(Exception, match="write-ahead log failed"):
            engine.step("p", [Allocate("c", [1])])  # fail-stop
    finally:
        engine.close()
