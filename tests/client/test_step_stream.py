"""Steps over one StepStream call answer exactly as unary Step does: the same
results and the same refusals (raised as the same exceptions, with nothing
changed and the stream still open), the same idempotency by request id across
streams and across unary calls, a per-step deadline, and a stream cut by a
daemon killed and restarted (real ``blockd serve`` processes) that the next
step reopens, its resent request id answered as it first was.

Each test runs twice (``transport``): over the gRPC stream, and over the step
lane of a daemon that serves one (``--step-lane-port``), where the SDK opens
its streams on the lane (checked: the stream in use is a lane connection).
The lane's own faults and bad input are in ``tests/blockd/service/test_lane.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from blockd.core import Allocate, PoolConfig
from blockd.core.types import Append, Commit, DecodeAppend, Fork, Free
from blockd.engine.config import EngineConfig
from blockd.engine.guardrails import Guardrails
from blockd.engine.machine import Engine
from blockd.service.server import BlockdServer
from client.errors import BlockdClientError, DeadlineExceededError, InvalidArgumentError, UnavailableError
from client.scheduler import SchedulerConfig
from client.sdk import BlockdClient
from client.step_stream import StepStream, _LaneCall
from tests.support.procs import free_port, pause, start_blockd

pytest_plugins = ["tests.support.grpc_fixtures"]


@pytest.fixture(params=["grpc", "lane"])
def transport(request) -> str:
    return request.param


def lane_port(transport: str) -> int | None:
    """BlockdServer's ``step_lane_port`` for ``transport``."""
    return 0 if transport == "lane" else None


def lane_flags(transport: str) -> tuple[str, ...]:
    return ("--step-lane-port", "0") if transport == "lane" else ()


def on(stream: StepStream, transport: str) -> bool:
    """Whether ``stream``'s open connection is the one ``transport`` says."""
    return isinstance(stream._call, _LaneCall) is (transport == "lane")


@pytest.fixture
def blockd_server(transport):
    server = BlockdServer(Engine(), "127.0.0.1:0", max_workers=16, grace_s=2.0, step_lane_port=lane_port(transport))
    server.start()
    try:
        yield server
    finally:
        server.stop(0.5)

#: a scheduler's life in steps, refusals included (an unknown sequence, a fork onto a live id, a bad op)
SCRIPT = [
    [Allocate("a", list(range(10))), Allocate("b", list(range(6)))],
    [Commit("a", 10), Commit("b", 6)],
    [DecodeAppend(["a", "b"], [7, 8])],
    [Fork("a", "c")],
    [Free("nobody")],
    [Fork("a", "b")],
    [Append("c", [1, 2, 3, 4, 5])],
    [Allocate("d", list(range(10)))],  # a prefix hit on a's blocks
    [DecodeAppend(["a", "zz"], [1, 1])],
    [Free("a"), Free("b")],
    [Append("c", [])],
]


def _outcome(do) -> tuple:
    try:
        result = do()
    except BlockdClientError as err:
        return ("error", type(err).__name__, err.reason, err.op_index, str(err).replace("'other'", "'p'"))
    return ("ok", result.version, result.results, result.copy_ops, result.tier_ops)


def test_the_stream_answers_each_step_as_step_does_and_a_refusal_changes_nothing(blockd_server, client, transport):
    for pool in ("p", "other"):
        client.create_pool(PoolConfig(pool, num_blocks=32, block_size=4))
    engine = blockd_server.engine
    refused = 0
    with client.step_stream() as stream:
        for n, ops in enumerate(SCRIPT):
            unary = _outcome(lambda ops=ops, n=n: client.step("p", ops, request_id=f"u{n}"))
            before = engine.capture()
            streamed = _outcome(lambda ops=ops, n=n: stream.step("other", ops, request_id=f"s{n}"))
            assert streamed == unary, f"step {n}: {ops}"
            if streamed[0] == "error":
                refused += 1
                assert engine.capture() == before, f"step {n} was refused yet changed the pool"
        assert refused >= 3
        assert client.get_tables("other") == client.get_tables("p")
        # a request that names no pool, and one that names another pool's request id with other ops
        with pytest.raises(InvalidArgumentError, match="pool"):
            stream.step("", [Free("c")])
        with pytest.raises(InvalidArgumentError) as refused:
            stream.step("other", [Free("c")], request_id="s0")
        assert refused.value.reason == client_reason(client, "p", [Free("c")], "u0")
        # still open, still in order
        streamed_slots = stream.decode_append("other", ["c"], [3]).slot_mapping
        assert on(stream, transport)
        assert streamed_slots == client.decode_append("p", ["c"], [3]).slot_mapping


