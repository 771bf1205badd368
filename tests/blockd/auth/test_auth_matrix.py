"""Every RPC of every service blockd and a worker serve (discovered from the
descriptors, so a new RPC cannot be forgotten) x every kind of caller:

==============  ==============================================================
case            the caller
==============  ==============================================================
no-credentials  TLS without a client certificate (the mTLS handshake refuses)
bad-token       a trusted certificate naming nobody, and a token nobody issued
untrusted-cert  a certificate of another CA
expired-cert    a certificate of the CA whose validity has ended
wrong-tenant    a token of tenant ``globex`` with the role the RPC needs
wrong-role      a token of tenant ``acme`` whose role lacks the RPC's permission
allowed         a token of tenant ``acme`` whose role has it
==============  ==============================================================

Both servers run mutual TLS with an identities file (as ``blockd serve
--tls-client-ca ... --tokens-file ...`` and ``blockd-worker`` alike); the
pool ``p`` and the worker belong to ``acme``. Each refusal must carry its
exact status code and leave the engine, the worker registry and the worker's
runtime exactly as they were; the allowed call (last) gets the code its
request earns (OK, or INVALID_ARGUMENT for a data-plane request without
tensors: the check that refuses callers comes before anything else).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from blockd.auth import server_security, tokens
from blockd.auth.policy import AUTHENTICATED, METHOD_PERMISSIONS, OPEN, ROLE_PERMISSIONS
from blockd.core import Allocate, Commit, PoolConfig
from blockd.core.types import WorkerInfo
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.rpc import convert
from blockd.service.server import BlockdServer
from blockd.v1 import blockd_pb2 as pb
from blockd.v1 import worker_pb2 as wpb
from worker.runtime import WorkerRuntime
from worker.service import WorkerServer

pytest_plugins = ["tests.support.auth_fixtures"]

Code = grpc.StatusCode
SERVED = [*pb.DESCRIPTOR.services_by_name.values(), *wpb.DESCRIPTOR.services_by_name.values(),
          health_pb2.DESCRIPTOR.services_by_name["Health"],
          reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
METHODS = {f"/{s.full_name}/{m.name}": m for s in SERVED for m in s.methods}
CASES = ("no-credentials", "bad-token", "untrusted-cert", "expired-cert", "wrong-tenant", "wrong-role", "allowed")
PROMPT = list(range(1, 9))
WORKER_SERVICE = "/blockd.v1.KVShardService/"

#: each RPC's request, and the code the allowed caller gets for it
REQUESTS: dict[str, tuple[Callable[[], Message], Code]] = {
    "/blockd.v1.PoolService/CreatePool": (
        lambda: pb.CreatePoolRequest(config=pb.PoolConfig(name="n", num_blocks=8, block_size=4)), Code.OK),
    "/blockd.v1.PoolService/GetPool": (lambda: pb.GetPoolRequest(pool="p"), Code.OK),
    "/blockd.v1.PoolService/ListPools": (pb.ListPoolsRequest, Code.OK),
    "/blockd.v1.PoolService/DeletePool": (lambda: pb.DeletePoolRequest(pool="p"), Code.OK),
    "/blockd.v1.PoolService/ResetPrefixCache": (lambda: pb.ResetPrefixCacheRequest(pool="p"), Code.OK),
    # the worker's registration cleared the pool's cache: nothing to pin, nor to unpin
    "/blockd.v1.PoolService/PinPrefix": (lambda: pb.PinPrefixRequest(pool="p", token_ids=PROMPT),
                                         Code.FAILED_PRECONDITION),
    "/blockd.v1.PoolService/UnpinPrefix": (lambda: pb.UnpinPrefixRequest(pool="p", pin_id="pin-1"), Code.NOT_FOUND),
    "/blockd.v1.PoolService/ListPins": (lambda: pb.ListPinsRequest(pool="p"), Code.OK),
    "/blockd.v1.PoolService/SetPrefixPriority": (
        lambda: pb.SetPrefixPriorityRequest(pool="p", token_ids=PROMPT, priority=1), Code.FAILED_PRECONDITION),
    "/blockd.v1.BlockService/Step": (
        lambda: convert.step_request_to_proto("p", [Allocate("t", [1, 2, 3])], ""), Code.OK),
    # a refused step is the stream's first answer (error_status), read as that step's code (_call)
    "/blockd.v1.BlockService/StepStream": (lambda: pb.StepStreamRequest(
        step=convert.step_request_to_proto("p", [Allocate("t", [1, 2, 3])], "")), Code.OK),
    "/blockd.v1.BlockService/GetTables": (lambda: pb.GetTablesRequest(pool="p"), Code.OK),
    "/blockd.v1.BlockService/GetSequence": (lambda: pb.GetSequenceRequest(pool="p", seq_id="s"), Code.OK),
    "/blockd.v1.BlockService/Watch": (lambda: pb.WatchRequest(pool="p"), Code.OK),
    "/blockd.v1.BlockService/Events": (lambda: pb.EventsRequest(pool="p"), Code.OK),
    "/blockd.v1.BlockService/LookupPrefix": (lambda: pb.LookupPrefixRequest(token_ids=PROMPT, pools=["p"]), Code.OK),
    "/blockd.v1.BlockService/GetHashSpec": (lambda: pb.GetHashSpecRequest(pool="p"), Code.OK),
    "/blockd.v1.BlockService/GetStepLane": (pb.GetStepLaneRequest, Code.OK),
    "/blockd.v1.WorkerService/RegisterWorker": (lambda: pb.RegisterWorkerRequest(info=convert.worker_info_to_proto(
        WorkerInfo("w2", "p", "127.0.0.1:9", 0, 1, 0, 1, incarnation="inc-2"))), Code.OK),
    "/blockd.v1.WorkerService/Heartbeat": (lambda: pb.HeartbeatRequest(worker_id="w1"), Code.OK),
    "/blockd.v1.WorkerService/ListWorkers": (lambda: pb.ListWorkersRequest(pool="p"), Code.OK),
    "/blockd.v1.KVShardService/GetWorkerStats": (wpb.GetWorkerStatsRequest, Code.OK),
    "/blockd.v1.KVShardService/WriteKV": (lambda: wpb.WriteKVRequest(pool="p"), Code.INVALID_ARGUMENT),
    "/blockd.v1.KVShardService/Attention": (lambda: wpb.AttentionRequest(pool="p"), Code.INVALID_ARGUMENT),
    "/blockd.v1.KVShardService/ModelStep": (lambda: wpb.ModelStepRequest(pool="p"), Code.INVALID_ARGUMENT),
    "/blockd.v1.KVShardService/FetchBlocks": (lambda: wpb.FetchBlocksRequest(pool="p"), Code.INVALID_ARGUMENT),
    "/blockd.v1.KVShardService/ReadBlocks": (lambda: wpb.ReadBlocksRequest(pool="p"), Code.INVALID_ARGUMENT),
    "/grpc.health.v1.Health/Check": (health_pb2.HealthCheckRequest, Code.OK),
    "/grpc.health.v1.Health/Watch": (health_pb2.HealthCheckRequest, Code.OK),
    "/grpc.health.v1.Health/List": (health_pb2.HealthListRequest, Code.OK),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": (
        lambda: reflection_pb2.ServerReflectionRequest(list_services=""), Code.OK),
}
#: RPCs that filter another tenant's pools out rather than refuse (the reply is checked empty)
FILTERED = {"/blockd.v1.PoolService/ListPools"}
#: calls that name no tenant's pool (where the step lane is): any tenant whose role has the permission may
UNSCOPED = {"/blockd.v1.BlockService/GetStepLane"}


def test_every_served_rpc_has_a_request_here() -> None:
    assert sorted(set(METHODS) - set(REQUESTS)) == [], "add a request (and its allowed code) to REQUESTS"
    assert sorted(set(REQUESTS) - set(METHODS)) == []


@dataclass
class Cluster:
    engine: Engine
    runtime: WorkerRuntime
    blockd: str
    worker: str
    tokens: dict[str, str]

    def state(self) -> str:
        workers = sorted((s.info, s.applied_version) for s in self.engine.list_workers())
        return json.dumps([self.engine.capture(), workers, self.runtime.stats()], sort_keys=True, default=repr)


@pytest.fixture
def cluster(pki, tmp_path) -> Iterator[Cluster]:
    path = str(tmp_path / "ids.json")
    issued = {f"{tenant}-{role}": tokens.add_token(path, f"{tenant}-{role}", tenant, [role])
              for tenant in ("acme", "globex") for role in ("admin", "scheduler", "worker", "reader")}
    engine = Engine(EngineConfig())
    engine.create_pool(PoolConfig("p", num_blocks=16, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4,
                                  dtype="float32", tenant="acme"))
    engine.step("p", [Allocate("s", PROMPT), Commit("s", len(PROMPT))])
    engine.register_worker(WorkerInfo("w1", "p", "127.0.0.1:8", 0, 1, 0, 1, incarnation="inc-1"))
    runtime = WorkerRuntime(engine.pool_config("p"), device="cpu", version_timeout_s=0.2, latest_committed=lambda: 0)
    blockd_security = server_security("127.0.0.1:0", pki.server_tls(mutual=True), path)
    worker_security = server_security("127.0.0.1:0", pki.server_tls(mutual=True), path)
    blockd = BlockdServer(engine, "127.0.0.1:0", max_workers=8, grace_s=0.5,
                          interceptors=blockd_security.interceptors, credentials=blockd_security.credentials)
    worker = WorkerServer(runtime, "w1", security=worker_security)
    blockd.start()
    worker.start()
    try:
        yield Cluster(engine, runtime, blockd.address, worker.address, issued)
    finally:
        worker.stop(0)
        blockd.stop(0.2)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _credentials(pki, case: str, method: str) -> tuple[str | None, str | None]:
    """(client certificate, token name) of ``case`` for ``method``."""
    if case in ("no-credentials", "untrusted-cert", "expired-cert"):
        return {"no-credentials": None, "untrusted-cert": "rogue", "expired-cert": "expired"}[case], None
    if case == "bad-token":
        return "plain-cn", None
    permission = METHOD_PERMISSIONS[method]
    holders = [r for r in ("scheduler", "worker", "reader", "admin") if permission in ROLE_PERMISSIONS[r]]
    role = holders[0] if holders else "reader"
    if case == "wrong-tenant":
        return "plain-cn", f"globex-{'scheduler' if role == 'admin' else role}"
    if case == "wrong-role":
        lacking = [r for r in ("reader", "worker", "scheduler") if permission not in ROLE_PERMISSIONS[r]]
        return "plain-cn", f"acme-{lacking[0] if lacking else role}"
    return "plain-cn", f"acme-{role}"


def _expected(case: str, method: str) -> Code:
    permission = METHOD_PERMISSIONS[method]
    allowed = REQUESTS[method][1]
    if case in ("no-credentials", "untrusted-cert", "expired-cert"):
        return Code.UNAVAILABLE  # no connection: the handshake refuses the certificate
    if permission == OPEN:
        return allowed
    if case == "bad-token":
        return Code.UNAUTHENTICATED
    if permission == AUTHENTICATED or case == "allowed":
        return allowed
    if case == "wrong-tenant":
        return allowed if method in FILTERED | UNSCOPED else Code.PERMISSION_DENIED
    lacking = [r for r in ("reader", "worker", "scheduler") if permission not in ROLE_PERMISSIONS[r]]
    return Code.PERMISSION_DENIED if lacking else allowed


_CODES = {code.value[0]: code for code in Code}


def _in_band(answer: bytes) -> Code:
    """A StepStream answer's code: OK, or the code of the refusal it carries."""
    reply = pb.StepStreamResponse.FromString(answer)
    if reply.HasField("error_status"):
        return _CODES[status_pb2.Status.FromString(reply.error_status).code]
    return Code.OK


