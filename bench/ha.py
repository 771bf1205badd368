"""blockd replicated on etcd (``blockd serve --etcd``, docs/ha.md): what sync replication costs, what failover takes.

Prints one JSON object per line. A real etcd (``etcd`` on PATH) and the
daemons run as child processes on loopback, each daemon with its own data
dir under one temp dir, ``--fsync always``.

* ``steps``: ``--schedulers`` threads (1 by default), each a scheduler of its
  own ``--seqs`` sequences with its own client, send decode steps (one
  ``decode_append`` each) through the sync SDK for ``--seconds`` to each
  of a single daemon (no ``--etcd``), the leader of a three-replica
  ``sync`` group, of one with ``--sync-followers 1`` (mode
  ``sync_first_follower``: steps wait for one follower, the first to have
  caught up), of a ``sync`` one whose feeds stay on gRPC (mode
  ``sync_grpc``: ``--replication-transport grpc``, what the framed socket
  saves) and of an ``async`` one (what three daemons on one
  machine cost without waiting for the followers). All five run at once
  and take turns, ``--rounds`` windows each, the others frozen
  (SIGSTOP) meanwhile: background load on a shared machine falls on each
  alike. A group's window begins once its followers stream again after
  the thaw (:func:`settle`).
  Every daemon serves ``/metrics`` (``--metrics-port``), as a deployed one
  would: the single daemon is not spared a cost the replicas pay. Fields:
  ``mode``, ``steps_per_s``, ``p50_ms``, ``p99_ms``; the groups' rows add
  ``ratio_steps_per_s`` and ``added_p50_ms`` against the single daemon,
  and the followers' lag as the leader reports it (its last LSN minus
  what the follower confirmed persisted; one record = one pool version
  here), sampled every 100 ms with ``GetReplicaStatus`` (the view its
  ``/metrics`` exports as ``blockd_replication_follower_lag_records``;
  a scrape costs the leader 6-7 ms of CPU, most of it prometheus_client's
  text exposition, so ten a second were ~0.5 ms of every step measured;
  a status call costs 1.5 ms): ``follower_lag_p50_records``,
  ``follower_lag_p99_records``, ``follower_lag_max_records`` (the largest
  follower's at each sample).
  ``cpu_ms_per_step``: CPU time (user + system, from ``/proc/PID/stat``)
  per acknowledged step of the single daemon (``daemon``) or of the
  group's ``leader`` and its two ``followers`` together, of ``etcd``
  (groups only), and of the stepping client threads (``client``), over
  the measuring windows: on a machine with fewer cores than processes, a
  group's steps/s is bounded by this sum. ``follower_cpu_per_record_vs_leader``:
  one follower's CPU per record (the two followers' over two; a record per
  step) against the leader's per step.
* ``failover``: a three-replica ``sync`` group under the same load from a
  client given every replica's address (it follows the leader); the leader
  is SIGKILLed ``--kills`` times (restarted as a follower after each).
  Failover time: from the kill to the first step the new leader
  acknowledges. ``lost_acks``: acknowledged steps missing on the new leader
  after each failover, ``lost_acks_at_end``: any acknowledged step missing
  once the load stopped (both must be 0). Fields: ``kills``,
  ``failover_p50_s``, ``failover_p99_s``, ``failover_max_s``, ``lost_acks``,
  ``lost_acks_at_end``, ``acknowledged``, ``lease_ttl_s``.

Run: ``python bench/ha.py [--part steps|failover] [--seconds 5] [--kills 10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from blockd.cluster.local import ChildProcess, proc_stat
from blockd.core import Allocate, PoolConfig
from blockd.core.types import DecodeAppend
from client.errors import BlockdClientError
from client.sdk import BlockdClient
from tests.support.etcd import EtcdServer
from tests.support.procs import free_port

BLOCK_SIZE = 16
#: how long a thawed group's followers must look caught up before its window begins (:func:`settle`)
STABLE_S = 0.5


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def daemon(data_dir: str, *flags: str, listen: str = "127.0.0.1:0") -> ChildProcess:
    proc = ChildProcess("blockd", ["-m", "blockd.cli", "serve", "--listen", listen, "--log-level", "WARNING",
                                   "--data-dir", data_dir, *flags], "blockd listening on")
    proc.wait_ready(time.monotonic() + 60)
    return proc


class Group:
    def __init__(self, root: str, etcd_url: str, ttl_s: int, *flags: str, name: str = "bench") -> None:
        self.root, self.etcd_url, self.ttl_s, self.flags, self.name = root, etcd_url, ttl_s, flags, name
        self.procs: dict[str, ChildProcess] = {}
        self.metrics_ports: dict[str, int] = {}

    def start(self, rid: str, listen: str = "127.0.0.1:0") -> None:
        """A restart takes the replica's old address (``listen``): clients list stable addresses."""
        port = self.metrics_ports.setdefault(rid, free_port())
        self.procs[rid] = daemon(os.path.join(self.root, rid), "--etcd", self.etcd_url, "--replica-id", rid,
                                 "--group", self.name, "--lease-ttl-s", str(self.ttl_s), "--metrics-port",
                                 str(port), *self.flags, listen=listen)

    def client(self) -> BlockdClient:
        return BlockdClient(",".join(p.address for p in self.procs.values()), timeout_s=60, max_attempts=1)

    def leader(self) -> str:
        for rid, proc in self.procs.items():
            with BlockdClient(proc.address, timeout_s=5, max_attempts=1) as c:
                try:
                    c.list_pools()
                except BlockdClientError:
                    continue
                return rid
        return ""

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()


