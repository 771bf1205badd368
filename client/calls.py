"""What each SDK call sends and how its reply is read: shared by both clients.

:class:`~client.sdk.BlockdClient` and :class:`~client.aio.AsyncBlockdClient`
differ only in how they wait; every request they build and every reply they
read goes through a :class:`Call` defined here, and the message <-> dataclass
mapping itself is :mod:`blockd.rpc.convert` (the one the daemon uses).

Also here: the channel settings both clients use. Retries of UNAVAILABLE are
left to gRPC's own retry policy in the channel's service config, and every
mutation carries a request id (a fresh uuid4 unless the caller gives one), so
a retried mutation is answered with its first result and changes nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from blockd.core.hashing import NO_EXTRA_KEYS, ExtraKeys
from blockd.core.types import Op, OpResult
from blockd.rpc import convert
from blockd.v1 import blockd_pb2 as pb
from blockd.v1 import blockd_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_ATTEMPTS = 5
MAX_MESSAGE_BYTES = 64 << 20
_STUBS = (pb_grpc.PoolServiceStub, pb_grpc.BlockServiceStub, pb_grpc.WorkerServiceStub)
SERVICE_NAMES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())


def new_request_id() -> str:
    return uuid.uuid4().hex


def channel_options(max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> list[tuple[str, Any]]:
    """Retry UNAVAILABLE with exponential backoff (gRPC caps attempts at 5)."""
    retry = {
        "maxAttempts": max(2, min(max_attempts, 5)),
        "initialBackoff": "0.05s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    config = {"methodConfig": [{"name": [{"service": s} for s in SERVICE_NAMES], "retryPolicy": retry}]}
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", json.dumps(config)),
        ("grpc.enable_retries", 1 if max_attempts > 1 else 0),
        # reconnect quickly after a daemon restart (gRPC's default waits ~1 s, then longer)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    return options


def bind(channel) -> dict[str, Callable]:
    """Method name -> multicallable, for a sync or an asyncio channel."""
    methods = {}
    for stub_cls in _STUBS:
        stub = stub_cls(channel)
        for name, attr in vars(stub).items():
            methods[name] = attr
    return methods


@dataclass(frozen=True)
class Call:
    """One RPC: its method name, how to build the request, how to read the reply."""

    method: str
    request: Callable[..., Any]
    reply: Callable[[Any], Any]


def _rid(request_id: str | None) -> str:
    return request_id if request_id else new_request_id()


def _step_request(pool: str, ops: Sequence[Op], request_id: str | None = None,
                  dry_run: bool = False, incarnation: str = "") -> pb.StepRequest:
    request = convert.step_request_to_proto(pool, ops, _rid(request_id), incarnation)
    request.dry_run = dry_run
    return request


def _only_result(reply: pb.StepResponse) -> OpResult:
    return convert.step_result_from_proto(reply).results[0]


def extra_or_none(extra_keys: ExtraKeys | None) -> ExtraKeys:
    return extra_keys if extra_keys is not None else NO_EXTRA_KEYS


CREATE_POOL = Call(
    "CreatePool",
    lambda config, request_id=None: pb.CreatePoolRequest(
        config=convert.pool_config_to_proto(config), request_id=_rid(request_id)),
    lambda reply: convert.stats_from_proto(reply.stats))
GET_POOL = Call("GetPool", lambda pool: pb.GetPoolRequest(pool=pool),
                lambda reply: convert.stats_from_proto(reply.stats))
POOL_CONFIG = Call("GetPool", lambda pool: pb.GetPoolRequest(pool=pool),
                   lambda reply: convert.pool_config_from_reply(reply.config))
LIST_POOLS = Call("ListPools", lambda: pb.ListPoolsRequest(),
                  lambda reply: [convert.stats_from_proto(s) for s in reply.pools])
DELETE_POOL = Call(
    "DeletePool", lambda pool, request_id=None: pb.DeletePoolRequest(pool=pool, request_id=_rid(request_id)),
    lambda reply: None)
RESET_PREFIX_CACHE = Call(
    "ResetPrefixCache",
    lambda pool, request_id=None: pb.ResetPrefixCacheRequest(pool=pool, request_id=_rid(request_id)),
    lambda reply: None)
STEP = Call("Step", _step_request, convert.step_result_from_proto)
#: a one-operation step whose reply is that operation's result
STEP_ONE = Call("Step", lambda pool, op, request_id=None: _step_request(pool, (op,), request_id), _only_result)
GET_TABLES = Call(
    "GetTables", lambda pool, seq_ids=(): pb.GetTablesRequest(pool=pool, seq_ids=list(seq_ids)),
    lambda reply: (reply.version, convert.tables_from_proto(reply.tables)))
GET_SEQUENCE = Call("GetSequence", lambda pool, seq_id: pb.GetSequenceRequest(pool=pool, seq_id=seq_id),
                    convert.sequence_from_proto)
WATCH = Call("Watch", lambda pool, from_version=0, incarnation="": pb.WatchRequest(
    pool=pool, from_version=from_version, pool_incarnation=incarnation), convert.watch_item_from_proto)
EVENTS = Call("Events", lambda pool, from_seq_no=0: pb.EventsRequest(pool=pool, from_seq_no=from_seq_no),
              lambda reply: convert.event_from_proto(reply.event))
LOOKUP_PREFIX = Call(
    "LookupPrefix",
    lambda token_ids, extra_keys=None, pools=(): pb.LookupPrefixRequest(
        token_ids=list(token_ids), extra_keys=convert.extra_keys_to_proto(extra_or_none(extra_keys)),
        pools=list(pools)),
    lambda reply: dict(reply.num_cached_tokens))
REGISTER_WORKER = Call(
    "RegisterWorker",
    lambda info, request_id=None: pb.RegisterWorkerRequest(
        info=convert.worker_info_to_proto(info), request_id=_rid(request_id)),
    lambda reply: convert.worker_status_from_proto(reply.status))
HEARTBEAT = Call(
    "Heartbeat",
    lambda worker_id, applied_version, request_id=None: pb.HeartbeatRequest(
        worker_id=worker_id, applied_version=applied_version, request_id=_rid(request_id)),
    lambda reply: convert.worker_status_from_proto(reply.status))
LIST_WORKERS = Call("ListWorkers", lambda pool=None: pb.ListWorkersRequest(pool=pool or ""),
                    lambda reply: [convert.worker_status_from_proto(w) for w in reply.workers])