def _call(pki, address: str, method: str, cert: str | None, token: str | None) -> tuple[Code, bytes]:
    creds = grpc.ssl_channel_credentials(
        _read(pki.ca), _read(pki.key(cert)) if cert else None, _read(pki.path(cert)) if cert else None)
    descriptor = METHODS[method]
    request = REQUESTS[method][0]().SerializeToString()
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.secure_channel(address, creds) as channel:
        kind = "_".join("stream" if streaming else "unary"
                        for streaming in (descriptor.client_streaming, descriptor.server_streaming))
        call = getattr(channel, kind)(method, request_serializer=bytes, response_deserializer=bytes)
        try:
            reply = call(iter([request]) if descriptor.client_streaming else request, timeout=10,
                         metadata=metadata)
            if descriptor.server_streaming:
                first = next(iter(reply))
                reply.cancel()
                if method.endswith("/StepStream"):
                    return _in_band(first), first
                return Code.OK, first
            return Code.OK, reply
        except grpc.RpcError as err:
            return err.code(), b""


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_rpc_refuses_every_wrong_caller_with_its_code_and_changes_nothing(pki, cluster, method) -> None:
    address = cluster.worker if method.startswith(WORKER_SERVICE) else cluster.blockd
    results = {}
    for case in CASES:
        cert, token_name = _credentials(pki, case, method)
        token = cluster.tokens[token_name] if token_name else None
        if case == "bad-token":
            token = "bkd_nobody-issued-this"
        before = cluster.state()
        code, reply = _call(pki, address, method, cert, token)
        results[case] = code
        if case != "allowed" and code != Code.OK:
            assert cluster.state() == before, f"{method} refused for {case} yet changed state"
        if case == "wrong-tenant" and method in FILTERED:
            assert not pb.ListPoolsResponse.FromString(reply).pools  # acme's pool is not listed to globex
    assert results == {case: _expected(case, method) for case in CASES}
