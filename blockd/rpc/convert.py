"""Protobuf messages <-> blockd's plain dataclasses, in both directions.

The daemon's servicer reads requests with the ``*_from_proto`` functions and
writes responses with the ``*_to_proto`` ones; the client SDK does the
reverse with the same functions, so each mapping exists once. Reading a
request validates what the wire types cannot express (a missing oneof or
sub-message, an empty id, an id longer than
:data:`~blockd.core.validate.MAX_ID_LEN`) and raises
:class:`~blockd.rpc.errors.BadField` naming the field, before anything echoes
the value; the range checks of sizes and counts stay in the core (one place
for each rule), which raises InvalidArgument naming the failing operation.

Repeated fields are copied by slicing (``[:]``, a list built in C, a third
faster than ``list()``): the core requires real lists, and this is the whole
per-step parsing cost of a decode step. Imports protobuf, the core and
:mod:`blockd.rpc.errors`; never the daemon.
"""

from __future__ import annotations

from typing import Literal

from blockd.core.hashing import NO_EXTRA_KEYS, ExtraKeys
from blockd.core.lru import DEFAULT_PRIORITY
from blockd.core.types import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    MAX_DEVICE_LEN,
    MISS_REASONS,
    OFFLOAD,
    RESTORE,
    Allocate,
    Append,
    Commit,
    DecodeAppend,
    FollowerStatus,
    Fork,
    Free,
    KVEvent,
    Op,
    OpResult,
    PoolConfig,
    PoolStats,
    ReplicaStatus,
    SequenceInfo,
    Snapshot,
    StepResult,
    TableUpdate,
    TierOp,
    TransferPlan,
    VersionDelta,
    WorkerInfo,
    WorkerStatus,
)
from blockd.core.validate import MAX_EXTRA_KEY_LEN, MAX_ID_LEN
from blockd.rpc.errors import BadField
from blockd.v1 import blockd_pb2 as pb
from blockd.v1 import replication_pb2 as rpb

_OP_KINDS = "allocate, append, decode_append, commit, fork, free"
_STATS_FIELDS = tuple(f for f in PoolStats.__dataclass_fields__ if f != "prefix_miss_tokens")
_MISS_FIELDS = tuple(f"miss_{reason}" for reason in MISS_REASONS)
_RARE_COUNTS = ("num_cached_tokens", "num_restored_tokens", *_MISS_FIELDS)
_WORKER_FIELDS = tuple(WorkerInfo.__dataclass_fields__)
_EVENT_KINDS = {
    BLOCK_STORED: pb.EVENT_KIND_BLOCK_STORED,
    BLOCK_REMOVED: pb.EVENT_KIND_BLOCK_REMOVED,
    ALL_BLOCKS_CLEARED: pb.EVENT_KIND_ALL_BLOCKS_CLEARED,
}
_EVENT_NAMES = {number: name for name, number in _EVENT_KINDS.items()}
_TIER_KINDS = {OFFLOAD: pb.TIER_OP_KIND_OFFLOAD, RESTORE: pb.TIER_OP_KIND_RESTORE}
_TIER_NAMES = {number: name for name, number in _TIER_KINDS.items()}
_MEDIA = {"device": pb.MEDIUM_DEVICE, "host": pb.MEDIUM_HOST}
#: an unset medium is a blockd without a host tier: its blocks are all on the device
_MEDIUM_NAMES = {pb.MEDIUM_UNSPECIFIED: "device", pb.MEDIUM_DEVICE: "device", pb.MEDIUM_HOST: "host"}
_CONFIG_DEFAULTS = {name: f.default for name, f in PoolConfig.__dataclass_fields__.items()}
_OptionalField = Literal["num_layers", "num_kv_heads", "head_dim", "dtype", "max_retained_versions"]
_OPTIONAL_CONFIG: tuple[_OptionalField, ...] = (
    "num_layers", "num_kv_heads", "head_dim", "dtype", "max_retained_versions")


def require_id(value: str, field: str, op_index: int | None = None) -> str:
    """An id the wire cannot leave out: refuse the empty string and one longer
    than any name blockd accepts, up front."""
    if not value:
        raise BadField(field, "must be a non-empty name", op_index=op_index)
    return optional_id(value, field, op_index)


