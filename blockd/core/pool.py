"""One KV pool: sequences, block tables, the prefix cache and atomic batches.

:class:`Pool` is the allocator the daemon wraps. A scheduler step is one
:meth:`Pool.step` call with a list of operations (:mod:`blockd.core.types`);
the batch applies entirely or not at all: every change is journaled in
:class:`~blockd.core.blocks.BlockSpace` and rolled back on the first error,
which is re-raised naming the failing operation.

Token bookkeeping of one sequence with block size 4 (``T`` tokens, ``C``
committed, i.e. their KV is written)::

    tokens     a b c d | e f g h | i j
    committed  ^^^^^^^^^^^^^^^^^  (C = 8: blocks 0 and 1 full and committed,
                                   so both are hashed and enter the index)
    table      [ 5 ]     [ 1 ]     [ 7 ]   fill of block 7 = 2 of 4

A successful mutating batch bumps ``version`` and records a
:class:`~blockd.core.types.VersionDelta` (table changes, copy ops, frees); the
last ``max_retained_versions`` deltas are kept for followers. Changes to the
prefix index are queued as :class:`~blockd.core.types.KVEvent` for
:meth:`take_events`. Imports only the standard library.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice

from blockd.core import ops as _ops
from blockd.core.blocks import BlockSpace
from blockd.core.errors import BlockdError, InvalidArgument, InvariantViolation, NotFound, WrongState, shown
from blockd.core.hashing import ExtraKeys, hash_block
from blockd.core.sequence import Sequence
from blockd.core.types import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    KVEvent,
    Op,
    OpResult,
    PoolConfig,
    PoolStats,
    StepResult,
    TableUpdate,
    VersionDelta,
)
from blockd.core.validate import check_config, check_name

MAX_OPS_PER_STEP = 65536
#: freed sequence ids remembered, so a late append is told 'freed', not 'unknown'
MAX_TOMBSTONES = 65536


class SnapshotRequired(WrongState):
    """The follower's version is older than the oldest retained delta."""


