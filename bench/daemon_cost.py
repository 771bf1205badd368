"""What one scheduler step costs the central daemon, in CPU time, and where that time goes.

The ``daemon_cost`` part of ``bench/rpc.py`` (issue 29 item 1). Every step of
every replica in a cluster goes through one daemon, so its CPU per step, not a
step's latency, decides how many replicas one daemon core serves. CPU time is
read from ``/proc/<pid>/stat`` (utime + stime, every thread of the daemon
process: gRPC's C core, the handlers, the log writer), so the figure holds on a
machine whose other processes take turns on the cores, as the schedulers do
here.

Each configuration starts a fresh ``blockd serve`` and ``schedulers`` scheduler
processes, each on its own pool, driving one of two steps through the sync SDK:

* ``decode``: one ``decode_append`` of 256 running sequences (as ``step_rpc``);
* ``prefill``: ``Free`` of the previous request and ``Allocate`` of a new
  2,048-token prompt (128 blocks to hash and index, no prefix hit).

Axes: ``schedulers`` 1 or 4, ``durability`` ``memory`` or ``fsync_always``
(``--data-dir`` and ``--fsync always``), ``security`` ``plain`` or
``mtls_token`` (mutual TLS and a bearer token, the auth interceptor on every
call), ``transport`` ``unary`` (one ``Step`` call per step), ``stream``
(:meth:`client.sdk.BlockdClient.step_stream`: the steps of a scheduler over
one ``StepStream`` call) or ``lane`` (the same stream object, on a daemon
started with ``--step-lane-port 0``: the steps go over the step lane,
:mod:`blockd.service.lane`). Fields of each row:

* ``daemon_cpu_us_per_step``: the daemon's CPU over the timed window divided
  by the steps all schedulers completed in it;
* ``daemon_cores_busy``: that CPU over the window's wall time (at most the
  machine's ``cpus``; a daemon bound by its GIL stays near 1);
* ``steps_per_s`` (all schedulers) and ``steps_per_daemon_core_s`` (1e6 /
  the CPU per step: what one core could serve if the daemon were the only cost);
* ``sdk_cpu_us_per_step``: each scheduler process's own CPU per step (the
  client side: building the request, the SDK, gRPC);
* ``threads``: the daemon's threads by name (``/proc/<pid>/task``; blockd
  names its own: ``blockd-lane`` the lane's loop, ``blockd-fsync`` the
  compiled fsync thread, ``blockd-lane-sync``, ``blockd-fsync-py``), each
  with ``cpu_us_per_step`` (utime + stime), ``runqueue_wait_us_per_step``
  (time runnable but not running, ``schedstat``: the cores were busy) and
  ``switches_per_step``; threads under 1 us a step are left out;
* ``fsyncs_per_step`` (``--fsync always`` rows): the log's fdatasyncs over
  the steps (``blockd_wal_sync_duration_seconds_count`` from the daemon's
  metrics endpoint, which every configuration serves, as deployments do);
  1.0 means no two steps shared a sync;
* ``core_cpu_us_per_step``: the same step on an in-process
  :class:`blockd.core.Pool` (CPU time, the baseline: the allocator's work with
  nothing around it) and ``ratio_vs_core``; ``core_cold_cpu_us_per_step``
  and ``ratio_vs_core_cold``: the same with one L2 cache's worth of other data
  copied before each step (not timed). The daemon sleeps between steps while
  the scheduler and the network stack run, so its steps start with cold
  caches: on the 2-core VM the hot core's 135 us become about 190-220, and the
  in-process handler chain (request bytes to answer bytes) 225 -> about 310 us;
* ``chain_cpu_us_per_step`` (decode rows): that handler chain in this
  process (:func:`chain_cpu_us`: the servicer's parser, its step, the
  answer's bytes; no transport, no interceptors), steps back to back, and
  ``chain_after_idle_cpu_us_per_step`` with a 200 us sleep before each
  (:data:`IDLE_S`), as the daemon waits between steps; ``ratio_vs_chain_after_idle``:
  what the transport and the daemon process add to the step's own work;
* ``ratio_vs_unary``, ``ratio_vs_stream`` (a lane row), ``ratio_vs_plain`` (CPU per step against the same
  configuration by unary calls / without security) and
  ``steps_per_s_vs_one_scheduler`` (4 schedulers against 1), all measured
  in the same run.

``daemon_durable_ratio``: issue 29's durable target (4 schedulers with
``--fsync always`` at 2x one) as :data:`RATIO_PAIRS` pairs of runs (3 with
``--quick``: 1), one scheduler then four, on the lane, so that each ratio's
two runs are minutes apart at most; the row has every pair's steps/s and
ratio and their median (``median_ratio``). One grid row's ratio rests on two
runs that this VM's swings (a third and more within an hour) can move apart.

``daemon_profile`` (with ``--profile``): py-spy samples the daemon during the
1-scheduler decode step (in memory by unary calls and over a stream, and
over a stream with ``--fsync always``); each
sampled stack is charged to the innermost frame that belongs to a known part
(:data:`PARTS`): the share per part of the samples taken while a Python thread
ran. gRPC's C-core threads never run Python, so py-spy cannot see them:
``sampled_share_of_cpu`` is the sampled on-CPU time over the daemon's CPU in
the same window, and the rest is gRPC's C core (polling, HTTP/2, TLS).
Protobuf's upb runtime is C too: its parse and serialise time is charged to
the Python frame that called it (``service`` or ``rpc_convert``).

Placement (``--placement``): ``shared`` (default: the daemon and the
schedulers on any CPU, as the issue measured) or ``own_core`` (the daemon
started with ``blockd serve --cpus`` on the first CPU, the schedulers on the
others; each row says which). On the 2-core VM a daemon sharing its core
with schedulers runs each step with caches they emptied: 4 schedulers on
the lane cost 510 us per decode step shared against 358 on a core of its own.

Run: ``python bench/rpc.py --part daemon_cost [--seconds 3] [--quick] [--profile] [--placement own_core]``.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

from bench.auth import security_variants
from bench.daemon import BLOCK_SIZE, MAX_STEPS, NUM_BLOCKS, NUM_SEQS, start_daemon, stop_daemon
from blockd.cluster.local import free_port
from blockd.core import Allocate, Pool, PoolConfig
from blockd.core.types import DecodeAppend, Free
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.service.servicer import BlockServicer
from blockd.v1 import blockd_pb2 as pb
from client import messages
from client.sdk import BlockdClient

PREFILL_TOKENS = 2048
#: the prefill pool: two prompts of blocks live at a time, the rest evictable
PREFILL_BLOCKS = 4096
_CLK_TCK = os.sysconf("SC_CLK_TCK")
WARMUP_STEPS = 50
#: the idle gap before each step of the ``chain_after_idle`` baseline: about what a lane daemon waits per step
IDLE_S = 0.0002
#: unary Step calls, the gRPC StepStream, the step lane (blockd serve --step-lane-port)
TRANSPORTS = ("unary", "stream", "lane")


def _stat_cpu_s(path: str) -> tuple[str, float]:
    """(command name, utime + stime in seconds) of a ``/proc`` ``stat`` file."""
    with open(path) as f:
        # the command name (field 2) may hold spaces: the fields after its ')' are fixed
        head, _, rest = f.read().rpartition(")")
    fields = rest.split()
    return head.partition("(")[2], (int(fields[11]) + int(fields[12])) / _CLK_TCK


def process_cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid`` so far, seconds (``/proc/<pid>/stat``)."""
    return _stat_cpu_s(f"/proc/{pid}/stat")[1]


