"""Hypothesis throws malformed, out-of-range and random requests at a running
daemon - raw protobuf messages and raw bytes, including what the SDK would
never send - and checks that:

* no call ends UNKNOWN or INTERNAL (only OK or a caller-error status);
* the daemon keeps serving (health SERVING, ListPools answers);
* ``check_invariants`` holds on every pool of the daemon's engine;
* the state equals what the accepted requests alone produce: they are
  replayed, in order, on a fresh Engine and tables and stats compared (a
  worker registration counts: a new worker incarnation marks the pool's KV
  lost; pool incarnations are random, so they are left out of the comparison).

One daemon serves the whole module; each example works on its own pool names
and request ids so examples do not see each other.
"""

from __future__ import annotations

import dataclasses
import itertools

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockd.core import Allocate, Append, Commit, ExtraKeys, Fork, Free
from blockd.core.types import DecodeAppend
from blockd.core.validate import MAX_ID_LEN
from blockd.engine.machine import Engine
from blockd.rpc import convert
from blockd.service.server import BlockdServer
from blockd.v1 import blockd_pb2 as pb
from blockd.v1 import blockd_pb2_grpc as pb_grpc

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}
POOLS = 4  # symbols 0, 1: this example's pools; 2: a pool nobody creates; 3: the empty name
_example = itertools.count()

# --- strategies: symbolic requests, bound to real names when run ---------------------
u32 = st.one_of(st.integers(0, 40), st.sampled_from([2**31 - 1, 2**32 - 1]))
u64 = st.one_of(st.integers(0, 40), st.sampled_from([2**32, 2**63 - 1, 2**64 - 1]))
token = st.one_of(st.integers(0, 3), st.integers(0, 3), st.just(2**32 - 1))
tokens = st.lists(token, max_size=12)
# mostly names that exist, so batches get far enough to matter; sometimes junk
seq_id = st.one_of(st.sampled_from(["s0", "s1", "s2"]), st.sampled_from(["s0", "s1", "s2"]),
                   st.sampled_from(["", "x" * 300, "tab\tid", "\u00e9t\u00e9"]))
pool_sym = st.sampled_from([0, 0, 0, 0, 0, 1, 2, 3])
rid_sym = st.one_of(st.none(), st.integers(0, 2))
# a worker incarnation; a pool incarnation a step names ("" is unchecked, "old" never matches)
worker_incarnation = st.sampled_from(["", "i0", "i1", "i2"])
planned = st.sampled_from(["", "", "", "old"])

extra_keys = st.builds(pb.ExtraKeys, model_id=st.sampled_from(["", "m"]), adapter_id=st.sampled_from([0, -1]),
                       mm_hashes=st.lists(st.sampled_from(["h", "y" * 2000]), max_size=1))
op = st.one_of(
    st.builds(lambda s, t, e: pb.Op(allocate=pb.AllocateOp(seq_id=s, prompt_token_ids=t, extra_keys=e)),
              seq_id, tokens, st.one_of(st.none(), extra_keys)),
    st.builds(lambda s, t: pb.Op(append=pb.AppendOp(seq_id=s, token_ids=t)), seq_id, tokens),
    st.builds(lambda s, t: pb.Op(decode_append=pb.DecodeAppendOp(seq_ids=s, token_ids=t)),
              st.lists(seq_id, max_size=4), st.lists(token, max_size=4)),
    st.builds(lambda s, n: pb.Op(commit=pb.CommitOp(seq_id=s, num_tokens=n)), seq_id, u64),
    st.builds(lambda a, b: pb.Op(fork=pb.ForkOp(parent_seq_id=a, child_seq_id=b)), seq_id, seq_id),
    st.builds(lambda s: pb.Op(free=pb.FreeOp(seq_id=s)), seq_id),
    st.just(pb.Op()),
)
config = st.fixed_dictionaries(
    {"num_blocks": st.one_of(st.integers(0, 24), u32), "block_size": st.one_of(st.integers(0, 4), u32),
     "watermark_blocks": st.integers(0, 30)},
    optional={"num_layers": u32, "num_kv_heads": u32, "head_dim": u32,
              "dtype": st.sampled_from(["float16", "int8", "float13", ""]),
              "max_retained_versions": st.one_of(st.integers(0, 4), u32)})