def optional_id(value: str, field: str, op_index: int | None = None) -> str:
    """An id that may be empty (a request id, a filter), at most MAX_ID_LEN long."""
    if len(value) > MAX_ID_LEN:
        raise BadField(field, f"is {len(value)} characters long; names and ids are at most {MAX_ID_LEN}",
                       op_index=op_index)
    return value


def require_ids(values, field: str) -> list[str]:
    """A list of ids (``GetTables.seq_ids``, ``LookupPrefix.pools``, ...), each
    checked like :func:`require_id`. The decode hot path does not come here:
    the core refuses an unknown over-long sequence id when it misses."""
    ids = list(values)
    for i, value in enumerate(ids):
        require_id(value, f"{field}[{i}]")
    return ids


def _bounded_text(values, field: str, limit: int) -> None:
    for name, value in values:
        if len(value) > limit:
            raise BadField(f"{field}.{name}", f"is {len(value)} characters long; at most {limit}")


# --- pools --------------------------------------------------------------------
def pool_config_from_proto(msg: pb.PoolConfig, field: str = "config") -> PoolConfig:
    """Unset optional geometry takes the core's defaults; an explicit 0 is kept
    (and refused by the core's checks)."""
    require_id(msg.name, f"{field}.name")
    optional = {name: getattr(msg, name) for name in _OPTIONAL_CONFIG if msg.HasField(name)}
    if len(msg.tenant) > MAX_ID_LEN:
        raise BadField(f"{field}.tenant", f"is {len(msg.tenant)} characters long; tenants are at most 128")
    return PoolConfig(name=msg.name, num_blocks=msg.num_blocks, block_size=msg.block_size,
                      watermark_blocks=msg.watermark_blocks, tenant=msg.tenant,
                      num_host_blocks=msg.num_host_blocks, **optional)


def pool_config_to_proto(cfg: PoolConfig) -> pb.PoolConfig:
    return pb.PoolConfig(
        name=cfg.name, num_blocks=cfg.num_blocks, block_size=cfg.block_size, num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
        watermark_blocks=cfg.watermark_blocks, max_retained_versions=cfg.max_retained_versions, tenant=cfg.tenant,
        num_host_blocks=cfg.num_host_blocks)


def pool_config_from_reply(msg: pb.PoolConfig) -> PoolConfig:
    """A config the daemon sent (every field set)."""
    values = {name: getattr(msg, name) for name in _CONFIG_DEFAULTS if name not in _OPTIONAL_CONFIG}
    for name in _OPTIONAL_CONFIG:
        values[name] = getattr(msg, name) if msg.HasField(name) else _CONFIG_DEFAULTS[name]
    return PoolConfig(**values)


def stats_to_proto(stats: PoolStats) -> pb.PoolStats:
    return pb.PoolStats(**{name: getattr(stats, name) for name in _STATS_FIELDS},
                        prefix_miss_tokens=pb.MissTokens(**stats.prefix_miss_by_reason))


def stats_from_proto(msg: pb.PoolStats) -> PoolStats:
    missed = msg.prefix_miss_tokens
    return PoolStats(**{name: getattr(msg, name) for name in _STATS_FIELDS},
                     prefix_miss_tokens=tuple(getattr(missed, reason) for reason in MISS_REASONS))


# --- operations -----------------------------------------------------------------
def extra_keys_from_proto(msg: pb.ExtraKeys, field: str = "extra_keys") -> ExtraKeys:
    _bounded_text([("model_id", msg.model_id), ("model_revision", msg.model_revision),
                   ("adapter_name", msg.adapter_name), ("cache_salt", msg.cache_salt),
                   *((f"mm_hashes[{i}]", h) for i, h in enumerate(msg.mm_hashes))], field, MAX_EXTRA_KEY_LEN)
    return ExtraKeys(model_id=msg.model_id, model_revision=msg.model_revision,
                     adapter_name=msg.adapter_name, adapter_id=msg.adapter_id,
                     cache_salt=msg.cache_salt, mm_hashes=tuple(msg.mm_hashes))