def client_reason(client: BlockdClient, pool: str, ops, request_id: str) -> str:
    """The reason unary Step refuses the same reuse of a request id."""
    with pytest.raises(InvalidArgumentError) as refused:
        client.step(pool, ops, request_id=request_id)
    return refused.value.reason


def test_an_oversized_batch_is_refused_unread_and_the_stream_reads_on(transport):
    engine = Engine(EngineConfig(guardrails=Guardrails(max_ops_per_step=100)))
    server = BlockdServer(engine, "127.0.0.1:0", max_workers=4, step_lane_port=lane_port(transport))
    server.start()
    try:
        with BlockdClient(server.address, timeout_s=5) as client, client.step_stream() as stream:
            client.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
            before = engine.capture()
            # over 64 KB: skimmed, counted, refused before the ops are parsed
            ops = [Free(f"seq-{i:04d}-" + "x" * 40) for i in range(2000)]
            with pytest.raises(InvalidArgumentError, match="at most 100 operations"):
                stream.step("p", ops)
            assert engine.capture() == before
            assert stream.step("p", [Allocate("a", [1, 2, 3])]).results[0].num_tokens == 3
            assert on(stream, transport)
    finally:
        server.stop(0.5)


def test_a_request_id_retried_on_a_new_stream_or_by_step_gets_the_first_answer(client, transport):
    client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
    with client.step_stream() as first:
        answer = first.step("p", [Allocate("a", [1, 2, 3, 4, 5])], request_id="r-1")
        assert on(first, transport)
    with client.step_stream() as second:
        again = second.step("p", [Allocate("a", [1, 2, 3, 4, 5])], request_id="r-1")
        assert again == answer
        with pytest.raises(InvalidArgumentError):
            second.step("p", [Allocate("a", [9, 9])], request_id="r-1")
    assert client.step("p", [Allocate("a", [1, 2, 3, 4, 5])], request_id="r-1") == answer
    assert client.get_pool("p").num_seqs == 1


def test_a_late_answer_is_a_deadline_and_the_next_step_opens_a_new_stream(transport):
    proc = start_blockd(*lane_flags(transport))
    try:
        with BlockdClient(proc.address, timeout_s=10) as client, client.step_stream(timeout_s=0.5) as stream:
            client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
            stream.step("p", [Allocate("a", [1, 2, 3])])
            assert on(stream, transport)
            pause(proc.pid)  # the daemon answers nothing, its socket stays open
            try:
                began = time.monotonic()
                with pytest.raises(DeadlineExceededError, match="request id"):
                    stream.step("p", [Append("a", [4])], request_id="late-1")
                assert time.monotonic() - began < 5
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            # the step may have been applied once the daemon ran again: its request id says so
            retried = stream.step("p", [Append("a", [4])], request_id="late-1")
            assert retried.results[0].slot_mapping == (3,)
            assert on(stream, transport)
            assert client.get_sequence("p", "a").num_tokens == 4
    finally:
        proc.kill()