def thread_times(pid: int) -> dict[str, list[float]]:
    """``{thread name: [cpu s, runqueue wait s, switches]}`` of ``pid``'s threads now, summed by
    name (``/proc/<pid>/task/<tid>/stat`` and ``schedstat``); a thread that ends meanwhile is left out."""
    out: dict[str, list[float]] = {}
    with os.scandir(f"/proc/{pid}/task") as tasks:
        for task in tasks:
            try:
                name, cpu_s = _stat_cpu_s(f"{task.path}/stat")
                with open(f"{task.path}/schedstat") as f:
                    _, wait_ns, slices = f.read().split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            times = out.setdefault(name, [0.0, 0.0, 0.0])
            times[0] += cpu_s
            times[1] += int(wait_ns) / 1e9
            times[2] += int(slices)
    return out


def threads_per_step(before: dict[str, list[float]], after: dict[str, list[float]], steps: int) -> dict:
    """:func:`thread_times` over a window, per step; threads under 1 us of CPU a step are left out."""
    rows = {}
    for name, (cpu, wait, slices) in sorted(after.items()):
        cpu0, wait0, slices0 = before.get(name, (0.0, 0.0, 0.0))
        if (cpu - cpu0) / steps * 1e6 >= 1.0:
            rows[name] = {"cpu_us_per_step": round((cpu - cpu0) / steps * 1e6, 1),
                          "runqueue_wait_us_per_step": round((wait - wait0) / steps * 1e6, 1),
                          "switches_per_step": round((slices - slices0) / steps, 2)}
    return rows