def extra_keys_to_proto(extra: ExtraKeys) -> pb.ExtraKeys:
    return pb.ExtraKeys(model_id=extra.model_id, model_revision=extra.model_revision,
                        adapter_name=extra.adapter_name, adapter_id=extra.adapter_id,
                        cache_salt=extra.cache_salt, mm_hashes=list(extra.mm_hashes))


def op_from_proto(msg: pb.Op, index: int) -> Op:
    kind = msg.WhichOneof("kind")
    where = f"ops[{index}].{kind}"
    if kind == "decode_append":
        seq_ids = msg.decode_append.seq_ids[:]
        if "" in seq_ids:
            raise BadField(f"{where}.seq_ids[{seq_ids.index('')}]", "must be a non-empty sequence id",
                           op_index=index)
        return DecodeAppend(seq_ids, msg.decode_append.token_ids[:])
    if kind == "allocate":
        alloc = msg.allocate
        extra = (extra_keys_from_proto(alloc.extra_keys, f"{where}.extra_keys") if alloc.HasField("extra_keys")
                 else NO_EXTRA_KEYS)
        return Allocate(require_id(alloc.seq_id, f"{where}.seq_id", index), alloc.prompt_token_ids[:], extra,
                        alloc.source_pool, alloc.retain_ttl_s,
                        alloc.priority if alloc.HasField("priority") else DEFAULT_PRIORITY,
                        optional_id(alloc.share_seq_id, f"{where}.share_seq_id", index), alloc.share_tokens)
    if kind == "append":
        return Append(require_id(msg.append.seq_id, f"{where}.seq_id", index), msg.append.token_ids[:])
    if kind == "commit":
        return Commit(require_id(msg.commit.seq_id, f"{where}.seq_id", index), msg.commit.num_tokens)
    if kind == "fork":
        return Fork(require_id(msg.fork.parent_seq_id, f"{where}.parent_seq_id", index),
                    require_id(msg.fork.child_seq_id, f"{where}.child_seq_id", index))
    if kind == "free":
        return Free(require_id(msg.free.seq_id, f"{where}.seq_id", index))
    raise BadField(f"ops[{index}]", f"no operation set; set exactly one of {_OP_KINDS}", op_index=index)


def ops_from_proto(ops) -> list[Op]:
    return [op_from_proto(op, i) for i, op in enumerate(ops)]


def op_into_proto(op: Op, out: pb.Op) -> None:
    """Write ``op`` into ``out`` in place (e.g. ``request.ops.add()``): building
    a sub-message and then assigning it would copy its arrays once more."""
    if isinstance(op, DecodeAppend):
        out.decode_append.SetInParent()
        out.decode_append.seq_ids.extend(op.seq_ids)
        out.decode_append.token_ids.extend(op.token_ids)
    elif isinstance(op, Allocate):
        out.allocate.SetInParent()
        out.allocate.seq_id = op.seq_id
        out.allocate.prompt_token_ids.extend(op.prompt_token_ids)
        if op.extra_keys != NO_EXTRA_KEYS:
            out.allocate.extra_keys.CopyFrom(extra_keys_to_proto(op.extra_keys))
        if op.source_pool:
            out.allocate.source_pool = op.source_pool
        if op.retain_ttl_s:
            out.allocate.retain_ttl_s = op.retain_ttl_s
        if op.priority != DEFAULT_PRIORITY:
            out.allocate.priority = op.priority
        if op.share_seq_id:
            out.allocate.share_seq_id, out.allocate.share_tokens = op.share_seq_id, op.share_tokens
    elif isinstance(op, Append):
        out.append.SetInParent()
        out.append.seq_id = op.seq_id
        out.append.token_ids.extend(op.token_ids)
    elif isinstance(op, Commit):
        out.commit.SetInParent()
        out.commit.seq_id, out.commit.num_tokens = op.seq_id, op.num_tokens
    elif isinstance(op, Fork):
        out.fork.SetInParent()
        out.fork.parent_seq_id, out.fork.child_seq_id = op.parent_seq_id, op.child_seq_id
    elif isinstance(op, Free):
        out.free.SetInParent()
        out.free.seq_id = op.seq_id
    else:
        raise TypeError(f"not a blockd operation: {type(op).__name__}")