def test_a_stream_cut_by_a_daemon_killed_and_restarted(tmp_path, transport):
    port = free_port()
    # the restarted daemon's lane is on another free port: the client asks again where it is
    flags = ("--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path), "--fsync", "always",
             *lane_flags(transport))
    procs = [start_blockd(*flags)]
    try:
        with BlockdClient(f"127.0.0.1:{port}", timeout_s=10) as client, client.step_stream(timeout_s=10) as stream:
            client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
            answer = stream.step("p", [Allocate("a", [1, 2, 3, 4, 5])], request_id="r-1")
            assert on(stream, transport)
            procs[0].kill()  # kill -9: the stream is cut
            with pytest.raises(UnavailableError):
                stream.step("p", [Append("a", [6])], request_id="r-2")
            procs.append(start_blockd(*flags))
            # the acknowledged step survived, and its request id answers as it first did
            assert stream.step("p", [Allocate("a", [1, 2, 3, 4, 5])], request_id="r-1") == answer
            assert stream.step("p", [Append("a", [6])], request_id="r-2").results[0].slot_mapping == (5,)
            assert on(stream, transport)
            assert client.get_sequence("p", "a").num_tokens == 6
    finally:
        for proc in procs:
            proc.kill()


def test_a_scheduler_on_a_client_that_streams_its_steps_runs_as_on_unary_steps(blockd_server, client):
    """The scheduler's steps over unary Step (``stream_steps=False``), over the
    client's per-thread stream (``BlockdClient(stream_steps=True)``) and over its
    own StepStream (``SchedulerConfig.stream_steps``, the default): the same tokens,
    preemptions and refusals for room every way."""
    from tests.client.test_scheduler import workload
    from tests.support.slot_model import StreamThrough, check_outputs, make

    runs = []
    for client_streams, scheduler_streams in ((False, False), (True, False), (False, True)):
        with BlockdClient(blockd_server.address, timeout_s=5, stream_steps=client_streams) as steps:
            requests = workload(0, 16)
            config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=12, stream_steps=scheduler_streams)
            sched, _ = make(steps, 24, config, watermark=1)
            for req in requests:
                sched.add_request(req)
            outputs = sched.run()
            check_outputs(outputs, requests)
            counts = {k: v for k, v in vars(sched.counters).items() if isinstance(v, int)}
            runs.append((sorted((o.request_id, o.output_token_ids) for o in outputs), counts))
            assert bool(steps._all_streams) is client_streams
            assert isinstance(getattr(sched._step, "__self__", None), StreamThrough) is scheduler_streams
        client.delete_pool("p")
    assert runs[0] == runs[1] == runs[2]
    assert runs[1][1]["num_preemptions"] > 0 and runs[1][1]["num_refused_batches"] > 0
    with pytest.raises(ValueError, match="stream_steps"):
        SchedulerConfig(stream_steps=1)


def test_the_asyncio_stream_answers_as_the_asyncio_step_does(blockd_server):
    """AsyncBlockdClient.step_stream(): the same script's results and refusals as its unary step."""
    import asyncio

    from client.aio import AsyncBlockdClient

    async def scenario() -> list[tuple]:
        async with AsyncBlockdClient(blockd_server.address, timeout_s=5) as client:
            for pool in ("p", "other"):
                await client.create_pool(PoolConfig(pool, num_blocks=32, block_size=4))
            pairs = []
            async with client.step_stream() as stream:
                for n, ops in enumerate(SCRIPT):
                    pairs.append((await _async_outcome(client.step("p", ops, request_id=f"u{n}")),
                                  await _async_outcome(stream.step("other", ops, request_id=f"s{n}"))))
                # a resent request id on the stream gets the first answer
                again = await _async_outcome(stream.step("other", SCRIPT[0], request_id="s0"))
                pairs.append((pairs[0][1], again))
            return pairs

    pairs = asyncio.run(scenario())
    assert all(unary == streamed for unary, streamed in pairs), [p for p in pairs if p[0] != p[1]]
    assert sum(1 for unary, _ in pairs if unary[0] == "error") >= 3


async def _async_outcome(call) -> tuple:
    try:
        result = await call
    except BlockdClientError as err:
        return ("error", type(err).__name__, err.reason, err.op_index, str(err).replace("'other'", "'p'"))
    return ("ok", result.version, result.results, result.copy_ops, result.tier_ops)


