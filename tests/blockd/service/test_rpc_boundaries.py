"""Every method of every service that blockd and a worker serve, found through
server reflection (so a new RPC cannot be forgotten), gets bytes that do not
parse and requests with one over-long string field (every string field, in
every nested message, one at a time). Each must answer a clear caller-error
code with a short message, never UNKNOWN, INTERNAL, or RESOURCE_EXHAUSTED
"metadata size exceeds hard limit", and leave no traceback in the logs.

The only exception to "an over-long string is INVALID_ARGUMENT" is
reflection itself, whose protocol answers a bad symbol in-band (an OK stream
carrying an ErrorResponse).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool, message_factory
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from blockd.core import Allocate, InvalidArgument, PoolConfig
from blockd.core.hashing import HASH_SPEC_ID
from blockd.engine.machine import Engine
from blockd.rpc.errors import MAX_MESSAGE_BYTES, blockd_status, unary
from blockd.service.server import BlockdServer
from blockd.v1 import blockd_pb2 as pb
from worker.runtime import WorkerRuntime
from worker.service import WorkerServer

OVERSIZED = "x" * 10_000
#: bytes no message parses: a truncated varint, a truncated length-delimited field
MALFORMED = (b"\xff\xff\xff", b"\x0a\x05ab")
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED}
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


#: string fields whose valid value is not "p" (set by the fixture)
FIELD_VALUES: dict[str, str] = {"hash_spec": HASH_SPEC_ID}  # another spec id is FAILED_PRECONDITION


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """blockd with a pool "p" holding a sequence "p", and a worker of a pool
    named "p": with every other string set to "p", only the over-long field
    can be wrong."""
    engine = Engine()
    engine.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
    engine.step("p", [Allocate("p", [1, 2, 3])])
    # a step naming another incarnation would be refused for that, not for the long field
    FIELD_VALUES["pool_incarnation"] = engine.pool_incarnation("p")
    blockd = BlockdServer(engine, "127.0.0.1:0", max_workers=8)
    config = PoolConfig("p", num_blocks=16, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    runtime = WorkerRuntime(config, device="cpu", version_timeout_s=0.2, latest_committed=lambda: 0)
    FIELD_VALUES["worker_incarnation"] = runtime.incarnation
    worker = WorkerServer(runtime, "w")
    blockd.start()
    worker.start()
    yield {"blockd": blockd.address, "worker": worker.address}
    worker.stop(0)
    blockd.stop(0.5)


def discover(address: str) -> list[descriptor.MethodDescriptor]:
    """Every method of every service the server lists, from the descriptors
    reflection sends (not from this checkout's generated code)."""
    pool = descriptor_pool.DescriptorPool()
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        def ask(**request) -> reflection_pb2.ServerReflectionResponse:
            (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**request)]),
                                                 timeout=10)
            return reply

        names = [s.name for s in ask(list_services="").list_services_response.service]
        files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        for name in names:
            for raw in ask(file_containing_symbol=name).file_descriptor_response.file_descriptor_proto:
                proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
                files[proto.name] = proto
    added: set[str] = set()
    while len(added) < len(files):  # dependencies first
        for name, proto in files.items():
            if name not in added and all(dep in added for dep in proto.dependency):
                pool.Add(proto)
                added.add(name)
    return [m for name in names for m in pool.FindServiceByName(name).methods]


def string_paths(desc: descriptor.Descriptor, prefix: tuple[str, ...] = (), depth: int = 0):
    for field in desc.fields:
        if field.type == descriptor.FieldDescriptor.TYPE_STRING:
            yield (*prefix, field.name)
        elif (field.type == descriptor.FieldDescriptor.TYPE_MESSAGE and depth < 3
              and not field.message_type.GetOptions().map_entry):
            yield from string_paths(field.message_type, (*prefix, field.name), depth + 1)


def fill(msg, path: tuple[str, ...]) -> None:
    """Every string field "p" (one member per oneof: the one on ``path``),
    sub-messages only along ``path``, and the field at its end OVERSIZED."""
    on_path = path[0] if path else None
    for field in msg.DESCRIPTOR.fields:
        if field.containing_oneof is not None and field.name != on_path:
            continue
        repeated = field.is_repeated
        if field.type == descriptor.FieldDescriptor.TYPE_STRING:
            value = OVERSIZED if path == (field.name,) else FIELD_VALUES.get(field.name, "p")
            if repeated:
                getattr(msg, field.name).append(value)
            else:
                setattr(msg, field.name, value)
        elif field.type == descriptor.FieldDescriptor.TYPE_MESSAGE and field.name == on_path:
            sub = getattr(msg, field.name).add() if repeated else getattr(msg, field.name)
            fill(sub, path[1:])


class InBand:
    """A refusal a StepStream carries as an answer (its stream stays open), read like a call's error."""

    def __init__(self, data: bytes) -> None:
        self.status = status_pb2.Status.FromString(data)

    def code(self) -> grpc.StatusCode:
        return next(c for c in grpc.StatusCode if c.value[0] == self.status.code)

    def details(self) -> str:
        return self.status.message


