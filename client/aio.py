"""The asyncio SDK: :class:`AsyncBlockdClient`, the same calls as
:class:`client.sdk.BlockdClient` as coroutines and async iterators.

    async with AsyncBlockdClient("127.0.0.1:50051") as client:
        step = await client.step("llama", ops)
        async for delta in client.watch("llama", from_version=step.version):
            ...

Requests and replies are built and read in :mod:`client.calls` (shared with
the sync client); the same deadlines, retries and request ids apply.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from blockd.auth.channels import open_channel
from blockd.auth.config import TlsConfig
from blockd.core.hashing import ExtraKeys
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
    StepResult,
    VersionDelta,
)
from blockd.engine import SequenceInfo, Snapshot
from blockd.workers import WorkerInfo, WorkerStatus
from client import calls
from client.calls import Call
from client.errors import from_rpc_error

if TYPE_CHECKING:
    from typing_extensions import Self


class AsyncBlockdClient:
    """A connection to one blockd daemon for one event loop."""

    def __init__(self, target: str = calls.DEFAULT_TARGET, *, timeout_s: float = calls.DEFAULT_TIMEOUT_S,
                 max_attempts: int = calls.DEFAULT_MAX_ATTEMPTS, tls: TlsConfig | None = None,
                 token: str | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.tls, self.token = tls, token
        self._channel = open_channel(target, tls, token, options=calls.channel_options(max_attempts), aio=True)
        self._rpc = calls.bind(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, call: Call, *args, timeout_s: float | None = None):
        request = call.request(*args)
        try:
            reply = await self._rpc[call.method](request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return call.reply(reply)

    async def _stream(self, call: Call, *args, timeout_s: float | None = None) -> AsyncGenerator:
        stream = self._rpc[call.method](call.request(*args), timeout=timeout_s)
        try:
            async for reply in stream:
                yield call.reply(reply)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            stream.cancel()

    # --- pools -------------------------------------------------------------------
    async def create_pool(self, config: PoolConfig, *, request_id: str | None = None) -> PoolStats:
        return await self._call(calls.CREATE_POOL, config, request_id)

    async def get_pool(self, pool: str) -> PoolStats:
        return await self._call(calls.GET_POOL, pool)

    async def pool_config(self, pool: str) -> PoolConfig:
        return await self._call(calls.POOL_CONFIG, pool)

    async def list_pools(self) -> list[PoolStats]:
        return await self._call(calls.LIST_POOLS)

    async def delete_pool(self, pool: str, *, request_id: str | None = None) -> None:
        await self._call(calls.DELETE_POOL, pool, request_id)

    async def reset_prefix_cache(self, pool: str, *, request_id: str | None = None) -> None:
        await self._call(calls.RESET_PREFIX_CACHE, pool, request_id)

    # --- steps ---------------------------------------------------------------------
    async def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
                   timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "") -> StepResult:
        return await self._call(calls.STEP, pool, ops, request_id, dry_run, incarnation, timeout_s=timeout_s)

    async def allocate(self, pool: str, seq_id: str, prompt_token_ids: Sequence[int],
                       extra_keys: ExtraKeys | None = None, *, request_id: str | None = None) -> OpResult:
        op = Allocate(seq_id, list(prompt_token_ids), calls.extra_or_none(extra_keys))
        return await self._call(calls.STEP_ONE, pool, op, request_id)

    async def append(self, pool: str, seq_id: str, token_ids: Sequence[int], *,
                     request_id: str | None = None) -> OpResult:
        return await self._call(calls.STEP_ONE, pool, Append(seq_id, list(token_ids)), request_id)

    async def decode_append(self, pool: str, seq_ids: Sequence[str], token_ids: Sequence[int], *,
                            request_id: str | None = None) -> OpResult:
        return await self._call(calls.STEP_ONE, pool, DecodeAppend(list(seq_ids), list(token_ids)), request_id)

    async def commit(self, pool: str, seq_id: str, num_tokens: int, *,
                     request_id: str | None = None) -> OpResult:
        return await self._call(calls.STEP_ONE, pool, Commit(seq_id, num_tokens), request_id)

    async def fork(self, pool: str, parent_seq_id: str, child_seq_id: str, *,
                   request_id: str | None = None) -> OpResult:
        return await self._call(calls.STEP_ONE, pool, Fork(parent_seq_id, child_seq_id), request_id)

    async def free(self, pool: str, seq_id: str, *, request_id: str | None = None) -> OpResult:
        return await self._call(calls.STEP_ONE, pool, Free(seq_id), request_id)

    # --- reads and streams -----------------------------------------------------------
    async def get_tables(self, pool: str, seq_ids: Sequence[str] = ()) -> tuple[int, dict[str, list[int]]]:
        return await self._call(calls.GET_TABLES, pool, seq_ids)

    async def get_sequence(self, pool: str, seq_id: str) -> SequenceInfo:
        return await self._call(calls.GET_SEQUENCE, pool, seq_id)

    def watch(self, pool: str, from_version: int = 0, *, incarnation: str = "",
              timeout_s: float | None = None) -> AsyncGenerator[Snapshot | VersionDelta, None]:
        """Like :meth:`client.sdk.BlockdClient.watch`. An async generator is only
        finalised when closed: leave it early inside ``contextlib.aclosing(...)``
        (or ``await it.aclose()``) so the call is cancelled at once."""
        return self._stream(calls.WATCH, pool, from_version, incarnation, timeout_s=timeout_s)

    def events(self, pool: str, from_seq_no: int = 0, *,
               timeout_s: float | None = None) -> AsyncGenerator[KVEvent, None]:
        """Like :meth:`client.sdk.BlockdClient.events`; close it as :meth:`watch` says."""
        return self._stream(calls.EVENTS, pool, from_seq_no, timeout_s=timeout_s)

    async def lookup_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None,
                            pools: Sequence[str] = ()) -> dict[str, int]:
        return await self._call(calls.LOOKUP_PREFIX, token_ids, extra_keys, pools)

    # --- workers -----------------------------------------------------------------------
    async def register_worker(self, info: WorkerInfo, *, request_id: str | None = None) -> WorkerStatus:
        return await self._call(calls.REGISTER_WORKER, info, request_id)

    async def heartbeat(self, worker_id: str, applied_version: int, *,
                        request_id: str | None = None) -> WorkerStatus:
        return await self._call(calls.HEARTBEAT, worker_id, applied_version, request_id)

    async def list_workers(self, pool: str | None = None) -> list[WorkerStatus]:
        return await self._call(calls.LIST_WORKERS, pool)
