"""The columnar decode step: one new token for each of many sequences.

This is the hot path of every scheduler step, so it is one tight loop over
plain lists. The common case (the token lands in the sequence's own, partly
filled last block) touches one dict and a few lists; crossing a
block boundary takes a block; a shared partly filled last block is copied on
write by the same :meth:`~blockd.core.batch.Batch.copy_on_write` that
:class:`~blockd.core.types.Append` uses. A sequence listed twice is refused
(INVALID_ARGUMENT): one decode token per sequence and step, and a
``set`` of the ids costs about 2% of the step.

The step journals one columnar entry for all its sequences (a
:class:`~blockd.core.batch.DecodeMarks`: the sequences and their committed
counts in two lists, the rest follows from the step itself), because an undo
object per sequence costs about as much as the rest of the loop, and a tuple
per sequence cost 7% of a compiled step (parsed to answered, in one process); and it
grows block fills in one :meth:`~blockd.core.blocks.BlockSpace.add_fill_each`
call after the loop, because an ``add_fill`` call per sequence costs about 8%
of the step (``bench/core.py --against``). Fills grow only once the whole step
succeeded; a failed step's marks restore them anyway. A slot is
:func:`~blockd.core.arith.slot_at`'s ``block * block_size + offset`` written
inline: the call per sequence cost about 5% of the step. Imports only the
standard library.
"""

from __future__ import annotations

from blockd.core.batch import Batch
from blockd.core.errors import InvalidArgument, NotFound, shown
from blockd.core.hashing import check_token_ids
from blockd.core.sequence import Sequence
from blockd.core.types import DecodeAppend, OpResult, TableUpdate

MAX_DECODE_BATCH = 1 << 20


def _check(op: DecodeAppend) -> None:
    if not isinstance(op.seq_ids, (list, tuple)) or not isinstance(op.token_ids, (list, tuple)):
        raise InvalidArgument("decode_append takes a list of seq_ids and a list of token_ids")
    if len(op.seq_ids) != len(op.token_ids):
        raise InvalidArgument(
            f"decode_append has {len(op.seq_ids)} seq_ids but {len(op.token_ids)} token_ids; "
            "give exactly one token per sequence")
    if len(op.seq_ids) > MAX_DECODE_BATCH:
        raise InvalidArgument(f"decode_append holds at most {MAX_DECODE_BATCH} sequences")
    check_token_ids(op.token_ids)
    try:
        distinct = len(set(op.seq_ids))
    except TypeError:  # an unhashable id: the loop names it
        return
    if distinct != len(op.seq_ids):
        seen: set[object] = set()
        for index, seq_id in enumerate(op.seq_ids):
            if seq_id in seen:
                raise InvalidArgument(f"decode_append names sequence {shown(seq_id)} twice (again at seq_ids"
                                      f"[{index}]); give each sequence at most one token per step")
            seen.add(seq_id)


def apply_decode(batch: Batch, op: DecodeAppend) -> OpResult:
    _check(op)
    batch.settle_decoded()  # an earlier DecodeAppend of the same batch
    before = batch.written_before  # sequences this batch handed tokens to already
    b, blocks, seqs = batch.block_size, batch.blocks, batch.seqs
    ref, take = blocks.ref, blocks.take
    marked: list[Sequence] = []  # every sequence the step reached, in order
    committed_before: list[int] = []  # and its num_committed before the step
    cows: list[tuple[Sequence, int]] = []  # (sequence, its shared last block) for each copy on write
    slots: list[int] = []
    slot = slots.append
    added: list[int] = []
    copies: list[tuple[int, int]] = []
    grown: list[int] = []  # blocks that gain the token in a slot they already had
    grow = grown.append
    update = batch.updates.append  # Batch.record_update, inline: every sequence crossing a block calls it
    try:
        for seq_id, token in zip(op.seq_ids, op.token_ids):
            seq = seqs.get(seq_id) if type(seq_id) is str else None
            if seq is None:
                batch.get_seq(seq_id)  # raises NotFound, or WrongState for a freed id
                raise NotFound(f"sequence #{len(slots)} {shown(seq_id)} is not in pool {shown(batch.config.name)}",
                               seq_id=seq_id)
            tokens, table = seq.token_ids, seq.table
            num_tokens, committed = len(tokens), seq.num_committed
            marked.append(seq)
            committed_before.append(committed)
            if committed < num_tokens:  # appending implies the earlier KV is written
                if before and seq.seq_id in before:  # but not the tokens this batch handed out itself
                    batch.commit_tokens(seq, before[seq.seq_id])
                elif num_tokens // b > len(seq.hashes):
                    batch.commit_tokens(seq, num_tokens)
                else:
                    seq.num_committed = num_tokens
            offset = num_tokens % b
            if offset:
                last = table[-1]
                if ref[last] > 1:  # shared and partly filled
                    if not blocks.num_available:
                        raise batch.no_room(f"copy-on-write for {shown(seq_id)} needs a block", watermark=False)
                    cows.append((seq, last))
                    copy = batch.copy_on_write(seq, offset)
                    copies.append(copy)
                    last = copy[1]
                    update(TableUpdate(seq_id, len(table) - 1, (last,)))
                grow(last)
            else:
                if not blocks.num_available:
                    raise batch.no_room(f"sequence {shown(seq_id)} needs a new block", watermark=False)
                last = take(1)
                table.append(last)
                added.append(last)
                update(TableUpdate(seq_id, len(table) - 1, (last,)))  # positional: keywords cost 0.4 us more
            tokens.append(token)
            slot(last * b + offset)  # arith.slot_at, inlined: a call per sequence was 5% of the step
    finally:
        batch.add_decode_marks(marked, committed_before, len(slots), cows)
    blocks.add_fill_each(grown)
    batch.num_tokens += len(slots)
    batch.decoded = marked
    return OpResult(seq_id="", num_tokens=len(slots), new_block_ids=tuple(added), copy_ops=tuple(copies),
                    slot_mapping=tuple(slots))
