"""Log replication between real daemons (``blockd serve --etcd``) over a real etcd (docs/ha.md).

Three replicas of one group in ``sync`` mode: followers refuse calls with
NOT_LEADER naming the leader, and only the leader's ``blockd.v1.Leader``
health is SERVING; the chaos test kills the leader (SIGKILL)
``BLOCKD_HA_KILLS`` times (default 12) under a worker and four schedulers'
load, and after each failover every acknowledged step is on the new leader,
the steps in flight at the kill, resent there with their request ids, are
applied at most once, and the worker's tables equal the leader's; a leader paused
past its lease acknowledges nothing once resumed and steps down, and a worker
moves to the new leader while the old one is still paused; a follower
stopped past the retained window catches up from the leader's snapshot; in
``async`` mode a worker that received versions a failover lost resyncs from
a snapshot; a
replica whose data dir was lost does not lead with its empty log, however
long it campaigns alone, and rejoins the in-sync set once caught up; each
replica's /metrics shows its role, the leader's view of every follower (lag,
in-sync) and the follower's feed, and a killed follower's lag and removal;
a group serving mutual TLS, or tokens, replicates with its peer credentials
(an admin identity) and refuses the replication stream to anyone else;
acknowledgements on ``StreamAcks`` are checked as calls are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import deque
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from blockd.auth import TlsConfig, tokens
from blockd.auth.channels import open_channel
from blockd.core import Allocate, DecodeAppend, Free, PoolConfig
from blockd.core.types import WorkerInfo
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.ha.etcd import EtcdClient
from blockd.ha.group import read_status
from blockd.ha.insync import InSyncSet
from blockd.storage.wal import parse_name
from blockd.v1 import replication_pb2 as rpb
from blockd.v1 import replication_pb2_grpc as rpb_grpc
from client.aio import AsyncBlockdClient
from client.errors import BlockdClientError, FailedPreconditionError, InvalidArgumentError, from_rpc_error
from client.scheduler import SchedulerConfig
from client.sdk import BlockdClient
from client.serving import GenerationRequest
from tests.support.ha_fixtures import wait_for
from tests.support.procs import Proc, free_port, start_blockd
from tests.support.slot_model import check_outputs, make
from worker.attachment import Attachment
from worker.runtime import WorkerRuntime

pytest_plugins = ["tests.support.etcd", "tests.support.auth_fixtures", "tests.support.grpc_fixtures"]

KILLS = int(os.environ.get("BLOCKD_HA_KILLS", "12"))
#: a loaded test machine must not make a healthy leader miss its keepalives
TTL_S = "4"


class Group:
    """Three replicas of a new group, each with its own data dir; restartable."""

    def __init__(self, etcd_url: str, root: str, *extra: str, metrics: bool = False, tls: TlsConfig | None = None,
                 token: str | None = None) -> None:
        self.etcd_url, self.root, self.extra, self.tls, self.token = etcd_url, root, extra, tls, token
        self.metrics_ports: dict[str, int] | None = {} if metrics else None
        # one etcd serves the module: each test's group must not inherit another's in-sync set
        self.name = f"g-{uuid.uuid4().hex[:8]}"
        self.procs: dict[str, Proc] = {}
        self.clients: dict[str, BlockdClient] = {}
        self.dead: list[BlockdClient] = []

    def start(self, rid: str) -> None:
        """Start (or restart, on its old address) replica ``rid``."""
        old = self.procs.get(rid)
        args = ["--data-dir", os.path.join(self.root, rid), "--etcd", self.etcd_url, "--replica-id", rid,
                "--group", self.name, "--lease-ttl-s", TTL_S, "--ack-timeout-s", "2", *self.extra]
        if self.metrics_ports is not None:
            args += ["--metrics-port", str(self.metrics_ports.setdefault(rid, free_port()))]
        proc = start_blockd(*args) if old is None else Proc(["-m", "blockd.cli", "serve", "--listen", old.address,
                                                             *args], "blockd listening on")
        self.procs[rid] = proc
        # each talks to its own replica: a refusal is raised, not followed to the leader
        self.clients[rid] = BlockdClient(proc.address, timeout_s=10, max_attempts=1, follow_leader=False,
                                         tls=self.tls, token=self.token)

    def kill(self, rid: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[rid].pid, sig)
        if sig == signal.SIGKILL:
            self.procs[rid].popen.wait()
            self.dead.append(self.clients.pop(rid))  # closed at the end: a load thread may still hold it

    def outputs(self, lines: int = 30) -> str:
        """The last lines each replica printed, for a failure's message."""
        return "\n".join(f"--- {rid}:\n" + "\n".join(proc.output().splitlines()[-lines:])
                         for rid, proc in self.procs.items())

    def leader(self) -> str | None:
        return next((rid for rid, client in list(self.clients.items()) if _serves(client)), None)

    def close(self) -> None:
        for client in [*self.clients.values(), *self.dead]:
            client.close()
        for proc in self.procs.values():
            proc.kill()


@pytest.fixture
def group(etcd_server) -> Iterator:
    made: list[Group] = []
    with tempfile.TemporaryDirectory(prefix="blockd-ha-") as root:
        def make(*extra: str, metrics: bool = False, tls: TlsConfig | None = None, token: str | None = None) -> Group:
            g = Group(etcd_server.url, os.path.join(root, str(len(made))), *extra, metrics=metrics, tls=tls,
                      token=token)
            made.append(g)
            for rid in ("r0", "r1", "r2"):
                g.start(rid)
            return g

        try:
            yield make
        finally:
            for g in made:
                g.close()


def ready(g: Group) -> str:
    """The leader, once a step it acknowledges has reached a follower."""
    def step_ok() -> str | None:
        rid = g.leader()
        if rid is None:
            return None
        try:
            g.clients[rid].create_pool(PoolConfig("p", num_blocks=4096, block_size=4), request_id="create-p")
        except BlockdClientError:
            return None
        return rid

    return wait_for(step_ok, "a leader that acknowledges a replicated step", timeout_s=60)


