"""What the idempotency table keeps per request id, in compact form.

* :func:`fingerprint`: ``"kind:pool:digest"``, where digest is BLAKE2b-128
  over a canonical, injective encoding of the request's content (a step's
  operations, a pool's config). Equal requests give equal fingerprints
  whether their lists arrived as lists or tuples, live or replayed from the
  log, so an id reused for different content is caught. The decode hot path
  (one ``DecodeAppend`` of N sequences) costs one C-level join, one array
  copy and one hash, never a per-item Python loop.
* :func:`encode_result` / :func:`decode_result`: a step's answer as bytes:
  little-endian packed arrays; an allocation's or append's slot mapping as
  the blocks it runs through (one u32 per block instead of one per token,
  checked exactly), and a list that counts up or down by one as (first,
  length). A 2,048-token prefill's answer shrinks from ~87 KB of Python
  objects to ~100 bytes (~600 when its blocks are scattered); a 256-sequence
  decode step's from ~19 KB to ~1-2 KB.

Imports only the standard library and the core.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from dataclasses import replace
from hashlib import blake2b
from itertools import chain

from blockd.core.lru import DEFAULT_PRIORITY
from blockd.core.pool import Pin, PrefixPriority
from blockd.core.types import (
    MISS_REASONS,
    OFFLOAD,
    RESTORE,
    Allocate,
    Append,
    Commit,
    DecodeAppend,
    Fork,
    Free,
    OpResult,
    PoolConfig,
    PoolStats,
    StepResult,
    TierOp,
)

_LEN = struct.Struct("<Q")
_BIG = sys.byteorder == "big"


# --- fingerprints -------------------------------------------------------------------
def _le(values: array) -> bytes:
    """Little-endian bytes of an array, whatever this machine's byte order."""
    if _BIG:
        values.byteswap()
    return values.tobytes()


def _chunk(tag: bytes, data: bytes) -> tuple[bytes, bytes]:
    return tag + _LEN.pack(len(data)), data


