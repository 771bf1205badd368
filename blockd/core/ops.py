"""The five per-sequence operations of a step, applied through a
:class:`~blockd.core.batch.Batch`, and the capacity queries behind ``can_*``.

Each ``_apply_*`` first checks everything that can fail (names, sizes,
capacity), then mutates through the batch and the block space's journaled
primitives, so a failure part-way through a batch is undone by its rollback.
Capacity is checked against free + evictable blocks; only admissions
(:class:`Allocate`) must also leave the watermark untouched. Copy-on-write
(:meth:`~blockd.core.batch.Batch.copy_on_write`) happens when an append
lands in a shared, partly filled last block. The columnar decode step lives in
:mod:`blockd.core.decode`; :func:`apply` dispatches to both.

Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockd.core.arith import num_blocks_for, slot_mapping
from blockd.core.batch import Batch
from blockd.core.blocks import DEVICE, HOST, BlockSpace
from blockd.core.decode import apply_decode
from blockd.core.errors import InvalidArgument, shown
from blockd.core.hashing import (
    NO_EXTRA_DIGEST,
    NO_EXTRA_KEYS,
    ExtraKeys,
    check_token_ids,
    hash_block,
    hash_full_blocks,
    tenant_digest,
)
from blockd.core.lru import MissLedger
from blockd.core.sequence import Sequence
from blockd.core.types import Allocate, Append, Commit, DecodeAppend, Fork, Free, OpResult, TableUpdate
from blockd.core.validate import check_extra_keys, check_int, check_name, check_priority

MAX_TOKENS_PER_SEQ = 1 << 24
#: a prefix hit in the host tier, in :func:`cached_prefix`'s blocks (its host
#: block is the host index's entry for the hash)
IN_HOST = -1


def describe(op: object) -> str:
    """Short human name of an operation for error messages."""
    if isinstance(op, DecodeAppend):
        return "decode_append"
    if isinstance(op, Fork):
        return f"fork {shown(op.parent_seq_id)} -> {shown(op.child_seq_id)}"
    seq_id = getattr(op, "seq_id", None)
    return f"{type(op).__name__.lower()} {shown(seq_id)}" if seq_id is not None else type(op).__name__


def apply(batch: Batch, op: object) -> OpResult:
    handler = _HANDLERS.get(type(op))
    if handler is None:
        raise InvalidArgument(f"unknown operation type {type(op).__name__}")
    return handler(batch, op)


def _digest(extra: ExtraKeys, tenant: str) -> bytes:
    """The digest a sequence's block hashes chain on: its extra keys and the pool's tenant."""
    digest = NO_EXTRA_DIGEST if extra is NO_EXTRA_KEYS or extra == NO_EXTRA_KEYS else extra.digest()
    return tenant_digest(digest, tenant)


def _check_tokens(token_ids: object, what: str) -> list[int] | tuple[int, ...]:
    if not isinstance(token_ids, (list, tuple)):
        raise InvalidArgument(f"{what} must be a list of token ids")
    if len(token_ids) > MAX_TOKENS_PER_SEQ:
        raise InvalidArgument(f"{what} holds {len(token_ids)} tokens; at most {MAX_TOKENS_PER_SEQ}")
    check_token_ids(token_ids)
    return token_ids


# --- queries (read only; used by the operations and by Pool.can_*) -----------


def cached_prefix(blocks: BlockSpace, token_ids: object, extra: ExtraKeys | None,
                  max_blocks: int, tenant: str = "") -> tuple[list[int], list[bytes]]:
    """Longest run of cached full blocks of ``token_ids``: (blocks, hashes).

    The chain runs on as long as each next block is cached in either tier, so
    it may go device, host, device...; a hit in the host tier is
    :data:`IN_HOST` in the blocks."""
    tokens = _check_tokens(token_ids, "token_ids")
    extra = check_extra_keys(extra if extra is not None else NO_EXTRA_KEYS)
    b, index, digest = blocks.block_size, blocks.index, _digest(extra, tenant)
    host_index = blocks.host.index if blocks.host is not None else None
    hits: list[int] = []
    hashes: list[bytes] = []
    parent = None
    for i in range(min(max_blocks, len(tokens) // b)):
        parent = hash_block(parent, tokens[i * b : (i + 1) * b], digest)
        block = index.get(parent)
        if block is None:
            if host_index is None or parent not in host_index:
                break
            block = IN_HOST
        hits.append(block)
        hashes.append(parent)
    return hits, hashes


def located(blocks: BlockSpace, token_ids: object, extra: ExtraKeys | None, first: int, count: int,
            tenant: str = "") -> list[tuple[str, int]]:
    """Where full blocks ``first .. first + count - 1`` of ``token_ids`` are
    cached, as ``(DEVICE or HOST, block)``, up to the first that is not (so a
    run another pool can copy in order). Read only: no LRU touch, no counts."""
    tokens = _check_tokens(token_ids, "token_ids")
    extra = check_extra_keys(extra if extra is not None else NO_EXTRA_KEYS)
    b, digest = blocks.block_size, _digest(extra, tenant)
    host_index = blocks.host.index if blocks.host is not None else {}
    out: list[tuple[str, int]] = []
    parent = None
    for i in range(min(first + count, len(tokens) // b)):
        parent = hash_block(parent, tokens[i * b : (i + 1) * b], digest)
        if i < first:
            continue
        if parent in blocks.index:
            out.append((DEVICE, blocks.index[parent]))
        elif parent in host_index:
            out.append((HOST, host_index[parent]))
        else:
            break
    return out


def allocation_need(blocks: BlockSpace, watermark: int, token_ids: object, extra: ExtraKeys | None,
                    tenant: str = "", share: Sequence | None = None,
                    share_tokens: int = 0) -> tuple[list[int], list[bytes], list[int]] | None:
    """``(hit blocks, hashes, blocks shared from share)`` if an allocation of
    this prompt is admitted now, else None. At least the last prompt token is
    always left to compute. A host-tier hit needs a device block like a miss."""
    num_tokens = len(token_ids) if isinstance(token_ids, (list, tuple)) else 0
    max_hit = (num_tokens - 1) // blocks.block_size if num_tokens else 0
    hits, hashes = cached_prefix(blocks, token_ids, extra, max_hit, tenant)
    shared: list[int] = []
    if share is not None:
        digest = _digest(check_extra_keys(extra if extra is not None else NO_EXTRA_KEYS), tenant)
        shared = shared_run(blocks.block_size, share, token_ids, digest, len(hits),
                            min(max_hit, share_tokens // blocks.block_size))
    ref = blocks.ref
    in_host = hits.count(IN_HOST) if blocks.host is not None else 0
    revived = sum(1 for block in hits if block >= 0 and ref[block] == 0) if in_host else (
        sum(1 for block in hits if ref[block] == 0))
    need = num_blocks_for(num_tokens, blocks.block_size) - len(hits) - len(shared) + in_host + revived
    if blocks.num_available - need < watermark:
        return None
    return hits, hashes, shared


def shared_run(b: int, other: Sequence, token_ids: object, digest: bytes, first: int, last: int) -> list[int]:
    """The blocks of ``other`` that stand in for full blocks ``first .. last - 1``
    of ``token_ids`` (``Allocate.share_seq_id``): a block's K/V depends on every
    token before it, so the run goes as far as both prompts agree from their
    first token, under the same extra keys and tenant, and ``other`` holds the block."""
    if other.extra_digest != digest or not isinstance(token_ids, (list, tuple)):
        return []
    theirs = other.token_ids
    last = min(last, len(theirs) // b, len(other.table))
    k = 0
    while k < last and list(token_ids[k * b : (k + 1) * b]) == theirs[k * b : (k + 1) * b]:
        k += 1
    return other.table[first:k] if k > first else []


def append_need(blocks: BlockSpace, seq: Sequence, num_new: int) -> int:
    """New blocks an append of ``num_new`` tokens takes, copy-on-write included."""
    b, num_tokens = blocks.block_size, len(seq.token_ids)
    need = num_blocks_for(num_tokens + num_new, b) - len(seq.table)
    if num_new and num_tokens % b and blocks.ref[seq.table[-1]] > 1:
        need += 1
    return need


# --- operations ----------------------------------------------------------------


def _apply_allocate(batch: Batch, op: Allocate) -> OpResult:
    seq_id = check_name(op.seq_id, "seq_id")
    if seq_id in batch.seqs:
        batch.refuse_existing(seq_id)
    tokens = _check_tokens(op.prompt_token_ids, "prompt_token_ids")
    priority = check_priority(op.priority)
    blocks = batch.blocks
    share = _share_source(batch, op)
    need = allocation_need(blocks, batch.config.watermark_blocks, tokens, op.extra_keys, batch.config.tenant,
                           share, op.share_tokens if share is not None else 0)
    if need is None:
        raise batch.no_room(f"admitting {len(tokens)} prompt tokens", watermark=True)
    hits, hashes, shared = need
    b = batch.block_size
    seq = Sequence(seq_id, op.extra_keys, _digest(op.extra_keys, batch.config.tenant), priority)
    # before this allocation's own takes evict anything: the cache as the prompt found it
    served = hashes
    if shared:  # the shared blocks are no misses: the ledger's chain runs on through them
        served = list(hashes)
        for i in range(len(hits), len(hits) + len(shared)):
            served.append(hash_block(served[-1] if served else None, tokens[i * b : (i + 1) * b], seq.extra_digest))
    miss = explain_misses(blocks, batch.misses, tokens, len(served), served, seq.extra_digest)
    num_restored = hits.count(IN_HOST) if blocks.host is not None else 0
    for block in hits:
        if block >= 0:
            blocks.acquire(block)
    for block in shared:
        blocks.acquire(block)
    if num_restored:
        _restore(batch, hits, hashes)
    seq.table = hits + shared
    for logical in range(len(seq.table), num_blocks_for(len(tokens), b)):
        seq.table.append(blocks.take(min(b, len(tokens) - logical * b)))
    seq.token_ids = list(tokens)
    seq.hashes = hashes
    # shared blocks are not committed: published only once a holder commits them
    seq.num_committed = len(hits) * b
    cached = (len(hits) + len(shared)) * b
    batch.add_seq(seq)
    batch.written_before[seq_id] = seq.num_committed
    batch.num_tokens += len(tokens)
    batch.prefix_queried_tokens += len(tokens)
    batch.prefix_hit_tokens += cached
    totals = batch.prefix_miss_tokens
    for i, count in enumerate(miss):
        totals[i] += count
    batch.record_update(TableUpdate(seq_id=seq_id, keep=0, block_ids=tuple(seq.table)))
    return OpResult(seq_id=seq_id, num_tokens=len(tokens), num_cached_tokens=cached,
                    new_block_ids=tuple(seq.table[len(hits) + len(shared):]), slot_start=cached,
                    slot_mapping=tuple(slot_mapping(seq.table, cached, len(tokens), b)),
                    num_restored_tokens=num_restored * b, miss_never_stored=miss[0], miss_evicted_device=miss[1],
                    miss_evicted_host=miss[2], miss_partial=miss[3], miss_other_extra_keys=miss[4])


def _share_source(batch: Batch, op: Allocate) -> Sequence | None:
    """The live sequence ``op.share_seq_id`` names (None: none named); a bad
    ``share_tokens`` is INVALID_ARGUMENT, an unknown sequence NOT_FOUND."""
    check_int(op.share_tokens, "share_tokens", 0, MAX_TOKENS_PER_SEQ)
    if isinstance(op.share_seq_id, str) and not op.share_seq_id:
        return None
    return batch.get_seq(check_name(op.share_seq_id, "share_seq_id"))


def explain_misses(blocks: BlockSpace, misses: MissLedger, tokens: list[int] | tuple[int, ...], num_hits: int,
                   hashes: list[bytes], digest: bytes) -> list[int]:
    """A prompt's tokens not served from cache, by reason (:data:`~blockd.core.types.MISS_REASONS`)::

        tokens   | hit | hit | miss: own reason | miss: own reason | partial |
                   ^ num_hits blocks ^ full blocks a hit may cover ^ the rest

    Only when the ledger can explain something are the missed blocks hashed
    (the tokens-only chain too, for a prompt with extra keys); otherwise
    every missed full block is never stored, for no hashing at all."""
    n, b = len(tokens), blocks.block_size
    max_hit = (n - 1) // b if n else 0
    miss = [0, 0, 0, n - max_hit * b, 0]
    if num_hits >= max_hit:
        return miss
    plain_digest = misses.plain_digest
    has_extra = digest != plain_digest
    if not (misses.dropped_device or misses.dropped_host or misses.variants or has_extra):
        miss[0] = (max_hit - num_hits) * b
        return miss
    index, host_index = blocks.index, blocks.host.index if blocks.host is not None else {}
    parent = hashes[num_hits - 1] if num_hits else None
    plain = hash_full_blocks(tokens, b, plain_digest, limit=num_hits)[-1] if has_extra and num_hits else parent
    for i in range(num_hits, max_hit):
        block = tokens[i * b : (i + 1) * b]
        parent = hash_block(parent, block, digest)
        if has_extra:
            plain = hash_block(plain, block, plain_digest)
            miss[misses.explains(parent, plain, plain in index or plain in host_index)] += b
        else:
            miss[misses.explains(parent, parent, False)] += b
    return miss


def _restore(batch: Batch, hits: list[int], hashes: list[bytes]) -> None:
    """Replace each :data:`IN_HOST` of ``hits`` by a device block restored from
    the host tier. Every host hit is pinned first, so the offloads these takes
    cause cannot reuse a host block that is still to be read; device hits are
    already acquired, so no take evicts them. Restore targets avoid the batch's
    copy-op blocks (:meth:`~blockd.core.blocks.BlockSpace.take_clean`)."""
    blocks = batch.blocks
    pinned = [blocks.pin_host(hashes[i]) if block == IN_HOST else -1 for i, block in enumerate(hits)]
    dirty = {block for copy in batch.copy_ops for block in copy}
    for i, hb in enumerate(pinned):
        if hb >= 0:
            block = blocks.restore(hb, dirty)
            if block is None:
                raise batch.no_room("restoring cached blocks from the host tier needs blocks that this batch's "
                                    "copy-on-write copies do not use", watermark=False)
            hits[i] = block


def _apply_append(batch: Batch, op: Append) -> OpResult:
    seq = batch.get_seq(op.seq_id)
    new = _check_tokens(op.token_ids, "token_ids")
    b, blocks, table = batch.block_size, batch.blocks, seq.table
    old_len = len(seq.token_ids)
    if old_len + len(new) > MAX_TOKENS_PER_SEQ:
        raise InvalidArgument(f"sequence would exceed {MAX_TOKENS_PER_SEQ} tokens")
    need = append_need(blocks, seq, len(new))
    if need > blocks.num_available:
        raise batch.no_room(f"appending {len(new)} tokens needs {need} blocks", watermark=False)
    batch.mark(seq)
    # an append implies the earlier tokens are written, all but those this batch handed out
    batch.commit_tokens(seq, batch.written_limit(seq))
    batch.written_before.setdefault(seq.seq_id, old_len)
    copies: tuple[tuple[int, int], ...] = ()
    keep, offset = len(table), old_len % b
    if new and offset:
        last = table[-1]
        if blocks.ref[last] > 1:  # shared, partly filled
            copy = batch.copy_on_write(seq, offset)
            copies, keep, last = (copy,), keep - 1, copy[1]
        blocks.add_fill(last, min(len(new), b - offset))
    total, grown_from = old_len + len(new), len(table)
    for logical in range(len(table), num_blocks_for(total, b)):
        table.append(blocks.take(min(b, total - logical * b)))
    seq.token_ids.extend(new)
    batch.num_tokens += len(new)
    if keep != len(table):
        batch.record_update(TableUpdate(seq_id=seq.seq_id, keep=keep, block_ids=tuple(table[keep:])))
    return OpResult(seq_id=seq.seq_id, num_tokens=total, new_block_ids=tuple(table[grown_from:]),
                    copy_ops=copies, slot_start=old_len,
                    slot_mapping=tuple(slot_mapping(table, old_len, total, b)))


def _apply_commit(batch: Batch, op: Commit) -> OpResult:
    seq = batch.get_seq(op.seq_id)
    num_tokens = len(seq.token_ids)
    check_int(op.num_tokens, f"num_tokens (sequence {shown(seq.seq_id)} holds {num_tokens})", 0, num_tokens)
    if op.num_tokens > seq.num_committed:
        batch.mark(seq)
        batch.commit_tokens(seq, op.num_tokens)
    return OpResult(seq_id=seq.seq_id, num_tokens=num_tokens)


def _apply_fork(batch: Batch, op: Fork) -> OpResult:
    parent = batch.get_seq(op.parent_seq_id)
    child_id = check_name(op.child_seq_id, "child_seq_id")
    if child_id in batch.seqs:
        batch.refuse_existing(child_id)
    child = Sequence(child_id, parent.extra, parent.extra_digest, parent.priority)
    child.table = list(parent.table)
    child.token_ids = list(parent.token_ids)
    child.num_committed = parent.num_committed
    child.hashes = list(parent.hashes)
    for block in child.table:
        batch.blocks.acquire(block)
    batch.add_seq(child)
    batch.settle_decoded()  # the child's tokens are as written as its parent's
    if parent.seq_id in batch.written_before:
        batch.written_before[child_id] = batch.written_before[parent.seq_id]
    else:
        batch.written_before.pop(child_id, None)
    batch.num_tokens += len(child.token_ids)
    batch.record_update(TableUpdate(seq_id=child_id, keep=0, block_ids=tuple(child.table)))
    return OpResult(seq_id=child_id, num_tokens=len(child.token_ids))


def _apply_free(batch: Batch, op: Free) -> OpResult:
    seq = batch.get_seq(op.seq_id)
    # tail first, so the LRU evicts a freed sequence's tail before its head
    release, priority = batch.blocks.release, seq.priority
    for block in reversed(seq.table):
        release(block, priority)
    batch.remove_seq(seq)
    batch.num_tokens -= len(seq.token_ids)
    batch.record_update(TableUpdate(seq_id=seq.seq_id, freed=True))
    return OpResult(seq_id=seq.seq_id, num_tokens=0)


_HANDLERS: dict[type, Callable[[Batch, Any], OpResult]] = {
    Allocate: _apply_allocate,
    Append: _apply_append,
    DecodeAppend: apply_decode,
    Commit: _apply_commit,
    Fork: _apply_fork,
    Free: _apply_free,
}