def _worker(g: Group, leader: str, num_blocks: int) -> tuple[WorkerRuntime, BlockdClient, Attachment]:
    """Pool ``w`` made on the leader and an in-process worker for it (not started) that
    follows Watch through every replica's address, as a real worker's SDK does."""
    config = PoolConfig("w", num_blocks=num_blocks, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4,
                        dtype="float32")
    g.clients[leader].create_pool(config, request_id="create-w")
    runtime = WorkerRuntime(config, device="cpu")
    client = BlockdClient(",".join(p.address for p in g.procs.values()), timeout_s=60)
    follower = Attachment(client, runtime, WorkerInfo("w0", "w", "", 0, 1, 0, 1, incarnation=runtime.incarnation),
                        heartbeat_interval_s=0.2)
    return runtime, client, follower


def test_followers_refuse_naming_the_leader(group):
    g = group()
    leader = ready(g)
    follower = next(rid for rid in g.clients if rid != leader)
    with pytest.raises(FailedPreconditionError) as info:
        g.clients[follower].step("p", [Allocate("x", [1, 2, 3])], request_id="on-a-follower")
    assert info.value.reason == "NOT_LEADER"
    assert info.value.metadata["leader_id"] == leader
    assert info.value.metadata["leader_address"] == g.procs[leader].address
    g.clients[leader].step("p", [Allocate("x", [1, 2, 3])], request_id="on-the-leader")
    assert "x" in g.clients[leader].get_tables("p")[1]
    # every live replica is SERVING; the leader-only health name tells load balancers which one leads
    serving = health_pb2.HealthCheckResponse.SERVING
    for rid, proc in g.procs.items():
        with grpc.insecure_channel(proc.address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == serving
            leads = check(health_pb2.HealthCheckRequest(service="blockd.v1.Leader"), timeout=10).status
            assert (leads == serving) == (rid == leader), (rid, leads)


@pytest.mark.timeout(900)  # 20 failovers of a lease TTL each, on a shared 2-core machine: 4-8 minutes
def test_chaos_leader_killed_under_a_worker_and_four_schedulers(group):
    """The issue's chaos test: three replicas in sync mode, a worker following
    Watch and four schedulers stepping through the SDK (every replica's
    address given, so calls follow the leader and resend with the same
    request id); the leader is SIGKILLed at a random moment ``KILLS`` times.
    After each failover the load is paused and checked: every acknowledged
    sequence is on the new leader and every acknowledged free is applied
    (0 lost); no step was applied twice (each allocates or frees a sequence,
    so a second application would fail, and every scheduler's call
    succeeded); the worker received every version once, in order, without a
    snapshot, and its tables equal the leader's; the terms acknowledging steps
    never go down, and the worker's replica names the new leader's term."""
    g = group()
    leader = ready(g)
    addresses = ",".join(p.address for p in g.procs.values())
    runtime, worker_client, follower = _worker(g, leader, 8192)
    delivered: list[int] = []
    push = runtime.mirror.push

    def recording_push(delta) -> None:
        delivered.append(delta.version)
        push(delta)

    runtime.mirror.push = recording_push  # type: ignore[method-assign]
    follower.start()
    load = _Load(addresses, schedulers=4)
    rng = random.Random(int(os.environ.get("BLOCKD_HA_SEED", "14")))
    failovers: list[float] = []
    in_sync = InSyncSet(EtcdClient(g.etcd_url), g.name)
    try:
        load.start()
        for kill in range(KILLS):
            wait_for(lambda: len(in_sync.members()) == 3, "all three replicas in the in-sync set", timeout_s=60)
            before = load.count()
            wait_for(lambda before=before: load.count() >= before + 20, "steps acknowledged under load")
            time.sleep(rng.uniform(0.0, 0.5))  # a random moment in the load
            at, count = time.monotonic(), load.count()
            g.kill(leader)
            wait_for(lambda count=count: load.count() > count + 4 or load.errors, "steps after the failover",
                     timeout_s=60)
            failovers.append(time.monotonic() - at)
            assert not load.errors, load.errors
            old, leader = leader, wait_for(g.leader, "the new leader", timeout_s=60)
            assert leader != old
            # the killed replica restarts (as a follower; its uncommitted tail, if any, is cut)
            # while the load is paused and checked
            with concurrent.futures.ThreadPoolExecutor(1) as restart:
                restarted = restart.submit(g.start, old)
                with load.paused():
                    _check(g.clients[leader], load, runtime, delivered, kill)
                restarted.result()
    finally:
        load.stop()
        follower.stop()
        worker_client.close()
    assert not load.errors, load.errors
    assert load.count() >= 20 * KILLS and len(failovers) == KILLS
    print(f"chaos: {KILLS} kills, {load.count()} steps acknowledged, failover (kill to the next ack) "
          f"max {max(failovers):.2f} s")


def test_async_a_worker_holding_versions_the_new_leader_lacks_resyncs_from_a_snapshot(group):
    """``async``: both followers are killed, the leader acknowledges steps that a worker
    receives over Watch, then the leader dies and the followers come back. The new leader never had those versions and
    makes others under the same numbers; the worker, reconnecting with the old term, gets a
    snapshot rather than deltas on top of what it holds, and its tables equal the new
    leader's (without it they would mix the lost steps with the new ones); it registers as a
    new worker incarnation, so blockd marks every sequence's KV lost (the KV it wrote for the
    lost steps may sit in blocks the new leader gives to others)."""
    g = group("--replication", "async")
    leader = ready(g)
    runtime, worker_client, follower = _worker(g, leader, 1024)
    for i in range(5):
        g.clients[leader].step("w", [Allocate(f"base{i}", [i, i, i])], request_id=f"base{i}")
    first_incarnation = runtime.incarnation
    follower.start()
    followers = [rid for rid in g.procs if rid != leader]
    try:
        version = g.clients[leader].get_tables("w")[0]
        wait_for(lambda: runtime.mirror.received_version >= version, "the worker to catch up")
        def replicated() -> bool:  # both followers hold everything so far (GetReplicaStatus)
            status = g.clients[leader].replica_status()
            return len(status.followers) == 2 and all(f.lag_records == 0 for f in status.followers)

        wait_for(replicated, "both followers to hold the pool and its first steps")
        for rid in followers:
            g.kill(rid)
        for i in range(5):  # acknowledged (async), seen by the worker, never replicated
            g.clients[leader].step("w", [Allocate(f"lost{i}", [7, 7, 7, 7, 7])], request_id=f"lost{i}")
        lost_version = g.clients[leader].get_tables("w")[0]
        wait_for(lambda: runtime.mirror.received_version >= lost_version, "the worker to receive the lost steps")
        assert runtime.mirror.num_snapshots == 0
        g.kill(leader)
        for rid in followers:
            g.start(rid)  # on their own logs, which lack the lost steps
        new = wait_for(lambda: (lambda r: r if r not in (None, leader) else None)(g.leader()), "a new leader",
                       timeout_s=60)
        for i in range(10):
            g.clients[new].step("w", [Allocate(f"new{i}", [i + 1, i + 2])], request_id=f"new{i}")
        version, tables = g.clients[new].get_tables("w")
        assert version > lost_version and not any(s.startswith("lost") for s in tables)
        wait_for(lambda: runtime.mirror.received_version >= version and runtime.mirror.term > 0,
                 "the worker to follow the new leader", timeout_s=60)
        runtime.mirror.advance_to(version, 10.0)
        assert runtime.mirror.tables == tables
        assert runtime.mirror.num_snapshots == 1
        # nor is the KV trusted: the worker came back as a new incarnation, so blockd marked every
        # sequence's KV lost (a scheduler recomputes) and cleared the prefix cache
        assert follower.info.incarnation == runtime.incarnation != first_incarnation
        # every sequence the pool held when the worker came back (the five before the failover at
        # least; the new ones too if they came first) lost its KV
        wait_for(lambda: g.clients[new].get_pool("w").num_kv_lost_seqs >= 5,
                 "blockd to mark the KV of the sequences lost", timeout_s=30)
        with pytest.raises(FailedPreconditionError) as info:
            g.clients[new].step("w", [DecodeAppend(["base0"], [5])], request_id="after-resync")
        assert info.value.reason == "KV_LOST"
    finally:
        follower.stop()
        worker_client.close()


def test_async_a_scheduler_recomputes_what_a_failover_lost(group):
    """``async``: the leader alone acknowledges the steps that admit some requests and
    decode the others, then dies; the new leader never had those steps. Planned on them,
    the scheduler's next step would name sequences the leader lacks (``late*``) or append at
    the wrong position (``early*``). It names the term of its previous step, so the new
    leader refuses it (TERM_CHANGED); the scheduler recomputes every running request and
    every request ends with the reference tokens. A step that names no term, or the new
    one, is not refused."""
    g = group("--replication", "async")
    leader = ready(g)
    addresses = ",".join(p.address for p in g.procs.values())
    client = BlockdClient(addresses, timeout_s=60)
    try:
        # "short" finishes while only the leader logs, so the Free of its sequence is lost too
        early = [GenerationRequest(f"early{i}", (1 + i, 2, 3, 4, 5), 40) for i in range(3)]
        early.append(GenerationRequest("short", (6, 5, 4, 3, 2), 5))
        late = [GenerationRequest(f"late{i}", (9, 8, 7 + i), 40) for i in range(3)]
        client.delete_pool("p")  # ready()'s; make() creates its own
        sched, model = make(client, 256, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16))
        for req in early:
            sched.add_request(req)
        for _ in range(3):
            sched.step()

        def replicated() -> bool:
            status = client.replica_status()
            return len(status.followers) == 2 and all(f.lag_records == 0 for f in status.followers)

        wait_for(replicated, "both followers to hold the first steps")
        followers = [rid for rid in g.procs if rid != leader]
        for rid in followers:
            g.kill(rid)
        for req in late:  # admitted by steps only the leader logs
            sched.add_request(req)
        for _ in range(3):
            sched.step()
        assert {s.request.request_id for s in sched.running} >= {req.request_id for req in late}
        assert "short" not in {s.request.request_id for s in sched.running}  # finished and freed
        g.kill(leader)
        for rid in followers:
            g.start(rid)
        wait_for(lambda: g.leader() not in (None, leader), "a new leader", timeout_s=60)
        model.slots.clear()  # the worker's resync (a new incarnation): its KV is not trusted
        with pytest.raises(FailedPreconditionError) as refused:
            client.step("p", [], previous_term=sched.term, dry_run=True)
        new_term = int(refused.value.metadata["term"])
        assert refused.value.reason == "TERM_CHANGED" and new_term > sched.term
        client.step("p", [], previous_term=new_term, dry_run=True)
        client.step("p", [], dry_run=True)
        with pytest.raises(InvalidArgumentError, match="newer than any term"):
            client.step("p", [], previous_term=new_term + 1, dry_run=True)
        outputs = sched.run()
        check_outputs(outputs, early + late)
        c = sched.counters
        # every sequence is freed at the end: "short.0" too, whose Free the failover lost
        assert c.num_term_changes == 1 and c.num_lost_seqs >= len(late) and sched.term == new_term
        assert client.get_pool("p").num_seqs == 0
    finally:
        client.close()


