"""A pool's complete state as JSON-able data, and back, exactly.

Used by the daemon's snapshots: :func:`dump_pool` captures everything that
determines future behaviour (ref counts, fills, hashes, the free list order,
the LRU order, the never-used counter, every sequence with its tokens and
hash chain, counters, version, retained deltas, event numbering), so a pool
rebuilt by :func:`load_pool` and then fed the same batches hands out the
same block ids and evicts in the same order as the original.

Integer arrays travel as base64 of little-endian uint32/int64 so a snapshot of
100k sequences loads in about a second. Imports only the standard library.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections import deque

from blockd.core.hashing import ExtraKeys
from blockd.core.pool import Pool
from blockd.core.sequence import Sequence
from blockd.core.types import PoolConfig, TableUpdate, VersionDelta

_LITTLE = sys.byteorder == "little"


def pack(values, typecode: str = "I") -> str:
    arr = array(typecode, values)
    if not _LITTLE:
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode()


def unpack(text: str, typecode: str = "I") -> list[int]:
    arr = array(typecode)
    arr.frombytes(base64.b64decode(text))
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def extra_to_json(extra: ExtraKeys) -> list:
    return [extra.model_id, extra.model_revision, extra.adapter_name, extra.adapter_id,
            extra.cache_salt, list(extra.mm_hashes)]


def extra_from_json(data: list) -> ExtraKeys:
    return ExtraKeys(data[0], data[1], data[2], data[3], data[4], tuple(data[5]))


def config_to_json(cfg: PoolConfig) -> dict:
    return {k: getattr(cfg, k) for k in PoolConfig.__dataclass_fields__}


def _delta_to_json(delta: VersionDelta) -> list:
    return [delta.version, [[u.seq_id, u.keep, list(u.block_ids), u.freed] for u in delta.updates],
            [list(c) for c in delta.copy_ops]]


def _delta_from_json(data: list) -> VersionDelta:
    updates = tuple(TableUpdate(s, k, tuple(ids), f) for s, k, ids, f in data[1])
    return VersionDelta(data[0], updates, tuple(tuple(c) for c in data[2]))


def dump_pool(pool: Pool) -> dict:
    blocks = pool.blocks
    hashed = {str(b): h.hex() for b, h in enumerate(blocks.hash) if h is not None}
    seqs = [
        [s.seq_id, pack(s.table), pack(s.token_ids), s.num_committed,
         "".join(h.hex() for h in s.hashes), extra_to_json(s.extra)]
        for s in pool.seqs.values()
    ]
    return {
        "config": config_to_json(pool.config),
        "ref": pack(blocks.ref), "fill": pack(blocks.fill), "hash": hashed,
        "next_fresh": blocks.next_fresh, "free": pack(blocks.free), "lru": pack(list(blocks.lru)),
        "num_used": blocks.num_used, "filled_slots": blocks.filled_slots,
        "num_evictions": blocks.num_evictions, "seqs": seqs,
        "counters": [pool.version, pool.num_tokens, pool.prefix_queried_tokens,
                     pool.prefix_hit_tokens, pool.num_copies, pool.last_event_seq_no],
        "deltas": [_delta_to_json(d) for d in pool.deltas],
        "freed": [[seq_id, version] for seq_id, version in pool.freed.items()],
    }


def load_pool(data: dict) -> Pool:
    pool = Pool(PoolConfig(**data["config"]))
    blocks = pool.blocks
    blocks.ref = unpack(data["ref"])
    blocks.fill = unpack(data["fill"])
    for block, h in data["hash"].items():
        blocks.hash[int(block)] = digest = bytes.fromhex(h)
        blocks.index[digest] = int(block)
    blocks.next_fresh = data["next_fresh"]
    blocks.free = deque(unpack(data["free"]))
    for block in unpack(data["lru"]):
        blocks.lru.push_back(block)
    blocks.num_used, blocks.filled_slots = data["num_used"], data["filled_slots"]
    blocks.num_evictions = data["num_evictions"]
    digests: dict[tuple, tuple[ExtraKeys, bytes]] = {}
    for seq_id, table, tokens, committed, hashes, extra in data["seqs"]:
        key = tuple(extra[:5]) + tuple(extra[5])
        if key not in digests:
            keys = extra_from_json(extra)
            digests[key] = (keys, keys.digest())
        seq = Sequence(seq_id, *digests[key])
        seq.table, seq.token_ids, seq.num_committed = unpack(table), unpack(tokens), committed
        seq.hashes = [bytes.fromhex(hashes[i : i + 32]) for i in range(0, len(hashes), 32)]
        pool.seqs[seq_id] = seq
    (pool.version, pool.num_tokens, pool.prefix_queried_tokens, pool.prefix_hit_tokens,
     pool.num_copies, pool.last_event_seq_no) = data["counters"]
    pool.deltas.extend(_delta_from_json(d) for d in data["deltas"])
    pool.freed.update((seq_id, version) for seq_id, version in data.get("freed", []))
    return pool


def op_to_json(op) -> list:
    """One batch operation as a compact JSON list (the write-ahead log's form)."""
    from blockd.core.types import Allocate, Append, Commit, DecodeAppend, Fork, Free

    if isinstance(op, DecodeAppend):
        return ["D", list(op.seq_ids), list(op.token_ids)]
    if isinstance(op, Append):
        return ["P", op.seq_id, list(op.token_ids)]
    if isinstance(op, Allocate):
        return ["A", op.seq_id, list(op.prompt_token_ids), extra_to_json(op.extra_keys)]
    if isinstance(op, Commit):
        return ["C", op.seq_id, op.num_tokens]
    if isinstance(op, Fork):
        return ["K", op.parent_seq_id, op.child_seq_id]
    if isinstance(op, Free):
        return ["F", op.seq_id]
    raise TypeError(f"not an operation: {op!r}")


def op_from_json(data: list):
    from blockd.core.types import Allocate, Append, Commit, DecodeAppend, Fork, Free

    kind = data[0]
    if kind == "D":
        return DecodeAppend(data[1], data[2])
    if kind == "P":
        return Append(data[1], data[2])
    if kind == "A":
        return Allocate(data[1], data[2], extra_from_json(data[3]))
    if kind == "C":
        return Commit(data[1], data[2])
    if kind == "K":
        return Fork(data[1], data[2])
    if kind == "F":
        return Free(data[1])
    raise ValueError(f"unknown operation kind {kind!r} in the log")
