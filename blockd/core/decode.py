"""The columnar decode step: one new token for each of many sequences.

This is the hot path of every scheduler step, so it is one tight loop over
plain lists. The common case (the token lands in the sequence's own, partly
filled last block) touches one dict, two lists and one counter; crossing a
block boundary takes a block; a shared partly filled last block is copied on
write exactly as :class:`~blockd.core.types.Append` does. A sequence listed
twice gets two tokens, in list order.
Imports only the standard library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blockd.core.errors import InvalidArgument, NoRoom, NotFound, shown
from blockd.core.hashing import check_token_ids
from blockd.core.types import DecodeAppend, OpResult, TableUpdate

if TYPE_CHECKING:
    from blockd.core.pool import Pool

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


def apply_decode(pool: Pool, op: DecodeAppend) -> OpResult:
    _check(op)
    b = pool.block_size
    blocks = pool.blocks
    seqs, ref, fill = pool.seqs, blocks.ref, blocks.fill
    log = blocks.journal().append
    slots: list[int] = []
    added: list[int] = []
    copies: list[tuple[int, int]] = []
    for i, seq_id in enumerate(op.seq_ids):
        seq = seqs.get(seq_id) if type(seq_id) is str else None
        if seq is None:
            pool.get_seq(seq_id)  # raises NotFound, or WrongState for a freed id
            raise NotFound(f"sequence #{i} {shown(seq_id)} is not in pool {shown(pool.config.name)}")
        token = op.token_ids[i]
        tokens, table = seq.token_ids, seq.table
        num_tokens = len(tokens)
        log(("seq", seq, len(table), table[-1] if table else -1, num_tokens,
             seq.num_committed, len(seq.hashes)))
        if seq.num_committed < num_tokens:  # appending implies the earlier KV is written
            if num_tokens // b > len(seq.hashes):
                pool.commit_tokens(seq, num_tokens)
            else:
                seq.num_committed = num_tokens
        offset = num_tokens % b
        if offset:
            last = table[-1]
            if ref[last] > 1:  # shared and partly filled: copy on write
                if not blocks.num_available:
                    raise NoRoom(pool.no_room_message(f"copy-on-write for {shown(seq_id)} needs a block",
                                                      watermark=False))
                dst = blocks.take(offset)
                blocks.release(last)
                table[-1] = dst
                pool.record_copy(last, dst)
                copies.append((last, dst))
                pool.record_update(TableUpdate(seq_id, len(table) - 1, (dst,)))
                last = dst
            fill[last] += 1
            blocks.filled_slots += 1
        else:
            if not blocks.num_available:
                raise NoRoom(pool.no_room_message(f"sequence {shown(seq_id)} needs a new block",
                                                  watermark=False))
            last = blocks.take(1)
            table.append(last)
            added.append(last)
            pool.record_update(TableUpdate(seq_id, len(table) - 1, (last,)))
        tokens.append(token)
        slots.append(last * b + offset)
    pool.num_tokens += len(slots)
    return OpResult("", len(slots), 0, tuple(added), tuple(copies), 0, tuple(slots))