def _check(client: BlockdClient, load: _Load, runtime: WorkerRuntime, delivered: list[int], kill: int) -> None:
    version, tables = client.get_tables("w")
    lost = sorted(load.alive() - set(tables))
    assert not lost, f"acknowledged sequences lost after failover {kill + 1}: {lost[:10]}"
    undone = sorted(load.freed() & set(tables))
    assert not undone, f"acknowledged frees undone after failover {kill + 1}: {undone[:10]}"
    assert set(tables) == load.alive(), "the leader holds sequences no scheduler was told of"
    wait_for(lambda: runtime.mirror.received_version >= version, f"the worker to receive version {version}",
             timeout_s=60)
    runtime.mirror.advance_to(version, 10.0)
    assert runtime.mirror.tables == tables, f"the worker's tables differ from the leader's after failover {kill + 1}"
    assert delivered == list(range(1, len(delivered) + 1)), "the worker saw a version twice or missed one"
    assert runtime.mirror.num_snapshots == 0
    assert runtime.mirror.term == load.term > 0, "the worker's replica does not name the new leader's term"


class _Load:
    """``schedulers`` threads, each with its own SDK client, stepping until stopped:
    allocate a new sequence, and free its oldest once it holds 50."""

    def __init__(self, addresses: str, schedulers: int) -> None:
        self._clients = [BlockdClient(addresses, timeout_s=60) for _ in range(schedulers)]
        self._lock = threading.Lock()
        self._alive: set[str] = set()
        self._freed: set[str] = set()
        self._steps = 0
        self.term = 0  #: the newest leader term that acknowledged a step
        self.errors: list[str] = []
        self._stop, self._run = threading.Event(), threading.Event()
        self._idle = [threading.Event() for _ in range(schedulers)]
        self._threads = [threading.Thread(target=self._scheduler, args=(k,), daemon=True)
                         for k in range(schedulers)]

    def start(self) -> None:
        self._run.set()
        for thread in self._threads:
            thread.start()

    def count(self) -> int:
        with self._lock:
            return self._steps

    def alive(self) -> set[str]:
        with self._lock:
            return set(self._alive)

    def freed(self) -> set[str]:
        with self._lock:
            return set(self._freed)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._run.clear()
        for idle in self._idle:
            assert idle.wait(120), "a scheduler's step did not return"
        try:
            yield
        finally:
            self._run.set()

    def stop(self) -> None:
        self._stop.set()
        self._run.set()
        for thread in self._threads:
            thread.join(120)
        for client in self._clients:
            client.close()

    def _scheduler(self, k: int) -> None:
        client, mine, n = self._clients[k], deque[str](), 0
        while not self._stop.is_set():
            if not self._run.is_set():
                self._idle[k].set()
                self._run.wait()
                continue
            self._idle[k].clear()
            n += 1
            seq = f"k{k}-{n}"
            ops: list = [Allocate(seq, [k, n, n + 1])]
            oldest = mine[0] if len(mine) >= 50 else None
            if oldest is not None:
                ops.append(Free(oldest))
            try:
                result = client.step("w", ops, request_id=f"chaos-{k}-{n}")
            except BlockdClientError as err:
                self.errors.append(f"scheduler {k} step {n}: {err}")
                self._idle[k].set()
                return
            mine.append(seq)
            if result.term < self.term:
                self.errors.append(f"scheduler {k} step {n}: acknowledged in term {result.term} after term "
                                   f"{self.term}")
            with self._lock:
                self.term = max(self.term, result.term)
                self._steps += 1
                self._alive.add(seq)
                if oldest is not None:
                    mine.popleft()
                    self._alive.discard(oldest)
                    self._freed.add(oldest)
        self._idle[k].set()


