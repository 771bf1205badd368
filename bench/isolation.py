"""One caller's huge batch against everyone else's small steps (``bench/rpc.py --part big_batch_isolation``).

A batch of 30,000 Allocates into a 64-block pool once took seconds to fail
(its request id's fingerprint was quadratic in the batch, and computed before
the first op ran) while every other caller waited. This part measures what
the guardrails and the fail-fast path leave of that, with the daemon in its
own process (``blockd serve``, state in memory) and each caller in its own:

* ``big_batch_isolation``: a small step (a 16-sequence ``decode_append``,
  with a request id, as a scheduler sends it) timed alone, then while another
  process sends 20,000-op Allocate batches into a 64-block pool back to back
  (each fails at its 33rd op with RESOURCE_EXHAUSTED). ``p99_ratio``:
  the small step's p99 during the batches against its p99 alone in the same
  run (target: <= 3). One row per daemon configuration: ``limits=default``
  (a 20,000-op batch is over ``--max-ops-per-step`` 8192 and is refused
  before a single op is read) and ``limits=raised`` (``--max-ops-per-step
  65536``: the batch is read and runs until its first failing op).
* ``big_batch_fail``: the time a failing batch of 30,000 ops (over the default
  bound) and of 8,192 ops (the largest within it) takes to fail, from
  sending its prebuilt request to the error (median of 7; the client's own
  cost of building 30,000 ops is left out), for both configurations
  (target: under 50 ms).

Wall time is what a waiting caller feels, so these are wall-clock figures.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import time
import uuid
from collections.abc import Iterator

import grpc

from bench.daemon import start_daemon, stop_daemon
from blockd.core import Allocate, PoolConfig
from blockd.rpc import convert
from client.sdk import BlockdClient

SMALL_SEQS = 16
BIG_OPS = 20_000
#: a batch over the default bound, and the largest one within it
FAIL_OPS = (30_000, 8192)
CONFIGS = {"default": (), "raised": ("--max-ops-per-step", "65536")}
#: how the big batches arrive: as fast as one process can send them, or at a
#: scheduler's step rate (a misconfigured scheduler sending one per step)
ARRIVALS = {"back_to_back": 0.0, "20_per_s": 0.05}


def _big_request(pool: str, num_ops: int):
    ops = [Allocate(f"big-{i}", list(range(i % 50, i % 50 + 20))) for i in range(num_ops)]
    return convert.step_request_to_proto(pool, ops, "")


def _send_big(address: str, stop, sent, interval_s: float) -> None:
    """The same failing batch, one every ``interval_s`` (0: back to back),
    until ``stop``. Its bytes are serialized once: on two cores the sender's
    own serializing would otherwise take CPU from the caller being measured.
    One request id serves all (a failed batch's id is never remembered)."""
    data = _big_request("big", BIG_OPS).SerializeToString()
    with grpc.insecure_channel(address) as channel:
        step = channel.unary_unary("/blockd.v1.BlockService/Step", request_serializer=None,
                                   response_deserializer=None)
        due = time.monotonic()
        while not stop.is_set():
            due += interval_s
            time.sleep(max(0.0, due - time.monotonic()))
            with contextlib.suppress(grpc.RpcError):  # each one fails: that is the point
                step(data, timeout=30)
            sent.value += 1


def _small_steps(client: BlockdClient, seconds: float) -> list[float]:
    ids = [f"small-{i}" for i in range(SMALL_SEQS)]
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        client.decode_append("small", ids, [7] * SMALL_SEQS)
        times.append(time.perf_counter() - start)
    return sorted(times)


def _p(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


def _isolation_row(client: BlockdClient, address: str, seconds: float, interval_s: float) -> dict:
    alone = _small_steps(client, seconds)
    ctx = multiprocessing.get_context("spawn")
    stop, sent = ctx.Event(), ctx.Value("i", 0)
    sender = ctx.Process(target=_send_big, args=(address, stop, sent, interval_s))
    sender.start()
    time.sleep(1.0)  # the sender's start-up and its first batch
    before = sent.value
    during = _small_steps(client, seconds)
    arrived = sent.value - before
    stop.set()
    sender.join(60)
    return {"name": "big_batch_isolation", "big_batch_ops": BIG_OPS,
            "big_batches_per_s": round(arrived / seconds, 1), "small_step_seqs": SMALL_SEQS,
            "alone_p50_ms": round(_p(alone, 0.5), 3), "alone_p99_ms": round(_p(alone, 0.99), 3),
            "during_p50_ms": round(_p(during, 0.5), 3), "during_p99_ms": round(_p(during, 0.99), 3),
            "p99_ratio": round(_p(during, 0.99) / _p(alone, 0.99), 2), "target_p99_ratio": 3.0,
            "steps_alone": len(alone), "steps_during": len(during)}


def _one_config(name: str, flags: tuple[str, ...], seconds: float) -> Iterator[dict]:
    proc, address = start_daemon(*flags)
    try:
        with BlockdClient(address, timeout_s=30) as client:
            client.create_pool(PoolConfig("small", num_blocks=1 << 14, block_size=16))
            client.create_pool(PoolConfig("big", num_blocks=64, block_size=16))
            client.step("small", [Allocate(f"small-{i}", list(range(16))) for i in range(SMALL_SEQS)])
            _small_steps(client, 0.5)  # warm both sides
            for arrival, interval_s in ARRIVALS.items():
                yield _isolation_row(client, address, seconds, interval_s) | {"limits": name, "arrival": arrival}
            for num_ops in FAIL_OPS:
                yield _fail_row(client, num_ops) | {"limits": name}
    finally:
        stop_daemon(proc)


def _fail_row(client: BlockdClient, num_ops: int) -> dict:
    request, stub, times, error = _big_request("big", num_ops), client._blocks, [], ""
    for _ in range(7):
        request.request_id = uuid.uuid4().hex
        start = time.perf_counter()
        try:
            stub.Step(request, timeout=30)
        except grpc.RpcError as err:
            error = f"{err.code().name}: {err.details()[:120]}"
        times.append(time.perf_counter() - start)
    return {"name": "big_batch_fail", "ops": num_ops,
            "request_bytes": request.ByteSize(), "fail_ms": round(statistics.median(times) * 1e3, 2),
            "target_ms": 50, "error": error}


def big_batch_isolation(seconds: float) -> Iterator[dict]:
    for name, flags in CONFIGS.items():
        yield from _one_config(name, flags, seconds)