def test_a_wrapper_that_overrides_step_keeps_it_unless_it_offers_its_own_stream(blockd_server):
    """``SchedulerConfig.stream_steps`` must never bypass a backend's own ``step``: a
    wrapper that watches steps and hands everything else through to a client keeps
    its ``step``; the client itself, or a wrapper with its own ``step_stream``, streams."""
    from client.backends import stream_step

    class Watching:
        def __init__(self, client) -> None:
            self.client, self.seen = client, 0

        def step(self, pool, ops, **kwargs):
            self.seen += 1
            return self.client.step(pool, ops, **kwargs)

        def __getattr__(self, name):
            return getattr(self.client, name)

    with BlockdClient(blockd_server.address, timeout_s=5) as client:
        watching, owner = Watching(client), Watching(None)  # any object a weak reference can name
        assert stream_step(watching, owner) == watching.step
        streamed = stream_step(client, owner)
        assert isinstance(streamed.__self__, StepStream)
        client.create_pool(PoolConfig("w", num_blocks=8, block_size=4))
        assert streamed("w", [Allocate("a", [1, 2, 3])]).results[0].num_cached_tokens == 0


def test_streams_beyond_the_daemons_slots_step_by_unary_and_never_stall_others(transport):
    """Each open StepStream holds one of the daemon's RPC threads, so at most half
    of ``max_workers`` may be open: with 4 threads, a third stream's step is refused
    in band (STEP_STREAMS_FULL, nothing applied) and the SDK sends it by unary Step,
    applied once; unary calls keep being answered; a closed stream frees its slot."""
    with _every_slot_held(transport) as (server, client, held):
        assert all(on(stream, transport) for stream in held)
        third = client.step_stream()
        result = third.step("p", [Allocate("third", [4, 5, 6])], request_id="third-1")
        assert third._unary_until > time.monotonic() and third._call is None  # refused a slot: unary
        assert result.results[0].seq_id == "third"
        assert client.get_sequence("p", "third").num_tokens == 3
        again = third.step("p", [Allocate("third", [4, 5, 6])], request_id="third-1")  # a resend
        assert again.version == result.version  # the first answer: applied once
        assert [p.name for p in client.list_pools()] == ["p"]  # unary calls are answered meanwhile
        held.pop().close()
        third._unary_until = 0.0
        deadline = time.monotonic() + 10
        while True:  # the daemon frees the slot once it sees the stream's cancellation
            third.step("p", [Append("third", [7])])
            if third._call is not None:
                break
            assert time.monotonic() < deadline, "the closed stream's slot was never freed"
            third._unary_until = 0.0
            time.sleep(0.05)
        asyncio_third = _asyncio_step_beyond_the_slots(server.address)
        assert asyncio_third == (True, 3)  # by unary Step, applied
        third.close()


@contextlib.contextmanager
def _every_slot_held(transport: str = "grpc"):
    """A daemon of 4 RPC threads (2 stream slots), pool ``p``, and both slots
    held by open streams: ``(server, client, the two streams)``."""
    server = BlockdServer(Engine(), "127.0.0.1:0", max_workers=4, step_lane_port=lane_port(transport))
    server.start()
    try:
        with BlockdClient(server.address, timeout_s=5) as client:
            client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
            held = [client.step_stream() for _ in range(2)]
            for n, stream in enumerate(held):
                stream.step("p", [Allocate(f"held-{n}", [1, 2, 3])])
            yield server, client, held
            for stream in held:
                stream.close()
    finally:
        server.stop(0.5)


def _asyncio_step_beyond_the_slots(address: str) -> tuple[bool, int]:
    """With every slot held, an AsyncStepStream's step also goes by unary Step:
    (whether it stepped unary, the new sequence's tokens)."""
    import asyncio

    from client.aio import AsyncBlockdClient

    async def scenario() -> tuple[bool, int]:
        async with AsyncBlockdClient(address, timeout_s=5) as client, client.step_stream() as stream:
            await stream.step("p", [Allocate("async", [1, 2, 3])], request_id="async-1")
            unary = stream._unary_until > time.monotonic() and stream._call is None
            return unary, (await client.get_sequence("p", "async")).num_tokens

    return asyncio.run(scenario())