def test_a_paused_leader_acknowledges_nothing_and_steps_down(group):
    g = group()
    leader = ready(g)
    # a worker follows Watch: it must move to the new leader while the old one is still paused
    runtime, worker_client, follower = _worker(g, leader, 64)
    # Both followers in the in-sync set: the one that does not win must leave the paused leader's
    # open feed (it sends nothing, and never ends) for the new leader's, or the new leader cannot
    # commit its first record. That follower used to wait on the paused leader for ever.
    wait_for(lambda: sum(f.in_sync for f in g.clients[leader].replica_status().followers) == 2,
             "both followers in the in-sync set")
    try:
        follower.start()
        g.clients[leader].step("w", [Allocate("before", [1, 2])], request_id="w-before")
        wait_for(lambda: runtime.mirror.received_version >= 1, "the worker to follow the leader")
        g.kill(leader, signal.SIGSTOP)
        others = {rid: c for rid, c in g.clients.items() if rid != leader}
        try:
            new = wait_for(lambda: next((rid for rid, c in others.items() if _serves(c)), None), "a new leader",
                           timeout_s=60)
            # the worker's Watch to the paused leader gets no error by itself; gRPC keepalive ends it
            version = g.clients[new].step("w", [Allocate("after", [3])], request_id="w-after").version
            wait_for(lambda: runtime.mirror.received_version >= version,
                     "the worker to follow the new leader while the old one is paused", timeout_s=30)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{g.outputs()}") from None
        finally:
            g.kill(leader, signal.SIGCONT)
        runtime.mirror.advance_to(version, 10.0)
        assert runtime.mirror.tables == g.clients[new].get_tables("w")[1]
    finally:
        follower.stop()
        worker_client.close()
    old = g.clients[leader]
    with pytest.raises(BlockdClientError) as info:
        old.step("p", [Allocate("late", [1])], request_id="to-the-old-leader")
    assert info.value.reason in ("NOT_LEADER", "NO_LEADER"), info.value

    def names_new() -> bool:
        try:
            old.step("p", [Allocate("late", [1])], request_id="to-the-old-leader")
        except FailedPreconditionError as err:
            return err.reason == "NOT_LEADER" and err.metadata["leader_id"] == new
        except BlockdClientError:
            return False
        raise AssertionError("the deposed leader acknowledged a step")

    wait_for(names_new, "the old leader refusing, naming the new one", timeout_s=30)
    assert "late" not in g.clients[new].get_tables("p")[1]
    # a worker that has seen the new term is refused a Watch by the old leader, which names the new one
    term = g.clients[new].step("p", [Allocate("term", [1])], request_id="term").term
    with pytest.raises(FailedPreconditionError) as refused:
        next(iter(old.watch("p", 0, min_term=term, timeout_s=10)))
    assert refused.value.reason == "NOT_LEADER" and refused.value.metadata["leader_id"] == new


def _serves(client: BlockdClient) -> bool:
    try:
        client.list_pools()
    except BlockdClientError:
        return False
    return True