BODIES = {
    "CreatePool": st.tuples(pool_sym, st.one_of(st.none(), config), rid_sym),
    "Step": st.tuples(pool_sym, st.lists(op, max_size=3), rid_sym, planned),
    "DeletePool": st.tuples(pool_sym, rid_sym),
    "ResetPrefixCache": st.tuples(pool_sym, rid_sym),
    "GetPool": st.tuples(pool_sym),
    "GetTables": st.tuples(pool_sym, st.lists(seq_id, max_size=3)),
    "GetSequence": st.tuples(pool_sym, seq_id),
    "LookupPrefix": st.tuples(st.lists(pool_sym, max_size=2), tokens, st.one_of(st.none(), extra_keys)),
    "RegisterWorker": st.tuples(pool_sym, seq_id, u32, u32, u32, u32, u64, worker_incarnation),
    "Heartbeat": st.tuples(seq_id, u64),
    "ListWorkers": st.tuples(pool_sym),
    "Raw": st.tuples(st.sampled_from(["Step", "CreatePool", "GetTables", "LookupPrefix"]), st.binary(max_size=40)),
}
# steps are where the state is: about half of all requests
KINDS = ["Step"] * 12 + [k for k in BODIES if k != "Step"]
request = st.sampled_from(KINDS).flatmap(lambda kind: st.tuples(st.just(kind), BODIES[kind]))

# --- running them --------------------------------------------------------------------------
_SERVICE = {"CreatePool": "PoolService", "DeletePool": "PoolService", "ResetPrefixCache": "PoolService",
            "GetPool": "PoolService", "RegisterWorker": "WorkerService", "Heartbeat": "WorkerService",
            "ListWorkers": "WorkerService"}


class Run:
    """One example: binds symbols to names and records the accepted mutations."""

    def __init__(self, channel: grpc.Channel) -> None:
        n = next(_example)
        self.pools = [f"f{n}a", f"f{n}b", f"f{n}-missing", ""]
        self.rids = [f"f{n}-r{i}" for i in range(3)]
        self.channel = channel
        self.accepted: list[tuple[str, object]] = []

    def rid(self, sym: int | None) -> str:
        return "" if sym is None else self.rids[sym]

    def message(self, kind: str, body: tuple):
        if kind == "CreatePool":
            pool, cfg, rid = body
            conf = None if cfg is None else pb.PoolConfig(name=self.pools[pool], **cfg)
            return pb.CreatePoolRequest(config=conf, request_id=self.rid(rid))
        if kind == "Step":
            return pb.StepRequest(pool=self.pools[body[0]], ops=body[1], request_id=self.rid(body[2]),
                                  pool_incarnation=body[3])
        if kind in ("DeletePool", "ResetPrefixCache"):
            cls = pb.DeletePoolRequest if kind == "DeletePool" else pb.ResetPrefixCacheRequest
            return cls(pool=self.pools[body[0]], request_id=self.rid(body[1]))
        if kind == "GetPool":
            return pb.GetPoolRequest(pool=self.pools[body[0]])
        if kind == "GetTables":
            return pb.GetTablesRequest(pool=self.pools[body[0]], seq_ids=body[1])
        if kind == "GetSequence":
            return pb.GetSequenceRequest(pool=self.pools[body[0]], seq_id=body[1])
        if kind == "LookupPrefix":
            return pb.LookupPrefixRequest(pools=[self.pools[p] for p in body[0]], token_ids=body[1],
                                          extra_keys=body[2])
        if kind == "RegisterWorker":
            pool, worker, *ranges, size, incarnation = body
            info = pb.WorkerInfo(worker_id=worker, pool=self.pools[pool], layer_start=ranges[0],
                                 layer_end=ranges[1], kv_head_start=ranges[2], kv_head_end=ranges[3],
                                 pool_bytes=size, incarnation=incarnation)
            return pb.RegisterWorkerRequest(info=info)
        if kind == "Heartbeat":
            return pb.HeartbeatRequest(worker_id=body[0], applied_version=body[1])
        return pb.ListWorkersRequest(pool=self.pools[body[0]])

    def send(self, kind: str, body: tuple) -> None:
        if kind == "Raw":
            method, data = body
            service = _SERVICE.get(method, "BlockService")
            call, payload = self.channel.unary_unary(f"/blockd.v1.{service}/{method}"), data
        else:
            service = _SERVICE.get(kind, "BlockService")
            call = self.channel.unary_unary(f"/blockd.v1.{service}/{kind}",
                                            response_deserializer=lambda b: b)
            payload = self.message(kind, body).SerializeToString()
        try:
            call(payload, timeout=10)
        except grpc.RpcError as err:
            assert err.code() in ALLOWED, f"{kind} {body!r} -> {err.code()}: {err.details()}"
            return
        if kind in ("CreatePool", "Step", "DeletePool", "ResetPrefixCache", "RegisterWorker"):
            self.accepted.append((kind, self.message(kind, body)))


def replay(accepted: list[tuple[str, object]]) -> Engine:
    """The accepted mutations alone, applied in order to a fresh engine."""
    engine = Engine()
    for kind, msg in accepted:
        if kind == "CreatePool":
            engine.create_pool(convert.pool_config_from_proto(msg.config), msg.request_id)
        elif kind == "Step":
            engine.step(msg.pool, convert.ops_from_proto(msg.ops), msg.request_id)
        elif kind == "DeletePool":
            engine.delete_pool(msg.pool, msg.request_id)
        elif kind == "RegisterWorker":
            engine.register_worker(convert.worker_info_from_proto(msg.info))
        else:
            engine.reset_prefix_cache(msg.pool, msg.request_id)
    return engine


