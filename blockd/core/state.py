"""A pool's complete state as JSON-able data, and back, exactly.

Used by the daemon's snapshots: :func:`dump_pool` captures everything that
determines future behaviour (ref counts, fills, hashes, the free list order,
the LRU order, the never-used counter, every sequence with its tokens and
hash chain, counters, version, retained deltas, event numbering, and the
host tier's hashes, free list and LRU order, each block's retention
priority (so each priority's LRU order) and each sequence's, the miss ledger: dropped
hashes in order, tokens-only hashes, missed tokens by reason, and the pins:
each one's id, blocks, tokens and deadline, in order), so a pool
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
from collections.abc import Iterable
from typing import Any

from blockd.core.hashing import HASH_BYTES, ExtraKeys, tenant_digest
from blockd.core.lru import DEFAULT_PRIORITY, NUM_PRIORITIES
from blockd.core.pool import Pin, Pool
from blockd.core.sequence import Sequence
from blockd.core.types import (
    Allocate,
    Append,
    Commit,
    DecodeAppend,
    Fork,
    Free,
    Op,
    PoolConfig,
    TableUpdate,
    TierOp,
    VersionDelta,
)

_LITTLE = sys.byteorder == "little"


def pack(values: Iterable[int], typecode: str = "I") -> str:
    arr = values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)
    if not _LITTLE:
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode()


def unpack(text: str, typecode: str = "I") -> list[int]:
    arr = array(typecode)
    arr.frombytes(base64.b64decode(text))
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def extra_to_json(extra: ExtraKeys) -> list[Any]:
    return [extra.model_id, extra.model_revision, extra.adapter_name, extra.adapter_id,
            extra.cache_salt, list(extra.mm_hashes)]


def extra_from_json(data: list[Any]) -> ExtraKeys:
    return ExtraKeys(data[0], data[1], data[2], data[3], data[4], tuple(data[5]))


def config_to_json(cfg: PoolConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in PoolConfig.__dataclass_fields__}


def _delta_to_json(delta: VersionDelta) -> list[Any]:
    data = [delta.version, [[u.seq_id, u.keep, list(u.block_ids), u.freed] for u in delta.updates],
            [list(c) for c in delta.copy_ops]]
    if delta.tier_ops:  # absent before the host tier, and in deltas without tier ops
        data.append([[t.kind, t.device_block, t.host_block] for t in delta.tier_ops])
    return data


def _delta_from_json(data: list[Any]) -> VersionDelta:
    updates = tuple(TableUpdate(s, k, tuple(ids), f) for s, k, ids, f in data[1])
    tier_ops = tuple(TierOp(*t) for t in data[3]) if len(data) > 3 else ()
    return VersionDelta(data[0], updates, tuple(tuple(c) for c in data[2]), tier_ops=tier_ops)


def _dump_host(pool: Pool) -> dict[str, Any] | None:
    host = pool.blocks.host
    if host is None:
        return None
    return {"hash": {str(hb): h.hex() for hb, h in enumerate(host.hash) if h is not None},
            "next_fresh": host.next_fresh, "free": pack(host.free), "lru": pack(list(host.lru)),
            "priority": pack(host.priority, "B"),
            "num_offloads": pool.blocks.num_offloads, "num_restores": pool.blocks.num_restores}


def _load_tier(tier: Any, data: dict[str, Any]) -> None:
    """What both tiers keep alike: the hash of each block and its index, the
    never-used front, the free list, each block's priority and the LRU order
    (a snapshot from before priorities: every block at the default)."""
    for block, h in data["hash"].items():
        tier.hash[int(block)] = digest = bytes.fromhex(h)
        tier.index[digest] = int(block)
    tier.next_fresh = data["next_fresh"]
    tier.free = deque(unpack(data["free"]))
    priority = unpack(data["priority"], "B") if "priority" in data else [DEFAULT_PRIORITY] * len(tier.priority)
    if len(priority) != len(tier.priority) or not all(0 <= p < NUM_PRIORITIES for p in priority):
        raise ValueError(f"a snapshot's priorities do not fit {len(tier.priority)} blocks of {NUM_PRIORITIES} levels")
    tier.priority = priority
    for block in unpack(data["lru"]):
        tier.lru.push_back(block, priority[block])


def _load_host(pool: Pool, data: dict[str, Any] | None) -> None:
    """The host tier as dumped; a snapshot without one (older, or of a pool
    without a tier) leaves the tier empty."""
    host = pool.blocks.host
    if host is None or data is None:
        return
    _load_tier(host, data)
    pool.blocks.num_offloads, pool.blocks.num_restores = data["num_offloads"], data["num_restores"]


def _dump_misses(pool: Pool) -> dict[str, Any]:
    """The miss ledger (its tokens-only hashes are of hashes with extra keys only)."""
    misses = pool.misses
    return {"dropped_device": [h.hex() for h in misses.dropped_device],
            "dropped_host": [h.hex() for h in misses.dropped_host],
            "plain_of": {h.hex(): p.hex() for h, p in misses.plain_of.items()},
            "tokens": list(pool.prefix_miss_tokens)}


def _load_misses(pool: Pool, data: dict[str, Any] | None) -> None:
    """The miss ledger as dumped (its variants rebuilt); a snapshot from before
    it leaves it empty and the counts 0."""
    if data is None:
        return
    misses = pool.misses
    for key in ("dropped_device", "dropped_host"):
        getattr(misses, key).update((bytes.fromhex(h), None) for h in data[key])
    for h, p in data["plain_of"].items():
        digest = bytes.fromhex(h)
        misses.stored(digest, bytes.fromhex(p))
    pool.prefix_miss_tokens = list(data["tokens"])


def _dump_pins(pool: Pool) -> dict[str, Any]:
    return {"made": pool.num_pins_made,
            "pins": [[p.pin_id, pack(p.block_ids), p.num_tokens, p.expires_at] for p in pool.pins.values()]}


def _load_pins(pool: Pool, data: dict[str, Any] | None) -> None:
    """The pins as dumped (their references are in the dumped ref counts); a
    snapshot from before pins has none."""
    if data is None:
        return
    pool.num_pins_made = data["made"]
    cfg = pool.config
    for pin_id, blocks, num_tokens, expires_at in data["pins"]:
        pin = Pin(pin_id, cfg.name, cfg.tenant, tuple(unpack(blocks)), num_tokens, expires_at)
        pool.pins[pin_id] = pin
        for block in pin.block_ids:
            pool.pinned[block] = pool.pinned.get(block, 0) + 1


def _dump_seqs(pool: Pool) -> dict[str, Any]:
    """Every sequence, columnar: one packed array per field for all of them, so
    100k sequences cost a few list extends each rather than a dict apiece.
    Ordered by id, so equal pools dump equal (dict order carries no meaning)."""
    ids, tokens, tables, hashes, priority = [], array("I"), array("I"), [], array("B")
    num_tokens, num_blocks, committed, extra_index = array("I"), array("I"), array("I"), array("I")
    extras: dict[ExtraKeys, int] = {}
    for seq_id in sorted(pool.seqs):
        seq = pool.seqs[seq_id]
        ids.append(seq_id)
        tokens.extend(seq.token_ids)
        tables.extend(seq.table)
        num_tokens.append(len(seq.token_ids))
        num_blocks.append(len(seq.table))
        committed.append(seq.num_committed)
        priority.append(seq.priority)
        hashes.extend(seq.hashes)
        extra_index.append(extras.setdefault(seq.extra, len(extras)))
    return {"ids": ids, "tokens": pack(tokens), "tables": pack(tables), "num_tokens": pack(num_tokens),
            "num_blocks": pack(num_blocks), "committed": pack(committed), "extra_index": pack(extra_index),
            "extras": [extra_to_json(e) for e in extras], "hashes": base64.b64encode(b"".join(hashes)).decode(),
            "priority": pack(priority, "B")}


def _load_seqs(pool: Pool, data: dict[str, Any]) -> None:
    extras = [extra_from_json(e) for e in data["extras"]]
    digests = [(e, tenant_digest(e.digest(), pool.config.tenant)) for e in extras]
    tokens, tables = unpack(data["tokens"]), unpack(data["tables"])
    hashes = base64.b64decode(data["hashes"])
    tok = blk = hsh = 0
    b = pool.block_size
    ids = data["ids"]
    # a snapshot from before priorities: every sequence at the default
    priority = unpack(data["priority"], "B") if "priority" in data else [DEFAULT_PRIORITY] * len(ids)
    for seq_id, n, m, committed, extra, prio in zip(ids, unpack(data["num_tokens"]), unpack(data["num_blocks"]),
                                                    unpack(data["committed"]), unpack(data["extra_index"]),
                                                    priority):
        extra_keys, digest = digests[extra]
        seq = Sequence(seq_id, extra_keys, digest, prio)
        seq.token_ids, seq.table, seq.num_committed = tokens[tok : tok + n], tables[blk : blk + m], committed
        k = committed // b
        seq.hashes = [hashes[i : i + HASH_BYTES] for i in range(hsh, hsh + k * HASH_BYTES, HASH_BYTES)]
        tok, blk, hsh = tok + n, blk + m, hsh + k * HASH_BYTES
        pool.seqs[seq_id] = seq


def dump_pool(pool: Pool) -> dict[str, Any]:
    blocks = pool.blocks
    hashed = {str(b): h.hex() for b, h in enumerate(blocks.hash) if h is not None}
    seqs = _dump_seqs(pool)
    return {
        "config": config_to_json(pool.config),
        "ref": pack(blocks.ref), "fill": pack(blocks.fill), "hash": hashed,
        "next_fresh": blocks.next_fresh, "free": pack(blocks.free), "lru": pack(list(blocks.lru)),
        "priority": pack(blocks.priority, "B"), "num_used": blocks.num_used, "filled_slots": blocks.filled_slots,
        "num_evictions": blocks.num_evictions, "seqs": seqs,
        "counters": [pool.version, pool.num_tokens, pool.prefix_queried_tokens,
                     pool.prefix_hit_tokens, pool.num_copies, pool.last_event_seq_no],
        "deltas": [_delta_to_json(d) for d in pool.deltas],
        "freed": [[seq_id, version] for seq_id, version in pool.freed.items()],
        "host": _dump_host(pool),
        "misses": _dump_misses(pool),
        "pins": _dump_pins(pool),
    }


def load_pool(data: dict[str, Any]) -> Pool:
    pool = Pool(PoolConfig(**data["config"]))
    blocks = pool.blocks
    blocks.ref = unpack(data["ref"])
    blocks.fill = unpack(data["fill"])
    _load_tier(blocks, data)
    blocks.num_used, blocks.filled_slots = data["num_used"], data["filled_slots"]
    blocks.num_evictions = data["num_evictions"]
    _load_seqs(pool, data["seqs"])
    (pool.version, pool.num_tokens, pool.prefix_queried_tokens, pool.prefix_hit_tokens,
     pool.num_copies, pool.last_event_seq_no) = data["counters"]
    pool.deltas.extend(_delta_from_json(d) for d in data["deltas"])
    pool.freed.update((seq_id, version) for seq_id, version in data.get("freed", []))
    _load_host(pool, data.get("host"))
    _load_misses(pool, data.get("misses"))
    _load_pins(pool, data.get("pins"))
    return pool


def op_to_json(op: object) -> list[Any]:
    """One batch operation as a compact JSON list (the write-ahead log's form)."""
    if isinstance(op, DecodeAppend):
        return ["D", list(op.seq_ids), list(op.token_ids)]
    if isinstance(op, Append):
        return ["P", op.seq_id, list(op.token_ids)]
    if isinstance(op, Allocate):
        if op.share_seq_id:  # kind "a": a blockd that predates sharing refuses it by name, never misreads it
            return ["a", op.seq_id, list(op.prompt_token_ids), extra_to_json(op.extra_keys), op.retain_ttl_s,
                    op.priority, op.share_seq_id, op.share_tokens]
        data = ["A", op.seq_id, list(op.prompt_token_ids), extra_to_json(op.extra_keys)]
        if op.priority != DEFAULT_PRIORITY:  # absent before priorities, and for the default one
            return [*data, op.retain_ttl_s, op.priority]
        return [*data, op.retain_ttl_s] if op.retain_ttl_s else data
    if isinstance(op, Commit):
        return ["C", op.seq_id, op.num_tokens]
    if isinstance(op, Fork):
        return ["K", op.parent_seq_id, op.child_seq_id]
    if isinstance(op, Free):
        return ["F", op.seq_id]
    raise TypeError(f"not an operation: {op!r}")


def op_from_json(data: list[Any]) -> Op:
    kind = data[0]
    if kind == "D":
        return DecodeAppend(data[1], data[2])
    if kind == "P":
        return Append(data[1], data[2])
    if kind == "A":
        return Allocate(data[1], data[2], extra_from_json(data[3]), retain_ttl_s=data[4] if len(data) > 4 else 0.0,
                        priority=data[5] if len(data) > 5 else DEFAULT_PRIORITY)
    if kind == "a":
        return Allocate(data[1], data[2], extra_from_json(data[3]), retain_ttl_s=data[4], priority=data[5],
                        share_seq_id=data[6], share_tokens=data[7])
    if kind == "C":
        return Commit(data[1], data[2])
    if kind == "K":
        return Fork(data[1], data[2])
    if kind == "F":
        return Free(data[1])
    raise ValueError(f"unknown operation kind {kind!r} in the log")
