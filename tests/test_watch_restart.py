"""A worker's Watch stream survives a daemon restart: the follower reconnects
from its last version and receives every later version exactly once."""

import time

from blockd.core import Allocate, Append, Fork, Free, PoolConfig
from blockd.core.types import WorkerInfo
from client.errors import BlockdClientError
from client.sdk import BlockdClient
from tests.procs import free_port, start_blockd
from worker.follower import Follower
from worker.runtime import WorkerRuntime


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _reachable(client: BlockdClient) -> bool:
    try:
        client.get_pool("m")
        return True
    except BlockdClientError:
        return False


def test_watch_resumes_after_restart_without_gap_or_duplicate(tmp_path):
    listen = f"127.0.0.1:{free_port()}"
    args = ("--data-dir", str(tmp_path), "--fsync", "always")
    config = PoolConfig("m", num_blocks=64, block_size=2, num_layers=1, num_kv_heads=1, head_dim=4,
                        dtype="float32")
    proc = start_blockd(*args, "--listen", listen)  # a fixed port, so the restart can take it again
    client = BlockdClient(listen, timeout_s=5)
    follower = None
    try:
        client.create_pool(config)
        runtime = WorkerRuntime(config, device="cpu")
        seen: list[int] = []
        original_push = runtime.replica.push

        def recording_push(delta):
            seen.append(delta.version)
            original_push(delta)

        runtime.replica.push = recording_push
        info = WorkerInfo("w", "m", "", 0, 1, 0, 1, incarnation=runtime.incarnation)
        follower = Follower(client, runtime, info, heartbeat_interval_s=0.1)
        follower.start()
        for i in range(5):
            client.step("m", [Allocate(f"s{i}", [i] * 3)])
        assert wait_for(lambda: runtime.replica.received_version == 5)

        proc.kill()  # SIGKILL: the stream breaks mid-flight
        proc = start_blockd(*args, "--listen", listen)
        assert wait_for(lambda: _reachable(client)), "the restarted daemon is not reachable"
        client.step("m", [Append("s0", [9]), Fork("s1", "f1")])
        client.step("m", [Free("s2")])
        assert wait_for(lambda: runtime.replica.received_version == 7)
        runtime.replica.advance_to(7, 1.0)
        assert runtime.replica.tables == client.get_tables("m")[1]
        assert seen == list(range(1, 8)), f"versions received: {seen}"
        assert runtime.replica.num_snapshots == 0
        # the heartbeat thread re-registered with the restarted daemon
        assert wait_for(lambda: [w.info.worker_id for w in client.list_workers("m")] == ["w"])
    finally:
        if follower is not None:
            follower.stop()
        client.close()
        proc.kill()