def step_request_to_proto(pool: str, ops, request_id: str, incarnation: str = "") -> pb.StepRequest:
    request = pb.StepRequest(pool=pool, request_id=request_id, pool_incarnation=incarnation)
    for op in ops:
        op_into_proto(op, request.ops.add())
    return request


# --- step results -------------------------------------------------------------------
def _copies_to_proto(copy_ops) -> list[pb.CopyOp]:
    return [pb.CopyOp(src_block_id=src, dst_block_id=dst) for src, dst in copy_ops]


def _copies_from_proto(msgs) -> tuple[tuple[int, int], ...]:
    return tuple((c.src_block_id, c.dst_block_id) for c in msgs)


def tier_ops_to_proto(tier_ops) -> list[pb.TierOp]:
    """Tier ops as messages; a kind other than OFFLOAD/RESTORE or a negative
    block is a bug of whoever made the op (ValueError, naming it), not a value
    for protobuf to refuse without a field name."""
    out = []
    for i, op in enumerate(tier_ops):
        kind = _TIER_KINDS.get(op.kind)
        if kind is None:
            raise ValueError(f"tier_ops[{i}].kind is {op.kind!r}, not {OFFLOAD!r} or {RESTORE!r}")
        if not (type(op.device_block) is int and type(op.host_block) is int
                and op.device_block >= 0 and op.host_block >= 0):
            raise ValueError(f"tier_ops[{i}] names blocks {op.device_block!r} (device) and {op.host_block!r} "
                             "(host); both must be integers >= 0")
        out.append(pb.TierOp(kind=kind, device_block_id=op.device_block, host_block_id=op.host_block))
    return out


def tier_ops_from_proto(msgs, field: str = "tier_ops") -> tuple[TierOp, ...]:
    """Tier ops of a reply or a Watch delta. A kind this code does not know (unset,
    or a newer blockd's) is refused (:class:`~blockd.rpc.errors.BadField`):
    a worker that skipped it would hold other KV than blockd's tables say."""
    out = []
    for i, m in enumerate(msgs):
        kind = _TIER_NAMES.get(m.kind)
        if kind is None:
            raise BadField(f"{field}[{i}].kind", f"is {m.kind}, not a tier op kind this client knows "
                                                  "(offload, restore): upgrade it")
        out.append(TierOp(kind, m.device_block_id, m.host_block_id))
    return tuple(out)


def step_result_to_proto(result: StepResult, response: pb.StepResponse | None = None) -> pb.StepResponse:
    """``result`` as a StepResponse; written into ``response`` when given (a
    StepStream answer's, so that the answer is not built and then copied)."""
    response = pb.StepResponse() if response is None else response
    response.version, response.pool_incarnation, response.term = result.version, result.incarnation, result.term
    if result.copy_ops:
        response.copy_ops.extend(_copies_to_proto(result.copy_ops))
    if result.tier_ops:
        response.tier_ops.extend(tier_ops_to_proto(result.tier_ops))
    add = response.results.add  # built in place: no copy of the slot arrays
    for r in result.results:
        # counts a decode step leaves at zero are set only when not (a keyword costs: 2 us of 7 here)
        out = add(seq_id=r.seq_id, num_tokens=r.num_tokens, new_block_ids=r.new_block_ids,
                  copy_ops=_copies_to_proto(r.copy_ops), slot_start=r.slot_start, slot_mapping=r.slot_mapping)
        for name in _RARE_COUNTS:
            if value := getattr(r, name):
                setattr(out, name, value)
        if r.transfer is not None:
            _transfer_to_proto(r.transfer, out.transfer)
    return response


def _transfer_to_proto(plan: TransferPlan, out: pb.TransferPlan) -> None:
    out.source_pool, out.source_incarnation = plan.source_pool, plan.source_incarnation
    out.source_version, out.first_token = plan.source_version, plan.first_token
    out.num_tokens = plan.num_tokens
    out.src_tiers.extend(plan.src_tiers)
    out.src_blocks.extend(plan.src_blocks)
    out.dst_blocks.extend(plan.dst_blocks)
    for rank, address, incarnation in plan.source_workers:
        out.source_workers.add(rank=rank, address=address, worker_incarnation=incarnation)