def setup_pool(client: BlockdClient, seqs: int, seconds: float, schedulers: int = 1) -> None:
    blocks = schedulers * seqs * (int(seconds * 2000) // BLOCK_SIZE + 4)
    client.create_pool(PoolConfig("bench", num_blocks=blocks, block_size=BLOCK_SIZE), request_id="create-bench")
    client.step("bench", [Allocate(f"c{c}s{i}", [i]) for c in range(schedulers) for i in range(seqs)],
                request_id="admit-bench")


def load(clients: list[BlockdClient], seqs: int, seconds: float,
         cpu: list[float] | None = None) -> list[float]:
    """Each client (a scheduler of its own ``seqs`` sequences) steps on its own
    thread for ``seconds``; each thread appends its CPU seconds to ``cpu``."""
    out: list[float] = []

    def run(c: int, client: BlockdClient) -> None:
        ids, tokens, mine = [f"c{c}s{i}" for i in range(seqs)], [1] * seqs, []
        start_cpu = time.thread_time()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            client.step("bench", [DecodeAppend(ids, tokens)])
            mine.append(time.perf_counter() - t)
        if cpu is not None:
            cpu.append(time.thread_time() - start_cpu)  # list.append: atomic under the GIL
        out.extend(mine)  # one extend per thread: atomic under the GIL

    threads = [threading.Thread(target=run, args=(c, client)) for c, client in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc``)."""
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds each named process spends inside ``with`` blocks, summed over them."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids, self.seconds = pids, dict.fromkeys(pids, 0.0)
        self._start: dict[str, float] = {}

    def __enter__(self) -> CpuMeter:
        self._start = {name: sum(map(cpu_seconds, pids)) for name, pids in self.pids.items()}
        return self

    def __exit__(self, *exc) -> None:
        for name, pids in self.pids.items():
            self.seconds[name] += sum(map(cpu_seconds, pids)) - self._start[name]


def follower_lag(client: BlockdClient) -> float | None:
    """The largest follower lag the leader ``client`` calls reports now (None: no follower)."""
    lags = [f.lag_records for f in client.replica_status().followers]
    return max(lags) if lags else None


def settle(address: str, followers: int, timeout_s: float = 10.0) -> None:
    """Return once the leader at ``address`` has ``followers`` followers, each acknowledged
    within the last 0.3 s and at most one record behind. A group thawed for its window was
    frozen through the others' (longer than a follower waits on a silent feed), so its
    followers dial their leader again first; a window that began meanwhile measured the
    reconnection (async steps do not wait for a follower that is not live, and its lag grew
    by the records of those ~0.3 s), not replication. The state must hold for ``STABLE_S``:
    a follower whose read was cut by the freeze gives its feed up only once it runs again
    (its socket's timeout has passed by then), which can come after a first good look
    (an async window with four schedulers once showed a lag p99 of 813 records, the bound
    being 100; with this wait, and in a run of that group alone, it stayed under 10)."""
    deadline, stable_since = time.monotonic() + timeout_s, None
    with BlockdClient(address, timeout_s=5, max_attempts=1) as client:
        while time.monotonic() < deadline:
            found = client.replica_status().followers
            if len(found) >= followers and all(f.last_ack_age_s < 0.3 and f.lag_records <= 1 for f in found):
                stable_since = stable_since or time.monotonic()
                if time.monotonic() - stable_since >= STABLE_S:
                    return
            else:
                stable_since = None
            time.sleep(0.05)
    raise RuntimeError(f"the followers of {address} did not catch up within {timeout_s:g} s of a thaw")


class LagSampler:
    """Asks the leader at ``address`` for its per-follower lag every ``every_s`` while the load runs."""

    def __init__(self, address: str, every_s: float = 0.1) -> None:
        self.address, self.every_s, self.samples = address, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LagSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with BlockdClient(self.address, timeout_s=5, max_attempts=1) as client:
            while not self._stop.wait(self.every_s):
                lag = follower_lag(client)
                if lag is not None:
                    self.samples.append(lag)


def lag_fields(samples: list[float]) -> dict:
    """A row's lag fields from the samples of all its windows."""
    return {"follower_lag_p50_records": percentile(samples, 0.5),
            "follower_lag_p99_records": percentile(samples, 0.99),
            "follower_lag_max_records": max(samples, default=float("nan")),
            "lag_samples": len(samples)}


def row(mode: str, latencies: list[float], seconds: float) -> dict:
    return {"name": "ha_steps", "mode": mode, "steps_per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(percentile(latencies, 0.5) * 1e3, 3), "p99_ms": round(percentile(latencies, 0.99) * 1e3, 3)}


class Frozen:
    """SIGSTOP these processes for a while (another setup's measuring window), then SIGCONT them."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def __enter__(self) -> Frozen:
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT)


def part_steps(args, root: str, etcd: EtcdServer) -> None:
    """The single daemon and the groups run side by side and take turns: ``--rounds``
    windows each, in the same order every round, the others frozen (SIGSTOP) meanwhile,
    so a shared machine's background load falls on all alike and the idle ones cost
    nothing. The groups' lease TTL is long enough to outlast the frozen windows."""
    window = args.seconds / args.rounds
    # A group stays frozen through the four other setups' windows and their settling (~1 s
    # each). Its leader renews the lease every TTL/3, so when frozen it may hold only 2/3 of
    # a TTL: the TTL is 1.5x the longest freeze and more. With 4x the window alone, a leader
    # lost its lease in a 40 s / 8 rounds run, a new election followed, and the bench,
    # which measures a fixed leader, failed waiting for its followers.
    ttl = max(args.ttl_s, int(1.5 * 4 * (window + 1)) + 5)
    # with a metrics endpoint, as every replica of the groups: the rows compare replication,
    # not metrics (about 0.08 ms of CPU a step, measured in a leader's profile)
    single = daemon(os.path.join(root, "single"), "--metrics-port", str(free_port()))
    setups = {"sync": ("--replication", "sync"),
              "sync_first_follower": ("--replication", "sync", "--sync-followers", "1"),
              "sync_grpc": ("--replication", "sync", "--replication-transport", "grpc"),
              "async": ("--replication", "async")}
    groups = {mode: Group(os.path.join(root, f"steps-{mode}"), etcd.url, ttl, *flags, name=f"steps-{mode}")
              for mode, flags in setups.items()}
    clients: dict[str, list[BlockdClient]] = {}
    pids = {"single": [single.pid]}
    try:
        for mode, group in groups.items():
            for rid in ("r0", "r1", "r2"):
                group.start(rid)
            pids[mode] = [p.pid for p in group.procs.values()]
        clients["single"] = [BlockdClient(single.address) for _ in range(args.schedulers)]
        for mode, group in groups.items():
            clients[mode] = [group.client() for _ in range(args.schedulers)]
        leaders = {mode: group.leader() for mode, group in groups.items()}
        meters = {"single": CpuMeter({"daemon": [single.pid]})}
        for mode, group in groups.items():
            meters[mode] = CpuMeter({"leader": [group.procs[leaders[mode]].pid], "etcd": [etcd.popen.pid],
                                     "followers": [p.pid for r, p in group.procs.items() if r != leaders[mode]]})
        client_cpu: dict[str, list[float]] = {mode: [] for mode in clients}
        for each in clients.values():
            setup_pool(each[0], args.seqs, args.seconds, args.schedulers)
        latencies: dict[str, list[float]] = {mode: [] for mode in clients}
        lags: dict[str, list[float]] = {mode: [] for mode in groups}
        for _ in range(args.rounds):
            for mode, each in clients.items():
                others = [pid for m, ps in pids.items() if m != mode for pid in ps]
                with Frozen(others):
                    if mode == "single":
                        with meters[mode]:
                            latencies[mode] += load(each, args.seqs, window, client_cpu[mode])
                        continue
                    settle(groups[mode].procs[leaders[mode]].address, followers=2)
                    with LagSampler(groups[mode].procs[leaders[mode]].address) as lag, meters[mode]:
                        latencies[mode] += load(each, args.seqs, window, client_cpu[mode])
                    lags[mode] += lag.samples
    finally:
        for each in clients.values():
            for client in each:
                client.close()
        single.stop()
        for group in groups.values():
            group.close()

    def cpu_fields(mode: str) -> dict:
        steps = max(1, len(latencies[mode]))
        spent = {**meters[mode].seconds, "client": sum(client_cpu[mode])}
        fields: dict = {"cpu_ms_per_step": {name: round(s / steps * 1e3, 3) for name, s in spent.items()}}
        if spent.get("leader") and "followers" in spent:
            # one record per step here: a follower's CPU per record (receive, persist, apply)
            # against the leader's per step (issue 29 item 5: at most 0.5)
            fields["follower_cpu_per_record_vs_leader"] = round(spent["followers"] / 2 / spent["leader"], 3)
        return fields

    base = row("single", latencies["single"], args.seconds)
    base.update(rounds=args.rounds, schedulers=args.schedulers, **cpu_fields("single"))
    print(json.dumps(base), flush=True)
    for mode in groups:
        result = row(mode, latencies[mode], args.seconds)
        result.update(lag_fields(lags[mode]))
        result["ratio_steps_per_s"] = round(result["steps_per_s"] / base["steps_per_s"], 3)
        result["added_p50_ms"] = round(result["p50_ms"] - base["p50_ms"], 3)
        result.update(rounds=args.rounds, lease_ttl_s=ttl, schedulers=args.schedulers, **cpu_fields(mode))
        print(json.dumps(result), flush=True)


def part_failover(args, root: str, etcd: EtcdServer) -> None:
    group = Group(os.path.join(root, "failover"), etcd.url, args.ttl_s)
    acked: list[tuple[str, float, float]] = []  # (sequence, sent, acknowledged)
    stop = threading.Event()
    try:
        for rid in ("r0", "r1", "r2"):
            group.start(rid)
        client = group.client()
        client.create_pool(PoolConfig("bench", num_blocks=1 << 16, block_size=BLOCK_SIZE), request_id="create")

        def steps() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                sent = time.monotonic()
                client.step("bench", [Allocate(f"a{n}", [n])], request_id=f"a-{n}")
                acked.append((f"a{n}", sent, time.monotonic()))

        loader = threading.Thread(target=steps, daemon=True)
        loader.start()
        times, lost = [], 0
        for _ in range(args.kills):
            time.sleep(1.0)
            leader = group.leader()
            killed_at = time.monotonic()
            os.kill(group.procs[leader].pid, signal.SIGKILL)
            group.procs[leader].popen.wait()
            # the first step sent after the kill, once acknowledged, was answered by the new leader
            while not acked or acked[-1][1] <= killed_at:
                if not loader.is_alive():
                    raise RuntimeError("the load stopped: a step failed")
                time.sleep(0.005)
            times.append(acked[-1][2] - killed_at)
            known = list(acked)  # acknowledged before the read below began: each must be in its answer
            tables = client.get_tables("bench")[1]
            lost += sum(1 for seq, _, _ in known if seq not in tables)
            group.start(leader, group.procs.pop(leader).address)
        stop.set()
        loader.join(60)
        tables = client.get_tables("bench")[1]  # and once more, the load stopped: every step ever acknowledged
        lost_at_end = sum(1 for seq, _, _ in acked if seq not in tables)
        client.close()
    finally:
        group.close()
    print(json.dumps({"name": "ha_failover", "kills": args.kills, "lease_ttl_s": args.ttl_s,
                      "failover_p50_s": round(percentile(times, 0.5), 3),
                      "failover_p99_s": round(percentile(times, 0.99), 3),
                      "failover_max_s": round(max(times), 3), "lost_acks": lost,
                      "lost_acks_at_end": lost_at_end, "acknowledged": len(acked)}), flush=True)


PARTS = {"steps": part_steps, "failover": part_failover}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", action="append", choices=sorted(PARTS))
    parser.add_argument("--seconds", type=float, default=5.0, help="load time per setup (steps), in all")
    parser.add_argument("--rounds", type=int, default=5, help="windows per setup (steps), taken in turns")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--schedulers", type=int, default=1,
                        help="steps: clients stepping at once, each on its own sequences and thread")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--ttl-s", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="blockd-bench-ha-") as root:
        os.mkdir(os.path.join(root, "etcd"))
        etcd = EtcdServer(os.path.join(root, "etcd")).start()
        try:
            for name in args.part or list(PARTS):
                PARTS[name](args, root, etcd)
        finally:
            etcd.kill()


if __name__ == "__main__":
    main()
