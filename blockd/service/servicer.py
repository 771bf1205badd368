"""Thin gRPC adapters over :class:`blockd.engine.machine.Engine`.

Each method converts the request (:mod:`blockd.rpc.convert`), calls one
engine method, and converts the result back; every failure leaves through
:mod:`blockd.rpc.errors`. No allocation logic lives here.

Streaming methods hand the engine a ``should_stop`` that turns true when the
client goes away (``context.is_active()``) or the server begins shutting down,
so a Watch or Events stream never outlives its reader by more than the
engine's wait slice (0.25 s).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator

import grpc

from blockd.core.errors import Unavailable, shown
from blockd.core.hashing import check_hash_spec, hash_spec
from blockd.core.types import Snapshot
from blockd.engine.machine import Engine
from blockd.engine.tenancy import owner_of
from blockd.rpc import convert, retention
from blockd.rpc.convert import optional_id, require_id, require_ids
from blockd.rpc.errors import BadField, answer_each, server_stream, status_bytes, unary
from blockd.rpc.hash_spec import hash_spec_to_proto
from blockd.rpc.tracing import server_span
from blockd.service.skim import step_parser, step_stream_parser
from blockd.v1 import blockd_pb2 as pb
from blockd.v1 import blockd_pb2_grpc as pb_grpc


def _stopper(context: grpc.ServicerContext, shutdown: threading.Event) -> Callable[[], bool]:
    return lambda: shutdown.is_set() or not context.is_active()


class PoolServicer(pb_grpc.PoolServiceServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @unary
    def CreatePool(self, request: pb.CreatePoolRequest, context) -> pb.CreatePoolResponse:
        if not request.HasField("config"):
            raise BadField("config", "is required: name, num_blocks and block_size at least")
        config = convert.pool_config_from_proto(request.config)
        stats = self._engine.create_pool(config, optional_id(request.request_id, "request_id"))
        return pb.CreatePoolResponse(stats=convert.stats_to_proto(stats))

    @unary
    def GetPool(self, request: pb.GetPoolRequest, context) -> pb.GetPoolResponse:
        name = require_id(request.pool, "pool")
        # both reads name the same pool; a delete in between shows as NOT_FOUND
        config = self._engine.pool_config(name)
        stats = self._engine.get_pool(name)
        return pb.GetPoolResponse(config=convert.pool_config_to_proto(config),
                                  stats=convert.stats_to_proto(stats))

    @unary
    def ListPools(self, request: pb.ListPoolsRequest, context) -> pb.ListPoolsResponse:
        pools = sorted(self._engine.list_pools(), key=lambda s: s.name)
        return pb.ListPoolsResponse(pools=[convert.stats_to_proto(s) for s in pools])

    @unary
    def DeletePool(self, request: pb.DeletePoolRequest, context) -> pb.DeletePoolResponse:
        self._engine.delete_pool(require_id(request.pool, "pool"), optional_id(request.request_id, "request_id"))
        return pb.DeletePoolResponse()

    @unary
    def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest, context) -> pb.ResetPrefixCacheResponse:
        self._engine.reset_prefix_cache(require_id(request.pool, "pool"),
                                        optional_id(request.request_id, "request_id"))
        return pb.ResetPrefixCacheResponse()

    @unary
    def PinPrefix(self, request: pb.PinPrefixRequest, context) -> pb.PinPrefixResponse:
        pin = self._engine.pin_prefix(require_id(request.pool, "pool"), list(request.token_ids),
                                      convert.extra_keys_from_proto(request.extra_keys), request.ttl_s,
                                      optional_id(request.request_id, "request_id"))
        return pb.PinPrefixResponse(pin=retention.pin_to_proto(pin))

    @unary
    def UnpinPrefix(self, request: pb.UnpinPrefixRequest, context) -> pb.UnpinPrefixResponse:
        pin = self._engine.unpin_prefix(require_id(request.pool, "pool"), require_id(request.pin_id, "pin_id"),
                                        optional_id(request.request_id, "request_id"))
        return pb.UnpinPrefixResponse(pin=retention.pin_to_proto(pin))

    @unary
    def ListPins(self, request: pb.ListPinsRequest, context) -> pb.ListPinsResponse:
        pins = self._engine.list_pins(require_id(request.pool, "pool"))
        return pb.ListPinsResponse(pins=[retention.pin_to_proto(pin) for pin in pins])

    @unary
    def SetPrefixPriority(self, request: pb.SetPrefixPriorityRequest, context) -> pb.SetPrefixPriorityResponse:
        done = self._engine.set_prefix_priority(require_id(request.pool, "pool"), list(request.token_ids),
                                                convert.extra_keys_from_proto(request.extra_keys), request.priority,
                                                optional_id(request.request_id, "request_id"))
        return retention.prefix_priority_to_proto(done)


#: how long a stream refused a slot may take to send the step it is refused for
REFUSAL_WAIT_S = 5.0


def _first_step_arrives(requests: Iterator, context: grpc.ServicerContext) -> bool:
    """Wait for a stream's first request, at most :data:`REFUSAL_WAIT_S`
    (then the call is cancelled): whether one came."""
    timer = threading.Timer(REFUSAL_WAIT_S, context.cancel)
    timer.daemon = True
    timer.start()
    try:
        return next(iter(requests), None) is not None
    except grpc.RpcError:  # cancelled: by the caller, or by the timer
        return False
    finally:
        timer.cancel()


class StepStreamsFull(Unavailable):
    """Every StepStream slot is taken: the caller steps by unary Step instead
    (:class:`client.step_stream.StepStream` does so by itself)."""

    reason = "STEP_STREAMS_FULL"


def _holding_a_slot(method: Callable) -> Callable:
    """A StepStream holds one of the server's RPC threads for as long as it is
    open; at most ``max_step_streams`` of them may, so open streams can never
    take every thread and stall the unary calls (and other streams) of everyone
    else. A stream beyond that answers its first step with STEP_STREAMS_FULL
    (UNAVAILABLE, nothing applied) and ends.

    The refusal waits for that first step rather than answering the stream's
    opening: a stream that ends before its caller writes loses the answer, since
    an asyncio caller's write then fails and gRPC reports only "INTERNAL:
    Internal error from Core". A caller that opens and never writes is cut
    after :data:`REFUSAL_WAIT_S`, so refused streams cannot hold threads either."""

    @functools.wraps(method)
    def handler(self, requests, context):
        if not self._stream_slots.acquire(blocking=False):
            if not _first_step_arrives(requests, context):
                return  # nobody to answer: the caller went away or never wrote
            yield self.refused(StepStreamsFull(
                f"blockd serves at most {self.max_step_streams} step streams at once (half of --max-workers) "
                "and all are open: step by unary Step (the SDK does), or raise --max-workers"), "StepStream")
            return
        try:
            yield from method(self, requests, context)
        finally:
            self._stream_slots.release()

    return handler


class BlockServicer(pb_grpc.BlockServiceServicer):
    def __init__(self, engine: Engine, shutdown: threading.Event, max_step_streams: int = 64) -> None:
        self._engine = engine
        self._shutdown = shutdown
        self.max_step_streams = max_step_streams
        self._stream_slots = threading.BoundedSemaphore(max_step_streams)
        #: (port, tls) of the step lane (blockd.service.lane), set by the server that serves one
        self.step_lane: tuple[int, bool] = (0, False)
        #: read by blockd.rpc.errors.method_handlers: an oversized Step is refused before it is parsed whole
        self.request_parsers = {"Step": step_parser(engine.config.guardrails),
                                "StepStream": step_stream_parser(engine.config.guardrails)}

    @unary
    def Step(self, request: pb.StepRequest, context) -> pb.StepResponse:
        return self._step(request)

    @_holding_a_slot
    @answer_each
    def StepStream(self, request: pb.StepRequest, context) -> pb.StepStreamResponse:
        # the stream's parser hands over the StepRequest inside each StepStreamRequest; its
        # traceparent is how a streamed step joins its caller's trace (gRPC has no metadata per message)
        answer = pb.StepStreamResponse()
        with server_span("blockd.v1.BlockService/StepStream", request.traceparent):
            self._step(request, answer.response)
        return answer

    @staticmethod
    def refused(err: BaseException, rpc: str) -> pb.StepStreamResponse:
        """A StepStream request's refusal, as its answer (:func:`blockd.rpc.errors.answer_each`)."""
        return pb.StepStreamResponse(error_status=status_bytes(err, rpc))

    def _step(self, request: pb.StepRequest, out: pb.StepResponse | None = None) -> pb.StepResponse:
        """Serve one step; the answer is written into ``out`` when given (a StepStream answer's)."""
        pool = require_id(request.pool, "pool")
        request_id = optional_id(request.request_id, "request_id")
        incarnation = optional_id(request.pool_incarnation, "pool_incarnation")
        optional_id(request.traceparent, "traceparent")  # read by tracing only (a W3C value is 55 characters)
        # before a single op is converted: an oversized batch costs nothing but its bytes
        self._engine.config.guardrails.check_num_ops(len(request.ops))
        result = self._engine.step(pool, convert.ops_from_proto(request.ops), request_id, dry_run=request.dry_run,
                                   incarnation=incarnation, previous_term=request.previous_term)
        return convert.step_result_to_proto(result, out)

    @unary
    def GetTables(self, request: pb.GetTablesRequest, context) -> pb.GetTablesResponse:
        pool = require_id(request.pool, "pool")
        version, tables = self._engine.get_tables(pool, require_ids(request.seq_ids, "seq_ids"))
        return pb.GetTablesResponse(version=version, tables=convert.tables_to_proto(tables), term=self._engine.term())

    @unary
    def GetSequence(self, request: pb.GetSequenceRequest, context) -> pb.GetSequenceResponse:
        info = self._engine.sequence_info(require_id(request.pool, "pool"), require_id(request.seq_id, "seq_id"))
        return convert.sequence_to_proto(info)

    @server_stream
    def Watch(self, request: pb.WatchRequest, context) -> Iterator[pb.WatchResponse]:
        pool = require_id(request.pool, "pool")
        # Every message names its incarnation. A follower that named none gets
        # the current one; should the pool be re-created before the stream
        # starts, the engine sees the mismatch and opens with a snapshot.
        incarnation = optional_id(request.pool_incarnation, "pool_incarnation") or self._engine.pool_incarnation(pool)
        self._engine.check_min_term(request.min_term)
        stream = self._engine.watch(pool, request.from_version, _stopper(context, self._shutdown), incarnation,
                                    request.min_term)
        for item in stream:
            if isinstance(item, Snapshot):
                incarnation = item.incarnation
            # the serving leader's term: a follower that has seen a newer one refuses this message
            yield convert.watch_item_to_proto(item, incarnation, self._engine.term())

    @server_stream
    def Events(self, request: pb.EventsRequest, context) -> Iterator[pb.EventsResponse]:
        stream = self._engine.events(require_id(request.pool, "pool"), request.from_seq_no,
                                     _stopper(context, self._shutdown))
        for event in stream:
            yield pb.EventsResponse(event=convert.event_to_proto(event))

    @unary
    def LookupPrefix(self, request: pb.LookupPrefixRequest, context) -> pb.LookupPrefixResponse:
        pools = require_ids(request.pools, "pools")
        extra = convert.extra_keys_from_proto(request.extra_keys)
        found = self._engine.lookup_prefix(list(request.token_ids), extra, pools, tiers=True)
        return pb.LookupPrefixResponse(num_cached_tokens={name: n for name, (n, _) in found.items()},
                                       num_host_tokens={name: host for name, (_, host) in found.items()})

    @unary
    def GetHashSpec(self, request: pb.GetHashSpecRequest, context) -> pb.GetHashSpecResponse:
        pool = optional_id(request.pool, "pool")
        config = self._engine.pool_config(pool) if pool else None  # NOT_FOUND for an unknown pool
        spec = hash_spec(config.block_size, owner_of(config)) if config is not None else hash_spec()
        return hash_spec_to_proto(spec)


    @unary
    def GetStepLane(self, request: pb.GetStepLaneRequest, context) -> pb.GetStepLaneResponse:
        port, tls = self.step_lane
        return pb.GetStepLaneResponse(port=port, tls=tls)


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @unary
    def RegisterWorker(self, request: pb.RegisterWorkerRequest, context) -> pb.RegisterWorkerResponse:
        if not request.HasField("info"):
            raise BadField("info", "is required: worker_id, pool and the shard's layer and head ranges")
        optional_id(request.request_id, "request_id")  # accepted, not needed: registration is an upsert
        info = convert.worker_info_from_proto(request.info)  # malformed ids first, as for every RPC
        # before anything is looked up: a worker of another hash spec changes nothing
        check_hash_spec(optional_id(request.hash_spec, "hash_spec"), f"worker {shown(info.worker_id)}")
        status = self._engine.register_worker(info)
        return pb.RegisterWorkerResponse(status=convert.worker_status_to_proto(status))

    @unary
    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        optional_id(request.request_id, "request_id")  # accepted, not needed: a heartbeat repeats harmlessly
        status = self._engine.heartbeat(require_id(request.worker_id, "worker_id"), request.applied_version)
        return pb.HeartbeatResponse(status=convert.worker_status_to_proto(status))

    @unary
    def ListWorkers(self, request: pb.ListWorkersRequest, context) -> pb.ListWorkersResponse:
        workers = self._engine.list_workers(optional_id(request.pool, "pool") or None)
        return pb.ListWorkersResponse(workers=[convert.worker_status_to_proto(w) for w in workers])