def _transfer_from_proto(r) -> TransferPlan | None:
    if not r.HasField("transfer"):
        return None
    t = r.transfer
    if not (len(t.src_tiers) == len(t.src_blocks) == len(t.dst_blocks)):
        raise ValueError(f"a transfer plan of {len(t.dst_blocks)} blocks lists {len(t.src_blocks)} source "
                         f"blocks and {len(t.src_tiers)} tiers")
    return TransferPlan(t.source_pool, t.source_incarnation, t.source_version, t.first_token, t.num_tokens,
                        tuple(t.src_tiers), tuple(t.src_blocks), tuple(t.dst_blocks),
                        tuple((w.rank, w.address, w.worker_incarnation) for w in t.source_workers))


def step_result_from_proto(msg: pb.StepResponse) -> StepResult:
    results = tuple(
        OpResult(seq_id=r.seq_id, num_tokens=r.num_tokens, num_cached_tokens=r.num_cached_tokens,
                 new_block_ids=tuple(r.new_block_ids), copy_ops=_copies_from_proto(r.copy_ops),
                 slot_start=r.slot_start, slot_mapping=tuple(r.slot_mapping),
                 num_restored_tokens=r.num_restored_tokens, miss_never_stored=r.miss_never_stored,
                 miss_evicted_device=r.miss_evicted_device, miss_evicted_host=r.miss_evicted_host,
                 miss_partial=r.miss_partial, miss_other_extra_keys=r.miss_other_extra_keys,
                 transfer=_transfer_from_proto(r))
        for r in msg.results)
    return StepResult(version=msg.version, results=results, copy_ops=_copies_from_proto(msg.copy_ops),
                      incarnation=msg.pool_incarnation, term=msg.term, tier_ops=tier_ops_from_proto(msg.tier_ops))


# --- tables, sequences, followers ----------------------------------------------------
def tables_to_proto(tables: dict[str, list[int]]) -> list[pb.BlockTable]:
    return [pb.BlockTable(seq_id=seq_id, block_ids=table) for seq_id, table in tables.items()]


def tables_from_proto(msgs) -> dict[str, list[int]]:
    return {t.seq_id: list(t.block_ids) for t in msgs}


def sequence_to_proto(info: SequenceInfo) -> pb.GetSequenceResponse:
    return pb.GetSequenceResponse(seq_id=info.seq_id, num_tokens=info.num_tokens,
                                  num_committed=info.num_committed, block_ids=info.block_table,
                                  kv_lost=info.kv_lost)


def sequence_from_proto(msg: pb.GetSequenceResponse) -> SequenceInfo:
    return SequenceInfo(msg.seq_id, msg.num_tokens, msg.num_committed, list(msg.block_ids), msg.kv_lost)


def watch_item_to_proto(item: Snapshot | VersionDelta, incarnation: str, term: int = 0) -> pb.WatchResponse:
    """``incarnation``: the pool incarnation of a delta (a snapshot names its
    own); ``term``: the serving leader's (0: not replicated)."""
    if isinstance(item, Snapshot):
        return pb.WatchResponse(snapshot=pb.Snapshot(version=item.version, tables=tables_to_proto(item.tables)),
                                pool_incarnation=item.incarnation, term=term, resync=item.resync)
    updates = [pb.TableUpdate(seq_id=u.seq_id, keep=u.keep, block_ids=u.block_ids, freed=u.freed)
               for u in item.updates]
    return pb.WatchResponse(delta=pb.VersionDelta(version=item.version, updates=updates,
                                                  copy_ops=_copies_to_proto(item.copy_ops),
                                                  tier_ops=tier_ops_to_proto(item.tier_ops)),
                            pool_incarnation=incarnation, term=term)


