"""``blockd check-data`` / ``repair-data`` / ``serve`` on damaged data dirs, as
processes; snapshots in a crash loop; compactions killed part-way."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from blockd.cluster.local import child_env
from blockd.core import Allocate, PoolConfig
from blockd.engine.config import EngineConfig
from blockd.engine.idempotency import IdempotencyLimits
from blockd.engine.machine import Engine
from blockd.engine.snapshots import CompactionFailed, run_compactor
from blockd.offline.compact import compact
from blockd.storage.lock import DirLock
from blockd.storage.reader import Reader
from blockd.storage.wal import COMPACT_LOCK
from client.sdk import BlockdClient
from tests.support.datadirs import build, data_files, digest, flip, reference, segments, state, workload
from tests.support.procs import start_blockd


def blockd(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockd.cli", *argv], env=child_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture
def built(tmp_path):
    data_dir = str(tmp_path / "data")
    return data_dir, build(data_dir)


def damage_middle(data_dir: str) -> str:
    name = segments(data_dir)[0]
    path = os.path.join(data_dir, name)
    flip(path, os.path.getsize(path) // 2)
    return name


def test_check_data_reports_a_healthy_dir(built):
    data_dir, _ = built
    done = blockd("check-data", data_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = segments(data_dir)
    assert "snapshot snapshot-000000000008.snap: format 2, lsn 8" in done.stdout
    assert f"segment {first}: format 3, 8 records, lsn 9-16" in done.stdout
    assert f"segment {second}: format 3, 7 records, lsn 17-23" in done.stdout
    assert "last lsn 23; 15 records after the snapshot" in done.stdout
    assert "pool a: version 22" in done.stdout and "OK: blockd would start" in done.stdout


def test_check_data_reports_a_torn_tail_and_changes_nothing(built):
    data_dir, _ = built
    path = os.path.join(data_dir, segments(data_dir)[-1])
    with open(path, "ab") as f:
        f.write(b"\x00" * 100)
    before = digest(data_dir)
    done = blockd("check-data", data_dir)
    assert done.returncode == 0 and "torn tail at byte" in done.stdout and "trailing zero bytes" in done.stdout
    assert digest(data_dir) == before


def test_serve_and_check_data_refuse_a_damaged_dir_with_the_same_error(built):
    data_dir, _ = built
    name = damage_middle(data_dir)
    before = digest(data_dir)
    served = blockd("serve", "--listen", "127.0.0.1:0", "--data-dir", data_dir, timeout=60)
    assert served.returncode == 1
    error = next(line for line in served.stderr.splitlines() if "ERROR" in line)
    assert name in error and "record checksum mismatch" in error and "check-data" in error
    assert "nothing on disk was changed" in error and "repair-data" in error
    checked = blockd("check-data", data_dir)
    assert checked.returncode == 1
    reason = error.split("the data dir is damaged: ", 1)[1].split("; nothing on disk")[0]
    assert f"error: {reason}" in checked.stdout
    assert digest(data_dir) == before


def test_repair_data_refuses_without_the_flag_then_cuts_keeping_a_copy(built):
    data_dir, _ = built
    name = damage_middle(data_dir)
    before = digest(data_dir)
    dry = blockd("repair-data", data_dir)
    assert dry.returncode == 2 and "--truncate-at-first-bad" in dry.stdout and digest(data_dir) == before
    reader = Reader(data_dir)
    lsns: list[int] = []
    with pytest.raises(Exception, match="checksum"):
        lsns.extend(record.lsn for record in reader.records())
    done = blockd("repair-data", data_dir, "--truncate-at-first-bad")
    assert done.returncode == 0, done.stdout
    (qdir,) = [n for n in os.listdir(data_dir) if n.startswith("quarantine-")]
    kept = digest(os.path.join(data_dir, qdir))
    # the damaged segment and the one after it, byte for byte as they were
    assert {k: v for k, v in kept.items() if k != "README.txt"} == {
        k: v for k, v in before.items() if k.startswith("wal-")}
    assert "README.txt" in kept
    assert blockd("check-data", data_dir).returncode == 0
    engine = Engine(EngineConfig(data_dir=data_dir))
    assert engine._durability._wal.lsn == lsns[-1]  # everything up to the bad record
    assert engine.get_pool("a").version == lsns[-1] - 1  # lsn 1 created the pool
    engine.close()
    assert name in os.listdir(os.path.join(data_dir, qdir))


def test_repair_data_refuses_while_a_daemon_serves_the_dir(built):
    data_dir, _ = built
    proc = start_blockd("--data-dir", data_dir)
    try:
        done = blockd("repair-data", data_dir, "--truncate-at-first-bad")
        assert done.returncode == 1 and "stop it before repairing" in done.stdout
        second = blockd("serve", "--listen", "127.0.0.1:0", "--data-dir", data_dir, timeout=60)
        assert second.returncode == 1 and "in use by another blockd" in second.stderr
    finally:
        proc.kill()


def test_repair_data_cannot_fix_a_damaged_snapshot(built):
    data_dir, _ = built
    snap = next(n for n in data_files(data_dir) if n.startswith("snapshot-"))
    flip(os.path.join(data_dir, snap), 40)
    before = digest(data_dir)
    done = blockd("repair-data", data_dir, "--truncate-at-first-bad")
    assert done.returncode == 1 and "backup" in done.stdout and digest(data_dir) == before


def test_snapshots_happen_in_a_crash_loop(tmp_path):
    """Each life writes fewer records than --snapshot-every and is SIGKILLed;
    the records in the log, replayed ones included, still bring snapshots."""
    data_dir, every, per_life, lives = str(tmp_path / "data"), 40, 15, 8
    for life in range(lives + 1):
        proc = start_blockd("--data-dir", data_dir, "--snapshot-every", str(every))
        try:
            if life == lives:  # a last life that stops gracefully, so its compaction finishes
                assert proc.stop(60) == 0
                break
            with BlockdClient(proc.address) as client:
                if life == 0:
                    client.create_pool(PoolConfig("p", num_blocks=4096, block_size=4))
                for i in range(per_life):
                    client.step("p", [Allocate(f"l{life}-{i}", [life, i, 1, 2, 3])])
        finally:
            proc.kill()
    reader = Reader(data_dir)
    reader.load_snapshot()
    for _ in reader.records():
        pass
    assert reader.last_lsn == 1 + lives * per_life
    assert reader.snapshot_lsn > 0, "no snapshot in a crash loop"
    # the last life compacted unless the log since the snapshot was below a
    # threshold: --snapshot-every records, or a quarter of the snapshot's size
    # (--snapshot-log-ratio 0.25)
    assert reader.records_after_snapshot < every or reader.bytes_after_snapshot < 0.25 * reader.snapshot_size
    engine = Engine(EngineConfig(data_dir=data_dir))
    assert engine.get_pool("p").num_seqs == lives * per_life
    engine.close()


#: a compactor in its own process that SIGKILLs itself at one point (the seam ``compact(at=...)``)
KILLED_AT = """
import os, signal, sys
from blockd.offline.compact import compact
data_dir, point, upto = sys.argv[1:]
def at(name):
    if name == point:
        os.kill(os.getpid(), signal.SIGKILL)
