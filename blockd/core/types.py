"""Plain data exchanged with the allocator: config, operations, results, events.

These small frozen dataclasses are the whole interface between a caller (the
gRPC service, a scheduler, a test) and :class:`blockd.core.pool.Pool`; they
carry plain ints, strings and bytes, never internal block objects. The last
section holds what the daemon reports besides allocation (table snapshots,
sequences, workers), so the SDK and the workers read it without the daemon.
Imports only the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blockd.core.hashing import NO_EXTRA_KEYS, ExtraKeys
from blockd.core.lru import DEFAULT_PRIORITY

#: bytes per element of the dtypes a pool may declare
DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3": 1, "float8_e5m2": 1, "int8": 1,
}
MAX_BLOCK_SIZE = 1 << 16
MAX_NUM_BLOCKS = 1 << 26


@dataclass(frozen=True)
class PoolConfig:
    """One logical KV cache: ``num_blocks`` blocks of ``block_size`` slots.

    The model geometry gives bytes per block for the metrics and the workers;
    the allocator itself only needs the two sizes and the watermark.
    """

    name: str
    num_blocks: int
    block_size: int
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 1
    dtype: str = "float16"
    #: blocks kept back from new sequences so running ones can still append
    watermark_blocks: int = 0
    #: how many past versions' deltas a follower can catch up from
    max_retained_versions: int = 1024
    #: who owns the pool (:data:`~blockd.core.hashing.DEFAULT_TENANT` when nobody
    #: assigned one); folded into every block hash. ``""`` in a request means
    #: "the caller's tenant" (the daemon fills it in); the allocator treats it
    #: as the default tenant
    tenant: str = ""
    #: blocks of the host-memory tier, per shard, with the device blocks' layout
    #: (0: no host tier). A cached block evicted from the device tier moves here
    #: (an OFFLOAD tier op) instead of being dropped, and comes back (RESTORE) on
    #: a prefix hit; only eviction from this tier drops its hash.
    num_host_blocks: int = 0

    @property
    def bytes_per_slot(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_slot


@dataclass(frozen=True)
class Allocate:
    """Create a sequence holding ``prompt_token_ids``, reusing cached prefix blocks."""

    seq_id: str
    prompt_token_ids: tuple[int, ...] | list[int]
    extra_keys: ExtraKeys = NO_EXTRA_KEYS
    #: another pool of the tenant whose cached blocks may serve the prompt's missed
    #: blocks (the daemon plans a :class:`TransferPlan`; the core ignores it)
    source_pool: str = ""
    #: > 0: once the prompt's full blocks are committed, the daemon pins them for
    #: this many seconds (docs/protocol.md, Pins; the core ignores it)
    retain_ttl_s: float = 0.0
    #: retention priority in ``[0, 8)``, lower evicted first (4: the default):
    #: the sequence's blocks enter the evictable LRU at it, or at the higher
    #: priority of another holder (docs/protocol.md, Priorities)
    priority: int = DEFAULT_PRIORITY
    #: a live sequence of the pool (usually allocated earlier in the same batch)
    #: whose blocks stand in for the prompt's full blocks past the cached ones, as
    #: far as both prompts' tokens and extra keys agree, at most ``share_tokens``
    #: tokens: the caller's model step writes that K/V before this sequence reads
    #: it. Shared, not published: the blocks enter the prefix cache once committed.
    share_seq_id: str = ""
    share_tokens: int = 0


@dataclass(frozen=True)
class Append:
    """Add tokens to a sequence; implies that its tokens from before the batch
    are committed (not those an earlier op of the same batch added)."""

    seq_id: str
    token_ids: tuple[int, ...] | list[int]


@dataclass(frozen=True)
class DecodeAppend:
    """Append one token to each of many sequences: a decode step in one op.

    Equivalent to ``Append(seq_ids[i], [token_ids[i]])`` for every ``i`` in
    order, but columnar, so a step over thousands of running sequences costs
    a tight loop instead of thousands of op objects (and, over gRPC, two
    packed arrays instead of thousands of messages). Its result's
    ``slot_mapping[i]`` is the slot of ``token_ids[i]``.
    """

    seq_ids: tuple[str, ...] | list[str]
    token_ids: tuple[int, ...] | list[int]


@dataclass(frozen=True)
class Commit:
    """The KV of the sequence's first ``num_tokens`` tokens has been written."""

    seq_id: str
    num_tokens: int


@dataclass(frozen=True)
class Fork:
    """Create ``child_seq_id`` sharing every block of ``parent_seq_id``."""

    parent_seq_id: str
    child_seq_id: str


@dataclass(frozen=True)
class Free:
    """Drop a sequence; its blocks lose one reference."""

    seq_id: str


Op = Allocate | Append | DecodeAppend | Commit | Fork | Free


