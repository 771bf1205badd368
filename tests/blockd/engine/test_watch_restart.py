"""A worker's Watch stream survives a daemon restart: the follower reconnects
from its last version and receives every later version exactly once. A
stream from a paused daemon (SIGSTOP: its connection stays open, nothing
arrives) fails UNAVAILABLE within seconds by gRPC keepalive, and a quiet
stream is not ended by those pings."""

import os
import queue
import signal
import threading
import time

from blockd.core import Allocate, Append, Fork, Free, PoolConfig
from blockd.core.types import WorkerInfo
from client.errors import BlockdClientError, UnavailableError
from client.sdk import BlockdClient
from tests.support.procs import free_port, pause, start_blockd
from worker.attachment import Attachment
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
        original_push = runtime.mirror.push

        def recording_push(delta):
            seen.append(delta.version)
            original_push(delta)

        runtime.mirror.push = recording_push
        info = WorkerInfo("w", "m", "", 0, 1, 0, 1, incarnation=runtime.incarnation)
        follower = Attachment(client, runtime, info, heartbeat_interval_s=0.1)
        follower.start()
        for i in range(5):
            client.step("m", [Allocate(f"s{i}", [i] * 3)])
        assert wait_for(lambda: runtime.mirror.received_version == 5)

        proc.kill()  # SIGKILL: the stream breaks mid-flight
        proc = start_blockd(*args, "--listen", listen)
        assert wait_for(lambda: _reachable(client)), "the restarted daemon is not reachable"
        client.step("m", [Append("s0", [9]), Fork("s1", "f1")])
        client.step("m", [Free("s2")])
        assert wait_for(lambda: runtime.mirror.received_version == 7)
        runtime.mirror.advance_to(7, 1.0)
        assert runtime.mirror.tables == client.get_tables("m")[1]
        assert seen == list(range(1, 8)), f"versions received: {seen}"
        assert runtime.mirror.num_snapshots == 0
        # the heartbeat thread re-registered with the restarted daemon
        assert wait_for(lambda: [w.info.worker_id for w in client.list_workers("m")] == ["w"])
    finally:
        if follower is not None:
            follower.stop()
        client.close()
        proc.kill()


def test_a_quiet_stream_stays_open_and_a_paused_daemon_is_given_up(tmp_path):
    proc = start_blockd("--data-dir", str(tmp_path))
    client = BlockdClient(proc.address, timeout_s=5, max_attempts=1)
    items: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            for item in client.watch("m", 1, timeout_s=None):
                items.put(item)
        except Exception as err:  # noqa: BLE001 - handed to the test
            items.put(err)

    try:
        client.create_pool(PoolConfig("m", num_blocks=16, block_size=2))
        client.step("m", [Allocate("a", [1])])
        threading.Thread(target=read, daemon=True).start()
        # quiet for a while: the client pings every 2 s; a server that refused them (gRPC's default
        # allows one in 5 minutes without data, then two strikes) ends the stream after 4 pings, ~8 s
        time.sleep(11)
        assert items.empty(), f"the quiet stream ended: {items.get()!r}"
        client.step("m", [Allocate("b", [2])])
        assert items.get(timeout=5).version == 2
        pause(proc.pid)
        try:
            start = time.monotonic()
            err = items.get(timeout=20)  # keepalive: 2 s to the next ping, 4 s without its answer
            took = time.monotonic() - start
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert isinstance(err, UnavailableError), err
        assert took < 10, f"the stream from a paused daemon failed only after {took:.1f} s"
        client.step("m", [Allocate("c", [3])])  # the resumed daemon streams from where the caller was
        assert next(iter(client.watch("m", 2, timeout_s=5))).version == 3
    finally:
        client.close()
        proc.kill()