compact(data_dir, int(upto), prune=False, at=at)
"""


@pytest.mark.parametrize("point", ["written", "renamed"])
def test_a_compaction_killed_part_way_leaves_a_recoverable_dir(built, point):
    data_dir, ref = built
    Engine(EngineConfig(data_dir=data_dir)).close()  # every segment with records is now closed
    before = digest(data_dir)
    proc = subprocess.run([sys.executable, "-c", KILLED_AT, data_dir, point, "23"], env=child_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr
    leftovers = set(digest(data_dir)) - set(before)
    assert leftovers == ({"snapshot-000000000023.snap.tmp"} if point == "written" else {"snapshot-000000000023.snap"})
    engine = Engine(EngineConfig(data_dir=data_dir))
    assert state(engine) == state(ref)
    engine.close()
    # recovery removed the leftover, or used the new snapshot and pruned what it replaces
    names = data_files(data_dir)
    assert not [n for n in names if n.endswith(".tmp")]
    if point == "renamed":
        assert names[0] == "snapshot-000000000023.snap" and len([n for n in names if n.startswith("snap")]) == 1
    assert blockd("check-data", data_dir).returncode == 0


def test_a_compaction_killed_at_random_moments(tmp_path):
    data_dir = str(tmp_path / "data")
    engine = Engine(EngineConfig(data_dir=data_dir, snapshot_every=1 << 30))
    for part in range(4):
        workload(engine, part)
    engine.close()
    Engine(EngineConfig(data_dir=data_dir)).close()
    ref = state(reference(4))
    for delay in (0.05, 0.2, 0.4, 0.8):
        proc = subprocess.Popen([sys.executable, "-m", "blockd.cli", "compact", data_dir, "--no-prune"],
                                env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        engine = Engine(EngineConfig(data_dir=data_dir))
        assert state(engine) == ref
        engine.close()


def test_two_compactions_never_run_at_once(built):
    data_dir, _ = built
    Engine(EngineConfig(data_dir=data_dir)).close()
    lock = DirLock(data_dir, COMPACT_LOCK)
    assert lock.acquire(timeout_s=0)
    proc = subprocess.Popen([sys.executable, "-m", "blockd.cli", "compact", data_dir], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)  # long enough for it to have written a snapshot, were it not waiting
        assert proc.poll() is None and Reader(data_dir).snapshot_lsn == 8
    finally:
        lock.release()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert Reader(data_dir).snapshot_lsn == 23 and "\"lsn\": 23" in out
    # and an in-process compaction afterwards finds nothing to do
    assert compact(data_dir, 23).size == 0


def test_a_compactor_that_fails_is_reported_with_how_it_ended(built, tmp_path):
    data_dir, _ = built
    Engine(EngineConfig(data_dir=data_dir)).close()
    assert run_compactor(data_dir, 23, IdempotencyLimits()).lsn == 23
    with pytest.raises(CompactionFailed, match=r"the compactor failed \(exit code \d+\)"):
        run_compactor(str(tmp_path / "nowhere"), 5, IdempotencyLimits())