def test_a_follower_behind_the_retained_log_catches_up_from_a_snapshot(group):
    g = group("--snapshot-every", "30")
    leader = ready(g)
    lagging = next(rid for rid in g.clients if rid != leader)
    client = g.clients[leader]
    killed_at = client.replica_status().last_lsn  # the lagging replica holds no more than this
    g.kill(lagging)  # the third replica keeps the group committing
    for i in range(150):  # several snapshots: the lagging replica's position leaves the window
        client.step("p", [Allocate(f"a{i}", [i, i + 1]), *([Free(f"a{i - 1}")] if i % 3 == 0 and i else [])],
                    request_id=f"a-{i}")

    # The leader keeps the records after its snapshot before the newest. Snapshots are written in
    # the background (on a loaded machine they trail the steps, and may be skipped), so step on
    # until two have been seen past the lagging replica's position: its records are gone then.
    seen: set[int] = set()

    def past_the_window() -> bool:
        seen.update(found[1] for n in os.listdir(os.path.join(g.root, leader))
                    if (found := parse_name(n)) is not None and found[0] == "snapshot" and found[1] > killed_at)
        if len(seen) >= 2:
            return True
        client.step("p", [Allocate(f"more{len(seen)}-{time.monotonic_ns()}", [1])])
        return False

    wait_for(past_the_window, "the leader's snapshots to leave the lagging replica's position behind", timeout_s=60)
    g.start(lagging)
    data_dir = os.path.join(g.root, lagging)
    wait_for(lambda: any(n.startswith("quarantine-") and n.endswith("replaced") for n in os.listdir(data_dir)),
             "the lagging replica installing the leader's snapshot", timeout_s=60)
    in_sync = InSyncSet(EtcdClient(g.etcd_url), g.name)
    wait_for(lambda: in_sync.contains(lagging), "the lagging replica back in the in-sync set", timeout_s=60)
    client.step("p", [Allocate("after", [7])], request_id="after")  # so it must hold this one too
    for rid in list(g.procs):
        g.procs[rid].stop()
    engines = [Engine(EngineConfig(data_dir=os.path.join(g.root, rid))) for rid in (lagging, leader)]
    try:
        mine, theirs = (e.get_tables("p", []) for e in engines)
        assert "after" in mine[1] and mine == theirs
    finally:
        for engine in engines:
            engine.close()


def test_a_follower_warns_not_errs_when_its_leader_is_killed_under_load(group):
    """A normal failover: the leader is SIGKILLed while steps stream to the followers (its
    replication sockets reset mid-feed). The followers say they wait for the next leader,
    at WARNING; no ERROR line, no traceback."""
    g = group()
    leader = ready(g)
    stop = threading.Event()

    def load(k: int) -> None:
        client, i = g.clients[leader], 0
        while not stop.is_set():
            with contextlib.suppress(BlockdClientError):
                client.step("p", [Allocate(f"l{k}-{i}", [1, 2, 3])])
            i += 1

    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.5)
        g.kill(leader)
        wait_for(lambda: g.leader() not in (None, leader), "the next leader", timeout_s=60)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    time.sleep(0.5)
    followers = {rid: proc.output() for rid, proc in g.procs.items() if rid != leader}
    for rid, output in followers.items():
        bad = [line for line in output.splitlines() if " ERROR " in line or line.startswith("Traceback")]
        assert not bad, f"{rid} logged:\n" + "\n".join(bad[:5]) + "\n" + g.outputs()
    resets = [line for output in followers.values() for line in output.splitlines() if "ConnectionReset" in line]
    assert all(" WARNING " in line and "waiting for the next leader" in line for line in resets), resets


@pytest.mark.parametrize("stream_steps", [False, True], ids=["unary", "stream"])
def test_the_sdk_follows_the_leader_across_a_failover(group, stream_steps):
    """One client given every replica's address steps through a SIGKILL of
    the leader without an error: each call follows NOT_LEADER or moves to
    the next replica and resends the same request (so the same request id:
    a step applied twice would fail, its sequence already existing). Over a
    StepStream the same: a refusal in the stream or the stream cut moves it."""
    g = group()
    leader = ready(g)
    client = BlockdClient(",".join(p.address for p in g.procs.values()), timeout_s=60, max_attempts=1,
                          stream_steps=stream_steps)
    try:
        for i in range(120):
            if i == 40:
                g.kill(leader)
            client.step("p", [Allocate(f"f{i}", [i, i + 1])], request_id=f"f-{i}")
        tables = client.get_tables("p")[1]
        assert all(f"f{i}" in tables for i in range(120))
        assert g.leader() != leader
        assert bool(client._all_streams) is stream_steps
    finally:
        client.close()