def call(channel: grpc.Channel, method: descriptor.MethodDescriptor, payload: bytes):
    """One call with raw request bytes; the error it ended with (a StepStream's
    first answer's refusal), or None."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    identity = {"request_serializer": None, "response_deserializer": None}
    try:
        if method.full_name == "blockd.v1.BlockService.StepStream":
            answers = list(channel.stream_stream(path, **identity)(iter([payload]), timeout=10))
            assert len(answers) == 1, "one answer per request"
            answer = pb.StepStreamResponse.FromString(answers[0])
            return InBand(answer.error_status) if answer.HasField("error_status") else None
        if method.client_streaming:
            list(channel.stream_stream(path, **identity)(iter([payload]), timeout=10))
        elif method.server_streaming:
            for _ in channel.unary_stream(path, **identity)(payload, timeout=10):
                break  # a stream that answers at all took the request
        else:
            channel.unary_unary(path, **identity)(payload, timeout=10)
    except grpc.RpcError as err:
        return err
    return None


def methods_of(servers: dict[str, str]) -> list[tuple[str, descriptor.MethodDescriptor]]:
    found = [(address, m) for address in servers.values() for m in discover(address)]
    services = {m.containing_service.full_name for _, m in found}
    assert {"blockd.v1.PoolService", "blockd.v1.BlockService", "blockd.v1.WorkerService",
            "blockd.v1.KVShardService", "grpc.health.v1.Health", REFLECTION} <= services
    return found


def assert_quiet(caplog) -> None:
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [f"{r.name}: {r.getMessage()}" for r in loud]


def test_malformed_bytes_are_invalid_argument_everywhere(servers, caplog) -> None:
    caplog.set_level(logging.WARNING)
    checked = 0
    for address, method in methods_of(servers):
        with grpc.insecure_channel(address) as channel:
            for payload in MALFORMED:
                err = call(channel, method, payload)
                where = f"{method.full_name} {payload!r}"
                assert err is not None, f"{where} answered OK"
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {err.code()} {err.details()}"
                assert "do not parse" in err.details()
                checked += 1
    assert checked >= 2 * 20
    assert_quiet(caplog)


def test_oversized_ids_are_invalid_argument_with_a_short_message(servers, caplog) -> None:
    caplog.set_level(logging.WARNING)
    checked = 0
    for address, method in methods_of(servers):
        request_cls = message_factory.GetMessageClass(method.input_type)
        with grpc.insecure_channel(address) as channel:
            for path in string_paths(method.input_type):
                request = request_cls()
                fill(request, path)
                err = call(channel, method, request.SerializeToString())
                where = f"{method.full_name} {'.'.join(path)}"
                if method.containing_service.full_name == REFLECTION:
                    assert err is None or err.code() not in BAD_CODES, f"{where}: {err.code()}"
                    continue
                assert err is not None, f"{where} answered OK"
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {err.code()} {err.details()}"
                assert len(err.details()) < 300 and "x" * 100 not in err.details(), f"{where}: {err.details()}"
                checked += 1
    assert checked >= 30
    assert_quiet(caplog)


def test_health_list_is_served_and_malformed_health_requests_are_quiet(servers, caplog) -> None:
    caplog.set_level(logging.WARNING)
    for name, address in servers.items():
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            statuses = health.List(health_pb2.HealthListRequest(), timeout=5).statuses
            assert statuses[""].status == health_pb2.HealthCheckResponse.SERVING, name
            for _ in range(20):  # the stock service logged a traceback for each of these
                err = call(channel, health_pb2.DESCRIPTOR.services_by_name["Health"].methods_by_name["Check"],
                           MALFORMED[0])
                assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_quiet(caplog)


class Loud:
    """A servicer whose error message is far past gRPC's metadata limit."""

    @unary
    def Shout(self, request, context):
        raise InvalidArgument("\u00e9t\u00e9 " * 100_000)


def test_every_status_fits_the_metadata_limit() -> None:
    status = blockd_status(InvalidArgument("\u00e9" * 100_000), "Shout")
    assert len(status.details.encode()) <= MAX_MESSAGE_BYTES
    # the message travels percent-encoded (3 bytes per non-ASCII byte) and
    # again inside the base64 details
    size = 3 * len(status.details.encode()) + sum(4 * len(v) // 3 + len(k) for k, v in status.trailing_metadata)
    assert size < 6 * 1024

    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(Loud().Shout)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Loud", {"Shout": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            err = call(channel, _shout_method(), b"")
    finally:
        server.stop(0)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith("\u00e9t\u00e9") and err.details().endswith("\u2026")


def _shout_method() -> descriptor.MethodDescriptor:
    pool = descriptor_pool.DescriptorPool()
    proto = descriptor_pb2.FileDescriptorProto(name="loud.proto", package="test")
    proto.message_type.add(name="Empty")
    proto.service.add(name="Loud").method.add(name="Shout", input_type=".test.Empty", output_type=".test.Empty")
    pool.Add(proto)
    return pool.FindMethodByName("test.Loud.Shout")


class _Broken(grpc.RpcError):
    pass


class _Context:
    """What a client-streaming handler may call when the caller is gone: nothing."""

    def abort_with_status(self, status):  # pragma: no cover - failing path
        raise AssertionError(f"answered a caller that is gone: {status}")


def test_a_client_stream_that_the_caller_cancels_is_not_an_incident(caplog):
    """A follower that gives up its feed cancels its acknowledgement stream; the
    leader's handler ends quietly (it logged an INTERNAL incident with a traceback)."""
    from blockd.rpc.errors import client_stream

    seen: list[int] = []

    class Servicer:
        @client_stream
        def StreamThings(self, requests, context):
            seen.extend(requests)
            return "answered"

    def requests():
        yield 1
        raise _Broken()

    with caplog.at_level(logging.DEBUG):
        assert Servicer().StreamThings(requests(), _Context()) is None
    assert seen == [1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert Servicer().StreamThings(iter([1, 2]), _Context()) == "answered"
