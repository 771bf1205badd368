"""The worker's in-process API: one pool shard's KV memory, its table mirror
and the kernels, behind version-checked calls.

A model runner living in the worker process calls :class:`WorkerRuntime`
directly; the gRPC service (:mod:`worker.service`) is a thin adapter over the
same methods. Every call names the pool version its tables come from; the
runtime advances the replica to exactly that version (running that version's
tier ops and copy-on-write copies first) under one execution lock, so kernels
never race with copy ops. A pool with ``num_host_blocks`` gets a host tier
beside the device shard (:mod:`worker.tiers`).

The shard holds layers ``[layer_start, layer_end)`` and KV heads
``[kv_head_start, kv_head_end)`` of the pool; a tensor-parallel group of
workers shares one set of block ids and splits the heads. Layer arguments are
the pool's global layer indices.

Identity: the runtime is one worker incarnation (a random id made here; the
process restarting makes a new one, and its KV starts empty). It records which
slots it has written in its current incarnation (:mod:`worker.written`) and
refuses attention whose context reaches any other slot; a call may name the
pool incarnation it planned against, and the record is cleared the first time
the replica serves a new pool incarnation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from blockd.core.errors import InvalidArgument, WrongState, shown
from blockd.core.incarnations import new_incarnation
from blockd.core.types import PoolConfig
from blockd.rpc import tracing
from worker.kernels import PagedAttention, copy_blocks, native, select_device, write_kv
from worker.layout import KVGeometry, allocate_host_pool, allocate_kv_pool, split_slots
from worker.metrics import trace_kernel
from worker.tables import TableMirror
from worker.tiers import HostTier
from worker.written import ContextBlocks, WrittenSlots, padded_tables

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: makes a zeroed pool shard: (geometry, dtype, device) -> tensor of ``geometry.shape``
Allocator = Callable[[KVGeometry, torch.dtype, torch.device], torch.Tensor]


@dataclass(frozen=True)
class ShardSpec:
    """Which part of a pool this worker holds."""

    layer_start: int
    layer_end: int
    kv_head_start: int
    kv_head_end: int

    @classmethod
    def whole(cls, config: PoolConfig) -> ShardSpec:
        return cls(0, config.num_layers, 0, config.num_kv_heads)

    def check(self, config: PoolConfig) -> None:
        if not 0 <= self.layer_start < self.layer_end <= config.num_layers:
            raise InvalidArgument(f"layer range [{self.layer_start}, {self.layer_end}) is not inside the "
                                  f"pool's {config.num_layers} layers")
        if not 0 <= self.kv_head_start < self.kv_head_end <= config.num_kv_heads:
            raise InvalidArgument(f"KV head range [{self.kv_head_start}, {self.kv_head_end}) is not inside "
                                  f"the pool's {config.num_kv_heads} KV heads")


@dataclass(frozen=True)
class PreparedStep:
    """One model step's batch, validated and indexed once for every layer
    (:meth:`WorkerRuntime.prepare_step`): the per-layer calls
    (:meth:`WorkerRuntime.step_attention`) only write, mark and attend."""

    version: int
    pool_incarnation: str | None
    #: the pool incarnation the replica served when the step was prepared
    incarnation: str
    seq_ids: list[str]
    query_lens: torch.Tensor  # int64 [batch]
    context_lens: torch.Tensor  # int64 [batch]
    total: int
    slots: torch.Tensor  # int64 [T], CPU
    #: the slots split once (CPU): block and offset of each, and the distinct blocks
    blocks: torch.Tensor
    offsets: torch.Tensor
    touched: torch.Tensor
    #: rows of a layer's K half seen as ``[2 * N * H * b, D]``, token-major then head ([T * H]),
    #: on the pool's device; ``value_rows``: the same for V (``N * H * b`` rows further)
    key_rows: torch.Tensor
    value_rows: torch.Tensor
    plan_key: tuple
    #: this worker's incarnation when the step was prepared (a resync may start another meanwhile)
    worker_incarnation: str = ""
    #: rows of the new tokens whose K/V also goes to the copies' rows (past ``total * H`` in
    #: ``key_rows``/``value_rows``), token-major; None: no copies
    copy_rows: torch.Tensor | None = None


class _NoMetrics:
    def observe_kernel(self, kernel: str, seconds: float) -> None:
        if tracing.tracer is not None:  # spans need no metrics port
            trace_kernel(kernel, seconds)

    def add_tokens(self, n: int) -> None: ...
    def add_copy_ops(self, n: int) -> None: ...
    def add_tier_ops(self, kind: str, n: int) -> None: ...
    def add_transfer_blocks(self, result: str, n: int) -> None: ...


def _batch_lengths(seq_ids: Sequence[str], query_lens, context_lens) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A batch's query and context lengths as int64 tensors, checked (one of each per
    sequence, ``1 <= query_len <= context_len``), and the number of new tokens."""
    q_lens = _int_tensor(query_lens, "query_lens")
    ctx = _int_tensor(context_lens, "context_lens")
    if not (len(seq_ids) == q_lens.numel() == ctx.numel()) or not seq_ids:
        raise InvalidArgument("seq_ids, query_lens and context_lens need one entry per sequence, "
                              f"got {len(seq_ids)}, {q_lens.numel()}, {ctx.numel()}")
    if bool((q_lens < 1).any()) or bool((ctx < q_lens).any()):
        raise InvalidArgument("each sequence needs 1 <= query_len <= context_len")
    return q_lens, ctx, int(q_lens.sum())