def test_an_etcd_target_finds_the_leader_and_follows_it_across_a_failover(group, etcd_server, capsys):
    """``etcd://HOST:PORT/GROUP``: the SDK reads the leader from etcd, and again when it dies;
    ``blockctl --target etcd://...`` reads the group's status there; a malformed one is refused."""
    from client.cli import main as blockctl

    g = group()
    leader = ready(g)
    target = f"etcd://{etcd_server.url.removeprefix('http://')}/{g.name}"
    client = BlockdClient(target, timeout_s=60, max_attempts=1)
    try:
        assert client._replicas.targets.current == g.procs[leader].address
        terms = []
        for i in range(60):
            if i == 20:
                g.kill(leader)
            terms.append(client.step("p", [Allocate(f"e{i}", [i, i + 1])], request_id=f"e-{i}").term)
        tables = client.get_tables("p")[1]
        assert all(f"e{i}" in tables for i in range(60))
        # sync keeps every acknowledged step: a step naming the old leader's term is not refused
        assert terms[-1] > terms[0]
        client.step("p", [], previous_term=terms[0], dry_run=True)
        new = g.leader()
        assert new not in (None, leader) and client._replicas.targets.current == g.procs[new].address
    finally:
        client.close()
    code = blockctl(["--target", target, "cluster", "status", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["leader"]["replica_id"] == new
    for bad in ("etcd://", "etcd://127.0.0.1:1", "etcd:///g", "etcd://h:1/a/b"):
        with pytest.raises(ValueError, match="an etcd target is etcd://HOST:PORT"):
            BlockdClient(bad)
    with pytest.raises(BlockdClientError, match="has no leader in etcd"):
        BlockdClient(f"etcd://{etcd_server.url.removeprefix('http://')}/nobody-leads-this")


@pytest.mark.parametrize("target", ["addresses", "etcd"])
def test_the_asyncio_sdk_follows_the_leader_across_a_failover(group, etcd_server, monkeypatch, target):
    """The asyncio SDK, given every replica's address or the group in etcd, steps
    through a SIGKILL of the leader as the sync one does (same request id on each
    resend). Its etcd reads (blocking calls, here each made 0.3 s slower) run off the
    event loop: a ticker on the same loop never waits for one."""
    import client.leader

    g = group()
    leader = ready(g)
    if target == "etcd":
        read = client.leader.etcd_leader

        def slow_read(*args, **kwargs) -> str:
            time.sleep(0.3)
            return read(*args, **kwargs)

        monkeypatch.setattr(client.leader, "etcd_leader", slow_read)
        address = f"etcd://{etcd_server.url.removeprefix('http://')}/{g.name}"
    else:
        address = ",".join(p.address for p in g.procs.values())
    gaps: list[float] = []

    async def tick(done: asyncio.Event) -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def run() -> dict:
        done = asyncio.Event()
        ticker = asyncio.create_task(tick(done))
        try:
            async with AsyncBlockdClient(address, timeout_s=60) as sdk:
                for i in range(60):
                    if i == 20:
                        g.kill(leader)
                    await sdk.step("p", [Allocate(f"a{i}", [i, i + 1])], request_id=f"a-{i}")
                return (await sdk.get_tables("p"))[1]
        finally:
            done.set()
            await ticker

    tables = asyncio.run(run())
    assert all(f"a{i}" in tables for i in range(60))
    assert g.leader() != leader
    assert max(gaps) < 0.25, f"the event loop stalled {max(gaps):.2f} s"


def test_a_replica_whose_data_dir_was_lost_does_not_lead(group):
    """Every replica is killed; one comes back alone with an empty data dir.
    Its in-sync entry in etcd was earned by the lost log, so it must not
    lead (it would serve an empty group, every acknowledged step gone); the
    others come back, one leads with every step, and the emptied replica
    catches up and is admitted again under its new log id."""
    g = group()
    leader = ready(g)
    client = g.clients[leader]
    for i in range(20):
        client.step("p", [Allocate(f"k{i}", [i, i + 1])], request_id=f"k-{i}")
    in_sync = InSyncSet(EtcdClient(g.etcd_url), g.name)
    wait_for(lambda: len(in_sync.members()) == 3, "all three replicas in the in-sync set")
    lost = next(rid for rid in g.clients if rid != leader)
    for rid in list(g.clients):
        g.kill(rid)
    shutil.rmtree(os.path.join(g.root, lost))
    g.start(lost)
    kv = EtcdClient(g.etcd_url)
    wait_for(lambda: kv.get(in_sync.keys.leader) is None, "the killed leader's lease to expire", timeout_s=30)
    time.sleep(4)  # the emptied replica campaigns (every 0.2 s) all this while
    assert kv.get(in_sync.keys.leader) is None, "a replica with an empty log won the election"
    with pytest.raises(BlockdClientError) as info:
        g.clients[lost].list_pools()
    assert info.value.reason == "NO_LEADER", info.value
    for rid in ("r0", "r1", "r2"):
        if rid != lost:
            g.start(rid)
    new = wait_for(g.leader, "a replica with its whole log to lead", timeout_s=60)
    assert new != lost
    tables = g.clients[new].get_tables("p")[1]
    assert all(f"k{i}" in tables for i in range(20))
    with open(os.path.join(g.root, lost, "log-id")) as f:
        new_log = f.read().strip()

    def rejoined() -> bool:
        return any(e.replica_id == lost and e.log_id == new_log for e in in_sync.members())

    wait_for(rejoined, "the emptied replica admitted again under its new log id", timeout_s=60)


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "group"))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith(("blockd_ha_", "blockd_replication_"))}


def test_replication_metrics_show_roles_lag_and_the_in_sync_set(group):
    g = group(metrics=True)
    leader = ready(g)
    ports = g.metrics_ports
    assert ports is not None
    follower, other = (rid for rid in g.clients if rid != leader)
    client = g.clients[leader]
    for i in range(10):
        client.step("p", [Allocate(f"m{i}", [i, i + 1])], request_id=f"m-{i}")

    def settled() -> dict | None:
        lead, fol = _scrape(ports[leader]), _scrape(ports[follower])
        caught_up = fol.get(("blockd_replication_last_lsn", ())) == lead[("blockd_replication_last_lsn", ())]
        all_in = lead.get(("blockd_replication_in_sync_replicas", ())) == 3
        return {"leader": lead, "follower": fol} if caught_up and all_in else None

    seen = wait_for(settled, "every replica in sync, the follower at the leader's last LSN")
    lead, fol = seen["leader"], seen["follower"]
    assert lead[("blockd_ha_is_leader", ())] == 1 and lead[("blockd_replication_leading", ())] == 1
    assert lead[("blockd_ha_term", ())] > 0 and lead[("blockd_replication_sync_mode", ())] == 1
    for rid in (follower, other):
        assert lead[("blockd_replication_follower_in_sync", (("follower", rid),))] == 1
        assert lead[("blockd_replication_follower_lag_records", (("follower", rid),))] >= 0
    assert fol[("blockd_ha_is_leader", ())] == 0 and fol[("blockd_replication_leading", ())] == 0
    assert fol[("blockd_replication_streaming", ())] == 1
    assert fol[("blockd_ha_term", ())] == lead[("blockd_ha_term", ())]
    assert 0 < fol[("blockd_replication_commit_lsn", ())] <= fol[("blockd_replication_last_lsn", ())]
    # `blockctl cluster status` (etcd's member keys): the leader reports where it is now, not at its term start
    last = lead[("blockd_replication_last_lsn", ())]

    def reported() -> dict | None:
        status = read_status(g.etcd_url, g.name).to_dict()
        members = {m["replica_id"]: m for m in status["members"]}
        return status if members.get(leader, {}).get("applied_lsn") == last and len(members) == 3 else None

    status = wait_for(reported, "the leader's member key at its last LSN")
    assert {m["replica_id"]: m["behind_leader"] for m in status["members"]}[leader] == 0
    # a follower dies: the leader drops it from the set (the next step waits 2 s for it) and its lag grows
    g.kill(follower)
    for i in range(30):
        client.step("p", [Allocate(f"n{i}", [i, i + 1])], request_id=f"n-{i}")
    lead = _scrape(ports[leader])
    assert lead[("blockd_replication_follower_in_sync", (("follower", follower),))] == 0
    assert lead[("blockd_replication_follower_lag_records", (("follower", follower),))] >= 30
    assert lead[("blockd_replication_in_sync_replicas", ())] == 2
    assert lead[("blockd_replication_follower_in_sync", (("follower", other),))] == 1