class Pool:
    """Allocation state of one pool. Not thread-safe: one writer per pool."""

    def __init__(self, config: PoolConfig) -> None:
        check_config(config)
        self.config = config
        self.block_size = config.block_size
        self.blocks = BlockSpace(config.num_blocks, config.block_size)
        self.seqs: dict[str, Sequence] = {}
        #: recently freed sequence id -> the version that freed it
        self.freed: OrderedDict[str, int] = OrderedDict()
        self.version = 0
        self.num_tokens = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_copies = 0
        self.deltas: deque[VersionDelta] = deque(maxlen=config.max_retained_versions)
        self.last_event_seq_no = 0
        self._events: list[KVEvent] = []
        # per-batch scratch, valid while a step runs
        self._updates: list[TableUpdate] = []
        self._copy_ops: list[tuple[int, int]] = []
        self._stored: list[tuple[int, bytes, bytes, tuple[int, ...]]] = []

    # --- batches --------------------------------------------------------
    def step(self, ops: list[Op] | tuple[Op, ...], *, dry_run: bool = False) -> StepResult:
        """Apply a batch atomically; on error nothing changes and the raised
        :class:`~blockd.core.errors.BlockdError` names the failing operation.

        ``dry_run`` runs the batch and rolls it back whatever happens: the
        answer (results, or the error) is what the batch would do now, and the
        pool, its version and its events stay as they were."""
        if not isinstance(ops, (list, tuple)):
            raise InvalidArgument("a step takes a list of operations")
        if len(ops) > MAX_OPS_PER_STEP:
            raise InvalidArgument(f"a step holds at most {MAX_OPS_PER_STEP} operations, got {len(ops)}")
        if not ops:
            return StepResult(self.version, ())
        saved = (self.num_tokens, self.prefix_queried_tokens, self.prefix_hit_tokens, self.num_copies)
        self._updates, self._copy_ops, self._stored = [], [], []
        self.blocks.begin()
        results = []
        index = 0
        try:
            for index, op in enumerate(ops):
                results.append(_ops.apply(self, op))
        except BlockdError as err:
            self._rollback(saved)
            raise err.at_op(index, _ops.describe(ops[index])) from None
        except Exception as err:  # a bug: still leave the pool as it was
            self._rollback(saved)
            raise InvariantViolation(f"operation {index} failed unexpectedly: {err!r}") from err
        if dry_run:
            copy_ops = tuple(self._copy_ops)
            self._rollback(saved)
            return StepResult(self.version, tuple(results), copy_ops)
        self.blocks.commit()
        return self._finish(tuple(results))

    def _rollback(self, saved: tuple[int, int, int, int]) -> None:
        self.blocks.rollback(self._undo_seq)
        self.num_tokens, self.prefix_queried_tokens, self.prefix_hit_tokens, self.num_copies = saved

    def _undo_seq(self, entry: tuple) -> None:
        kind = entry[0]
        if kind == "seq":
            _, seq, table_len, last, num_tokens, committed, num_hashes = entry
            del seq.table[table_len:]
            if table_len:
                seq.table[-1] = last
                self.blocks.fill[last] = num_tokens - (table_len - 1) * self.block_size
            del seq.token_ids[num_tokens:]
            seq.num_committed = committed
            del seq.hashes[num_hashes:]
        elif kind == "seq_add":
            del self.seqs[entry[1]]
        elif kind == "seq_del":
            self.seqs[entry[1]] = entry[2]
        elif kind == "tomb_add":
            del self.freed[entry[1]]
            if entry[2] is not None:
                self.freed[entry[1]] = entry[2]
        elif kind == "tomb_del":
            self.freed[entry[1]] = entry[2]
        else:
            raise InvariantViolation(f"unknown undo entry {kind!r}")

    def _finish(self, results: tuple[OpResult, ...]) -> StepResult:
        self.version += 1
        while len(self.freed) > MAX_TOMBSTONES:
            self.freed.popitem(last=False)
        copy_ops = tuple(self._copy_ops)
        self.deltas.append(VersionDelta(self.version, tuple(self._updates), copy_ops))
        self._publish_events()
        return StepResult(self.version, results, copy_ops)

    def _publish_events(self) -> None:
        """Turn the batch's evictions and stores into numbered events, in order:
        evictions happen while taking blocks, before any store of the batch
        could reuse the hash."""
        for block, h in self.blocks.evicted:
            self._emit(BLOCK_REMOVED, block_hash=h, block_id=block)
        self.blocks.evicted.clear()
        for block, h, parent, tokens in self._stored:
            self._emit(BLOCK_STORED, block_hash=h, parent_hash=parent, block_id=block, token_ids=tokens)
        self._stored = []

    def _emit(self, kind: str, **fields) -> None:
        self.last_event_seq_no += 1
        self._events.append(KVEvent(self.last_event_seq_no, kind, **fields))

    # --- used by blockd.core.ops while a batch runs -----------------------
    def journal_seq(self, seq: Sequence) -> None:
        """Remember a sequence's lengths before an op changes it."""
        table = seq.table
        self.blocks.log(("seq", seq, len(table), table[-1] if table else -1,
                         len(seq.token_ids), seq.num_committed, len(seq.hashes)))

    def commit_tokens(self, seq: Sequence, num_tokens: int) -> None:
        """Mark the first ``num_tokens`` tokens written; index newly full blocks."""
        if num_tokens <= seq.num_committed:
            return
        b = self.block_size
        seq.num_committed = num_tokens
        hashes = seq.hashes
        for logical in range(len(hashes), num_tokens // b):
            parent = hashes[-1] if hashes else None
            tokens = seq.token_ids[logical * b : (logical + 1) * b]
            h = hash_block(parent, tokens, seq.extra_digest)
            hashes.append(h)
            block = seq.table[logical]
            if self.blocks.hash[block] is None and self.blocks.index_block(block, h):
                self._stored.append((block, h, parent or b"", tuple(tokens)))

    def get_seq(self, seq_id: str) -> Sequence:
        seq = self.seqs.get(seq_id) if type(seq_id) is str else None
        if seq is None:
            check_name(seq_id, "seq_id")  # an id no sequence can have is the caller's mistake
            freed_at = self.freed.get(seq_id)
            if freed_at is not None:
                raise WrongState(f"sequence {shown(seq_id)} was freed at version {freed_at} of pool "
                                 f"{shown(self.config.name)}; allocate it again to reuse the id")
            raise NotFound(f"pool {shown(self.config.name)} has no sequence {shown(seq_id)}")
        return seq

    def bury(self, seq_id: str) -> None:
        """Remember that ``seq_id`` was freed in the batch now running."""
        self.blocks.log(("tomb_add", seq_id, self.freed.pop(seq_id, None)))
        self.freed[seq_id] = self.version + 1

    def unbury(self, seq_id: str) -> None:
        """A freed id is taken again by a new sequence."""
        freed_at = self.freed.pop(seq_id, None)
        if freed_at is not None:
            self.blocks.log(("tomb_del", seq_id, freed_at))

    def no_room_message(self, what: str, *, watermark: bool) -> str:
        blocks, cfg = self.blocks, self.config
        msg = (f"pool {shown(cfg.name)} has {blocks.num_free} free and {len(blocks.lru)} evictable "
               f"of {cfg.num_blocks} blocks; {what}")
        if watermark and cfg.watermark_blocks:
            msg += f" while keeping {cfg.watermark_blocks} blocks in reserve for running sequences"
        return msg + "; free or preempt sequences, or retry later"

    def record_update(self, update: TableUpdate) -> None:
        self._updates.append(update)

    def record_copy(self, src: int, dst: int) -> None:
        self._copy_ops.append((src, dst))
        self.num_copies += 1

    # --- queries (never change state) -------------------------------------
    def can_allocate(self, prompt_token_ids, extra_keys: ExtraKeys | None = None) -> bool:
        """Whether :class:`Allocate` of this prompt would be admitted now."""
        return _ops.allocation_need(self, prompt_token_ids, extra_keys) is not None

    def can_append(self, seq_id: str, num_new_tokens: int) -> bool:
        """Whether appending ``num_new_tokens`` tokens to ``seq_id`` would fit."""
        if type(num_new_tokens) is not int or num_new_tokens < 0:
            raise InvalidArgument(f"num_new_tokens must be a non-negative int, got {shown(num_new_tokens)}")
        return _ops.append_need(self, self.get_seq(seq_id), num_new_tokens) <= self.blocks.num_available

    def lookup_prefix(self, token_ids, extra_keys: ExtraKeys | None = None) -> int:
        """Tokens of ``token_ids`` whose full blocks are cached (no allocation)."""
        return len(_ops.cached_prefix(self, token_ids, extra_keys, len(token_ids))[0]) * self.block_size

    def block_table(self, seq_id: str) -> list[int]:
        return list(self.get_seq(seq_id).table)

    def tables(self) -> dict[str, list[int]]:
        """Every sequence's table at the current version (a snapshot)."""
        return {seq_id: list(seq.table) for seq_id, seq in self.seqs.items()}

    def deltas_since(self, version: int) -> list[VersionDelta]:
        """Deltas ``version + 1 .. current``; :class:`SnapshotRequired` when the
        first of them is no longer retained."""
        if type(version) is not int or version < 0:
            raise InvalidArgument(f"version must be a non-negative int, got {shown(version)}")
        if version > self.version:
            raise WrongState(
                f"version {version} is ahead of pool {shown(self.config.name)} (at {self.version})")
        if version == self.version:
            return []
        oldest = self.deltas[0].version if self.deltas else self.version + 1
        if version + 1 < oldest:
            raise SnapshotRequired(
                f"version {version} is no longer retained (oldest delta is {oldest}); take a snapshot")
        return list(islice(self.deltas, version + 1 - oldest, None))

    def take_events(self) -> list[KVEvent]:
        """Drain the queued KV events (ordered by ``seq_no``)."""
        events, self._events = self._events, []
        return events

    def stats(self) -> PoolStats:
        blocks, cfg = self.blocks, self.config
        waste = blocks.num_used * cfg.block_size - blocks.filled_slots
        return PoolStats(
            name=cfg.name, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
            num_free_blocks=blocks.num_free, num_used_blocks=blocks.num_used,
            num_evictable_blocks=len(blocks.lru), num_seqs=len(self.seqs),
            num_tokens=self.num_tokens, tail_waste_slots=waste,
            tail_waste_bytes=waste * cfg.bytes_per_slot,
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens, num_evictions=blocks.num_evictions,
            num_copies=self.num_copies, version=self.version,
            last_event_seq_no=self.last_event_seq_no,
        )

    # --- operator actions ---------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Drop every cached hash (evictable blocks become free) and emit
        ``AllBlocksCleared``. Tables are unchanged, so the version is too.
        Running sequences keep their hash chains, so blocks they fill later
        are cached again; blocks already full stay uncached."""
        self.blocks.clear_index()
        self._emit(ALL_BLOCKS_CLEARED)