def test_a_refused_stream_answers_its_first_step_however_late_it_comes(monkeypatch):
    """The STEP_STREAMS_FULL refusal answers a stream's first step, not its
    opening: an asyncio caller that writes only after the daemon has long run
    the stream's handler still reads the refusal (a stream ended before the
    write would fail it with gRPC's bare "INTERNAL: Internal error from Core"),
    nothing is applied, and a refused stream that never writes is cut after
    REFUSAL_WAIT_S instead of holding a daemon thread."""
    import asyncio

    import grpc

    from blockd.service import servicer
    from blockd.v1 import blockd_pb2 as pb
    from client.aio import AsyncBlockdClient
    from client.errors import NotFoundError, from_status_bytes
    from client.messages import step_request

    monkeypatch.setattr(servicer, "REFUSAL_WAIT_S", 1.0)
    with _every_slot_held() as (server, client, _held):

        async def scenario() -> tuple[str, float]:
            async with AsyncBlockdClient(server.address, timeout_s=5) as aclient:
                late = aclient._blocks.StepStream()
                await asyncio.sleep(0.5)
                request = step_request("p", [Allocate("late", [4, 5, 6])], "late-1", False, "", 0)
                await late.write(pb.StepStreamRequest(step=request))
                answer = await asyncio.wait_for(late.read(), 5)
                silent, began = aclient._blocks.StepStream(), time.monotonic()
                with pytest.raises(grpc.RpcError) as cut:  # never answered: the daemon cancels it
                    await asyncio.wait_for(silent.read(), 5)
                assert cut.value.code() == grpc.StatusCode.CANCELLED
                return from_status_bytes(answer.error_status).reason, time.monotonic() - began

        reason, cut_after = asyncio.run(scenario())
        assert reason == "STEP_STREAMS_FULL"
        assert 0.9 <= cut_after < 4.0
        with pytest.raises(NotFoundError):
            client.get_sequence("p", "late")
        assert [p.name for p in client.list_pools()] == ["p"]  # the daemon's threads answer on


def test_an_asyncio_step_on_a_stream_ended_before_it_was_sent_is_unavailable_and_unapplied():
    """A daemon that ends a stream before its first step is written (as one
    before the refusal waited for that step did; here a bare gRPC server
    stands in for it, since today's daemon never does): gRPC fails the write
    with a bare "INTERNAL: Internal error from Core", which the SDK raises as
    what it is, UNAVAILABLE with nothing applied, the step never sent."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from client.aio import AsyncBlockdClient

    seen: list[object] = []

    def ends_at_once(requests, context):
        seen.append(context.peer())
        return iter(())  # status OK, no answer, nothing read

    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "blockd.v1.BlockService", {"StepStream": grpc.stream_stream_rpc_method_handler(ends_at_once)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    class LateWrites:  # the call as gRPC makes it; its first write only after the daemon ended it
        def __init__(self, call):
            self.call = call

        async def write(self, request):
            while not self.call.done():
                await asyncio.sleep(0.01)
            await self.call.write(request)

        def __getattr__(self, name):
            return getattr(self.call, name)

    async def scenario():
        async with AsyncBlockdClient(f"127.0.0.1:{port}", timeout_s=2) as client:
            opened = client._blocks.StepStream
            client._blocks.StepStream = lambda: LateWrites(opened())
            async with client.step_stream() as stream:
                with pytest.raises(UnavailableError, match="before this step was sent; nothing was applied"):
                    await stream.step("p", [Allocate("a", [1, 2, 3])], request_id="r-1")

    try:
        asyncio.run(scenario())
        assert seen, "the stream reached the server"
    finally:
        server.stop(0)