@dataclass(frozen=True)
class OpResult:
    """What one operation did, as plain ints.

    ``slot_mapping`` holds the physical slots of the tokens the caller must now
    compute, starting at token position ``slot_start``: for an allocation the
    prompt tokens after the cached prefix, for an append the new tokens.
    ``new_block_ids`` were appended to the table; ``copy_ops`` are
    copy-on-write copies ``(src, dst)`` the workers run before attention.
    For :class:`DecodeAppend` ``seq_id`` is empty, ``slot_mapping`` has one
    slot per listed sequence and ``new_block_ids`` the blocks it added, in
    order; the table changes themselves are in the version's delta.
    """

    seq_id: str
    num_tokens: int
    num_cached_tokens: int = 0
    new_block_ids: tuple[int, ...] = ()
    copy_ops: tuple[tuple[int, int], ...] = ()
    slot_start: int = 0
    slot_mapping: tuple[int, ...] = ()
    #: of ``num_cached_tokens``, those whose blocks come back from the host tier
    #: (RESTORE tier ops at this version): cached for the scheduler, copied by the workers.
    #: Their blocks are in the table's cached prefix, not in ``new_block_ids``.
    num_restored_tokens: int = 0
    #: an :class:`Allocate`'s prompt tokens not served from cache, by reason
    #: (:data:`MISS_REASONS`; they add up to ``num_tokens - num_cached_tokens``).
    #: ``miss_partial``: the tokens past the last block a hit may cover (the last,
    #: not-full block; for a prompt of whole blocks its last block, since the last
    #: token is always computed). Each full block from the first miss on has its
    #: own reason: its hash was dropped from the device tier with no host tier to
    #: take it (``evicted_device``) or from the host tier (``evicted_host``); its
    #: tokens are cached in the pool under other extra keys (``other_extra_keys``);
    #: or none of these is known (``never_stored``). 0 for other operations.
    miss_never_stored: int = 0
    miss_evicted_device: int = 0
    miss_evicted_host: int = 0
    miss_partial: int = 0
    miss_other_extra_keys: int = 0
    #: blocks of ``Allocate.source_pool`` that can stand in for computing some of
    #: the missed tokens (set by the daemon; None: nothing to fetch)
    transfer: TransferPlan | None = None


#: why prompt tokens missed the prefix cache (:class:`OpResult`'s ``miss_*``, in this order)
MISS_REASONS = ("never_stored", "evicted_device", "evicted_host", "partial", "other_extra_keys")


#: :class:`TierOp` kinds
OFFLOAD = "offload"
RESTORE = "restore"


@dataclass(frozen=True)
class TierOp:
    """One block copied between a pool's device blocks and its host tier.

    ``OFFLOAD``: device block -> host block, so the device block can be reused
    while its KV stays cached; ``RESTORE``: host block -> device block, a
    prefix hit in the host tier. Every worker of the pool runs a version's tier
    ops in order, before that version's copy-on-write copies and before
    anything writes the device block or reads it (write_kv, attention).
    """

    kind: str
    device_block: int
    host_block: int


@dataclass(frozen=True)
class TransferPlan:
    """Cached blocks of ``source_pool`` holding the KV of an allocation's missed
    prompt blocks, ``num_tokens`` from token ``first_token`` on: ``src_blocks`` (in tier
    ``src_tiers[i]``, ``"device"`` or ``"host"``) as of ``source_version`` of
    incarnation ``source_incarnation``, for the destination blocks ``dst_blocks``
    of the allocating pool. Those tokens stay uncached for blockd: the caller's
    workers fetch the blocks shard by shard from ``source_workers`` (rank,
    address, worker incarnation) and, where every shard succeeded, the tokens
    count as computed and are committed like computed ones; where any failed
    they are computed. A source worker refuses a block reassigned since
    ``source_version``, so a fetch never reads other KV."""

    source_pool: str
    source_incarnation: str
    source_version: int
    first_token: int
    num_tokens: int
    src_tiers: tuple[str, ...]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    source_workers: tuple[tuple[int, str, str], ...] = ()


@dataclass(frozen=True)
class TableUpdate:
    """One table change inside a version: keep the first ``keep`` entries, then
    append ``block_ids``; or, when ``freed``, drop the sequence's table."""

    seq_id: str
    keep: int = 0
    block_ids: tuple[int, ...] = ()
    freed: bool = False