def watch_item_from_proto(msg: pb.WatchResponse) -> Snapshot | VersionDelta:
    """A snapshot keeps its incarnation; a delta's is the one the stream was
    opened with (or the last snapshot's)."""
    if msg.WhichOneof("kind") == "snapshot":
        return Snapshot(msg.snapshot.version, tables_from_proto(msg.snapshot.tables), msg.pool_incarnation,
                        msg.term, msg.resync)
    delta = msg.delta
    updates = tuple(TableUpdate(u.seq_id, u.keep, tuple(u.block_ids), u.freed) for u in delta.updates)
    return VersionDelta(delta.version, updates, _copies_from_proto(delta.copy_ops), msg.term,
                        tier_ops_from_proto(delta.tier_ops, "delta.tier_ops"))


def event_to_proto(event: KVEvent) -> pb.KVEvent:
    medium = _MEDIA.get(event.medium)
    if medium is None:
        raise ValueError(f"KVEvent.medium is {event.medium!r}, not 'device' or 'host'")
    return pb.KVEvent(seq_no=event.seq_no, kind=_EVENT_KINDS[event.kind], block_hash=event.block_hash,
                      parent_hash=event.parent_hash,
                      block_id=event.block_id if event.block_id >= 0 else None,
                      token_ids=event.token_ids, medium=medium)


def event_from_proto(msg: pb.KVEvent) -> KVEvent:
    """An unknown kind reads "Unknown" and an unknown medium "unknown": events only
    inform (a router's prefix index), so a newer blockd's are passed on, not refused."""
    return KVEvent(msg.seq_no, _EVENT_NAMES.get(msg.kind, "Unknown"), msg.block_hash, msg.parent_hash,
                   msg.block_id if msg.HasField("block_id") else -1, tuple(msg.token_ids),
                   _MEDIUM_NAMES.get(msg.medium, "unknown"))


# --- workers ---------------------------------------------------------------------------
def worker_info_from_proto(msg: pb.WorkerInfo, field: str = "info") -> WorkerInfo:
    require_id(msg.worker_id, f"{field}.worker_id")
    require_id(msg.pool, f"{field}.pool")
    _bounded_text([("address", msg.address)], field, MAX_ID_LEN)
    _bounded_text([("device", msg.device)], field, MAX_DEVICE_LEN)
    return WorkerInfo(**{name: getattr(msg, name) for name in _WORKER_FIELDS})


def worker_info_to_proto(info: WorkerInfo) -> pb.WorkerInfo:
    return pb.WorkerInfo(**{name: getattr(info, name) for name in _WORKER_FIELDS})


def worker_status_to_proto(status: WorkerStatus) -> pb.WorkerStatus:
    return pb.WorkerStatus(info=worker_info_to_proto(status.info), is_up=status.is_up,
                           last_heartbeat_age_s=status.last_heartbeat_age_s,
                           applied_version=status.applied_version)


def worker_status_from_proto(msg: pb.WorkerStatus) -> WorkerStatus:
    info = WorkerInfo(**{name: getattr(msg.info, name) for name in _WORKER_FIELDS})
    return WorkerStatus(info, msg.is_up, msg.last_heartbeat_age_s, msg.applied_version)


# --- replicas ---------------------------------------------------------------------------
_FOLLOWER_FIELDS = tuple(FollowerStatus.__dataclass_fields__)
_REPLICA_FIELDS = tuple(f for f in ReplicaStatus.__dataclass_fields__ if f != "followers")


def replica_status_to_proto(status: ReplicaStatus) -> rpb.GetReplicaStatusResponse:
    return rpb.GetReplicaStatusResponse(
        **{name: getattr(status, name) for name in _REPLICA_FIELDS},
        followers=[rpb.FollowerStatus(**{name: getattr(f, name) for name in _FOLLOWER_FIELDS})
                   for f in status.followers])


def replica_status_from_proto(msg: rpb.GetReplicaStatusResponse) -> ReplicaStatus:
    return ReplicaStatus(**{name: getattr(msg, name) for name in _REPLICA_FIELDS},
                         followers=tuple(FollowerStatus(**{name: getattr(f, name) for name in _FOLLOWER_FIELDS})
                                         for f in msg.followers))
