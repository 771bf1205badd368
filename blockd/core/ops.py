"""The five operations of a step, applied to a :class:`~blockd.core.pool.Pool`.

Each ``_apply_*`` first checks everything that can fail (names, sizes,
capacity), then mutates through journaled primitives, so a failure part-way
through a batch is undone by the pool's rollback. Capacity is checked against
free + evictable blocks; only admissions (:class:`Allocate`) must also leave
the watermark untouched.

Copy-on-write happens in :func:`_apply_append` when the last block is shared
and partly filled::

    before   A: [3, 8]  B: [3, 8]   block 8 holds 2 of 4 slots, ref 2
    A += x   A: [3, 9]  B: [3, 8]   copy op (8 -> 9), then x goes to slot 9*4+2

Imports only the standard library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blockd.core.arith import num_blocks_for, slot_mapping
from blockd.core.decode import apply_decode
from blockd.core.errors import AlreadyExists, InvalidArgument, NoRoom, shown
from blockd.core.hashing import NO_EXTRA_DIGEST, NO_EXTRA_KEYS, ExtraKeys, check_token_ids, hash_block
from blockd.core.sequence import Sequence
from blockd.core.types import Allocate, Append, Commit, DecodeAppend, Fork, Free, OpResult, TableUpdate
from blockd.core.validate import check_extra_keys, check_int, check_name

if TYPE_CHECKING:
    from blockd.core.pool import Pool

MAX_TOKENS_PER_SEQ = 1 << 24


def describe(op: object) -> str:
    """Short human name of an operation for error messages."""
    if isinstance(op, DecodeAppend):
        return "decode_append"
    if isinstance(op, Fork):
        return f"fork {shown(op.parent_seq_id)} -> {shown(op.child_seq_id)}"
    seq_id = getattr(op, "seq_id", None)
    return f"{type(op).__name__.lower()} {shown(seq_id)}" if seq_id is not None else type(op).__name__


def apply(pool: Pool, op: object) -> OpResult:
    handler = _HANDLERS.get(type(op))
    if handler is None:
        raise InvalidArgument(f"unknown operation type {type(op).__name__}")
    return handler(pool, op)


def _digest(extra: ExtraKeys) -> bytes:
    return NO_EXTRA_DIGEST if extra is NO_EXTRA_KEYS or extra == NO_EXTRA_KEYS else extra.digest()


def _check_tokens(token_ids: object, what: str) -> None:
    if not isinstance(token_ids, (list, tuple)):
        raise InvalidArgument(f"{what} must be a list of token ids")
    if len(token_ids) > MAX_TOKENS_PER_SEQ:
        raise InvalidArgument(f"{what} holds {len(token_ids)} tokens; at most {MAX_TOKENS_PER_SEQ}")
    check_token_ids(token_ids)


def cached_prefix(pool: Pool, token_ids, extra: ExtraKeys | None, max_blocks: int):
    """Longest run of indexed full blocks of ``token_ids``: (blocks, hashes)."""
    _check_tokens(token_ids, "token_ids")
    extra = check_extra_keys(extra if extra is not None else NO_EXTRA_KEYS)
    b, index, digest = pool.block_size, pool.blocks.index, _digest(extra)
    blocks: list[int] = []
    hashes: list[bytes] = []
    parent = None
    for i in range(min(max_blocks, len(token_ids) // b)):
        parent = hash_block(parent, token_ids[i * b : (i + 1) * b], digest)
        block = index.get(parent)
        if block is None:
            break
        blocks.append(block)
        hashes.append(parent)
    return blocks, hashes


def allocation_need(pool: Pool, token_ids, extra: ExtraKeys | None):
    """``(hit blocks, hashes)`` if an allocation of this prompt is admitted now,
    else None. At least the last prompt token is always left to compute."""
    num_tokens = len(token_ids) if isinstance(token_ids, (list, tuple)) else 0
    max_hit = (num_tokens - 1) // pool.block_size if num_tokens else 0
    hits, hashes = cached_prefix(pool, token_ids, extra, max_hit)
    ref = pool.blocks.ref
    revived = sum(1 for block in hits if ref[block] == 0)
    need = num_blocks_for(num_tokens, pool.block_size) - len(hits) + revived
    if pool.blocks.num_available - need < pool.config.watermark_blocks:
        return None
    return hits, hashes


def append_need(pool: Pool, seq: Sequence, num_new: int) -> int:
    """New blocks an append of ``num_new`` tokens takes, copy-on-write included."""
    b, num_tokens = pool.block_size, len(seq.token_ids)
    need = num_blocks_for(num_tokens + num_new, b) - len(seq.table)
    if num_new and num_tokens % b and pool.blocks.ref[seq.table[-1]] > 1:
        need += 1
    return need


def _apply_allocate(pool: Pool, op: Allocate) -> OpResult:
    seq_id = check_name(op.seq_id, "seq_id")
    if seq_id in pool.seqs:
        raise AlreadyExists(f"sequence {shown(seq_id)} already exists in pool {shown(pool.config.name)}")
    tokens = op.prompt_token_ids
    _check_tokens(tokens, "prompt_token_ids")
    need = allocation_need(pool, tokens, op.extra_keys)
    if need is None:
        raise NoRoom(pool.no_room_message(f"admitting {len(tokens)} prompt tokens", watermark=True))
    hits, hashes = need
    b, blocks = pool.block_size, pool.blocks
    seq = Sequence(seq_id, op.extra_keys, _digest(op.extra_keys))
    for block in hits:
        blocks.acquire(block)
    seq.table = list(hits)
    for logical in range(len(hits), num_blocks_for(len(tokens), b)):
        seq.table.append(blocks.take(min(b, len(tokens) - logical * b)))
    seq.token_ids = list(tokens)
    seq.hashes = hashes
    seq.num_committed = cached = len(hits) * b
    pool.seqs[seq_id] = seq
    blocks.log(("seq_add", seq_id))
    pool.unbury(seq_id)
    pool.num_tokens += len(tokens)
    pool.prefix_queried_tokens += len(tokens)
    pool.prefix_hit_tokens += cached
    pool.record_update(TableUpdate(seq_id, 0, tuple(seq.table)))
    return OpResult(seq_id, len(tokens), cached, tuple(seq.table[len(hits):]), (), cached,
                    tuple(slot_mapping(seq.table, cached, len(tokens), b)))


def _apply_append(pool: Pool, op: Append) -> OpResult:
    seq = pool.get_seq(op.seq_id)
    new = op.token_ids
    _check_tokens(new, "token_ids")
    b, blocks, table = pool.block_size, pool.blocks, seq.table
    old_len = len(seq.token_ids)
    if old_len + len(new) > MAX_TOKENS_PER_SEQ:
        raise InvalidArgument(f"sequence would exceed {MAX_TOKENS_PER_SEQ} tokens")
    need = append_need(pool, seq, len(new))
    if need > blocks.num_available:
        raise NoRoom(pool.no_room_message(f"appending {len(new)} tokens needs {need} blocks", watermark=False))
    pool.journal_seq(seq)
    pool.commit_tokens(seq, old_len)  # an append implies the earlier tokens are written
    keep, copies, offset = len(table), (), old_len % b
    if new and offset:
        last = table[-1]
        if blocks.ref[last] > 1:  # shared, partly filled: copy on write
            dst = blocks.take(offset)
            blocks.release(last)
            table[-1] = dst
            pool.record_copy(last, dst)
            copies, keep = ((last, dst),), keep - 1
            last = dst
        blocks.add_fill(last, min(len(new), b - offset))
    total, grown_from = old_len + len(new), len(table)
    for logical in range(len(table), num_blocks_for(total, b)):
        table.append(blocks.take(min(b, total - logical * b)))
    seq.token_ids.extend(new)
    pool.num_tokens += len(new)
    if keep != len(table):
        pool.record_update(TableUpdate(seq.seq_id, keep, tuple(table[keep:])))
    return OpResult(seq.seq_id, total, 0, tuple(table[grown_from:]), copies, old_len,
                    tuple(slot_mapping(table, old_len, total, b)))


def _apply_commit(pool: Pool, op: Commit) -> OpResult:
    seq = pool.get_seq(op.seq_id)
    num_tokens = len(seq.token_ids)
    check_int(op.num_tokens, f"num_tokens (sequence {shown(seq.seq_id)} holds {num_tokens})", 0, num_tokens)
    if op.num_tokens > seq.num_committed:
        pool.journal_seq(seq)
        pool.commit_tokens(seq, op.num_tokens)
    return OpResult(seq.seq_id, num_tokens)


def _apply_fork(pool: Pool, op: Fork) -> OpResult:
    parent = pool.get_seq(op.parent_seq_id)
    child_id = check_name(op.child_seq_id, "child_seq_id")
    if child_id in pool.seqs:
        raise AlreadyExists(f"sequence {shown(child_id)} already exists in pool {shown(pool.config.name)}")
    child = Sequence(child_id, parent.extra, parent.extra_digest)
    child.table = list(parent.table)
    child.token_ids = list(parent.token_ids)
    child.num_committed = parent.num_committed
    child.hashes = list(parent.hashes)
    for block in child.table:
        pool.blocks.acquire(block)
    pool.seqs[child_id] = child
    pool.blocks.log(("seq_add", child_id))
    pool.unbury(child_id)
    pool.num_tokens += len(child.token_ids)
    pool.record_update(TableUpdate(child_id, 0, tuple(child.table)))
    return OpResult(child_id, len(child.token_ids))


def _apply_free(pool: Pool, op: Free) -> OpResult:
    seq = pool.get_seq(op.seq_id)
    # tail first, so the LRU evicts a freed sequence's tail before its head
    for block in reversed(seq.table):
        pool.blocks.release(block)
    del pool.seqs[seq.seq_id]
    pool.blocks.log(("seq_del", seq.seq_id, seq))
    pool.bury(seq.seq_id)
    pool.num_tokens -= len(seq.token_ids)
    pool.record_update(TableUpdate(seq.seq_id, freed=True))
    return OpResult(seq.seq_id, 0)


_HANDLERS = {
    Allocate: _apply_allocate,
    Append: _apply_append,
    DecodeAppend: apply_decode,
    Commit: _apply_commit,
    Fork: _apply_fork,
    Free: _apply_free,
}
