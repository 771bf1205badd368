"""One forward step of a model over a packed batch, on a worker's KV pool shard.

:class:`ModelRunner` owns the model (whole, or this rank's tensor-parallel
shard) and the step contract that ``ModelStep`` serves::

    seq i:  |<------------- context_lens[i] ------------->|
            |  cached (already in the pool)  | query_lens[i] new tokens |
            positions  0 ..                    ctx-q .. ctx-1

All sequences' new tokens are packed into one row (``input_ids`` ``[1, T]``,
``position_ids`` ``[1, T]``); the paged attention function writes each layer's
new K/V into ``slot_mapping`` and attends over the sequence's whole context.
The result is the logits of each sequence's last new token, ``[batch, vocab]``
(:meth:`ModelRunner.step`), or only the greedy sequences' tokens and the
others' logits (:meth:`ModelRunner.split_step`: the greedy rows by the
bfloat16 screen of :mod:`worker.model.greedy_head` where it is on, without
the float32 LM head).

Errors are the runtime's (:mod:`blockd.core.errors`): inconsistent lengths,
token ids past the vocabulary, slots that are not the sequence's slots at that
version -> InvalidArgument; unknown sequence -> NotFound; stale or
never-arriving version, another pool incarnation, or cached context whose KV
this worker has not written in its incarnation (KVNotWritten) -> WrongState.
All of them are raised before the model runs, and in a tensor-parallel group the ranks agree on them first, so one
rank never waits in a collective for a peer that refused the step.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from blockd.core import arith
from blockd.core.errors import BlockdError, InvalidArgument, shown
from worker.model.build import check_pool, model_geometry
from worker.model.compiled import DECODER_MODELS, CompiledDecode, compilable
from worker.model.fused import fuse_layers
from worker.model.greedy_head import MODES as GREEDY_HEADS
from worker.model.greedy_head import greedy_head as screen_for
from worker.model.linear import LINEAR_KERNELS, kernel_of, pack_linears, packing_available
from worker.model.paged import NO_POOL, PagedBatch
from worker.runtime import PreparedStep, WorkerRuntime
from worker.sampling import greedy_tokens

#: a batch larger than this is a caller's bug, not a workload
MAX_STEP_TOKENS = 1 << 20


@dataclass(frozen=True)
class StepInput:
    """A validated step request."""

    version: int
    seq_ids: list[str]
    query_lens: list[int]
    context_lens: list[int]
    token_ids: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    #: the pool incarnation of ``version`` (None: whichever the replica holds)
    pool_incarnation: str | None = None
    #: context tokens each sequence copies from another's new tokens, and from which (empty: none)
    copy_lens: list[int] = field(default_factory=list)
    copy_from: list[int] = field(default_factory=list)

    def digest(self) -> bytes:
        """Identifies the request, so TP ranks can check that they run the same step."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self.version, self.pool_incarnation, self.seq_ids, self.query_lens,
                       self.context_lens, self.copy_lens, self.copy_from)).encode())
        h.update(self.token_ids.numpy().tobytes())
        h.update(self.slot_mapping.numpy().tobytes())
        return h.digest()


def _check_copies(seq_ids: list[str], q_lens: list[int], ctx: list[int], copy_lens: Sequence[int],
                  copy_from: Sequence[int], block_size: int) -> tuple[list[int], list[int]]:
    """``ModelStepRequest.copy_lens``/``copy_from`` checked against the batch's
    lengths: each copy's positions are context of its sequence, in the block its
    first new token goes to (a block the step writes anyway, which blockd never
    shares or publishes while it is partly filled: a copy can never touch a cached
    block another sequence reads), and new tokens of the one it copies from.
    Returns them as lists (empty: no copies)."""
    lens, sources = _ints(copy_lens, "copy_lens"), _ints(copy_from, "copy_from")
    if not lens and not sources:
        return [], []
    if not len(lens) == len(sources) == len(seq_ids):
        raise InvalidArgument(f"copy_lens and copy_from are both empty or one entry per sequence ({len(seq_ids)}), "
                              f"got {len(lens)} and {len(sources)}")
    for j, (c, i) in enumerate(zip(lens, sources)):
        if c == 0:
            continue
        start = ctx[j] - q_lens[j] - c  # the first copied position
        if not 0 <= i < len(seq_ids) or i == j:
            raise InvalidArgument(f"sequence {shown(seq_ids[j])}: copy_from {i} is not another sequence of the "
                                  f"batch")
        if c < 0 or start < (ctx[j] - q_lens[j]) // block_size * block_size:
            raise InvalidArgument(f"sequence {shown(seq_ids[j])}: its {c} copied positions reach before the block "
                                  f"of its first new token (position {ctx[j] - q_lens[j]}, blocks of {block_size})")
        if start < ctx[i] - q_lens[i] or start + c > ctx[i]:
            raise InvalidArgument(f"sequence {shown(seq_ids[j])}: its {c} copied positions from {max(start, 0)} "
                                  f"are not new tokens of sequence {shown(seq_ids[i])} (positions "
                                  f"{ctx[i] - q_lens[i]} .. {ctx[i] - 1})")
    return lens, sources