def _replicates(g: Group, leader: str) -> None:
    """A sync-mode step is acknowledged only once a follower persisted it: the followers' streams work."""
    for i in range(5):
        g.clients[leader].step("p", [Allocate(f"sec{i}", [i])], request_id=f"sec-{i}")


def _open_feed(address: str, tls: TlsConfig | None, token: str | None) -> grpc.RpcError:
    """What the leader answers a replication stream opened with these credentials."""
    with open_channel(address, tls, token) as channel:
        stream = rpb_grpc.ReplicationServiceStub(channel).ReplicateLog(
            rpb.ReplicateLogRequest(replica_id="intruder", from_lsn=1), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stream))
        return info.value


def test_cluster_status_asks_the_replicas_without_etcd(group, capsys):
    """``blockctl --target A,B,C cluster status`` (no ``--etcd``): every replica's
    ``GetReplicaStatus``; a dead follower is unreachable and the leader still reports it."""
    from client.cli import main as blockctl

    g = group()
    leader = ready(g)
    term = g.clients[leader].step("p", [Allocate("x", [1])], request_id="x").term
    target = ",".join(p.address for p in g.procs.values())

    def status() -> tuple[int, dict]:
        code = blockctl(["--target", target, "--timeout-s", "5", "cluster", "status", "--json"])
        return code, json.loads(capsys.readouterr().out)

    def settled() -> tuple[int, dict] | None:
        code, found = status()
        rows = {r["replica_id"]: r for r in found["replicas"]}
        return (code, found) if len(rows) == 3 and all(r["in_sync"] for r in rows.values()) else None

    code, found = wait_for(settled, "three replicas, all in sync")
    assert code == 0 and found["term"] == term and found["leader"] == {"replica_id": leader,
                                                                       "address": g.procs[leader].address}
    rows = {r["replica_id"]: r for r in found["replicas"]}
    assert rows[leader]["role"] == "leader" and found["in_sync_replicas"] == 3 and found["replication"] == "sync"
    for rid, row in rows.items():
        assert row["address"] == g.procs[rid].address and row["term"] == term and row["behind_leader"] >= 0
        assert rid == leader or (row["role"] == "follower" and row["leader_id"] == leader and row["streaming"])
    async def ask() -> str:  # the asyncio SDK asks the same
        async with AsyncBlockdClient(g.procs[leader].address) as aio:
            return (await aio.replica_status()).role

    assert asyncio.run(ask()) == "leader"
    dead = next(rid for rid in g.procs if rid != leader)
    g.kill(dead)
    code, found = status()
    assert code == 0 and [u["address"] for u in found["unreachable"]] == [g.procs[dead].address]
    assert {r["replica_id"]: r["role"] for r in found["replicas"]}[dead] == "follower (leader's view)"
    g.kill(leader)
    code = blockctl(["--target", g.procs[leader].address, "--timeout-s", "2", "cluster", "status"])
    assert code == 69 and "no replica answered" in capsys.readouterr().err


def _set_members(g: Group) -> set[str]:
    return {e.replica_id for e in InSyncSet(EtcdClient(g.etcd_url), g.name).members()}


def test_sync_followers_caps_the_in_sync_set_and_a_free_place_is_taken(group):
    """``--sync-followers 1``: the set holds the leader and one follower, however long both
    followers keep up; when that member dies, the first step after it waits out the ack
    deadline, the member is dropped, the other follower takes its place, and the step is
    acknowledged (held by the new member) without the caller retrying."""
    g = group("--sync-followers", "1")
    leader = ready(g)
    for n in range(20):
        g.clients[leader].step("p", [Allocate(f"s{n}", [n])], request_id=f"s{n}")
    members = wait_for(lambda: (lambda m: m if len(m) == 2 else None)(_set_members(g)),
                       "the leader and one follower in the set")
    assert leader in members
    time.sleep(1.0)  # both followers acknowledge every heartbeat meanwhile: the cap holds
    assert _set_members(g) == members
    (member,) = members - {leader}
    (other,) = set(g.procs) - {leader, member}
    g.kill(member)
    g.clients[leader].step("p", [Allocate("after", [99])], request_id="after")
    # the leader counts a joining member before its entry is written (the set in etcd trails, never leads)
    wait_for(lambda: _set_members(g) == {leader, other}, "the other follower's entry in the set")
    g.start(member)  # a follower again, outside the set: only `other` may lead next
    g.kill(leader)
    wait_for(lambda: g.leader() == other, "the remaining member to lead", timeout_s=60)
    tables = g.clients[other].get_tables("p")[1]
    assert {"after", *(f"s{n}" for n in range(20))} <= set(tables)