def _text(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def _ints(values) -> tuple[bytes, bytes]:
    return _chunk(b"i", _le(array("I", values)))


def _ids(ids) -> tuple[bytes, bytes]:
    """A list of ids, NUL-separated: one C-level join (a per-id length array
    costs several times more), injective because the count travels too and
    an id holding a NUL falls back to repr."""
    joined = "\0".join(ids)
    if ids and joined.count("\0") != len(ids) - 1:
        raise ValueError("an id holds a NUL character")
    return _chunk(b"s" + _LEN.pack(len(ids)), _text(joined))


def _op_parts(op: object) -> tuple[bytes, ...]:
    """One operation as length-prefixed parts, so that a batch's encoding is
    injective. Values the core would refuse (non-str ids, token ids past
    2**32) raise here, before anything is hashed, and are hashed by repr."""
    if type(op) is DecodeAppend:
        return (b"D", *_ids(op.seq_ids), *_ints(op.token_ids))
    if type(op) is Allocate:
        # fields at their defaults are left out, so older fingerprints stay valid
        head: tuple = (op.seq_id, op.extra_keys, op.retain_ttl_s) if op.retain_ttl_s else (op.seq_id, op.extra_keys)
        if op.priority != DEFAULT_PRIORITY:
            head = (op.seq_id, op.extra_keys, op.retain_ttl_s, op.priority)
        if op.share_seq_id:
            head = (op.seq_id, op.extra_keys, op.retain_ttl_s, op.priority, "share", op.share_seq_id,
                    op.share_tokens)
        return (*_chunk(b"A", _text(repr(head))), *_ints(op.prompt_token_ids))
    if type(op) is Append:
        return (*_chunk(b"P", _text(repr(op.seq_id))), *_ints(op.token_ids))
    if type(op) is Commit:
        return _chunk(b"C", _text(repr((op.seq_id, op.num_tokens))))
    if type(op) is Fork:
        return _chunk(b"K", _text(repr((op.parent_seq_id, op.child_seq_id))))
    if type(op) is Free:
        return _chunk(b"F", _text(repr(op.seq_id)))
    raise TypeError(type(op))


def fingerprint(kind: str, pool: str, subject: object = None) -> str:
    """``"kind:pool:digest"`` of a request; ``subject`` is a step's operations,
    a pool's config, or None (the kind and pool say it all)."""
    h = blake2b(digest_size=16)  # the project's one hash function
    update = h.update
    if isinstance(subject, PoolConfig):
        for part in _chunk(b"c", _text(repr(subject))):
            update(part)
    elif isinstance(subject, (list, tuple)):
        # each op's parts go into the hash as they come: gathering them into
        # one tuple first (``parts += ...``) made a 30k-op batch quadratic
        # (seconds under no lock, but before any op could fail)
        for op in subject:
            try:
                op_parts = _op_parts(op)
            except (TypeError, ValueError, OverflowError, AttributeError):
                op_parts = _chunk(b"?", _text(repr(op)))
            for part in op_parts:
                update(part)
    elif subject is not None:  # something the core refuses (it still has a fingerprint)
        for part in _chunk(b"!", _text(repr(subject))):
            update(part)
    return f"{kind}:{pool}:{h.hexdigest()}"


# --- answers ----------------------------------------------------------------------------
_STEP = struct.Struct("<QIII")  # version, results, top-level copy ops, the pool's block size (0: unknown)
# id bytes, tokens, cached, slot_start, new-block form and bytes, copies, slot form and bytes
_RESULT = struct.Struct("<IQQQBIIBI")
_BLOCKS_HEAD = struct.Struct("<QB")  # slots, form of the block list
_SKIP = struct.Struct("<B")  # leading slot blocks that are not new
_U32, _U64, _UP, _DOWN, _BLOCKS, _FROM_SLOTS = range(6)


def _pack_ints(values) -> tuple[int, bytes]:
    """Ints as a packed array, or as (first, length) when they count up or
    down by one (an allocation's blocks from a fresh pool, or from a free list
    that a freed sequence refilled tail first). Only that one-run case is
    looked for: telling several runs apart is a per-item Python loop."""
    n = len(values)
    try:
        packed, form = array("I", values), _U32
    except OverflowError:  # pools of more than 2**32 slots
        packed, form = array("Q", values), _U64
    if n > 2 and abs(values[-1] - values[0]) == n - 1:
        step = 1 if values[-1] > values[0] else -1
        if packed == array(packed.typecode, range(values[0], values[0] + step * n, step)):
            return (_UP if step > 0 else _DOWN), _le(array("Q", (values[0], n)))
    return form, _le(packed)


def _blocks_of(slots, start: int, b: int) -> list[int] | None:
    """The blocks behind ``slots`` when they are exactly the slots of token
    positions ``start, start + 1, ...`` through a block table (docs/glossary.md, slot:
    position p lives in slot ``table[p // b] * b + p % b``), else None. The
    check rebuilds the slots from the blocks at C speed and compares."""
    n = len(slots)
    if b < 2 or n < b or ((start + 1) % b and slots[1] != slots[0] + 1):
        return None  # too short to pay, or (a decode step's slots) not even one block's worth in a row
    head = -start % b  # index of the first slot that opens a block
    blocks = [s // b for s in slots[head::b]]
    if head:
        blocks.insert(0, slots[0] // b)
    lo = [block * b for block in blocks]
    hi = [x + b for x in lo]
    lo[0] += start % b
    hi[-1] -= -(start + n) % b
    if tuple(chain.from_iterable(map(range, lo, hi))) != tuple(slots):
        return None
    return blocks


def _pack_slots(slots, start: int, b: int, new_blocks) -> tuple[int, bytes, int, bytes]:
    """A result's slot mapping and new blocks as (slot form, bytes, block form,
    bytes): the slots as the blocks they run through when they are (one u32
    per block of b slots), and the new blocks, when they are those blocks
    (an allocation) or all but the first (an append to a partly filled
    block), as just that; otherwise each as :func:`_pack_ints` keeps any ints
    (a decode step's slots, one per sequence, are a packed array)."""
    blocks = _blocks_of(slots, start, b)
    if blocks is None:
        return (*_pack_ints(slots), *_pack_ints(new_blocks))
    form, packed = _pack_ints(blocks)
    slots_part = _BLOCKS_HEAD.pack(len(slots), form) + packed
    for skip in (0, 1):
        if tuple(blocks[skip:]) == tuple(new_blocks):
            return _BLOCKS, slots_part, _FROM_SLOTS, _SKIP.pack(skip)
    return (_BLOCKS, slots_part, *_pack_ints(new_blocks))


def _array(typecode: str, data: bytes) -> array:
    values = array(typecode, data)
    if _BIG:
        values.byteswap()
    return values


def _unpack_ints(form: int, data: bytes, start: int = 0, b: int = 0) -> tuple[int, ...]:
    if form == _U32:
        return tuple(_array("I", data))
    if form == _U64:
        return tuple(_array("Q", data))
    if form == _BLOCKS:
        n, blocks_form = _BLOCKS_HEAD.unpack_from(data)
        blocks = _unpack_ints(blocks_form, data[_BLOCKS_HEAD.size :])
        return tuple(blocks[(p // b) - start // b] * b + p % b for p in range(start, start + n))
    first, length = _array("Q", data)
    return tuple(range(first, first + length) if form == _UP else range(first, first - length, -1))


def _pairs(pairs) -> bytes:
    return _le(array("I", [x for pair in pairs for x in pair]))


def _unpairs(data: bytes) -> tuple[tuple[int, int], ...]:
    flat = _array("I", data)
    return tuple(zip(flat[0::2], flat[1::2]))


def _encode_step(result: StepResult, b: int) -> bytes:
    parts = [b"R", _STEP.pack(result.version, len(result.results), len(result.copy_ops), b),
             _pairs(result.copy_ops)]
    for r in result.results:
        seq_id = _text(r.seq_id)
        slot_form, slots, block_form, blocks = _pack_slots(r.slot_mapping, r.slot_start, b, r.new_block_ids)
        parts += (_RESULT.pack(len(seq_id), r.num_tokens, r.num_cached_tokens, r.slot_start, block_form,
                               len(blocks), len(r.copy_ops), slot_form, len(slots)),
                  seq_id, blocks, _pairs(r.copy_ops), slots)
    parts.append(_tiers(result))
    parts.append(_misses(result))
    parts.append(_incarnation(result.incarnation))
    return b"".join(parts)


#: the tier section's marker, which no incarnation trailer starts with (``\x01``, ``\x02``)
_TIERS = b"\x03"
_TIER_KINDS = {OFFLOAD: 0, RESTORE: 1}
_KIND_OF = {code: kind for kind, code in _TIER_KINDS.items()}


def _tiers(result: StepResult) -> bytes:
    """A step's host-tier part, between the results and the incarnation: its
    tier ops and each result's restored tokens, so a retried request id gets
    the ops its workers must run and the tokens it must not compute. Absent
    for a step with neither (every answer kept before there was a host tier)."""
    restored = [(i, r.num_restored_tokens) for i, r in enumerate(result.results) if r.num_restored_tokens]
    if not result.tier_ops and not restored:
        return b""
    ops = array("I", [x for op in result.tier_ops for x in (_TIER_KINDS[op.kind], op.device_block, op.host_block)])
    return (_TIERS + _LEN.pack(len(result.tier_ops)) + _le(ops) + _LEN.pack(len(restored))
            + _le(array("I", [x for pair in restored for x in pair])))


def _tiers_of(data: bytes, pos: int) -> tuple[tuple[TierOp, ...], dict[int, int], int]:
    if data[pos : pos + 1] != _TIERS:
        return (), {}, pos
    (num_ops,) = _LEN.unpack_from(data, pos + 1)
    pos += 1 + _LEN.size
    flat = _array("I", data[pos : pos + 12 * num_ops])
    pos += 12 * num_ops
    ops = tuple(TierOp(_KIND_OF[flat[i]], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3))
    (num_restored,) = _LEN.unpack_from(data, pos)
    pos += _LEN.size
    pairs = _array("I", data[pos : pos + 8 * num_restored])
    pos += 8 * num_restored
    return ops, dict(zip(pairs[0::2], pairs[1::2])), pos


#: the miss section's marker (after the tier section, before the incarnation trailer)
_MISSES = b"\x04"
_MISS_FIELDS = tuple(f"miss_{reason}" for reason in MISS_REASONS)
#: where PoolStats.prefix_miss_tokens is in a kept PoolStats' field list
_MISS_AT = list(PoolStats.__dataclass_fields__).index("prefix_miss_tokens")


def _misses(result: StepResult) -> bytes:
    """Each allocation's missed tokens by reason, as varints (result index, 5
    counts): ~8 bytes a prefill. Absent for a step without any (every answer
    kept before they existed, and decode steps)."""
    rows = [(i, *(getattr(r, f) for f in _MISS_FIELDS)) for i, r in enumerate(result.results)
            if r.miss_never_stored or r.miss_evicted_device or r.miss_evicted_host or r.miss_partial
            or r.miss_other_extra_keys]
    if not rows:
        return b""
    out = bytearray(_MISSES)
    for count in (len(rows), *(x for row in rows for x in row)):
        value = count
        while value > 0x7F:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


def _misses_of(data: bytes, pos: int, results: list[OpResult]) -> int:
    if data[pos : pos + 1] != _MISSES:
        return pos
    pos += 1
    values: list[int] = []
    num_rows = -1
    while num_rows < 0 or len(values) < num_rows * (1 + len(_MISS_FIELDS)):
        value = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        if num_rows < 0:
            num_rows = value
        else:
            values.append(value)
    width = 1 + len(_MISS_FIELDS)
    for row in range(num_rows):
        i, never, device, host, partial, other = values[row * width : (row + 1) * width]
        results[i] = replace(results[i], miss_never_stored=never, miss_evicted_device=device,
                             miss_evicted_host=host, miss_partial=partial, miss_other_extra_keys=other)
    return pos


def _incarnation(text: str) -> bytes:
    """The pool incarnation a step's version belongs to, kept last (answers
    kept before there were incarnations simply end after the results): a
    uuid4's 32 hex digits as 16 bytes, anything else as its text."""
    if not text:
        return b""
    if len(text) == 32 and not text.strip("0123456789abcdef"):  # all hex digits, in C rather than a genexpr
        return b"\x01" + bytes.fromhex(text)
    return b"\x02" + _text(text)


def _incarnation_of(data: bytes) -> str:
    if not data:
        return ""
    return data[1:].hex() if data[:1] == b"\x01" else data[1:].decode("utf-8", "surrogatepass")


def _decode_step(data: bytes) -> StepResult:
    version, num_results, num_copies, b = _STEP.unpack_from(data, 1)
    pos = 1 + _STEP.size
    copies = _unpairs(data[pos : pos + 8 * num_copies])
    pos += 8 * num_copies
    results = []
    for _ in range(num_results):
        (id_len, tokens, cached, start, block_form, block_len, num_op_copies, slot_form,
         slot_len) = _RESULT.unpack_from(data, pos)
        pos += _RESULT.size
        seq_id = data[pos : pos + id_len].decode("utf-8", "surrogatepass")
        pos += id_len
        new_part = data[pos : pos + block_len]
        pos += block_len
        op_copies = _unpairs(data[pos : pos + 8 * num_op_copies])
        pos += 8 * num_op_copies
        slot_part = data[pos : pos + slot_len]
        pos += slot_len
        slots = _unpack_ints(slot_form, slot_part, start, b)
        if block_form == _FROM_SLOTS:
            (skip,) = _SKIP.unpack(new_part)
            _, blocks_form = _BLOCKS_HEAD.unpack_from(slot_part)
            new = _unpack_ints(blocks_form, slot_part[_BLOCKS_HEAD.size :])[skip:]
        else:
            new = _unpack_ints(block_form, new_part)
        results.append(OpResult(seq_id=seq_id, num_tokens=tokens, num_cached_tokens=cached, new_block_ids=new,
                                copy_ops=op_copies, slot_start=start, slot_mapping=slots))
    tier_ops, restored, pos = _tiers_of(data, pos)
    for i, count in restored.items():
        results[i] = replace(results[i], num_restored_tokens=count)
    pos = _misses_of(data, pos, results)
    return StepResult(version=version, results=tuple(results), copy_ops=copies,
                      incarnation=_incarnation_of(data[pos:]), tier_ops=tier_ops)


def encode_result(result: object, block_size: int = 0) -> bytes:
    """An engine answer (a StepResult, PoolStats, Pin, PrefixPriority, or None) as bytes;
    ``block_size`` (the pool's) lets slot mappings be kept as their blocks."""
    if result is None:
        return b"N"
    if isinstance(result, StepResult):
        return _encode_step(result, block_size)
    if isinstance(result, PoolStats):
        return b"S" + json.dumps([getattr(result, f) for f in PoolStats.__dataclass_fields__]).encode()
    if isinstance(result, Pin):
        return b"P" + json.dumps([result.pin_id, result.pool, result.tenant, list(result.block_ids),
                                  result.num_tokens, result.expires_at]).encode()
    if isinstance(result, PrefixPriority):
        return b"Q" + json.dumps([getattr(result, f) for f in PrefixPriority.__dataclass_fields__]).encode()
    raise TypeError(f"cannot keep an answer of type {type(result).__name__}")


def decode_result(data: bytes) -> object:
    kind = data[:1]
    if kind == b"N":
        return None
    if kind == b"R":
        return _decode_step(data)
    if kind == b"S":
        fields = json.loads(data[1:])
        if len(fields) > _MISS_AT:  # prefix_miss_tokens: a tuple, as PoolStats holds it
            fields[_MISS_AT] = tuple(fields[_MISS_AT])
        return PoolStats(*fields)
    if kind == b"P":
        pin_id, pool, tenant, block_ids, num_tokens, expires_at = json.loads(data[1:])
        return Pin(pin_id, pool, tenant, tuple(block_ids), num_tokens, expires_at)
    if kind == b"Q":
        return PrefixPriority(*json.loads(data[1:]))
    raise ValueError(f"unknown answer form {kind!r}")
