"""The synchronous SDK: :class:`BlockdClient`, for schedulers, workers and tools.

Results are blockd's plain dataclasses (:class:`~blockd.core.types.PoolStats`,
:class:`~blockd.core.types.StepResult`, :class:`~blockd.core.types.OpResult`,
:class:`~blockd.core.types.KVEvent`, :class:`~blockd.core.types.VersionDelta`,
:class:`~blockd.core.types.Snapshot`, :class:`~blockd.core.types.WorkerStatus`, ...),
failures are :mod:`client.errors` exceptions. Every unary call has a deadline
(``timeout_s``), UNAVAILABLE is retried by the channel, and mutations carry a
request id so those retries are safe. ``target`` may list the replicas of
a replicated group, comma-separated: a unary call then follows the leader
(NOT_LEADER's address, the next replica when one is down) and resends the
same request, hence the same request id (:mod:`client.leader`). Streams (``watch``, ``events``) have no
deadline unless one is given; closing their iterator cancels the call.

    with BlockdClient("127.0.0.1:50051") as client:
        client.create_pool(PoolConfig("llama", num_blocks=4096, block_size=16))
        result = client.allocate("llama", "req-1", prompt_token_ids)
        slots = client.decode_append("llama", ["req-1"], [next_token]).slot_mapping

Each method builds its request (:mod:`client.messages`, shared with
:mod:`client.aio`), calls its stub method, and reads the reply: follow
:meth:`BlockdClient.step` to ``BlockService.Step`` in three lines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from blockd.auth.config import TlsConfig
from blockd.core.hashing import HASH_SPEC_ID, ExtraKeys, HashSpec
from blockd.core.lru import DEFAULT_PRIORITY
from blockd.core.pool import Pin, PrefixPriority
from blockd.core.types import (
    Allocate,
    Append,
    Commit,
    DecodeAppend,
    Fork,
    Free,
    KVEvent,
    Op,
    OpResult,
    PoolConfig,
    PoolStats,
    ReplicaStatus,
    SequenceInfo,
    Snapshot,
    StepResult,
    VersionDelta,
    WorkerInfo,
    WorkerStatus,
)
from blockd.rpc import convert, retention
from blockd.rpc.hash_spec import hash_spec_from_proto
from blockd.v1 import blockd_pb2 as pb
from blockd.v1 import blockd_pb2_grpc as pb_grpc
from blockd.v1 import replication_pb2 as rpb
from blockd.v1 import replication_pb2_grpc as rpb_grpc
from client import messages
from client.channel import DEFAULT_MAX_ATTEMPTS, DEFAULT_TARGET, DEFAULT_TIMEOUT_S, dial
from client.errors import BlockdClientError, from_rpc_error
from client.leader import ReplicaStubs
from client.step_stream import StepLanes, StepStream

if TYPE_CHECKING:
    from typing_extensions import Self

T = TypeVar("T")


class BlockdClient:
    """A connection to one blockd daemon. Thread-safe; share one per process."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS, tls: TlsConfig | None = None,
                 token: str | None = None, follow_leader: bool = True, stream_steps: bool = False,
                 step_lane: bool = True) -> None:
        """``tls``: verify the server (and present a client certificate for
        mutual TLS); ``token``: a bearer token for every call. Neither: plain
        text (loopback only for a token). See :func:`client.channel.dial`.
        ``target`` may list a replicated group's replicas, comma-separated;
        ``follow_leader=False``: a refusal by a replica that does not lead is
        raised, not followed (to talk to one replica, whatever its role).
        ``stream_steps``: :meth:`step` (and the one-op helpers) go over a
        ``StepStream`` per calling thread (:meth:`step_stream`), the same
        answers for less of the daemon's CPU; a scheduler given this client
        steps that way unchanged. Closed with the client. ``step_lane``: a
        step stream opens on the daemon's step lane when it serves one
        (:mod:`client.step_stream`); False: always over gRPC."""
        self.target = target
        self.timeout_s = timeout_s
        self.tls, self.token = tls, token
        self._max_attempts = max_attempts
        self._follow = follow_leader
        #: stream_steps: each thread's StepStream, and all of them (closed with the client)
        self._streams: threading.local | None = threading.local() if stream_steps else None
        self._all_streams: list[StepStream] = []
        self._lanes = StepLanes(self, step_lane)
        self._replicas = ReplicaStubs(target, lambda address: dial(address, tls=tls, token=token,
                                                                   max_attempts=max_attempts))

    @property
    def _channel(self) -> grpc.Channel:
        """The channel to the replica calls go to now."""
        return self._replicas.channel

    @property
    def _pools(self) -> pb_grpc.PoolServiceStub:
        return self._replicas.pools

    @property
    def _blocks(self) -> pb_grpc.BlockServiceStub:
        return self._replicas.blocks

    @property
    def _workers(self) -> pb_grpc.WorkerServiceStub:
        return self._replicas.workers

    @property
    def _replication(self) -> rpb_grpc.ReplicationServiceStub:
        return self._replicas.replication

    def close(self) -> None:
        for stream in self._all_streams:
            stream.close()
        for channel in self._replicas.channels():
            channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, method: Callable[..., Any], request: Any, timeout_s: float | None = None) -> Any:
        """One call with a deadline; a failure raises its :mod:`client.errors`
        exception. Within the deadline, the same request follows the leader
        of a replicated group (:mod:`client.leader`)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        attempt = 0
        while True:
            try:
                return method(request, timeout=max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as err:
                error = from_rpc_error(err)
            step = self._replicas.next_call(method, error, attempt) if self._follow else None
            if step is None or time.monotonic() + step[1] >= deadline:
                raise error from None
            time.sleep(step[1])
            attempt += 1
            method = step[0]

    def _follow_next(self, method: Callable[..., Any], error: BlockdClientError,
                     attempt: int) -> tuple[Callable[..., Any], float] | None:
        """Where to resend after ``method`` failed (:mod:`client.leader`); None: raise."""
        return self._replicas.next_call(method, error, attempt) if self._follow else None

    def _stream(self, method: Callable[..., Any], request: Any, read: Callable[[Any], T],
                timeout_s: float | None) -> Generator[T, None, None]:
        """A server stream read item by item; closing the generator cancels the call.

        A stream is not resent here (only its caller knows where to resume,
        e.g. a worker from its last version); a failure that names the
        group's leader, or a replica gone down, moves this client to the
        replica to call next (:mod:`client.leader`) before it is raised, so
        the caller's next open reaches the leader."""
        stream = method(request, timeout=timeout_s)
        try:
            for reply in stream:
                yield read(reply)
        except grpc.RpcError as err:
            error = from_rpc_error(err)
            if self._follow:
                self._replicas.next_call(method, error, 0)
            raise error from None
        finally:
            stream.cancel()

    # --- pools -------------------------------------------------------------------
    def create_pool(self, config: PoolConfig, *, request_id: str | None = None) -> PoolStats:
        reply = self._unary(self._pools.CreatePool, messages.create_pool_request(config, request_id))
        return convert.stats_from_proto(reply.stats)

    def get_pool(self, pool: str) -> PoolStats:
        return convert.stats_from_proto(self._unary(self._pools.GetPool, pb.GetPoolRequest(pool=pool)).stats)

    def pool_config(self, pool: str) -> PoolConfig:
        reply = self._unary(self._pools.GetPool, pb.GetPoolRequest(pool=pool))
        return convert.pool_config_from_reply(reply.config)

    def list_pools(self) -> list[PoolStats]:
        reply = self._unary(self._pools.ListPools, pb.ListPoolsRequest())
        return [convert.stats_from_proto(s) for s in reply.pools]

    def delete_pool(self, pool: str, *, request_id: str | None = None) -> None:
        self._unary(self._pools.DeletePool, messages.delete_pool_request(pool, request_id))

    def reset_prefix_cache(self, pool: str, *, request_id: str | None = None) -> None:
        self._unary(self._pools.ResetPrefixCache, messages.reset_prefix_cache_request(pool, request_id))

    def pin_prefix(self, pool: str, token_ids: Sequence[int], *, extra_keys: ExtraKeys | None = None,
                   ttl_s: float = 0.0, request_id: str | None = None) -> Pin:
        """Pin the leading full blocks of ``token_ids`` cached in ``pool``'s
        device tier: never evicted until :meth:`unpin_prefix`, ``ttl_s`` (0: no
        TTL) or a reset of the pool's prefix cache. The pin's ``num_tokens``
        says how much was pinned; FailedPreconditionError if nothing is cached."""
        request = messages.pin_prefix_request(pool, token_ids, extra_keys, ttl_s, request_id)
        return retention.pin_from_proto(self._unary(self._pools.PinPrefix, request).pin)

    def set_prefix_priority(self, pool: str, token_ids: Sequence[int], priority: int, *,
                            extra_keys: ExtraKeys | None = None, request_id: str | None = None) -> PrefixPriority:
        """Keep the leading full blocks of ``token_ids`` cached in ``pool``
        (device or host tier) at retention ``priority`` (0..7, lower evicted
        first); FailedPreconditionError if nothing is cached."""
        request = messages.set_prefix_priority_request(pool, token_ids, extra_keys, priority, request_id)
        return retention.prefix_priority_from_proto(self._unary(self._pools.SetPrefixPriority, request))

    def unpin_prefix(self, pool: str, pin_id: str, *, request_id: str | None = None) -> Pin:
        """Let pin ``pin_id`` go (NotFoundError if ``pool`` holds none such)."""
        request = messages.unpin_prefix_request(pool, pin_id, request_id)
        return retention.pin_from_proto(self._unary(self._pools.UnpinPrefix, request).pin)

    def list_pins(self, pool: str) -> list[Pin]:
        """``pool``'s pins, in the order they were made."""
        reply = self._unary(self._pools.ListPins, pb.ListPinsRequest(pool=pool))
        return [retention.pin_from_proto(pin) for pin in reply.pins]

    # --- steps ---------------------------------------------------------------------
    def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
             timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "",
             previous_term: int = 0) -> StepResult:
        """Apply ``ops`` atomically; on error nothing changed and the exception's
        ``op_index`` names the failing operation. With ``dry_run`` nothing changes
        either way: the answer says what the batch would do now.

        ``incarnation``: the pool incarnation planned against (a result's
        ``incarnation``); a re-created pool then refuses the step
        (FailedPreconditionError, reason ``POOL_INCARNATION_MISMATCH``). A step
        naming a sequence whose KV a worker restart lost fails with reason
        ``KV_LOST``; the error's ``seq_ids`` lists them.

        ``previous_term``: the ``term`` of the caller's previous result; a
        replicated group whose failover may have lost it (``async``) refuses
        the step with reason ``TERM_CHANGED`` (metadata ``term``: the new
        one) rather than apply it to sequences that may lack earlier steps."""
        if self._streams is not None:
            stream = getattr(self._streams, "stream", None)
            if stream is None:
                stream = self._streams.stream = self.step_stream()
                self._all_streams.append(stream)
            return stream.step(pool, ops, request_id=request_id, timeout_s=timeout_s, dry_run=dry_run,
                               incarnation=incarnation, previous_term=previous_term)
        request = messages.step_request(pool, ops, request_id, dry_run, incarnation, previous_term)
        return convert.step_result_from_proto(self._unary(self._blocks.Step, request, timeout_s))

    def step_stream(self, timeout_s: float | None = None) -> StepStream:
        """Steps over one long-lived stream (:class:`client.step_stream.StepStream`:
        its ``step`` and ``decode_append`` answer as this client's do, for less of
        the daemon's CPU per step). ``timeout_s``: each step's deadline (default:
        this client's). Close it when done."""
        return StepStream(self, timeout_s or self.timeout_s)

    def _one(self, pool: str, op: Op, request_id: str | None) -> OpResult:
        """A one-operation step; its operation's result."""
        return self.step(pool, [op], request_id=request_id).results[0]

    def allocate(self, pool: str, seq_id: str, prompt_token_ids: Sequence[int],
                 extra_keys: ExtraKeys | None = None, *, request_id: str | None = None,
                 retain_ttl_s: float = 0.0, priority: int = DEFAULT_PRIORITY) -> OpResult:
        """``retain_ttl_s`` > 0: once the prompt's full blocks are committed,
        blockd pins them for that long (:meth:`pin_prefix`). ``priority``: the
        retention priority of its blocks once evictable, 0..7, lower evicted
        first (docs/protocol.md, Priorities)."""
        op = Allocate(seq_id, list(prompt_token_ids), messages.extra_or_none(extra_keys), retain_ttl_s=retain_ttl_s,
                      priority=priority)
        return self._one(pool, op, request_id)

    def append(self, pool: str, seq_id: str, token_ids: Sequence[int], *,
               request_id: str | None = None) -> OpResult:
        return self._one(pool, Append(seq_id, list(token_ids)), request_id)

    def decode_append(self, pool: str, seq_ids: Sequence[str], token_ids: Sequence[int], *,
                      request_id: str | None = None) -> OpResult:
        return self._one(pool, DecodeAppend(list(seq_ids), list(token_ids)), request_id)

    def commit(self, pool: str, seq_id: str, num_tokens: int, *, request_id: str | None = None) -> OpResult:
        return self._one(pool, Commit(seq_id, num_tokens), request_id)

    def fork(self, pool: str, parent_seq_id: str, child_seq_id: str, *,
             request_id: str | None = None) -> OpResult:
        return self._one(pool, Fork(parent_seq_id, child_seq_id), request_id)

    def free(self, pool: str, seq_id: str, *, request_id: str | None = None) -> OpResult:
        return self._one(pool, Free(seq_id), request_id)

    # --- reads and streams -----------------------------------------------------------
    def get_tables(self, pool: str, seq_ids: Sequence[str] = ()) -> tuple[int, dict[str, list[int]]]:
        """``(version, {seq_id: block table})``; no ``seq_ids`` means all."""
        reply = self._unary(self._blocks.GetTables, pb.GetTablesRequest(pool=pool, seq_ids=list(seq_ids)))
        return messages.tables_reply(reply)

    def get_sequence(self, pool: str, seq_id: str) -> SequenceInfo:
        reply = self._unary(self._blocks.GetSequence, pb.GetSequenceRequest(pool=pool, seq_id=seq_id))
        return convert.sequence_from_proto(reply)

    def watch(self, pool: str, from_version: int = 0, *, incarnation: str = "", min_term: int = 0,
              timeout_s: float | None = None) -> Generator[Snapshot | VersionDelta, None, None]:
        """Deltas after ``from_version`` (a snapshot first when they are gone, or
        when ``incarnation``, the replica's pool incarnation, is set and is no
        longer the pool's: the snapshot names the new one), then new ones as
        they commit; ends when the pool is deleted. Each item's ``term`` is
        the serving leader's (0: not replicated); ``min_term``: a replica
        serving an older term than this refuses (NOT_LEADER)."""
        request = pb.WatchRequest(pool=pool, from_version=from_version, pool_incarnation=incarnation,
                                  min_term=min_term)
        return self._stream(self._blocks.Watch, request, convert.watch_item_from_proto, timeout_s)

    def events(self, pool: str, from_seq_no: int = 0, *,
               timeout_s: float | None = None) -> Generator[KVEvent, None, None]:
        """KV events with ``seq_no > from_seq_no``, in order, then new ones."""
        request = pb.EventsRequest(pool=pool, from_seq_no=from_seq_no)
        return self._stream(self._blocks.Events, request, messages.event_reply, timeout_s)

    def lookup_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None,
                      pools: Sequence[str] = (), *, tiers: bool = False) -> dict:
        """Cached tokens of this prompt per pool (all pools when none named);
        ``tiers``: ``(cached, of them in the host tier)`` per pool, where the prefix lives."""
        request = messages.lookup_prefix_request(token_ids, extra_keys, pools)
        return messages.lookup_prefix_reply(self._unary(self._blocks.LookupPrefix, request), tiers)

    def get_hash_spec(self, pool: str | None = None) -> HashSpec:
        """blockd's block-hash algorithm in words, with test vectors; with
        ``pool``, that pool's block size and tenant too (NOT_FOUND if unknown)."""
        reply = self._unary(self._blocks.GetHashSpec, pb.GetHashSpecRequest(pool=pool or ""))
        return hash_spec_from_proto(reply)

    def check_hash_spec(self) -> HashSpec:
        """blockd's spec, if it is this client's (:data:`~blockd.core.hashing.HASH_SPEC_ID`);
        FailedPreconditionError (reason ``HASH_SPEC_MISMATCH``) if not."""
        return messages.checked_hash_spec(self.get_hash_spec(), self.target)

    # --- workers -----------------------------------------------------------------------
    def register_worker(self, info: WorkerInfo, *, request_id: str | None = None,
                        hash_spec: str = HASH_SPEC_ID) -> WorkerStatus:
        """``hash_spec``: the block-hash spec the worker is built for; blockd
        refuses another one than its own (FailedPreconditionError, reason
        ``HASH_SPEC_MISMATCH``), nothing registered."""
        request = messages.register_worker_request(info, request_id, hash_spec)
        reply = self._unary(self._workers.RegisterWorker, request)
        return convert.worker_status_from_proto(reply.status)

    def heartbeat(self, worker_id: str, applied_version: int, *, request_id: str | None = None) -> WorkerStatus:
        request = messages.heartbeat_request(worker_id, applied_version, request_id)
        return convert.worker_status_from_proto(self._unary(self._workers.Heartbeat, request).status)

    def list_workers(self, pool: str | None = None) -> list[WorkerStatus]:
        reply = self._unary(self._workers.ListWorkers, pb.ListWorkersRequest(pool=pool or ""))
        return [convert.worker_status_from_proto(w) for w in reply.workers]

    # --- replica groups ----------------------------------------------------------------
    def replica_status(self) -> ReplicaStatus:
        """The replica this client calls now: its view of its group (``blockd serve --etcd``;
        a daemon without ``--etcd`` answers UNIMPLEMENTED)."""
        reply = self._unary(self._replication.GetReplicaStatus, rpb.GetReplicaStatusRequest())
        return convert.replica_status_from_proto(reply)