def test_replication_settings_that_cannot_work_are_refused_before_anything_starts(tmp_path, etcd_server,
                                                                                   run_module):
    data_dir = tmp_path / "d"
    for flags, wanted in [
        (("--min-in-sync", "3", "--sync-followers", "1"),
         "--sync-followers 1 leaves fewer replicas in the in-sync set than --min-in-sync 3"),
        (("--sync-followers", "-1"), "argument --sync-followers: must be an integer >= 0"),
        (("--max-lag-records", "-5"), "argument --max-lag-records: must be an integer >= 0"),
    ]:
        proc = run_module("blockd.cli", "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), "--etcd",
                          etcd_server.url, "--replica-id", "r0", *flags)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert wanted in proc.stderr, proc.stderr
        assert not data_dir.exists()


def _stream_acks(address: str, *acks: rpb.StreamAcksRequest, tls: TlsConfig | None = None,
                 token: str | None = None) -> rpb.StreamAcksResponse:
    with open_channel(address, tls, token) as channel:
        return rpb_grpc.ReplicationServiceStub(channel).StreamAcks(iter(acks), timeout=10)


def test_acknowledgements_on_a_stream_are_checked_like_calls(group):
    """Followers that stay on gRPC (``--replication-transport grpc``) acknowledge
    on ``StreamAcks``; a stream naming a term the replica does not lead, or sent to a follower,
    is refused with NOT_LEADER naming the leader and its term, and a message that does
    not parse ends it as INVALID_ARGUMENT."""
    g = group()
    leader = ready(g)
    term = g.clients[leader].step("p", [Allocate("acked", [1])], request_id="acked").term
    assert term > 0
    address = g.procs[leader].address
    assert _stream_acks(address).acks == 0
    for target, ack in ((address, rpb.StreamAcksRequest(replica_id="r9", term=term - 1, persisted_lsn=1)),
                        (g.procs[next(r for r in g.procs if r != leader)].address,
                         rpb.StreamAcksRequest(replica_id="r9", term=term, persisted_lsn=1))):
        with pytest.raises(grpc.RpcError) as info:
            _stream_acks(target, ack)
        refused = from_rpc_error(info.value)
        assert isinstance(refused, FailedPreconditionError) and refused.reason == "NOT_LEADER", refused
        assert refused.metadata["leader_id"] == leader and refused.metadata["term"] == str(term), refused.metadata
    with grpc.insecure_channel(address) as channel:
        raw = channel.stream_unary("/blockd.v1.ReplicationService/StreamAcks")
        with pytest.raises(grpc.RpcError) as info:
            raw(iter([b"\xff\xff\xff"]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    g.clients[leader].step("p", [Allocate("after", [2])], request_id="after")  # the group still commits


def test_feeds_move_to_the_replication_port_and_a_group_can_keep_them_on_grpc(group):
    """By default a follower's feed moves to its leader's replication port (the
    FramesOffer of docs/ha.md), and a sync step is acknowledged only with a
    follower's acknowledgement from there; a connection to that port with a
    ticket nobody was offered is closed and changes nothing. With
    ``--replication-transport grpc`` the feeds stay on the call's stream and
    replicate as well."""
    g = group()
    leader = ready(g)
    _replicates(g, leader)
    followers = [r for r in g.procs if r != leader]
    said = re.compile(rf"follows {re.escape(g.procs[leader].address)} on its replication port (\d+)")
    ports = wait_for(lambda: [m.group(1) for r in followers if (m := said.search(g.procs[r].output()))] or None,
                     "a follower on the leader's replication port")
    with socket.create_connection(("127.0.0.1", int(ports[0])), timeout=10) as intruder:
        intruder.sendall(b"\0" * 32)
        assert intruder.recv(1) == b""  # closed without a byte of the log
    _replicates(g, leader)

    def both_caught_up() -> bool:
        status = g.clients[leader].replica_status()
        return len(status.followers) == 2 and all(f.persisted_lsn == status.last_lsn for f in status.followers)

    wait_for(both_caught_up, "both followers holding the leader's whole log")

    h = group("--replication-transport", "grpc")
    leader = ready(h)
    _replicates(h, leader)
    assert not any("replication port" in p.output() for p in h.procs.values()), h.outputs()


def test_a_group_serving_mutual_tls_replicates_with_an_admin_certificate(group, pki):
    server = pki.server_tls()
    g = group("--tls-cert", server.cert, "--tls-key", server.key, "--tls-client-ca", pki.ca,
              "--peer-tls-ca", pki.ca, "--peer-tls-cert", pki.path("admin"), "--peer-tls-key", pki.key("admin"),
              tls=pki.tls("admin"))
    leader = ready(g)
    _replicates(g, leader)
    # the feeds moved to the replication port, which serves TLS as the group does (docs/ha.md 2.3)
    said = re.compile(rf"follows {re.escape(g.procs[leader].address)} on its replication port \d+ \(TLS\)")
    wait_for(lambda: any(said.search(g.procs[r].output()) for r in g.procs if r != leader),
             "a follower on the leader's replication port over TLS")
    address = g.procs[leader].address
    assert _open_feed(address, pki.tls("scheduler"), None).code() == grpc.StatusCode.PERMISSION_DENIED
    assert _open_feed(address, pki.tls(None), None).code() == grpc.StatusCode.UNAVAILABLE  # no certificate


def test_a_group_serving_tokens_replicates_with_an_admin_token(group, tmp_path):
    ids = str(tmp_path / "ids.json")
    admin = tokens.add_token(ids, "ops", "acme", ["admin"])
    peer = tokens.add_token(ids, "replica", "acme", ["admin"])
    scheduler = tokens.add_token(ids, "router", "acme", ["scheduler"])
    (tmp_path / "peer-token").write_text(peer + "\n")
    g = group("--tokens-file", ids, "--peer-token-file", str(tmp_path / "peer-token"), token=admin)
    leader = ready(g)
    _replicates(g, leader)
    address = g.procs[leader].address
    assert _open_feed(address, None, scheduler).code() == grpc.StatusCode.PERMISSION_DENIED
    assert _open_feed(address, None, None).code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:  # nor may a scheduler acknowledge records
        _stream_acks(address, rpb.StreamAcksRequest(replica_id="r9", term=1, persisted_lsn=1), token=scheduler)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