def observe(engine: Engine, names: list[str]) -> dict:
    state = {}
    for name in names:
        try:
            state[name] = (dataclasses.replace(engine.get_pool(name), incarnation=""),
                           engine.get_tables(name, []))
        except Exception as err:  # noqa: BLE001 - absence is part of the observed state
            state[name] = type(err).__name__
    return state


@pytest.fixture(scope="module")
def fuzz_daemon():
    server = BlockdServer(Engine(), "127.0.0.1:0", max_workers=8)
    server.start()
    channel = grpc.insecure_channel(server.address)
    yield server, channel
    channel.close()
    server.stop(0.5)


valid_config = st.fixed_dictionaries({"num_blocks": st.integers(1, 24), "block_size": st.integers(1, 4),
                                      "watermark_blocks": st.integers(0, 2)})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(first=valid_config, requests=st.lists(request, min_size=4, max_size=24))
def test_random_requests_never_break_the_daemon(fuzz_daemon, first, requests) -> None:
    server, channel = fuzz_daemon
    run = Run(channel)
    # most random requests need a pool to mean anything: start each example with one
    for kind, body in [("CreatePool", (0, first, None)), *requests]:
        run.send(kind, body)
    server.engine.check_invariants()
    names = run.pools[:3]
    assert observe(server.engine, names) == observe(replay(run.accepted), names)


def test_daemon_still_serving_after_fuzzing(fuzz_daemon) -> None:
    server, channel = fuzz_daemon
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    pb_grpc.PoolServiceStub(channel).ListPools(pb.ListPoolsRequest(), timeout=5)
    server.engine.check_invariants()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=st.sampled_from(["Watch", "Events"]), pool=pool_sym, start=u64, steps=st.integers(0, 3),
       incarnation=planned)
def test_random_stream_requests(fuzz_daemon, stream, pool, start, steps, incarnation) -> None:
    server, channel = fuzz_daemon
    run = Run(channel)
    if pool == 0:
        run.send("CreatePool", (0, {"num_blocks": 8, "block_size": 2, "watermark_blocks": 0}, None))
        for i in range(steps):
            op = pb.Op(allocate=pb.AllocateOp(seq_id=f"s{i}", prompt_token_ids=[1, 2, 3]))
            run.send("Step", (0, [op, pb.Op(commit=pb.CommitOp(seq_id=f"s{i}", num_tokens=3))], None, ""))
    request = (pb.WatchRequest(pool=run.pools[pool], from_version=start, pool_incarnation=incarnation)
               if stream == "Watch"
               else pb.EventsRequest(pool=run.pools[pool], from_seq_no=start))
    call = channel.unary_stream(f"/blockd.v1.BlockService/{stream}", response_deserializer=lambda b: b)
    try:
        for _ in call(request.SerializeToString(), timeout=0.3):
            pass
    except grpc.RpcError as err:
        assert err.code() in ALLOWED | {grpc.StatusCode.DEADLINE_EXCEEDED}, err.details()
    server.engine.check_invariants()


# ids the converter lets through (an over-long one is refused there, see test_oversized_ids)
wire_id = seq_id.filter(lambda s: len(s) <= MAX_ID_LEN)
core_op = st.one_of(
    st.builds(Allocate, wire_id, tokens, st.builds(ExtraKeys, model_id=st.sampled_from(["", "m"]),
                                                   mm_hashes=st.lists(st.just("h"), max_size=2).map(tuple))),
    st.builds(Append, wire_id, tokens),
    st.builds(DecodeAppend, st.lists(wire_id.filter(bool), max_size=3), st.lists(token, max_size=3)),
    st.builds(Commit, wire_id.filter(bool), st.integers(0, 2**64 - 1)),
    st.builds(Fork, wire_id.filter(bool), wire_id.filter(bool)),
    st.builds(Free, wire_id.filter(bool)),
)


@given(ops=st.lists(core_op.filter(lambda o: getattr(o, "seq_id", "x") != ""), max_size=4))
def test_ops_survive_the_wire(ops) -> None:
    """What the SDK writes is what the servicer reads (lists compared as lists)."""
    wire = pb.StepRequest.FromString(convert.step_request_to_proto("p", ops, "r").SerializeToString())
    back = convert.ops_from_proto(wire.ops)
    assert [type(o) for o in back] == [type(o) for o in ops]
    for sent, got in zip(ops, back):
        for name, value in vars(sent).items():
            assert getattr(got, name) == (list(value) if isinstance(value, list) else value)