def _int_tensor(values: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(torch.int64)
    try:
        return torch.tensor(list(values), dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise InvalidArgument(f"{name} must be a list of integers: {err}") from None


class WorkerRuntime:
    def __init__(self, config: PoolConfig, shard: ShardSpec | None = None, *, device: str | None = None,
                 version_timeout_s: float = 5.0, latest_committed: Callable[[], int] | None = None,
                 metrics=None, allocate: Allocator = allocate_kv_pool) -> None:
        """``allocate`` makes the zeroed pool tensor (torch's allocator by
        default; :meth:`worker.ipc.SharedPool.allocate` for a pool other
        processes map over CUDA IPC)."""
        if config.dtype not in TORCH_DTYPES:
            raise InvalidArgument(f"workers hold float32, float16 or bfloat16 pools, not {config.dtype}")
        self.config = config
        self.shard = shard or ShardSpec.whole(config)
        self.shard.check(config)
        self.device = select_device(device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.geometry = KVGeometry(
            num_layers=self.shard.layer_end - self.shard.layer_start, num_blocks=config.num_blocks,
            num_kv_heads=self.shard.kv_head_end - self.shard.kv_head_start, block_size=config.block_size,
            head_dim=config.head_dim)
        self.kv = allocate(self.geometry, self.dtype, self.device)
        if tuple(self.kv.shape) != self.geometry.shape or self.kv.dtype != self.dtype:
            raise ValueError(f"the allocator made a {self.kv.dtype} pool of shape {tuple(self.kv.shape)}, "
                             f"not {self.dtype} {self.geometry.shape}")
        #: this process's worker incarnation: KV written by an earlier one is gone
        self.incarnation = new_incarnation()
        self.written = WrittenSlots(self.geometry.num_layers, config.num_blocks, config.block_size,
                                    config.num_host_blocks)
        self.metrics = metrics or _NoMetrics()
        host_kv = allocate_host_pool(self.geometry, config.num_host_blocks, self.dtype, self.device)
        #: the host tier (None: the pool has none)
        self.host = None if host_kv is None else HostTier(self.kv, host_kv, self.written, self.metrics)
        self.mirror = TableMirror(self._copy_blocks, tier_ops=None if self.host is None else self.host.run,
                                  on_snapshot=self.written.forget_host)
        #: the pool incarnation the written-slot record (so the KV) belongs to
        self._kv_incarnation = ""
        #: why this worker can serve nothing any more (its pool changed geometry)
        self.unusable = ""
        self._context: ContextBlocks | None = None
        self.version_timeout_s = version_timeout_s
        self.latest_committed = latest_committed
        self.tokens_processed = 0
        self._attention = PagedAttention(self.device)
        self._plan_key: tuple | None = None
        self._lock = threading.Lock()
        #: a layer's V rows follow its K rows in ``kv[layer].view(-1, head_dim)``
        self._value_offset = self.geometry.num_blocks * self.geometry.num_kv_heads * self.geometry.block_size
        # a prepared step's K/V rows go in by the compiled library's copy (one memcpy per
        # row) where the attention kernel is that library; index_copy_ otherwise
        self._copy_rows = native.layer_ops().copy_rows if self._attention.backend == "native" else None

    @property
    def pool_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def host_pool_bytes(self) -> int:
        """Bytes of the host tier (0: none)."""
        return 0 if self.host is None else self.host.nbytes

    # --- replica feeding (the Watch follower calls these) ---------------------
    def catch_up(self) -> None:
        """Apply old pending deltas when too many piled up (idle worker)."""
        with self._lock:
            self.mirror.trim()

    def _copy_blocks(self, copy_ops: Sequence[tuple[int, int]]) -> None:
        start = time.perf_counter()
        pairs = torch.tensor(copy_ops, dtype=torch.int64).view(-1, 2)
        copy_blocks(self.kv, pairs.to(self.device))
        self.written.copy(pairs)
        self.metrics.observe_kernel("copy_blocks", time.perf_counter() - start)
        self.metrics.add_copy_ops(len(pairs))

    # --- checks -----------------------------------------------------------
    def _local_layer(self, layer: int) -> int:
        if type(layer) is not int or not self.shard.layer_start <= layer < self.shard.layer_end:
            raise InvalidArgument(f"layer {shown(layer)} is not held by this worker (it holds "
                                  f"[{self.shard.layer_start}, {self.shard.layer_end}))")
        return layer - self.shard.layer_start

    def _check_tensor(self, tensor: torch.Tensor, name: str, shape: tuple) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgument(f"{name} must be a tensor")
        if tensor.dtype != self.dtype:
            raise InvalidArgument(f"{name} is {tensor.dtype} but the pool holds {self.dtype}")
        if tuple(tensor.shape) != shape:
            raise InvalidArgument(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
        return tensor.to(self.device)

    def _check_slots(self, slot_mapping, num_tokens: int) -> torch.Tensor:
        slots = _int_tensor(slot_mapping, "slot_mapping")
        if slots.dim() != 1 or slots.numel() != num_tokens:
            raise InvalidArgument(f"slot_mapping needs one slot per token ({num_tokens}), got {slots.numel()}")
        limit = self.config.num_blocks * self.config.block_size
        if num_tokens and int(slots.max()) >= limit:
            raise InvalidArgument(f"slot {int(slots.max())} is past the pool's {limit} slots")
        return slots

    # --- the data plane --------------------------------------------------------
    def _advance(self, version: int, pool_incarnation: str | None) -> str:
        if self.unusable:
            raise WrongState(self.unusable)
        incarnation = self.mirror.advance_to(version, self.version_timeout_s, self.latest_committed,
                                              pool_incarnation)
        if incarnation != self._kv_incarnation:
            # the memory holds another pool's data under these block ids
            self.written.clear()
            self._kv_incarnation = incarnation
            self._plan_key = None
        return incarnation

    def new_incarnation(self) -> str:
        """Become a new worker incarnation, as a restart would, with no KV written
        (the KV it holds may belong to steps blockd's leader does not have)."""
        with self._lock:
            self.incarnation = new_incarnation()
            self.written.clear()
            self._plan_key = None
            return self.incarnation

    def advance(self, version: int, pool_incarnation: str | None = None) -> str:
        """Bring the replica to exactly ``version`` (its copy ops included) of
        ``pool_incarnation`` (None: the one it holds) under the execution lock,
        without running a kernel, and return the incarnation: a model step does
        this before its forward so it fails early, before any layer ran."""
        with self._lock:
            return self._advance(version, pool_incarnation)

    def check_written(self, seq_ids: Sequence[str], tables: list[list[int]], lengths: Sequence[int],
                      writing: torch.Tensor | None = None) -> None:
        """Refuse (:class:`~blockd.core.incarnations.KVNotWritten`) unless the first
        ``lengths[i]`` tokens of each sequence are written in every layer of
        this shard in this incarnation (a model step checks its cached context
        once, before the forward). ``writing``: the step's own slots (int64,
        CPU), which count as written: :meth:`step_attention` writes every new
        token's K/V of a layer before that layer's attention reads any."""
        context = ContextBlocks.of(padded_tables(tables), torch.tensor(list(lengths), dtype=torch.int64),
                                   self.config.block_size)
        with self._lock:
            self.written.check(slice(None), context, seq_ids, lengths, writing)

    def prepare_step(self, version: int, seq_ids: Sequence[str], query_lens: Sequence[int],
                     context_lens: Sequence[int], slot_mapping: torch.Tensor,
                     pool_incarnation: str | None = None,
                     copies: tuple[torch.Tensor, torch.Tensor] | None = None) -> PreparedStep:
        """Validate and index a model step's batch once (a runner calls this
        after checking the slots against the tables and the cached context
        with :meth:`check_written`); :meth:`step_attention` then runs each
        layer. ``slot_mapping``: int64 ``[sum(query_lens)]`` on the CPU, every
        slot a real one (no padding); ``copies``: (new-token rows, their slots) also written."""
        q_lens, ctx, total = _batch_lengths(seq_ids, query_lens, context_lens)
        slots = self._check_slots(slot_mapping, total)
        if total and int(slots.min()) < 0:
            raise InvalidArgument("a model step's slots are all real slots (no padding)")
        with self._lock:
            incarnation = self._advance(version, pool_incarnation)
            worker_incarnation = self.incarnation
        b, heads = self.config.block_size, self.geometry.num_kv_heads
        source = None
        if copies is not None:  # their slots are written like the new tokens' own
            slots, source = torch.cat([slots, copies[1]]), copies[0].to(self.device)
        block, offset = split_slots(slots, b)
        rows = (block[:, None] * heads + torch.arange(heads, dtype=torch.int64)[None, :]) * b + offset[:, None]
        plan_key = (version, incarnation, tuple(seq_ids), tuple(q_lens.tolist()), tuple(ctx.tolist()))
        return PreparedStep(version, pool_incarnation, incarnation, list(seq_ids), q_lens, ctx, total, slots,
                            block, offset, torch.unique(block), rows.reshape(-1).to(self.device),
                            (rows.reshape(-1) + self._value_offset).to(self.device), plan_key, worker_incarnation,
                            source)

    def step_attention(self, step: PreparedStep, layer: int, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """:meth:`attention` of one layer of a prepared step: the new tokens'
        K/V (``[T, local_kv_heads, head_dim]``) into their slots, then paged
        attention of ``query`` ``[T, local_q_heads, head_dim]``. The cached
        context was checked written by the runner, and the new tokens are
        written here, so only the pool incarnation is re-checked per layer.
        The written-slot record learns of the new tokens in
        :meth:`finish_step`, once for every layer, after the last one (a step
        that fails half-way leaves them unrecorded: they get recomputed)."""
        local = self._local_layer(layer)
        geometry = self.geometry
        heads = query.shape[1] if isinstance(query, torch.Tensor) and query.dim() == 3 else -1
        if heads <= 0 or heads % geometry.num_kv_heads:
            raise InvalidArgument(f"query must be [tokens, q_heads, head_dim] with q_heads a multiple of the "
                                  f"worker's {geometry.num_kv_heads} KV heads")
        query = self._check_tensor(query, "query", (step.total, heads, geometry.head_dim))
        shape = (step.total, geometry.num_kv_heads, geometry.head_dim)
        key, value = self._check_tensor(key, "key", shape), self._check_tensor(value, "value", shape)
        with self._lock:
            if self._advance(step.version, step.pool_incarnation) != step.incarnation:
                raise WrongState("the pool incarnation changed during the step; plan it again")
            start = time.perf_counter()
            rows = self.kv[local].view(-1, geometry.head_dim)
            for index, computed in ((step.key_rows, key), (step.value_rows, value)):
                new = computed if step.copy_rows is None else \
                    torch.cat([computed, computed.index_select(0, step.copy_rows)])
                if self._copy_rows is not None:
                    self._copy_rows(rows, index, new.reshape(-1, geometry.head_dim).contiguous())
                else:
                    rows.index_copy_(0, index, new.reshape(-1, geometry.head_dim))
            self.metrics.observe_kernel("write_kv", time.perf_counter() - start)
            self._plan_from((*step.plan_key, heads, scale), step.seq_ids, step.query_lens, step.context_lens,
                            heads, scale)
            start = time.perf_counter()
            out = self._attention.run(query, self.kv[local])
            self.metrics.observe_kernel("attention", time.perf_counter() - start)
        self.tokens_processed += step.total
        self.metrics.add_tokens(step.total)
        return out

    def finish_step(self, step: PreparedStep) -> None:
        """Record the step's new tokens as written in every layer of this shard
        (call after :meth:`step_attention` ran for each of them)."""
        with self._lock:
            if self._kv_incarnation != step.incarnation or self.incarnation != step.worker_incarnation:
                return  # the record was cleared for another pool or worker incarnation: nothing of this step is kept
            start = time.perf_counter()
            self.written.mark_split(slice(None), step.blocks, step.offsets, step.touched)
            self.metrics.observe_kernel("write_kv", time.perf_counter() - start)

    def write_kv(self, version: int, layer: int, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: Sequence[int] | torch.Tensor, *, pool_incarnation: str | None = None) -> None:
        """Store ``key``/``value`` ``[num_tokens, local_kv_heads, head_dim]`` in their slots."""
        local = self._local_layer(layer)
        n = key.shape[0] if isinstance(key, torch.Tensor) and key.dim() else -1
        shape = (n, self.geometry.num_kv_heads, self.geometry.head_dim)
        key, value = self._check_tensor(key, "key", shape), self._check_tensor(value, "value", shape)
        slots = self._check_slots(slot_mapping, n)
        with self._lock:
            self._advance(version, pool_incarnation)
            start = time.perf_counter()
            write_kv(self.kv[local], key, value, slots.to(self.device))
            self.written.mark(local, slots)
            self.metrics.observe_kernel("write_kv", time.perf_counter() - start)

    def attention(self, version: int, layer: int, seq_ids: Sequence[str], query_lens: Sequence[int],
                  context_lens: Sequence[int], query: torch.Tensor, *, key: torch.Tensor | None = None,
                  value: torch.Tensor | None = None, slot_mapping: Sequence[int] | None = None,
                  scale: float | None = None, pool_incarnation: str | None = None) -> torch.Tensor:
        """Paged attention of ``query`` ``[sum(query_lens), local_q_heads, head_dim]``
        for sequences ``seq_ids`` at ``version``; each sequence's query tokens are
        the last ``query_lens[i]`` of its ``context_lens[i]`` tokens. With ``key``,
        ``value`` and ``slot_mapping`` the new tokens' K/V are written first.
        Returns ``[sum(query_lens), local_q_heads, head_dim]`` in the pool dtype;
        refuses (KVNotWritten) when a context slot is not written in this
        incarnation."""
        local = self._local_layer(layer)
        q_lens, ctx, total = _batch_lengths(seq_ids, query_lens, context_lens)
        heads = query.shape[1] if isinstance(query, torch.Tensor) and query.dim() == 3 else -1
        if heads <= 0 or heads % self.geometry.num_kv_heads:
            raise InvalidArgument(f"query must be [tokens, q_heads, head_dim] with q_heads a multiple of the "
                                  f"worker's {self.geometry.num_kv_heads} KV heads")
        query = self._check_tensor(query, "query", (total, heads, self.geometry.head_dim))
        with self._lock:
            incarnation = self._advance(version, pool_incarnation)
            if key is not None or value is not None or slot_mapping is not None:
                if key is None or value is None or slot_mapping is None:
                    raise InvalidArgument("key, value and slot_mapping go together")
                shape = (total, self.geometry.num_kv_heads, self.geometry.head_dim)
                key, value = self._check_tensor(key, "key", shape), self._check_tensor(value, "value", shape)
                slots = self._check_slots(slot_mapping, total)  # kept where the caller has it (the CPU)
                start = time.perf_counter()
                write_kv(self.kv[local], key, value, slots.to(self.device))
                self.written.mark(local, slots)
                self.metrics.observe_kernel("write_kv", time.perf_counter() - start)
            context = self._plan(version, incarnation, seq_ids, q_lens, ctx, heads, scale)
            self.written.check(local, context, seq_ids, ctx)
            start = time.perf_counter()
            out = self._attention.run(query, self.kv[local])
            self.metrics.observe_kernel("attention", time.perf_counter() - start)
        self.tokens_processed += total
        self.metrics.add_tokens(total)
        return out

    def _plan(self, version, incarnation, seq_ids, q_lens, ctx, heads, scale) -> ContextBlocks:
        """Plan once per batch: every layer of a forward pass reuses it. Returns
        the batch's context blocks (for the written-slot check)."""
        key = (version, incarnation, tuple(seq_ids), tuple(q_lens.tolist()), tuple(ctx.tolist()), heads, scale)
        return self._plan_from(key, seq_ids, q_lens, ctx, heads, scale)

    def _plan_from(self, key: tuple, seq_ids, q_lens, ctx, heads, scale) -> ContextBlocks:
        if key == self._plan_key and self._context is not None:
            return self._context
        version, incarnation = key[0], key[1]
        tables = self.mirror.tables_of(seq_ids, version, incarnation)
        b = self.config.block_size
        for seq_id, table, n in zip(seq_ids, tables, ctx.tolist()):
            if n > len(table) * b:
                raise InvalidArgument(f"sequence {shown(seq_id)} has {len(table)} blocks at version {version}, "
                                      f"too few for context length {n}")
        padded = padded_tables(tables)
        self._context = ContextBlocks.of(padded, ctx, b)
        starts = torch.zeros(len(tables) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=starts[1:])
        decode = bool((q_lens == 1).all())
        self._attention.plan(padded, ctx, None if decode else starts, num_q_heads=heads,
                             num_kv_heads=self.geometry.num_kv_heads, head_dim=self.geometry.head_dim,
                             block_size=b, kv_dtype=self.dtype, scale=scale)
        self._plan_key = key
        return self._context

    def stats(self) -> dict:
        return {
            "applied_version": self.mirror.applied_version,
            "received_version": self.mirror.received_version,
            "num_sequences": len(self.mirror.tables),
            "tokens_processed": self.tokens_processed,
            "copy_ops_applied": self.mirror.num_copy_ops,
            "snapshots_loaded": self.mirror.num_snapshots,
            "pool_bytes": self.pool_bytes,
            "host_pool_bytes": self.host_pool_bytes,
            "tier_ops_applied": self.mirror.num_tier_ops,
            "worker_incarnation": self.incarnation,
            "pool_incarnation": self.mirror.incarnation,
        }