def wal_syncs(metrics_port: int) -> float:
    """The daemon's fdatasyncs so far (its metrics endpoint's ``blockd_wal_sync_duration_seconds_count``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("blockd_wal_sync_duration_seconds_count"):
                return float(line.split()[-1])
    return 0.0


class _Steps:
    """One scheduler's step of one kind on its own pool, by unary Step or over a StepStream."""

    def __init__(self, client: BlockdClient, pool: str, kind: str, transport: str) -> None:
        self.client, self.pool, self.kind, self.n = client, pool, kind, 0
        self.steps = client.step_stream() if transport in ("stream", "lane") else client
        if kind == "decode":
            client.create_pool(PoolConfig(pool, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
            self.ids = [f"{pool}-{i}" for i in range(NUM_SEQS)]
            client.step(pool, [Allocate(s, list(range(BLOCK_SIZE))) for s in self.ids])
            self.tokens = [7] * NUM_SEQS
        else:
            client.create_pool(PoolConfig(pool, num_blocks=PREFILL_BLOCKS, block_size=BLOCK_SIZE))

    def limit(self) -> int:
        return MAX_STEPS - WARMUP_STEPS - 1 if self.kind == "decode" else 1 << 30

    def __call__(self) -> None:
        if self.kind == "decode":
            self.steps.decode_append(self.pool, self.ids, self.tokens)
        else:
            # distinct tokens every step: 128 new blocks to hash, never a prefix hit
            first = self.n * PREFILL_TOKENS % (1 << 30)
            ops: list = [Free(f"p{self.n - 1}")] if self.n else []
            ops.append(Allocate(f"p{self.n}", list(range(first, first + PREFILL_TOKENS))))
            self.steps.step(self.pool, ops)
        self.n += 1


def _scheduler(address: str, kwargs: dict, pool: str, kind: str, transport: str, seconds: float, barrier,
               results, cpus: frozenset[int] | None = None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        with BlockdClient(address, **kwargs) as client:
            step = _Steps(client, pool, kind, transport)
            for _ in range(WARMUP_STEPS):
                step()
            barrier.wait()
            cpu0, done = time.process_time(), 0
            end, limit = time.perf_counter() + seconds, step.limit()
            while time.perf_counter() < end and done < limit:
                step()
                done += 1
            results.put((done, time.process_time() - cpu0))
    except threading.BrokenBarrierError:
        return  # another scheduler failed first and says why
    except Exception as e:  # noqa: BLE001 - said to the parent, which would otherwise wait for a result
        results.put((f"scheduler {pool}: {e}", 0.0))  # before the abort: the parent reads it on waking
        barrier.abort()


def l2_bytes() -> int:
    """One core's L2 cache, from sysfs (1 MiB when it does not say)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            text = f.read().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        return 1 << 20


def core_cpu_us(kind: str, reps: int, evict_bytes: int = 0) -> float:
    """CPU microseconds per step of ``kind`` on an in-process core Pool.
    ``evict_bytes`` > 0: a buffer that size is copied before each step (and
    not timed), so each step starts with the core's L2 full of other data, as
    the daemon's does: it sleeps between steps while the scheduler and the
    network run. 0: steps back to back, caches hot."""
    src, dst = bytearray(evict_bytes), bytearray(evict_bytes)
    clock = time.process_time

    def timed(step, *args) -> float:
        if not evict_bytes:
            began = clock()
            step(*args)
            return clock() - began
        dst[:] = src
        began = clock()
        step(*args)
        return clock() - began

    if kind == "decode":
        pool = Pool(PoolConfig("local", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
        ids = [f"s{i}" for i in range(NUM_SEQS)]
        pool.step([Allocate(s, list(range(BLOCK_SIZE))) for s in ids])
        op = [DecodeAppend(ids, [7] * NUM_SEQS)]
        reps = min(reps, MAX_STEPS)
        return sum(timed(pool.step, op) for _ in range(reps)) / reps * 1e6
    pool = Pool(PoolConfig("local", num_blocks=PREFILL_BLOCKS, block_size=BLOCK_SIZE))
    prompts = [list(range(n * PREFILL_TOKENS, (n + 1) * PREFILL_TOKENS)) for n in range(reps + 1)]
    pool.step([Allocate("p0", prompts[0])])
    return sum(timed(pool.step, [Free(f"p{n - 1}"), Allocate(f"p{n}", prompts[n])])
               for n in range(1, reps + 1)) / reps * 1e6


def chain_cpu_us(reps: int, idle_s: float = 0.0) -> float:
    """CPU microseconds per decode step (as ``decode``'s) through the daemon's
    own StepStream path in this process, with no transport: the servicer's
    parser from the request's bytes, ``BlockServicer._step`` (conversion,
    ``Engine.step`` with a request id, the answer) and the answer's bytes.
    ``idle_s`` > 0: the process sleeps that long before each step (untimed),
    as the daemon waits for the next request. On the 2-core VM (2026-12-06,
    eight alternating pairs) a step took 176-259 us back to back and 217-385
    after a 200 us sleep, dearer in every pair, while a harness that spun
    through the 200 us instead paid 5-10% more: the price is the CPU going
    idle (to the hypervisor), not the time."""
    engine = Engine(EngineConfig())
    try:
        servicer = BlockServicer(engine, threading.Event())
        parse = servicer.request_parsers["StepStream"]
        engine.create_pool(PoolConfig("chain", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
        ids = [f"chain-{i}" for i in range(NUM_SEQS)]
        engine.step("chain", [Allocate(s, list(range(BLOCK_SIZE))) for s in ids])
        total = 0.0
        for n in range(min(reps, MAX_STEPS)):
            # each request's bytes new, as a daemon reads each into a fresh buffer (untimed)
            data = pb.StepStreamRequest(step=messages.step_request(
                "chain", [DecodeAppend(ids, [7] * NUM_SEQS)], f"r{n}", False, "", 0)).SerializeToString()
            if idle_s:
                time.sleep(idle_s)
            began = time.process_time()
            answer = pb.StepStreamResponse()
            servicer._step(parse(data), answer.response)
            answer.SerializeToString()
            total += time.process_time() - began
        return total / min(reps, MAX_STEPS) * 1e6
    finally:
        engine.close()


def placement_cpus(placement: str) -> tuple[frozenset[int], frozenset[int]] | None:
    """``own_core``: (the daemon's CPU, the schedulers'): the first CPU this
    process may use, and the others; ``shared`` (or one CPU only): None."""
    allowed = sorted(os.sched_getaffinity(0))
    if placement != "own_core" or len(allowed) < 2:
        return None
    return frozenset(allowed[:1]), frozenset(allowed[1:])


def measure(kind: str, schedulers: int, durability: str, security: str, transport: str, seconds: float,
            directory: str, variants: dict, profile_s: float = 0.0,
            placement: str = "shared") -> tuple[dict, tuple | None]:
    """One configuration's row (and, with ``profile_s``, py-spy's stacks of the daemon);
    ``variants``: :func:`bench.auth.security_variants`; ``placement``: ``shared``
    (the daemon and the schedulers on any CPU) or ``own_core`` (:func:`placement_cpus`)."""
    flags, kwargs = variants[security]
    cpus = placement_cpus(placement)
    if placement == "own_core" and cpus is None:
        raise ValueError("placement own_core needs two CPUs at least")
    if cpus is not None:
        flags = [*flags, "--cpus", ",".join(map(str, sorted(cpus[0])))]
    data_dir = tempfile.mkdtemp(prefix="blockd-bench-cost-", dir=directory)
    if durability == "fsync_always":
        flags = [*flags, "--data-dir", data_dir, "--fsync", "always"]
    if transport == "lane":
        flags = [*flags, "--step-lane-port", "0"]
    metrics_port = free_port()
    proc, address = start_daemon(*flags, "--metrics-port", str(metrics_port))
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(schedulers + 1), ctx.Queue()
    procs = [ctx.Process(target=_scheduler, args=(address, kwargs, f"{kind}-{i}", kind, transport, seconds, barrier,
                                                         results, cpus[1] if cpus else None))
             for i in range(schedulers)]
    stacks = None
    try:
        for p in procs:
            p.start()
        try:
            barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            try:
                said = results.get(timeout=30)[0]
            except queue.Empty:
                said = "no scheduler reached its first timed step within 120 s"
            raise RuntimeError(said) from None
        threads0, syncs0 = thread_times(proc.pid), wal_syncs(metrics_port)
        cpu0, wall0 = process_cpu_s(proc.pid), time.perf_counter()
        spy = _start_py_spy(proc.pid, profile_s, directory) if profile_s else None
        runs = [results.get(timeout=seconds + 120) for _ in procs]
        failed = [done for done, _ in runs if isinstance(done, str)]
        if failed:
            raise RuntimeError("; ".join(failed))
        cpu, wall = process_cpu_s(proc.pid) - cpu0, time.perf_counter() - wall0
        threads1, syncs = thread_times(proc.pid), wal_syncs(metrics_port) - syncs0
        if spy is not None:
            stacks = _stop_py_spy(*spy)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        stop_daemon(proc)
        shutil.rmtree(data_dir, ignore_errors=True)
    steps = sum(done for done, _ in runs)
    per_step = cpu / steps * 1e6
    row = {"name": "daemon_cost", "step": kind, "schedulers": schedulers, "durability": durability,
           "security": security, "transport": transport, "placement": placement, "steps": steps,
           "seconds": round(wall, 2),
           "daemon_cpu_us_per_step": round(per_step, 1), "daemon_cores_busy": round(cpu / wall, 2),
           "steps_per_s": round(steps / wall, 1), "steps_per_daemon_core_s": round(1e6 / per_step, 1),
           "sdk_cpu_us_per_step": round(sum(c for _, c in runs) / steps * 1e6, 1),
           "seqs": NUM_SEQS if kind == "decode" else 1,
           "tokens_per_step": NUM_SEQS if kind == "decode" else PREFILL_TOKENS,
           "block_size": BLOCK_SIZE, "cpus": os.cpu_count(),
           "threads": threads_per_step(threads0, threads1, steps)}
    if durability == "fsync_always":
        row["fsyncs_per_step"] = round(syncs / steps, 3)
    if stacks is not None:
        row["_cpu_s"] = cpu
    return row, stacks


#: pairs of runs behind ``daemon_durable_ratio``
RATIO_PAIRS = 3


def ratio_row(pairs: list[tuple[float, float]]) -> dict:
    """``daemon_durable_ratio`` from ``(one scheduler's steps/s, four's)`` per pair."""
    ratios = sorted(four / one for one, four in pairs)
    middle = len(ratios) // 2
    median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
    return {"name": "daemon_durable_ratio", "step": "decode", "durability": "fsync_always", "transport": "lane",
            "security": "plain", "pairs": [{"one": round(one, 1), "four": round(four, 1),
                                            "ratio": round(four / one, 3)} for one, four in pairs],
            "median_ratio": round(median, 3), "target": 2.0}


def durable_ratio(seconds: float, pairs: int, directory: str, variants: dict, placement: str = "shared") -> dict:
    """Alternating runs of one and four durable schedulers on the lane (:func:`ratio_row`)."""
    measured = []
    for _ in range(pairs):
        one, four = (measure("decode", n, "fsync_always", "plain", "lane", seconds, directory, variants,
                             placement=placement)[0]["steps_per_s"] for n in (1, 4))
        measured.append((one, four))
    row = ratio_row(measured)
    row["placement"] = placement
    return row


# --- the profile ---------------------------------------------------------------------------------

#: (part, what a frame's file path contains), innermost match wins; checked in this order
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("auth", ("blockd/auth/",)),
    ("idempotency", ("blockd/engine/idempotency",)),
    ("wal", ("blockd/storage/", "blockd/engine/durability", "blockd/engine/snapshots")),
    ("metrics", ("prometheus_client/", "blockd/service/metrics", "blockd/rpc/metrics_http")),
    ("allocator_core", ("blockd/core/",)),
    ("engine", ("blockd/engine/",)),
    # the step lane's framing and socket calls (its TLS too: ssl.py)
    ("lane", ("blockd/service/lane", "blockd/rpc/lane", "socket.py", "ssl.py")),
    ("rpc_convert", ("blockd/rpc/",)),
    ("service", ("blockd/service/",)),
    ("protobuf", ("google/protobuf/", "_pb2")),
    # the server's poller thread: gRPC's C core inside completion_queue.poll (HTTP/2, reads)
    ("grpc_poller", ("_serve (grpc/_server.py",)),
    ("grpc_python", ("grpc/", "grpc_status/")),
    # the executor's threads waking for each call's handler
    ("thread_pool", ("concurrent/futures/",)),
)


def part_of(stack: list[str]) -> str:
    """The part a sampled stack (outermost frame first) is charged to."""
    for frame in reversed(stack):
        for part, needles in PARTS:
            if any(n in frame for n in needles):
                return part
    return "other"


def parse_collapsed(text: str) -> tuple[Counter, Counter]:
    """py-spy's ``--format raw`` (collapsed stacks: ``f1;f2;... count`` per line) ->
    (part -> samples, innermost frame -> samples of the stacks charged to ``other``)."""
    parts: Counter = Counter()
    other: Counter = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            frames = stack.split(";")
            part = part_of(frames)
            parts[part] += int(count)
            if part == "other":
                other[frames[-1]] += int(count)
    return parts, other


PY_SPY_RATE = 250


def _py_spy_exe() -> str:
    """py-spy beside this interpreter (the venv's) or on PATH; "" if neither."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.path.exists(beside) else (shutil.which("py-spy") or "")


def _start_py_spy(pid: int, seconds: float, directory: str):
    exe = _py_spy_exe()
    out = os.path.join(directory, f"py-spy-{pid}.txt")
    spy = subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", str(PY_SPY_RATE),
                            "--duration", str(max(1, int(seconds))), "--nonblocking", "--output", out],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return spy, out


def _stop_py_spy(spy: subprocess.Popen, out: str) -> tuple[Counter, Counter]:
    _, err = spy.communicate(timeout=120)
    if spy.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace').strip()[-400:]}")
    with open(out) as f:
        return parse_collapsed(f.read())


def profile_row(row: dict, stacks: tuple[Counter, Counter], seconds: float) -> dict:
    parts, other = stacks
    total = sum(parts.values())
    sampled_cpu = total / PY_SPY_RATE
    return {"name": "daemon_profile", "step": row["step"], "schedulers": row["schedulers"],
            "durability": row["durability"], "security": row["security"], "transport": row["transport"],
            "samples": total,
            "sampled_share_of_cpu": round(min(1.0, sampled_cpu / row["_cpu_s"]), 3) if row["_cpu_s"] else None,
            "daemon_cpu_us_per_step": row["daemon_cpu_us_per_step"],
            "share": {part: round(n / total, 3) for part, n in parts.most_common()} if total else {},
            "other_top": {frame: round(n / total, 3) for frame, n in other.most_common(5)} if total else {},
            "profiled_s": seconds, "sampler": f"py-spy record --nonblocking --rate {PY_SPY_RATE}"}


def _has_py_spy() -> str:
    """"" when py-spy is there, else why not."""
    return "" if _py_spy_exe() else "py-spy is not installed (pip install py-spy; make setup installs it)"


def daemon_cost(seconds: float, quick: bool, profile: bool, placement: str = "shared") -> Iterator[dict]:
    """The rows (see the module docstring); ``quick``: the decode step, 1 scheduler, both
    durabilities, every transport, plain; ``placement``: as :func:`measure`'s."""
    if placement == "own_core" and placement_cpus(placement) is None:
        yield {"name": "daemon_cost", "placement": placement, "error": "own_core needs two CPUs at least"}
        return
    core = {kind: core_cpu_us(kind, 200 if quick else 2000) for kind in ("decode", "prefill")}
    cold = {kind: core_cpu_us(kind, 200 if quick else 1000, l2_bytes()) for kind in ("decode", "prefill")}
    chain = (chain_cpu_us(300 if quick else 1000), chain_cpu_us(300 if quick else 1000, IDLE_S))
    with tempfile.TemporaryDirectory(prefix="blockd-bench-cost-") as directory:
        variants = security_variants(directory)
        grid = [(k, s, d, sec, t) for k in ("decode", "prefill") for s in (1, 4)
                for d in ("memory", "fsync_always") for sec in ("plain", "mtls_token") for t in TRANSPORTS]
        if quick:
            grid = [("decode", 1, d, "plain", t) for d in ("memory", "fsync_always") for t in TRANSPORTS]
        unary: dict[tuple, float] = {}
        stream: dict[tuple, float] = {}
        plain: dict[tuple, float] = {}
        one: dict[tuple, float] = {}
        for kind, schedulers, durability, security, transport in grid:
            row, _ = measure(kind, schedulers, durability, security, transport, seconds, directory, variants,
                             placement=placement)
            cost = row["daemon_cpu_us_per_step"]
            row["core_cpu_us_per_step"] = round(core[kind], 1)
            row["ratio_vs_core"] = round(cost / core[kind], 2)
            row["core_cold_cpu_us_per_step"] = round(cold[kind], 1)
            row["ratio_vs_core_cold"] = round(cost / cold[kind], 2)
            if kind == "decode":
                row["chain_cpu_us_per_step"], row["chain_after_idle_cpu_us_per_step"] = (round(c, 1) for c in chain)
                row["ratio_vs_chain_after_idle"] = round(cost / chain[1], 2)
            # each ratio against the same configuration but one axis, measured earlier in this run
            key = (kind, schedulers, durability, security)
            if transport in ("unary", "stream"):
                (unary if transport == "unary" else stream)[key] = cost
            if transport != "unary" and key in unary:
                row["ratio_vs_unary"] = round(cost / unary[key], 3)
            if transport == "lane" and key in stream:
                row["ratio_vs_stream"] = round(cost / stream[key], 3)
            if security == "plain":
                plain[kind, schedulers, durability, transport] = cost
            elif (kind, schedulers, durability, transport) in plain:
                row["ratio_vs_plain"] = round(cost / plain[kind, schedulers, durability, transport], 3)
            if schedulers == 1:
                one[kind, durability, security, transport] = row["steps_per_s"]
            elif (kind, durability, security, transport) in one:
                row["steps_per_s_vs_one_scheduler"] = round(
                    row["steps_per_s"] / one[kind, durability, security, transport], 2)
            yield row
        yield durable_ratio(seconds, 1 if quick else RATIO_PAIRS, directory, variants, placement)
        if profile:
            missing = _has_py_spy()
            for durability, transport in (("memory", "unary"), ("memory", "stream"), ("memory", "lane"),
                                          ("fsync_always", "stream"), ("fsync_always", "lane")):
                if missing:
                    yield {"name": "daemon_profile", "durability": durability, "error": missing}
                    continue
                row, stacks = measure("decode", 1, durability, "plain", transport, seconds, directory, variants,
                                      profile_s=seconds, placement=placement)
                yield profile_row(row, stacks or (Counter(), Counter()), seconds)