@dataclass(frozen=True)
class VersionDelta:
    """Everything a follower applies to go from ``version - 1`` to ``version``:
    first the tier ops, then the copy ops, then the table updates in order."""

    version: int
    updates: tuple[TableUpdate, ...]
    copy_ops: tuple[tuple[int, int], ...]
    #: the leader term that served this delta over Watch (a replicated group,
    #: docs/ha.md); 0 when not replicated. The core leaves it 0.
    term: int = 0
    #: offloads and restores between the tiers, run before ``copy_ops``
    tier_ops: tuple[TierOp, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """Result of one atomic batch: the new version and one result per op."""

    version: int
    results: tuple[OpResult, ...]
    copy_ops: tuple[tuple[int, int], ...] = ()
    #: the pool incarnation ``version`` belongs to; set by the daemon (the core
    #: does not know incarnations and leaves it empty)
    incarnation: str = ""
    #: the term of the leader that acknowledged it (a replicated group); 0 when
    #: not replicated. Set by the daemon, like ``incarnation``.
    term: int = 0
    #: the batch's offloads and restores between the tiers (its delta's), run before ``copy_ops``
    tier_ops: tuple[TierOp, ...] = ()


BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"


@dataclass(frozen=True)
class KVEvent:
    """A change to the prefix index, numbered per pool from 1 without gaps."""

    seq_no: int
    kind: str
    block_hash: bytes = b""
    parent_hash: bytes = b""
    block_id: int = -1
    token_ids: tuple[int, ...] = field(default=())
    #: where the block was (``"device"`` or ``"host"``): a BlockStored is always
    #: on the device; a BlockRemoved names the tier it was evicted from (its
    #: ``block_id`` is then a host block). Offloads and restores move a hash
    #: between the tiers without an event: it stays cached.
    medium: str = "device"


@dataclass(frozen=True)
class PoolStats:
    """Counts read in O(1); ``tail_waste_slots`` = used blocks * b - distinct
    token slots in use."""

    name: str
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int
    num_evictable_blocks: int
    num_seqs: int
    num_tokens: int
    tail_waste_slots: int
    tail_waste_bytes: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    #: cached hashes dropped to make room (each a BlockRemoved), from either
    #: tier; a block offloaded to the host tier is not one
    num_evictions: int
    num_copies: int
    version: int
    last_event_seq_no: int
    #: set by the daemon (the core leaves them empty): the pool's incarnation and
    #: how many sequences lost their KV in a worker restart (:mod:`blockd.engine.incarnations`)
    incarnation: str = ""
    num_kv_lost_seqs: int = 0
    #: the pool's tenant (its config's)
    tenant: str = ""
    #: the host tier: its size, and how many of its blocks hold a cached block
    num_host_blocks: int = 0
    num_host_cached_blocks: int = 0
    #: blocks moved device -> host, and host -> device on a prefix hit, since the pool was made
    num_offloads: int = 0
    num_restores: int = 0
    #: prompt tokens missed since the pool was made, by reason, in :data:`MISS_REASONS` order
    prefix_miss_tokens: tuple[int, ...] = (0, 0, 0, 0, 0)
    #: device blocks held by at least one pin (used blocks: never evicted while pinned), and the pins
    num_pinned_blocks: int = 0
    num_pins: int = 0

    @property
    def prefix_miss_by_reason(self) -> dict[str, int]:
        return dict(zip(MISS_REASONS, self.prefix_miss_tokens, strict=True))

    @property
    def utilisation_ratio(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


# --- what the daemon reports besides allocation (shared with the SDK) --------------
#: longest device name a worker may report
MAX_DEVICE_LEN = 64


@dataclass(frozen=True)
class Snapshot:
    """All tables of a pool at ``version`` of ``incarnation`` (for a follower
    that fell behind, or whose replica belongs to another incarnation)."""

    version: int
    tables: dict[str, list[int]]
    incarnation: str = ""
    #: as :attr:`VersionDelta.term`
    term: int = 0
    #: the follower's versions may not be this leader's (``WatchResponse.resync``)
    resync: bool = False


@dataclass(frozen=True)
class SequenceInfo:
    """One sequence as the daemon holds it; ``kv_lost`` when a worker restart
    lost its KV (it must be freed and computed again)."""

    seq_id: str
    num_tokens: int
    num_committed: int
    block_table: list[int]
    kv_lost: bool = False


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's registration: the shard of the pool it holds and where to dial it."""

    worker_id: str
    pool: str
    address: str = ""
    layer_start: int = 0
    layer_end: int = 0
    kv_head_start: int = 0
    kv_head_end: int = 0
    pool_bytes: int = 0
    device: str = "cpu"
    #: a random id the worker process made when it started (required to register)
    incarnation: str = ""


@dataclass(frozen=True)
class WorkerStatus:
    """A registered worker and whether its heartbeats are recent."""

    info: WorkerInfo
    is_up: bool
    last_heartbeat_age_s: float
    applied_version: int


@dataclass(frozen=True)
class FollowerStatus:
    """The leader's view of one follower (``GetReplicaStatus``)."""

    replica_id: str
    address: str
    persisted_lsn: int
    lag_records: int
    in_sync: bool
    last_ack_age_s: float


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica's view of its group (``GetReplicaStatus``; ``blockctl cluster status``).

    ``role`` is ``leader``, ``follower`` or ``candidate``; ``term`` the term it
    leads or the newest it knows; ``commit_lsn`` the leader's commit point (a
    follower: as last streamed to it); ``followers`` and ``in_sync_replicas``
    are the leader's only.
    """

    replica_id: str
    group: str
    role: str
    term: int
    leader_id: str
    leader_address: str
    last_lsn: int
    commit_lsn: int
    mode: str
    streaming: bool = False
    in_sync_replicas: int = 0
    followers: tuple[FollowerStatus, ...] = ()
