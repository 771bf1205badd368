"""One batch in flight: its undo journal, its scratch and the counters it moves.

:meth:`blockd.core.pool.Pool.step` opens a :class:`Batch`, applies every
operation through it (:mod:`blockd.core.ops`, :mod:`blockd.core.decode`), then
either commits it or rolls it back. Operations change sequences only through
the batch's methods, and blocks only through
:class:`~blockd.core.blocks.BlockSpace` primitives, which journal into the
batch while it is open. So the journal holds one typed
:class:`~blockd.core.blocks.Undo` entry per mutation, and :meth:`Batch.rollback`
undoes them newest first::

    journal   [Counters | TookFresh 7 | SeqAdded 'a' | SeqMark b | DecodeMarks [c, d] | Indexed 3 ...]
    rollback  <------------------------------------------------------------------------ newest first

What only matters once the batch has succeeded is not journaled but kept
here and published by the pool on commit: table updates, copy ops, stored
hashes, tombstone changes and the changes to the pool's counters.

A sequence is journaled as a :class:`SeqMark` (its token and committed
counts and last block) before an operation changes it; undoing it cuts its
tokens, table and hashes back to those lengths (the lengths follow from the
token and committed counts, see :mod:`blockd.core.sequence`), restores its
last table entry (undoing a copy-on-write) and that block's fill. A decode
step journals its sequences in one columnar :class:`DecodeMarks` entry.

Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping

from blockd.core.arith import num_blocks_for
from blockd.core.blocks import BlockSpace, Journal, Undo
from blockd.core.errors import AlreadyExists, InvalidArgument, NoRoom, shown
from blockd.core.hashing import hash_block
from blockd.core.lru import MissLedger
from blockd.core.sequence import Sequence, find_seq
from blockd.core.types import PoolConfig, TableUpdate
from blockd.core.validate import check_name

#: a block that entered the prefix index: (evictions queued before it, block,
#: hash, parent hash or b"", tokens, its sequence, its logical index); the
#: first field orders the events, the last two find its tokens-only hash
Stored = tuple[int, int, bytes, bytes, tuple[int, ...], Sequence, int]


class Batch:
    """The pool's state as one batch of operations sees and changes it.

    Holds the pool's live structures (not copies): ``blocks`` and ``seqs``,
    which it changes (journaled), and ``freed``, which it only reads.
    Everything else here belongs to the batch and dies with it.
    """

    def __init__(self, config: PoolConfig, blocks: BlockSpace, seqs: dict[str, Sequence],
                 freed: Mapping[str, int], version: int, misses: MissLedger) -> None:
        self.config = config
        #: read only: the pool updates it when the batch commits
        self.misses = misses
        self.block_size = config.block_size
        self.blocks = blocks
        self.seqs = seqs
        self.freed = freed
        #: the version this batch becomes if it commits
        self.version = version + 1
        self.journal: Journal = []
        # scratch, published by the pool on commit
        self.updates: list[TableUpdate] = []
        self.copy_ops: list[tuple[int, int]] = []
        self.stored: list[Stored] = []
        #: tombstone changes in order: (seq_id, the version that freed it, or
        #: None when the id is live again). Applied on commit, so a rollback
        #: leaves the pool's tombstones untouched, order included.
        self.tombstones: list[tuple[str, int | None]] = []
        #: ids this batch allocated or forked, so a second Allocate of one is
        #: told apart from an id that existed before the batch
        self.added: set[str] = set()
        #: for each sequence this batch allocated, forked or extended: how many
        #: of its tokens were written before the batch. An Append or DecodeAppend
        #: implies that its sequence's earlier tokens are written, but never the
        #: ones this batch itself handed out: the step it plans computes those
        #: (committing them would publish blocks with no K/V in them)
        self.written_before: dict[str, int] = {}
        #: the sequences of the batch's last DecodeAppend, entered in
        #: ``written_before`` only when a later operation of the batch extends or
        #: forks a sequence (a decode step is usually the batch's last operation,
        #: and a dict entry per sequence would cost the hot path)
        self.decoded: list[Sequence] = []
        # changes to the pool's counters, added to them on commit
        self.num_tokens = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        #: missed prompt tokens by reason (:data:`~blockd.core.types.MISS_REASONS` order)
        self.prefix_miss_tokens = [0, 0, 0, 0, 0]
        self.num_copies = 0

    # --- lifecycle ----------------------------------------------------------
    def begin(self) -> None:
        self.blocks.begin(self.journal)

    def commit(self) -> None:
        """Keep every change; the journal is dropped."""
        self.blocks.end()
        self.journal = []

    def rollback(self) -> None:
        """Undo every change since :meth:`begin`, newest first."""
        journal, self.journal = self.journal, []
        try:
            for entry in reversed(journal):
                entry.undo()
        finally:
            self.blocks.end()

    # --- sequences ----------------------------------------------------------
    def get_seq(self, seq_id: object) -> Sequence:
        seq = self.seqs.get(seq_id) if type(seq_id) is str else None
        if seq is not None:
            return seq
        check_name(seq_id, "seq_id")  # an id no sequence can have is the caller's mistake
        return find_seq(self.seqs, seq_id, self.config.name, self.freed_at)

    def freed_at(self, seq_id: str) -> int | None:
        """The version that freed ``seq_id``, counting this batch's frees
        (a scan, but only for ids that are not live: an error path)."""
        for changed_id, version in reversed(self.tombstones):
            if changed_id == seq_id:
                return version
        return self.freed.get(seq_id)

    def mark(self, seq: Sequence) -> None:
        """Journal ``seq`` before an operation changes its tokens or table
        (a decode step journals its sequences as one :class:`DecodeMarks` instead)."""
        table = seq.table
        self.journal.append(SeqMark(self.blocks, seq, len(seq.token_ids), seq.num_committed,
                                    table[-1] if table else -1))

    def add_decode_marks(self, seqs: list[Sequence], committed: list[int], appended: int,
                         cows: list[tuple[Sequence, int]]) -> None:
        """Journal a decode step's sequences, once, after its changes:
        ``seqs`` in the order it reached them, each one's ``num_committed``
        before it, how many of them gained their token (all, or all but the
        last when the step stopped on it) and ``(sequence, shared last
        block)`` for each copy on write (:class:`DecodeMarks`)."""
        self.journal.append(DecodeMarks(self.blocks, seqs, committed, appended, cows))

    def add_seq(self, seq: Sequence) -> None:
        """A new sequence (allocated or forked); its id is no longer 'freed'."""
        self.seqs[seq.seq_id] = seq
        self.added.add(seq.seq_id)
        self.journal.append(_SeqAdded(self.seqs, seq.seq_id))
        self.tombstones.append((seq.seq_id, None))

    def refuse_existing(self, seq_id: str) -> None:
        """Raise for a new sequence whose id is live: InvalidArgument when this
        batch made it (the batch names it twice), AlreadyExists otherwise."""
        if seq_id in self.added:
            raise InvalidArgument(f"sequence {shown(seq_id)} is created twice in this batch (an earlier operation "
                                  "of the batch allocates or forks it); give each new sequence its own id")
        raise AlreadyExists(f"sequence {shown(seq_id)} already exists in pool {shown(self.config.name)}")

    def remove_seq(self, seq: Sequence) -> None:
        """Drop a sequence and remember that this batch's version freed it."""
        del self.seqs[seq.seq_id]
        self.journal.append(_SeqRemoved(self.seqs, seq))
        self.tombstones.append((seq.seq_id, self.version))

    def settle_decoded(self) -> None:
        """Enter the last DecodeAppend's sequences in ``written_before``: each
        held one token fewer before it (nothing else changed their tokens since)."""
        if self.decoded:
            decoded, self.decoded = self.decoded, []
            before = self.written_before
            for seq in decoded:
                before.setdefault(seq.seq_id, len(seq.token_ids) - 1)

    def written_limit(self, seq: Sequence) -> int:
        """How many of ``seq``'s tokens an Append or DecodeAppend of it may
        imply written: all it holds, less what this batch handed out."""
        self.settle_decoded()
        return self.written_before.get(seq.seq_id, len(seq.token_ids))

    def commit_tokens(self, seq: Sequence, num_tokens: int) -> None:
        """Mark the first ``num_tokens`` tokens written; index newly full blocks."""
        if num_tokens <= seq.num_committed:
            return
        b, blocks = self.block_size, self.blocks
        seq.num_committed = num_tokens
        hashes = seq.hashes
        for logical in range(len(hashes), num_tokens // b):
            parent = hashes[-1] if hashes else None
            tokens = seq.token_ids[logical * b : (logical + 1) * b]
            h = hash_block(parent, tokens, seq.extra_digest)
            hashes.append(h)
            block = seq.table[logical]
            if blocks.hash[block] is None and blocks.index_block(block, h):
                self.stored.append((len(blocks.evicted), block, h, parent or b"", tuple(tokens), seq, logical))

    def copy_on_write(self, seq: Sequence, offset: int) -> tuple[int, int]:
        """Give ``seq`` its own copy of its shared, partly filled last block,
        which holds ``offset`` tokens; returns the copy op ``(src, dst)``.
        The caller has checked that a block is available::

            before   A: [3, 8]  B: [3, 8]   block 8 holds 2 of 4 slots, ref 2
            after    A: [3, 9]  B: [3, 8]   copy op (8 -> 9); A writes to 9 from slot 9*4+2
        """
        src = seq.table[-1]
        dst = self.blocks.take(offset)
        self.blocks.release(src, seq.priority)
        seq.table[-1] = dst
        self.copy_ops.append((src, dst))
        self.num_copies += 1
        return src, dst

    def record_update(self, update: TableUpdate) -> None:
        self.updates.append(update)

    # --- errors -------------------------------------------------------------
    def no_room(self, what: str, *, watermark: bool) -> NoRoom:
        """The error for a request that does not fit, saying what is left."""
        return NoRoom(no_room_message(self.config, self.blocks, what, watermark=watermark))


def no_room_message(cfg: PoolConfig, blocks: BlockSpace, what: str, *, watermark: bool) -> str:
    msg = (f"pool {shown(cfg.name)} has {blocks.num_free} free and {len(blocks.lru)} evictable "
           f"of {cfg.num_blocks} blocks; {what}")
    if watermark and cfg.watermark_blocks:
        msg += f" while keeping {cfg.watermark_blocks} blocks in reserve for running sequences"
    return msg + "; free or preempt sequences, or retry later"


# --- undo entries for sequences ----------------------------------------------


class SeqMark(Undo):
    """A sequence as it was before an operation changed it: its token and
    committed counts and its last block (-1: none)."""

    __slots__ = ("committed", "last", "num_tokens", "seq", "space")

    def __init__(self, space: BlockSpace, seq: Sequence, num_tokens: int, committed: int, last: int) -> None:
        self.space, self.seq, self.num_tokens, self.committed, self.last = space, seq, num_tokens, committed, last

    def undo(self) -> None:
        b, seq, num_tokens = self.space.block_size, self.seq, self.num_tokens
        num_blocks = num_blocks_for(num_tokens, b)
        table = seq.table
        del table[num_blocks:]
        if num_blocks:
            table[-1] = self.last
            self.space.fill[self.last] = num_tokens - (num_blocks - 1) * b
        del seq.token_ids[num_tokens:]
        seq.num_committed = self.committed
        del seq.hashes[self.committed // b :]


class DecodeMarks(Undo):
    """A decode step's sequences as they were before it (columnar, see
    :meth:`Batch.add_decode_marks`). Each named sequence holds its one new
    token (but the last when ``appended`` says so), so its token count before
    the step follows, and from it its table length and last block's fill
    (:mod:`blockd.core.sequence`); a copy on write is the only change to an
    existing table entry, undone first. A decode op names each sequence once
    (:mod:`blockd.core.decode` refuses a repeat), so no sequence is listed twice.
    """

    __slots__ = ("appended", "committed", "cows", "seqs", "space")

    def __init__(self, space: BlockSpace, seqs: list[Sequence], committed: list[int], appended: int,
                 cows: list[tuple[Sequence, int]]) -> None:
        self.space, self.seqs, self.committed, self.appended, self.cows = space, seqs, committed, appended, cows

    def undo(self) -> None:
        fill, b = self.space.fill, self.space.block_size
        for seq, last in reversed(self.cows):
            seq.table[-1] = last
        seqs, committed, appended = self.seqs, self.committed, self.appended
        for i in range(len(seqs) - 1, -1, -1):
            seq = seqs[i]
            tokens = seq.token_ids
            num_tokens = len(tokens) - 1 if i < appended else len(tokens)
            num_blocks = num_blocks_for(num_tokens, b)
            table = seq.table
            del table[num_blocks:]
            if num_blocks:
                fill[table[-1]] = num_tokens - (num_blocks - 1) * b
            del tokens[num_tokens:]
            seq.num_committed = committed[i]
            del seq.hashes[committed[i] // b :]


class _SeqAdded(Undo):
    __slots__ = ("seq_id", "seqs")

    def __init__(self, seqs: dict[str, Sequence], seq_id: str) -> None:
        self.seqs, self.seq_id = seqs, seq_id

    def undo(self) -> None:
        del self.seqs[self.seq_id]


class _SeqRemoved(Undo):
    __slots__ = ("seq", "seqs")

    def __init__(self, seqs: dict[str, Sequence], seq: Sequence) -> None:
        self.seqs, self.seq = seqs, seq

    def undo(self) -> None:
        self.seqs[self.seq.seq_id] = self.seq