def _copies(batch: StepInput, tables: list[list[int]], b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source rows, destination slots)`` of the step's copies (int64, CPU): a
    row indexes the step's new tokens; a slot is from the copying sequence's table."""
    firsts = [0]
    for q in batch.query_lens:
        firsts.append(firsts[-1] + q)
    rows: list[int] = []
    slots: list[int] = []
    for j, (c, i) in enumerate(zip(batch.copy_lens, batch.copy_from)):
        if c:
            start = batch.context_lens[j] - batch.query_lens[j] - c
            first = firsts[i] + start - (batch.context_lens[i] - batch.query_lens[i])
            rows.extend(range(first, first + c))
            slots.extend(arith.slot_mapping(tables[j], start, start + c, b))
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)


def _ints(values, name: str) -> list[int]:
    values = list(values)
    if not all(type(v) is int for v in values):
        raise InvalidArgument(f"{name} must be a list of integers")
    return values


class ModelRunner:
    """Runs ``model`` on ``runtime``'s pool shard; ``tp`` is the tensor-parallel
    group when the model is sharded (:class:`worker.model.tp.TensorParallel`).

    ``linear``: ``auto`` packs the model's linear weights for oneDNN where that
    applies (CPU, float32; :mod:`worker.model.linear`), changing ``model`` in
    place; ``torch`` keeps ``nn.Linear``. ``compile_buckets``: run decode steps
    through compiled graphs for these batch sizes where the model allows
    (:mod:`worker.model.compiled`; :attr:`not_compiled` says why not), their
    GEMM ``compile_kernel`` (``auto``: measured); call :meth:`warm` before
    serving: until then every step runs eager. ``greedy_head``: how
    :meth:`split_step` picks greedy tokens (:mod:`worker.model.greedy_head`):
    ``auto`` takes the bfloat16 screen where :meth:`warm_head` measures it
    faster (never under tensor parallelism, whose ranks must not choose apart)."""

    def __init__(self, model: PreTrainedModel, runtime: WorkerRuntime, tp=None, *, linear: str = "auto",
                 compile_buckets: tuple[int, ...] | None = None, compile_kernel: str = "auto",
                 greedy_head: str = "auto") -> None:
        if linear not in LINEAR_KERNELS:
            raise ValueError(f"linear must be one of {', '.join(LINEAR_KERNELS)}, got {linear!r}")
        if greedy_head not in GREEDY_HEADS:
            raise ValueError(f"greedy_head must be one of {', '.join(GREEDY_HEADS)}, got {greedy_head!r}")
        check_pool(model, runtime.config)
        geometry = model_geometry(model.config)
        shard = runtime.shard
        if (shard.layer_start, shard.layer_end) != (0, geometry.num_layers):
            raise ValueError("a model runner needs every layer of the pool on this worker")
        heads = (0, geometry.num_kv_heads) if tp is None else tp.kv_head_range(geometry.num_kv_heads)
        if (shard.kv_head_start, shard.kv_head_end) != heads:
            raise ValueError(f"this worker holds KV heads [{shard.kv_head_start}, {shard.kv_head_end}) "
                             f"but its model shard needs {list(heads)}")
        self.model = model.to(runtime.device)
        # last: the weights are final once sharded and on the device
        self.packed_linears = pack_linears(self.model, linear) \
            if linear != "torch" and packing_available(self.model) else 0
        #: which kernel the linears run (worker.model.linear.kernel_of), for the worker's log
        self.linear_kernel = kernel_of(self.model)
        # on the packed path, Llama/Qwen2 layers also run fused (worker.model.fused)
        self.fused_layers = fuse_layers(self.model) if self.packed_linears else 0
        self.runtime = runtime
        self.tp = tp
        # decode steps through a compiled graph per bucket where the model allows (worker.model.compiled)
        self.not_compiled = "not asked for" if compile_buckets is None else compilable(self.model, tp)
        self.compiled = CompiledDecode(self.model, compile_buckets, compile_kernel) \
            if self.not_compiled is None else None
        # the screen needs the final hidden states: the models whose forward ends norm -> LM head
        self.greedy_head = screen_for(self.model.lm_head) \
            if greedy_head != "float32" and type(self.model).__name__ in DECODER_MODELS else None
        self.greedy_head_mode = greedy_head
        #: whether greedy steps take the screen now (``auto``: once :meth:`warm_head` measured it)
        self.screening = greedy_head == "bf16-screen" and self.greedy_head is not None
        self.vocab_size = model.config.vocab_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        # One step at a time: the runtime keeps one plan, and TP ranks must issue
        # their collectives in the same order.
        self._lock = threading.Lock()

    def step(self, version: int, seq_ids: Sequence[str], query_lens: Sequence[int],
             context_lens: Sequence[int], token_ids: Sequence[int],
             slot_mapping: Sequence[int], *, pool_incarnation: str | None = None,
             copy_lens: Sequence[int] = (), copy_from: Sequence[int] = ()) -> torch.Tensor:
        """Logits ``[batch, vocab]`` (float32, CPU) of each sequence's last new token;
        ``copy_lens``/``copy_from``: K/V copied within the step (``ModelStepRequest``)."""
        batch = self.check(version, seq_ids, query_lens, context_lens, token_ids, slot_mapping, pool_incarnation,
                           copy_lens, copy_from)
        return self._step(batch, None)  # type: ignore[return-value]

    def split_step(self, version: int, seq_ids: Sequence[str], query_lens: Sequence[int],
                   context_lens: Sequence[int], token_ids: Sequence[int],
                   slot_mapping: Sequence[int], *, pool_incarnation: str | None = None,
                   copy_lens: Sequence[int] = (), copy_from: Sequence[int] = (),
                   greedy: Sequence[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` for a batch whose sequences ``greedy[i]`` (default: all) take the
        argmax: ``(tokens, logits)``, the greedy rows' tokens (int64 ``[batch]``, -1 in
        the other rows) and the other rows' logits (float32 ``[others, vocab]``, in batch
        order), so that only those rows need the float32 LM head."""
        batch = self.check(version, seq_ids, query_lens, context_lens, token_ids, slot_mapping, pool_incarnation,
                           copy_lens, copy_from)
        rows = [True] * len(batch.seq_ids) if greedy is None else [bool(g) for g in greedy]
        if len(rows) != len(batch.seq_ids):
            raise InvalidArgument(f"greedy needs one entry per sequence ({len(batch.seq_ids)}), got {len(rows)}")
        return self._step(batch, rows)  # type: ignore[return-value]

    def _step(self, batch: StepInput, greedy: list[bool] | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            prepared = self._prepare(batch)
            error = prepared if isinstance(prepared, BlockdError) else None
            if self.tp is None:
                if error is not None:
                    raise error
                return self._forward(batch, prepared, greedy)  # type: ignore[arg-type]
            with self.tp.collective():
                self.tp.agree(error, batch.digest())
            with self.tp.collective(agreed=True):
                return self._forward(batch, prepared, greedy)  # type: ignore[arg-type]

    def check(self, version, seq_ids, query_lens, context_lens, token_ids, slot_mapping,
              pool_incarnation: str | None = None, copy_lens: Sequence[int] = (),
              copy_from: Sequence[int] = ()) -> StepInput:
        """Validate a request on its own (no pool state): the same on every rank."""
        if type(version) is not int or version < 0:
            raise InvalidArgument(f"version must be a non-negative integer, got {shown(version)}")
        seq_ids = list(seq_ids)
        if not seq_ids or not all(isinstance(s, str) and s for s in seq_ids):
            raise InvalidArgument("seq_ids must be a non-empty list of sequence ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgument("a sequence may appear only once in a step")
        q_lens, ctx = _ints(query_lens, "query_lens"), _ints(context_lens, "context_lens")
        if not len(seq_ids) == len(q_lens) == len(ctx):
            raise InvalidArgument("seq_ids, query_lens and context_lens need one entry per sequence, "
                                  f"got {len(seq_ids)}, {len(q_lens)}, {len(ctx)}")
        for seq_id, q, n in zip(seq_ids, q_lens, ctx):
            if not 1 <= q <= n:
                raise InvalidArgument(f"sequence {shown(seq_id)}: need 1 <= query_len <= context_len, "
                                      f"got {q}, {n}")
            if self.max_positions is not None and n > self.max_positions:
                raise InvalidArgument(f"sequence {shown(seq_id)}: context length {n} is past the model's "
                                      f"{self.max_positions} positions")
        total = sum(q_lens)
        tokens, slots = _ints(token_ids, "token_ids"), _ints(slot_mapping, "slot_mapping")
        if total > MAX_STEP_TOKENS or not len(tokens) == len(slots) == total:
            raise InvalidArgument(f"token_ids and slot_mapping need sum(query_lens) = {total} entries "
                                  f"(at most {MAX_STEP_TOKENS}), got {len(tokens)} and {len(slots)}")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is not in the model's vocabulary of {self.vocab_size}")
        copy_lens, copy_from = _check_copies(seq_ids, q_lens, ctx, copy_lens, copy_from,
                                             self.runtime.config.block_size)
        return StepInput(version, seq_ids, q_lens, ctx, torch.tensor(tokens, dtype=torch.int64),
                         torch.tensor(slots, dtype=torch.int64), pool_incarnation, copy_lens, copy_from)

    def _prepare(self, batch: StepInput) -> PreparedStep | BlockdError:
        """Bring the replica to ``batch.version``, check the slots against its
        tables and that the cached context of every sequence is written in this
        incarnation, and index the batch once for every layer; return (not
        raise) the error so TP ranks can agree on it."""
        try:
            incarnation = self.runtime.advance(batch.version, batch.pool_incarnation)
            tables = self.runtime.mirror.tables_of(batch.seq_ids, batch.version, incarnation)
            self._check_slots(batch, tables)
            copies = _copies(batch, tables, self.runtime.config.block_size) if batch.copy_lens else None
            writing = batch.slot_mapping if copies is None else torch.cat([batch.slot_mapping, copies[1]])
            self.runtime.check_written(batch.seq_ids, tables,
                                       [n - q for q, n in zip(batch.query_lens, batch.context_lens)], writing)
            return self.runtime.prepare_step(batch.version, batch.seq_ids, batch.query_lens, batch.context_lens,
                                             batch.slot_mapping, batch.pool_incarnation, copies)
        except BlockdError as err:
            return err

    def _check_slots(self, batch: StepInput, tables: list[list[int]]) -> None:
        """Each new token's slot must be the one its table gives at this version:
        a wrong slot would silently overwrite another sequence's cache."""
        b, row = self.runtime.config.block_size, 0
        given = batch.slot_mapping.tolist()
        for seq_id, table, q, n in zip(batch.seq_ids, tables, batch.query_lens, batch.context_lens):
            try:
                want = arith.slot_mapping(table, n - q, n, b)
            except (IndexError, ValueError):
                raise InvalidArgument(f"sequence {shown(seq_id)} has {len(table)} blocks at version "
                                      f"{batch.version}, too few for context length {n}") from None
            if given[row : row + q] != want:
                raise InvalidArgument(f"slot_mapping of sequence {shown(seq_id)} is not its slots at version "
                                      f"{batch.version} (expected {want[:8]}...)")
            row += q

    def _forward(self, batch: StepInput, prepared: PreparedStep,
                 greedy: list[bool] | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (``greedy`` None), or :meth:`split_step`'s tokens and logits (the greedy
        rows' final hidden states through the screen where it is on)."""
        positions = torch.cat([torch.arange(n - q, n) for q, n in zip(batch.query_lens, batch.context_lens)])
        last = torch.tensor(batch.query_lens).cumsum(0) - 1
        paged = PagedBatch(self.runtime, batch.version, batch.seq_ids, batch.query_lens, batch.context_lens,
                           batch.slot_mapping, batch.pool_incarnation, prepared)
        screen = greedy is not None and any(greedy) and self.screening
        if self.compiled is not None and self.compiled.applies(batch.query_lens):
            out = self.compiled.forward(paged, batch.token_ids, positions, hidden=screen)
        else:
            out = self._eager(paged, batch.token_ids, positions, last, hidden=screen)
        self.runtime.finish_step(prepared)
        if greedy is None:
            return out.float().cpu()
        if all(greedy):  # the usual case: no row to pick apart, no copy of the rows
            if screen:
                return self._screened(out), out.new_empty((0, self.model.lm_head.out_features))
            logits = out.float().cpu()
            return greedy_tokens(logits), logits[:0]
        chosen = torch.tensor([i for i, g in enumerate(greedy) if g], dtype=torch.int64)
        others = torch.tensor([i for i, g in enumerate(greedy) if not g], dtype=torch.int64)
        tokens = torch.full((len(greedy),), -1, dtype=torch.int64)
        if screen:
            tokens[chosen] = self._screened(out[chosen])
            with torch.inference_mode():  # only the sampled rows through the float32 head
                return tokens, self.model.lm_head(out[others]).float()
        logits = out.float().cpu()
        if len(chosen):
            tokens[chosen] = greedy_tokens(logits[chosen])
        return tokens, logits[others]

    def _screened(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of the final hidden states by the screen (the float32 head where it cannot)."""
        assert self.greedy_head is not None
        with torch.inference_mode():
            tokens = self.greedy_head.tokens(hidden)
            return tokens if tokens is not None else greedy_tokens(self.model.lm_head(hidden).float())

    def _eager(self, paged: PagedBatch | object, token_ids: torch.Tensor, positions: torch.Tensor,
               last: torch.Tensor, *, hidden: bool = False) -> torch.Tensor:
        """The model's eager forward: logits of the tokens at ``last`` (``hidden``: their
        final hidden states, before the LM head; Llama and Qwen2 only)."""
        device = self.runtime.device
        with torch.inference_mode():
            kwargs = {"input_ids": token_ids.to(device).unsqueeze(0),
                      "position_ids": positions.to(device).unsqueeze(0), "use_cache": False, "blockd_batch": paged}
            if hidden:
                return self.model.model(**kwargs).last_hidden_state[0, last.to(device)]
            out = self.model(**kwargs, logits_to_keep=last.to(device))
        return out.logits[0]

    def warm_head(self) -> str:
        """Choose the greedy head (``auto``: time the screen against the float32 head at
        64 rows) before serving; a line for the worker's log."""
        if self.greedy_head is None:
            return "float32 LM head (the bfloat16 screen does not apply to this model or CPU)" \
                if self.greedy_head_mode != "float32" else "float32 LM head (--greedy-head float32)"
        if self.greedy_head_mode == "auto" and self.tp is not None:
            return "float32 LM head (tensor parallelism: auto does not let ranks choose apart)"
        if self.greedy_head_mode == "auto":
            self.screening, screen, full = self.greedy_head.faster()
            return (f"{'bfloat16 screen' if self.screening else 'float32 LM head'} for greedy steps "
                    f"(screen {screen:.1f} ms, float32 {full:.1f} ms at 64 rows)")
        return "bfloat16 screen for greedy steps (--greedy-head bf16-screen)"

    def warm(self) -> float | None:
        """Compile, time and choose the decode buckets' code (:meth:`CompiledDecode.warm`)
        before serving; the seconds it took (None: nothing compiles)."""
        if self.compiled is None:
            return None
        with self._lock:
            return self.compiled.warm(lambda tokens, positions: self._eager(NO_POOL, tokens, positions, positions))
