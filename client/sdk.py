"""The synchronous SDK: :class:`BlockdClient`, for schedulers, workers and tools.

Results are blockd's plain dataclasses (:class:`~blockd.core.types.PoolStats`,
:class:`~blockd.core.types.StepResult`, :class:`~blockd.core.types.OpResult`,
:class:`~blockd.core.types.KVEvent`, :class:`~blockd.core.types.VersionDelta`,
:class:`~blockd.engine.Snapshot`, :class:`~blockd.workers.WorkerStatus`, ...),
failures are :mod:`client.errors` exceptions. Every unary call has a deadline
(``timeout_s``), UNAVAILABLE is retried by the channel, and mutations carry a
request id so those retries are safe. Streams (``watch``, ``events``) have no
deadline unless one is given; closing their iterator cancels the call.

    with BlockdClient("127.0.0.1:50051") as client:
        client.create_pool(PoolConfig("llama", num_blocks=4096, block_size=16))
        result = client.allocate("llama", "req-1", prompt_token_ids)
        slots = client.decode_append("llama", ["req-1"], [next_token]).slot_mapping

Requests and replies are built and read in :mod:`client.calls`, shared with
:mod:`client.aio`.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import grpc

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


class BlockdClient:
    """A connection to one blockd daemon. Thread-safe; share one per process."""

    def __init__(self, target: str = calls.DEFAULT_TARGET, *, timeout_s: float = calls.DEFAULT_TIMEOUT_S,
                 max_attempts: int = calls.DEFAULT_MAX_ATTEMPTS, tls: TlsConfig | None = None,
                 token: str | None = None) -> None:
        """``tls``: verify the server (and present a client certificate for
        mutual TLS); ``token``: a bearer token for every call. Neither: plain
        text (loopback). See :func:`blockd.auth.open_channel`."""
        self.target = target
        self.timeout_s = timeout_s
        self.tls, self.token = tls, token
        self._channel = open_channel(target, tls, token, options=calls.channel_options(max_attempts))
        self._rpc = calls.bind(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, call: Call, *args, timeout_s: float | None = None):
        request = call.request(*args)
        try:
            reply = self._rpc[call.method](request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return call.reply(reply)

    def _stream(self, call: Call, *args, timeout_s: float | None = None) -> Generator:
        stream = self._rpc[call.method](call.request(*args), timeout=timeout_s)
        try:
            for reply in stream:
                yield call.reply(reply)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            stream.cancel()

    # --- pools -------------------------------------------------------------------
    def create_pool(self, config: PoolConfig, *, request_id: str | None = None) -> PoolStats:
        return self._call(calls.CREATE_POOL, config, request_id)

    def get_pool(self, pool: str) -> PoolStats:
        return self._call(calls.GET_POOL, pool)

    def pool_config(self, pool: str) -> PoolConfig:
        return self._call(calls.POOL_CONFIG, pool)

    def list_pools(self) -> list[PoolStats]:
        return self._call(calls.LIST_POOLS)

    def delete_pool(self, pool: str, *, request_id: str | None = None) -> None:
        self._call(calls.DELETE_POOL, pool, request_id)

    def reset_prefix_cache(self, pool: str, *, request_id: str | None = None) -> None:
        self._call(calls.RESET_PREFIX_CACHE, pool, request_id)

    # --- steps ---------------------------------------------------------------------
    def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
             timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "") -> StepResult:
        """Apply ``ops`` atomically; on error nothing changed and the exception's
        ``op_index`` names the failing operation. With ``dry_run`` nothing changes
        either way: the answer says what the batch would do now.

        ``incarnation``: the pool incarnation planned against (a result's
        ``incarnation``); a re-created pool then refuses the step
        (FailedPreconditionError, reason ``POOL_INCARNATION_MISMATCH``). A step
        naming a sequence whose KV a worker restart lost fails with reason
        ``KV_LOST``; the error's ``seq_ids`` lists them."""
        return self._call(calls.STEP, pool, ops, request_id, dry_run, incarnation, timeout_s=timeout_s)

    def allocate(self, pool: str, seq_id: str, prompt_token_ids: Sequence[int],
                 extra_keys: ExtraKeys | None = None, *, request_id: str | None = None) -> OpResult:
        op = Allocate(seq_id, list(prompt_token_ids), calls.extra_or_none(extra_keys))
        return self._call(calls.STEP_ONE, pool, op, request_id)

    def append(self, pool: str, seq_id: str, token_ids: Sequence[int], *,
               request_id: str | None = None) -> OpResult:
        return self._call(calls.STEP_ONE, pool, Append(seq_id, list(token_ids)), request_id)

    def decode_append(self, pool: str, seq_ids: Sequence[str], token_ids: Sequence[int], *,
                      request_id: str | None = None) -> OpResult:
        return self._call(calls.STEP_ONE, pool, DecodeAppend(list(seq_ids), list(token_ids)), request_id)

    def commit(self, pool: str, seq_id: str, num_tokens: int, *, request_id: str | None = None) -> OpResult:
        return self._call(calls.STEP_ONE, pool, Commit(seq_id, num_tokens), request_id)

    def fork(self, pool: str, parent_seq_id: str, child_seq_id: str, *,
             request_id: str | None = None) -> OpResult:
        return self._call(calls.STEP_ONE, pool, Fork(parent_seq_id, child_seq_id), request_id)

    def free(self, pool: str, seq_id: str, *, request_id: str | None = None) -> OpResult:
        return self._call(calls.STEP_ONE, pool, Free(seq_id), request_id)

    # --- reads and streams -----------------------------------------------------------
    def get_tables(self, pool: str, seq_ids: Sequence[str] = ()) -> tuple[int, dict[str, list[int]]]:
        """``(version, {seq_id: block table})``; no ``seq_ids`` means all."""
        return self._call(calls.GET_TABLES, pool, seq_ids)

    def get_sequence(self, pool: str, seq_id: str) -> SequenceInfo:
        return self._call(calls.GET_SEQUENCE, pool, seq_id)

    def watch(self, pool: str, from_version: int = 0, *, incarnation: str = "",
              timeout_s: float | None = None) -> Generator[Snapshot | VersionDelta, None, None]:
        """Deltas after ``from_version`` (a snapshot first when they are gone, or
        when ``incarnation``, the replica's pool incarnation, is set and is no
        longer the pool's: the snapshot names the new one), then new ones as
        they commit; ends when the pool is deleted."""
        return self._stream(calls.WATCH, pool, from_version, incarnation, timeout_s=timeout_s)

    def events(self, pool: str, from_seq_no: int = 0, *,
               timeout_s: float | None = None) -> Generator[KVEvent, None, None]:
        """KV events with ``seq_no > from_seq_no``, in order, then new ones."""
        return self._stream(calls.EVENTS, pool, from_seq_no, timeout_s=timeout_s)

    def lookup_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None,
                      pools: Sequence[str] = ()) -> dict[str, int]:
        """Cached tokens of this prompt per pool (all pools when none named)."""
        return self._call(calls.LOOKUP_PREFIX, token_ids, extra_keys, pools)

    # --- workers -----------------------------------------------------------------------
    def register_worker(self, info: WorkerInfo, *, request_id: str | None = None) -> WorkerStatus:
        return self._call(calls.REGISTER_WORKER, info, request_id)

    def heartbeat(self, worker_id: str, applied_version: int, *, request_id: str | None = None) -> WorkerStatus:
        return self._call(calls.HEARTBEAT, worker_id, applied_version, request_id)

    def list_workers(self, pool: str | None = None) -> list[WorkerStatus]:
        return self._call(calls.LIST_WORKERS, pool)
