"""blockd's allocator core: pools, block tables, ref counts, copy-on-write,
the prefix cache, atomic batches, versions and KV events.

Pure Python over the standard library: it must never import grpc, torch or
prometheus_client (a test checks ``sys.modules`` in a fresh interpreter), so
the daemon, the workers, the benchmarks and the tests can all use it as is.
"""

from blockd.core.arith import locate, num_blocks_for, slot_at, slot_mapping, slot_of, tail_waste
from blockd.core.errors import (
    AlreadyExists,
    BlockdError,
    InvalidArgument,
    InvariantViolation,
    NoRoom,
    NotFound,
    WrongState,
)
from blockd.core.hashing import NO_EXTRA_KEYS, ExtraKeys, hash_block, hash_full_blocks
from blockd.core.invariants import check_invariants
from blockd.core.lru import DEFAULT_PRIORITY, NUM_PRIORITIES
from blockd.core.pool import Pin, Pool, PrefixPriority, SnapshotRequired
from blockd.core.types import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    OFFLOAD,
    RESTORE,
    Allocate,
    Append,
    Commit,
    DecodeAppend,
    Fork,
    Free,
    KVEvent,
    Op,
    OpResult,
    PoolConfig,
    PoolStats,
    StepResult,
    TableUpdate,
    TierOp,
    VersionDelta,
)

__all__ = [
    "ALL_BLOCKS_CLEARED",
    "BLOCK_REMOVED",
    "BLOCK_STORED",
    "DEFAULT_PRIORITY",
    "NO_EXTRA_KEYS",
    "NUM_PRIORITIES",
    "OFFLOAD",
    "RESTORE",
    "Allocate",
    "AlreadyExists",
    "Append",
    "BlockdError",
    "Commit",
    "DecodeAppend",
    "ExtraKeys",
    "Fork",
    "Free",
    "InvalidArgument",
    "InvariantViolation",
    "KVEvent",
    "NoRoom",
    "NotFound",
    "Op",
    "OpResult",
    "Pin",
    "Pool",
    "PoolConfig",
    "PoolStats",
    "PrefixPriority",
    "SnapshotRequired",
    "StepResult",
    "TableUpdate",
    "TierOp",
    "VersionDelta",
    "WrongState",
    "check_invariants",
    "hash_block",
    "hash_full_blocks",
    "locate",
    "num_blocks_for",
    "slot_at",
    "slot_mapping",
    "slot_of",
    "tail_waste",
]
