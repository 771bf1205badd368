"""One daemon per data dir (:mod:`blockd.storage.lock`): a second ``blockd
serve`` on a locked directory is refused, naming the holder; the lock goes
with its holder, however it ends (SIGTERM, SIGKILL)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from blockd.cluster.local import ROOT, child_env
from blockd.core import PoolConfig
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.storage.lock import LOCK_NAME, DataDirLock, DataDirLocked
from blockd.storage.reader import DataDirError
from client.sdk import BlockdClient

pytest_plugins = ["tests.support.grpc_fixtures"]


def serve_once(data_dir: str) -> subprocess.CompletedProcess:
    """A second ``blockd serve`` that is expected to exit by itself."""
    return subprocess.run([sys.executable, "-m", "blockd.cli", "serve", "--listen", "127.0.0.1:0",
                           "--data-dir", data_dir], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_second_daemon_on_a_locked_data_dir_is_refused(daemon, tmp_path) -> None:
    data_dir = str(tmp_path / "data")
    first = daemon("--listen", "127.0.0.1:0", "--data-dir", data_dir, "--fsync", "never")
    with BlockdClient(first.address) as c:
        c.create_pool(PoolConfig("kept", num_blocks=8, block_size=4))
    second = serve_once(data_dir)
    assert second.returncode == 1
    assert (f"data dir {data_dir!r} is in use by another blockd (pid={first.pid} host={socket.gethostname()} "
            "started=") in second.stderr
    assert "blockd listening" not in second.stdout
    with BlockdClient(first.address) as c:  # the first one is untouched
        assert [p.name for p in c.list_pools()] == ["kept"]
    assert first.stop() == 0
    # released on exit: the next daemon gets it, and the state
    again = daemon("--listen", "127.0.0.1:0", "--data-dir", data_dir, "--fsync", "never")
    with BlockdClient(again.address) as c:
        assert [p.name for p in c.list_pools()] == ["kept"]
    again.kill()  # SIGKILL: the kernel drops the lock with the process
    third = daemon("--listen", "127.0.0.1:0", "--data-dir", data_dir, "--fsync", "never")
    assert f"pid={third.pid} " in (tmp_path / "data" / LOCK_NAME).read_text()


def test_the_engine_holds_the_lock_until_closed(tmp_path) -> None:
    engine = Engine(EngineConfig(data_dir=str(tmp_path)))
    with pytest.raises(DataDirLocked, match=f"pid={os.getpid()} "):
        Engine(EngineConfig(data_dir=str(tmp_path)))  # also within one process: two engines would be two writers
    engine.close()
    Engine(EngineConfig(data_dir=str(tmp_path))).close()


def test_a_failed_open_releases_the_lock(tmp_path) -> None:
    (tmp_path / "snapshot-000000000001.json").write_text("not a snapshot")
    with pytest.raises(DataDirError) as failed:
        Engine(EngineConfig(data_dir=str(tmp_path)))
    lock = DataDirLock(str(tmp_path))  # free again although `failed` keeps the engine's frame alive
    assert lock.is_held and failed.value is not None
    lock.release()
    lock.release()  # idempotent
    assert not lock.is_held
