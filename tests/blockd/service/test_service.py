"""blockd over real gRPC on loopback: every RPC through the SDK (sync and
asyncio), the status code of each error case of docs/protocol.md with its
google.rpc details, atomicity and idempotency over the wire, health and
reflection, streams that end, retries and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from blockd.core import Allocate, Append, BlockdError, Commit, ExtraKeys, Fork, Free, PoolConfig
from blockd.core.types import DecodeAppend, Snapshot, VersionDelta, WorkerInfo
from blockd.v1 import blockd_pb2 as pb
from blockd.v1 import blockd_pb2_grpc as pb_grpc
from client import AsyncBlockdClient, BlockdClient
from client import errors as ce

pytest_plugins = ["tests.support.grpc_fixtures"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMALL = PoolConfig("small", num_blocks=16, block_size=4, num_layers=2, num_kv_heads=2)


def test_pool_rpcs(client: BlockdClient) -> None:
    stats = client.create_pool(SMALL)
    assert (stats.name, stats.num_blocks, stats.num_free_blocks, stats.version) == ("small", 16, 16, 0)
    client.create_pool(PoolConfig("another", num_blocks=8, block_size=2))
    assert client.pool_config("small") == replace(SMALL, tenant="default")  # replies name the owner
    assert client.get_pool("small") == stats
    assert [s.name for s in client.list_pools()] == ["another", "small"]
    client.allocate("small", "a", [1, 2, 3, 4, 5])
    client.commit("small", "a", 4)
    assert client.get_pool("small").num_evictable_blocks == 0
    client.free("small", "a")
    assert client.get_pool("small").num_evictable_blocks == 1
    client.reset_prefix_cache("small")
    assert client.get_pool("small").num_evictable_blocks == 0
    client.delete_pool("another")
    assert [s.name for s in client.list_pools()] == ["small"]


def test_step_rpcs(client: BlockdClient) -> None:
    client.create_pool(SMALL)
    first = client.allocate("small", "a", [1, 2, 3, 4, 5, 6])
    assert (first.num_tokens, first.new_block_ids, first.slot_mapping) == (6, (0, 1), (0, 1, 2, 3, 4, 5))
    grown = client.append("small", "a", [7, 8, 9])
    assert (grown.new_block_ids, grown.slot_start, grown.slot_mapping) == ((2,), 6, (6, 7, 8))
    client.fork("small", "a", "b")
    step = client.step("small", [DecodeAppend(["a", "b"], [10, 11]), Commit("b", 9)])
    # the shared, partly filled last block is copied on write by the first writer
    assert step.copy_ops == ((2, 3),)
    assert step.results[0].slot_mapping == (13, 9)
    version, tables = client.get_tables("small")
    assert version == step.version and tables == {"a": [0, 1, 3], "b": [0, 1, 2]}
    assert client.get_tables("small", ["b"]) == (version, {"b": [0, 1, 2]})
    info = client.get_sequence("small", "b")
    assert (info.num_tokens, info.num_committed, info.block_table) == (10, 9, [0, 1, 2])
    assert client.decode_append("small", ["a"], [12]).slot_mapping == (14,)
    client.free("small", "b")
    assert "b" not in client.get_tables("small")[1]


def test_prefix_lookup_and_events(client: BlockdClient) -> None:
    client.create_pool(SMALL)
    client.create_pool(PoolConfig("cold", num_blocks=4, block_size=4))
    extra = ExtraKeys(model_id="m", cache_salt="tenant-1")
    client.allocate("small", "a", list(range(9)), extra)
    client.commit("small", "a", 9)
    assert client.lookup_prefix(list(range(12)), extra) == {"small": 8, "cold": 0}
    assert client.lookup_prefix(list(range(12)), None, ["small"]) == {"small": 0}
    events = client.events("small", 0)
    got = [next(events), next(events)]
    events.close()
    assert [(e.seq_no, e.kind, e.block_id) for e in got] == [(1, "BlockStored", 0), (2, "BlockStored", 1)]
    assert got[1].parent_hash == got[0].block_hash and got[1].token_ids == (4, 5, 6, 7)
    client.reset_prefix_cache("small")
    tail = client.events("small", 2)
    cleared = next(tail)
    tail.close()
    assert (cleared.seq_no, cleared.kind, cleared.block_id) == (3, "AllBlocksCleared", -1)


def test_watch_deltas_and_snapshot(client: BlockdClient) -> None:
    client.create_pool(PoolConfig("w", num_blocks=16, block_size=4, max_retained_versions=2))
    client.allocate("w", "a", [1, 2, 3])
    stream = client.watch("w", 0)
    delta = next(stream)
    assert isinstance(delta, VersionDelta) and delta.version == 1 and delta.updates[0].block_ids == (0,)
    client.append("w", "a", [4, 5])  # crosses into a second block
    later = next(stream)
    stream.close()
    assert later.version == 2 and later.updates[0].keep == 1 and later.updates[0].block_ids == (1,)
    for _ in range(3):
        client.decode_append("w", ["a"], [9])
    behind = client.watch("w", 1)  # version 2 is no longer retained
    snapshot = next(behind)
    behind.close()
    assert isinstance(snapshot, Snapshot) and snapshot.version == 5 and snapshot.tables == {"a": [0, 1]}


def test_worker_rpcs(client: BlockdClient) -> None:
    client.create_pool(SMALL)
    info = WorkerInfo("w0", "small", "10.0.0.1:7000", 0, 2, 0, 1, 1 << 20, "cuda:0", "i0")
    status = client.register_worker(info)
    assert status.info == info and status.is_up
    assert client.heartbeat("w0", 3).applied_version == 3
    assert [w.info.worker_id for w in client.list_workers("small")] == ["w0"]
    assert [w.info.worker_id for w in client.list_workers()] == ["w0"]


def test_async_client(blockd_server) -> None:
    async def scenario() -> None:
        async with AsyncBlockdClient(blockd_server.address, timeout_s=5.0) as c:
            await c.create_pool(SMALL)
            assert (await c.get_pool("small")).num_blocks == 16
            assert await c.pool_config("small") == replace(SMALL, tenant="default")
            assert [s.name for s in await c.list_pools()] == ["small"]
            await c.allocate("small", "a", [1, 2, 3, 4, 5])
            await c.append("small", "a", [6])
            await c.commit("small", "a", 6)
            await c.fork("small", "a", "b")
            assert (await c.decode_append("small", ["b"], [7])).copy_ops == ((1, 2),)
            step = await c.step("small", [Free("b")])
            assert (await c.get_tables("small")) == (step.version, {"a": [0, 1]})
            assert (await c.get_sequence("small", "a")).num_committed == 6
            assert await c.lookup_prefix([1, 2, 3, 4, 5]) == {"small": 4}
            items = []
            async with contextlib.aclosing(c.watch("small", 0)) as stream:
                async for item in stream:
                    items.append(item.version)
                    if len(items) == 3:
                        break
            assert items == [1, 2, 3]
            async with contextlib.aclosing(c.events("small", 0)) as events:
                assert (await anext(events)).kind == "BlockStored"
            await c.register_worker(WorkerInfo("w", "small", layer_end=2, kv_head_end=2, incarnation="i"))
            assert (await c.heartbeat("w", 1)).applied_version == 1
            assert len(await c.list_workers("small")) == 1
            await c.reset_prefix_cache("small")
            with pytest.raises(ce.NotFoundError):
                await c.get_sequence("small", "nope")
            await c.delete_pool("small")
            assert await c.list_pools() == []

    asyncio.run(scenario())


# --- errors -----------------------------------------------------------------------------
def _raises(cls: type[ce.BlockdClientError], fn, *args, **kwargs) -> ce.BlockdClientError:
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    err = info.value
    assert err.reason and "UNKNOWN" not in str(err.code)
    return err


def test_invalid_argument_cases(client: BlockdClient) -> None:
    client.create_pool(SMALL)
    err = _raises(ce.InvalidArgumentError, client.create_pool, PoolConfig("z", num_blocks=4, block_size=0))
    assert "block_size" in err.message
    _raises(ce.InvalidArgumentError, client.create_pool, PoolConfig("z", num_blocks=0, block_size=4))
    _raises(ce.InvalidArgumentError, client.create_pool, PoolConfig("z", 4, 4, num_layers=0))
    _raises(ce.InvalidArgumentError, client.create_pool, PoolConfig("z", 4, 4, dtype="float13"))
    err = _raises(ce.InvalidArgumentError, client.step, "small", [Allocate("a", [1]), Allocate("", [1])])
    assert err.op_index == 1 and err.field_violations[0][0] == "ops[1].allocate.seq_id"
    client.allocate("small", "a", [1, 2])
    err = _raises(ce.InvalidArgumentError, client.step, "small", [DecodeAppend(["a", "a"], [1])])
    assert err.op_index == 0 and err.field_violations[0][0] == "ops[0]"
    err = _raises(ce.InvalidArgumentError, client.commit, "small", "a", 3)
    assert "num_tokens" in err.message
    _raises(ce.InvalidArgumentError, client.get_pool, "")
    client.step("small", [Commit("a", 1)], request_id="rid-1")
    err = _raises(ce.InvalidArgumentError, client.delete_pool, "small", request_id="rid-1")
    assert "request_id" in err.message


def test_malformed_messages_are_invalid_argument(blockd_server) -> None:
    channel = grpc.insecure_channel(blockd_server.address)
    stub = pb_grpc.BlockServiceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Step(pb.StepRequest(pool="p", ops=[pb.Op()]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "set exactly one of allocate" in info.value.details()
    raw = channel.unary_unary("/blockd.v1.BlockService/Step")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\x12\xff\xff\xff\xff\x0f")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.PoolServiceStub(channel).CreatePool(pb.CreatePoolRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "config" in info.value.details()
    channel.close()


def test_not_found_already_exists_exhausted_precondition(client: BlockdClient) -> None:
    client.create_pool(PoolConfig("p", num_blocks=4, block_size=4, watermark_blocks=1))
    _raises(ce.NotFoundError, client.get_pool, "nope")
    _raises(ce.NotFoundError, client.allocate, "nope", "a", [1])
    err = _raises(ce.NotFoundError, client.free, "p", "ghost")
    assert err.reason == "NOT_FOUND" and err.op_index == 0 and err.seq_ids == ["ghost"]
    err = _raises(ce.NotFoundError, client.step, "p", [DecodeAppend(["ghost"], [1])])
    assert err.seq_ids == ["ghost"]  # the unknown sequence is named, as KV_LOST names its sequences
    _raises(ce.NotFoundError, client.get_sequence, "p", "ghost")
    _raises(ce.NotFoundError, client.get_tables, "p", ["ghost"])
    _raises(ce.NotFoundError, client.heartbeat, "no-such-worker", 0)
    _raises(ce.AlreadyExistsError, client.create_pool, PoolConfig("p", 4, 4))
    client.allocate("p", "a", [1, 2, 3, 4, 5])
    _raises(ce.AlreadyExistsError, client.allocate, "p", "a", [1])
    _raises(ce.AlreadyExistsError, client.fork, "p", "a", "a")
    err = _raises(ce.ResourceExhaustedError, client.allocate, "p", "b", list(range(8)))
    assert err.reason == "NO_ROOM" and "reserve" in err.message
    err = _raises(ce.FailedPreconditionError, lambda: next(client.events("p", 99)))
    assert "ahead" in err.message
    _raises(ce.FailedPreconditionError, lambda: next(client.watch("p", 99)))


def test_failed_step_changes_nothing(client: BlockdClient, blockd_server) -> None:
    client.create_pool(SMALL)
    client.allocate("small", "a", [1, 2, 3, 4, 5])
    before = (client.get_pool("small"), client.get_tables("small"))
    err = _raises(ce.NotFoundError, client.step, "small",
                  [Append("a", [6, 7, 8, 9]), Fork("a", "b"), Allocate("c", [1] * 8), Free("ghost")])
    assert err.op_index == 3 and "operation 3" in err.message
    assert (client.get_pool("small"), client.get_tables("small")) == before
    blockd_server.engine.check_invariants()


def test_idempotent_retry_returns_first_result(client: BlockdClient) -> None:
    client.create_pool(SMALL, request_id="create-1")
    assert client.create_pool(SMALL, request_id="create-1").name == "small"
    first = client.step("small", [Allocate("a", [1, 2, 3])], request_id="step-1")
    again = client.step("small", [Allocate("a", [1, 2, 3])], request_id="step-1")
    assert again == first
    assert client.get_pool("small").version == 1 and client.get_pool("small").num_seqs == 1


def test_unexpected_exception_is_internal_with_incident(client, blockd_server, monkeypatch, caplog) -> None:
    def broken(name: str):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(blockd_server.engine, "pool_config", broken)
    with caplog.at_level(logging.ERROR, logger="blockd.service"):
        err = _raises(ce.InternalError, client.get_pool, "x")
    incident = err.details[0].metadata["incident"]
    assert incident in err.message
    assert any(incident in r.getMessage() and r.exc_info for r in caplog.records)


def test_unavailable_is_retried_with_the_same_request_id(client, blockd_server, monkeypatch) -> None:
    class Flaky(BlockdError):
        code = "UNAVAILABLE"

    client.create_pool(SMALL)
    real_step, seen = blockd_server.engine.step, []

    def flaky_step(pool, ops, request_id="", **kwargs):
        seen.append(request_id)
        if len(seen) == 1:
            raise Flaky("leader moving")
        return real_step(pool, ops, request_id, **kwargs)

    monkeypatch.setattr(blockd_server.engine, "step", flaky_step)
    assert client.allocate("small", "a", [1]).num_tokens == 1
    assert len(seen) == 2 and seen[0] == seen[1] != ""


# --- health, reflection, streams, shutdown ---------------------------------------------
def test_health_and_reflection(blockd_server) -> None:
    channel = grpc.insecure_channel(blockd_server.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "blockd.v1.PoolService", "blockd.v1.BlockService", "blockd.v1.WorkerService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(reflect.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="blockd.v1.BlockService"),
    ]), timeout=5))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"blockd.v1.PoolService", "blockd.v1.BlockService", "blockd.v1.WorkerService",
            "grpc.health.v1.Health"} <= names
    assert replies[1].file_descriptor_response.file_descriptor_proto
    channel.close()


def test_stream_ends_when_the_client_goes_away(client, blockd_server, monkeypatch) -> None:
    client.create_pool(SMALL)
    ended = threading.Event()
    real_watch = blockd_server.engine.watch

    def watched(*args):
        try:
            yield from real_watch(*args)
        finally:
            ended.set()

    monkeypatch.setattr(blockd_server.engine, "watch", watched)
    client.allocate("small", "a", [1])
    stream = client.watch("small", 0)
    assert next(stream).version == 1
    stream.close()
    assert ended.wait(3.0)


def test_shutdown_ends_streams_and_finishes_in_flight_calls(blockd_server, monkeypatch) -> None:
    c = BlockdClient(blockd_server.address, timeout_s=10.0)
    c.create_pool(SMALL)
    stream = c.watch("small", 0)
    stream_done = threading.Event()
    threading.Thread(target=lambda: (list(stream), stream_done.set()), daemon=True).start()
    real_get = blockd_server.engine.get_pool

    def slow_get(name):
        time.sleep(0.5)
        return real_get(name)

    monkeypatch.setattr(blockd_server.engine, "get_pool", slow_get)
    slow: list = []
    caller = threading.Thread(target=lambda: slow.append(c.get_pool("small")))
    caller.start()
    time.sleep(0.1)
    started = time.monotonic()
    blockd_server.stop(5.0)
    assert time.monotonic() - started < 3.0
    caller.join(5)
    assert slow and slow[0].name == "small"
    assert stream_done.wait(3.0)
    c.close()


def test_gen_proto_check_passes() -> None:
    run = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr


def test_gen_proto_check_names_stale_files(tmp_path, monkeypatch) -> None:
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("gen_proto", os.path.join(ROOT, "scripts", "gen_proto.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    shutil.copytree(os.path.join(ROOT, "proto"), tmp_path / "proto")
    shutil.copytree(os.path.join(ROOT, "blockd", "v1"), tmp_path / "blockd" / "v1")
    with open(tmp_path / "blockd" / "v1" / "blockd_pb2.pyi", "a") as f:
        f.write("# edited by hand\n")
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "PROTO_ROOT", tmp_path / "proto")
    assert gen.check() == 1


def test_dry_run_over_grpc_changes_nothing(client) -> None:
    from client.errors import ResourceExhaustedError

    client.create_pool(PoolConfig("dry", num_blocks=4, block_size=4))
    before = client.get_pool("dry")
    answer = client.step("dry", [Allocate("x", list(range(8)))], dry_run=True)
    assert answer.results[0].new_block_ids == (0, 1) and answer.version == before.version
    with pytest.raises(ResourceExhaustedError):
        client.step("dry", [Allocate("x", list(range(40)))], dry_run=True)
    assert client.get_pool("dry") == before
    assert client.step("dry", [Allocate("x", list(range(8)))]).results == answer.results
