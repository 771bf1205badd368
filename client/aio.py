"""The asyncio SDK: :class:`AsyncBlockdClient`, the same calls as
:class:`client.sdk.BlockdClient` as coroutines and async iterators.

    async with AsyncBlockdClient("127.0.0.1:50051") as client:
        step = await client.step("llama", ops)
        async for delta in client.watch("llama", from_version=step.version):
            ...

Requests are built and replies read in :mod:`client.messages` (shared with
the sync client); the same deadlines, retries and request ids apply, and
the same leader following for a replicated group (:mod:`client.leader`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio

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
from client.step_stream import AsyncStepStream

if TYPE_CHECKING:
    from typing_extensions import Self

T = TypeVar("T")


class AsyncBlockdClient:
    """A connection to one blockd daemon (or the replicas of a group) for one event loop."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS, tls: TlsConfig | None = None,
                 token: str | None = None, follow_leader: bool = True) -> None:
        """As :class:`client.sdk.BlockdClient`: ``target`` may list a replicated
        group's replicas, comma-separated, and calls follow its leader."""
        self.target = target
        self.timeout_s = timeout_s
        self.tls, self.token = tls, token
        self._follow = follow_leader
        self._replicas = ReplicaStubs(target, lambda address: dial(address, tls=tls, token=token,
                                                                   max_attempts=max_attempts, aio=True))

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

    async def close(self) -> None:
        for channel in self._replicas.channels():
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _next_call(self, method: Callable[..., Any], error: BlockdClientError,
                         attempt: int) -> tuple[Callable[..., Any], float] | None:
        """:meth:`client.leader.ReplicaStubs.next_call`; an etcd read (blocking)
        runs on a thread, so the event loop's other calls go on meanwhile."""
        replicas = self._replicas
        if not replicas.targets.reads_etcd:
            return replicas.next_call(method, error, attempt)
        return replicas.method_at(await asyncio.to_thread(replicas.next_target, method, error, attempt))

    async def _unary(self, method: Callable[..., Any], request: Any, timeout_s: float | None = None) -> Any:
        """As the sync client's: within the deadline, the same request follows
        the leader of a replicated group (:mod:`client.leader`)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        attempt = 0
        while True:
            try:
                return await method(request, timeout=max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as err:
                error = from_rpc_error(err)
            step = await self._next_call(method, error, attempt) if self._follow else None
            if step is None or time.monotonic() + step[1] >= deadline:
                raise error from None
            await asyncio.sleep(step[1])
            attempt += 1
            method = step[0]

    async def _stream(self, method: Callable[..., Any], request: Any, read: Callable[[Any], T],
                      timeout_s: float | None) -> AsyncGenerator[T, None]:
        """As the sync client's: not resent, but a failure moves the client to
        the replica to call next before it is raised."""
        stream = method(request, timeout=timeout_s)
        try:
            async for reply in stream:
                yield read(reply)
        except grpc.RpcError as err:
            error = from_rpc_error(err)
            if self._follow:
                await self._next_call(method, error, 0)
            raise error from None
        finally:
            stream.cancel()

    # --- pools -------------------------------------------------------------------
    async def create_pool(self, config: PoolConfig, *, request_id: str | None = None) -> PoolStats:
        reply = await self._unary(self._pools.CreatePool, messages.create_pool_request(config, request_id))
        return convert.stats_from_proto(reply.stats)

    async def get_pool(self, pool: str) -> PoolStats:
        reply = await self._unary(self._pools.GetPool, pb.GetPoolRequest(pool=pool))
        return convert.stats_from_proto(reply.stats)

    async def pool_config(self, pool: str) -> PoolConfig:
        reply = await self._unary(self._pools.GetPool, pb.GetPoolRequest(pool=pool))
        return convert.pool_config_from_reply(reply.config)

    async def list_pools(self) -> list[PoolStats]:
        reply = await self._unary(self._pools.ListPools, pb.ListPoolsRequest())
        return [convert.stats_from_proto(s) for s in reply.pools]

    async def delete_pool(self, pool: str, *, request_id: str | None = None) -> None:
        await self._unary(self._pools.DeletePool, messages.delete_pool_request(pool, request_id))

    async def reset_prefix_cache(self, pool: str, *, request_id: str | None = None) -> None:
        await self._unary(self._pools.ResetPrefixCache, messages.reset_prefix_cache_request(pool, request_id))

    async def pin_prefix(self, pool: str, token_ids: Sequence[int], *, extra_keys: ExtraKeys | None = None,
                         ttl_s: float = 0.0, request_id: str | None = None) -> Pin:
        """Like :meth:`client.sdk.BlockdClient.pin_prefix`."""
        request = messages.pin_prefix_request(pool, token_ids, extra_keys, ttl_s, request_id)
        return retention.pin_from_proto((await self._unary(self._pools.PinPrefix, request)).pin)

    async def set_prefix_priority(self, pool: str, token_ids: Sequence[int], priority: int, *,
                                  extra_keys: ExtraKeys | None = None,
                                  request_id: str | None = None) -> PrefixPriority:
        """Like :meth:`client.sdk.BlockdClient.set_prefix_priority`."""
        request = messages.set_prefix_priority_request(pool, token_ids, extra_keys, priority, request_id)
        return retention.prefix_priority_from_proto(await self._unary(self._pools.SetPrefixPriority, request))

    async def unpin_prefix(self, pool: str, pin_id: str, *, request_id: str | None = None) -> Pin:
        request = messages.unpin_prefix_request(pool, pin_id, request_id)
        return retention.pin_from_proto((await self._unary(self._pools.UnpinPrefix, request)).pin)

    async def list_pins(self, pool: str) -> list[Pin]:
        reply = await self._unary(self._pools.ListPins, pb.ListPinsRequest(pool=pool))
        return [retention.pin_from_proto(pin) for pin in reply.pins]

    # --- steps ---------------------------------------------------------------------
    async def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
                   timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "",
                   previous_term: int = 0) -> StepResult:
        """Like :meth:`client.sdk.BlockdClient.step`."""
        request = messages.step_request(pool, ops, request_id, dry_run, incarnation, previous_term)
        return convert.step_result_from_proto(await self._unary(self._blocks.Step, request, timeout_s))

    def step_stream(self, timeout_s: float | None = None) -> AsyncStepStream:
        """Like :meth:`client.sdk.BlockdClient.step_stream`
        (:class:`client.step_stream.AsyncStepStream`); close it when done."""
        return AsyncStepStream(self, timeout_s or self.timeout_s)

    async def _one(self, pool: str, op: Op, request_id: str | None) -> OpResult:
        return (await self.step(pool, [op], request_id=request_id)).results[0]

    async def allocate(self, pool: str, seq_id: str, prompt_token_ids: Sequence[int],
                       extra_keys: ExtraKeys | None = None, *, request_id: str | None = None,
                       retain_ttl_s: float = 0.0, priority: int = DEFAULT_PRIORITY) -> OpResult:
        op = Allocate(seq_id, list(prompt_token_ids), messages.extra_or_none(extra_keys), retain_ttl_s=retain_ttl_s,
                      priority=priority)
        return await self._one(pool, op, request_id)

    async def append(self, pool: str, seq_id: str, token_ids: Sequence[int], *,
                     request_id: str | None = None) -> OpResult:
        return await self._one(pool, Append(seq_id, list(token_ids)), request_id)

    async def decode_append(self, pool: str, seq_ids: Sequence[str], token_ids: Sequence[int], *,
                            request_id: str | None = None) -> OpResult:
        return await self._one(pool, DecodeAppend(list(seq_ids), list(token_ids)), request_id)

    async def commit(self, pool: str, seq_id: str, num_tokens: int, *,
                     request_id: str | None = None) -> OpResult:
        return await self._one(pool, Commit(seq_id, num_tokens), request_id)

    async def fork(self, pool: str, parent_seq_id: str, child_seq_id: str, *,
                   request_id: str | None = None) -> OpResult:
        return await self._one(pool, Fork(parent_seq_id, child_seq_id), request_id)

    async def free(self, pool: str, seq_id: str, *, request_id: str | None = None) -> OpResult:
        return await self._one(pool, Free(seq_id), request_id)

    # --- reads and streams -----------------------------------------------------------
    async def get_tables(self, pool: str, seq_ids: Sequence[str] = ()) -> tuple[int, dict[str, list[int]]]:
        reply = await self._unary(self._blocks.GetTables, pb.GetTablesRequest(pool=pool, seq_ids=list(seq_ids)))
        return messages.tables_reply(reply)

    async def get_sequence(self, pool: str, seq_id: str) -> SequenceInfo:
        reply = await self._unary(self._blocks.GetSequence, pb.GetSequenceRequest(pool=pool, seq_id=seq_id))
        return convert.sequence_from_proto(reply)

    def watch(self, pool: str, from_version: int = 0, *, incarnation: str = "", min_term: int = 0,
              timeout_s: float | None = None) -> AsyncGenerator[Snapshot | VersionDelta, None]:
        """Like :meth:`client.sdk.BlockdClient.watch`. An async generator is only
        finalised when closed: leave it early inside ``contextlib.aclosing(...)``
        (or ``await it.aclose()``) so the call is cancelled at once."""
        request = pb.WatchRequest(pool=pool, from_version=from_version, pool_incarnation=incarnation,
                                  min_term=min_term)
        return self._stream(self._blocks.Watch, request, convert.watch_item_from_proto, timeout_s)

    def events(self, pool: str, from_seq_no: int = 0, *,
               timeout_s: float | None = None) -> AsyncGenerator[KVEvent, None]:
        """Like :meth:`client.sdk.BlockdClient.events`; close it as :meth:`watch` says."""
        request = pb.EventsRequest(pool=pool, from_seq_no=from_seq_no)
        return self._stream(self._blocks.Events, request, messages.event_reply, timeout_s)

    async def lookup_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None,
                            pools: Sequence[str] = (), *, tiers: bool = False) -> dict:
        request = messages.lookup_prefix_request(token_ids, extra_keys, pools)
        return messages.lookup_prefix_reply(await self._unary(self._blocks.LookupPrefix, request), tiers)

    async def get_hash_spec(self, pool: str | None = None) -> HashSpec:
        reply = await self._unary(self._blocks.GetHashSpec, pb.GetHashSpecRequest(pool=pool or ""))
        return hash_spec_from_proto(reply)

    async def check_hash_spec(self) -> HashSpec:
        return messages.checked_hash_spec(await self.get_hash_spec(), self.target)

    # --- workers -----------------------------------------------------------------------
    async def register_worker(self, info: WorkerInfo, *, request_id: str | None = None,
                              hash_spec: str = HASH_SPEC_ID) -> WorkerStatus:
        request = messages.register_worker_request(info, request_id, hash_spec)
        return convert.worker_status_from_proto((await self._unary(self._workers.RegisterWorker, request)).status)

    async def heartbeat(self, worker_id: str, applied_version: int, *,
                        request_id: str | None = None) -> WorkerStatus:
        request = messages.heartbeat_request(worker_id, applied_version, request_id)
        return convert.worker_status_from_proto((await self._unary(self._workers.Heartbeat, request)).status)

    async def list_workers(self, pool: str | None = None) -> list[WorkerStatus]:
        reply = await self._unary(self._workers.ListWorkers, pb.ListWorkersRequest(pool=pool or ""))
        return [convert.worker_status_from_proto(w) for w in reply.workers]

    # --- replica groups ----------------------------------------------------------------
    async def replica_status(self) -> ReplicaStatus:
        """The replica this client calls now: its view of its group (``blockd serve --etcd``;
        a daemon without ``--etcd`` answers UNIMPLEMENTED)."""
        reply = await self._unary(self._replication.GetReplicaStatus, rpb.GetReplicaStatusRequest())
        return convert.replica_status_from_proto(reply)
