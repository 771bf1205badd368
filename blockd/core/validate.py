"""Input checks shared by the allocator's entry points.

Every check raises :class:`~blockd.core.errors.InvalidArgument` with a message
that says what was wrong and what is allowed, before any state changes.
Imports only the standard library.
"""

from __future__ import annotations

import re

from blockd.core.errors import InvalidArgument, shown
from blockd.core.hashing import ExtraKeys
from blockd.core.lru import DEFAULT_PRIORITY, NUM_PRIORITIES
from blockd.core.types import DTYPE_BYTES, MAX_BLOCK_SIZE, MAX_NUM_BLOCKS, PoolConfig

#: longest pool name, sequence id, worker id or request id (in characters)
MAX_ID_LEN = 256
#: longest extra-key string (model id, adapter name, cache salt, mm hash)
MAX_EXTRA_KEY_LEN = 1024
MAX_GEOMETRY = 1 << 20
#: tenant (and caller identity) names: short, printable, safe in a SPIFFE URI path and in a log line
SAFE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(value: object, what: str) -> str:
    """A pool name or sequence id: a non-empty printable string of <= 256 chars."""
    if type(value) is not str or not value:
        raise InvalidArgument(f"{what} must be a non-empty string, got {shown(value)}")
    if len(value) > MAX_ID_LEN or not value.isprintable():
        raise InvalidArgument(f"{what} must be printable and at most {MAX_ID_LEN} characters")
    return value


def check_int(value: object, what: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidArgument(f"{what} must be an integer in [{lo}, {hi}], got {shown(value)}")
    return value


def check_priority(value: object, what: str = "priority") -> int:
    """A retention priority: an int in ``[0, NUM_PRIORITIES)``."""
    if type(value) is not int or not 0 <= value < NUM_PRIORITIES:
        raise InvalidArgument(f"{what} must be an integer in [0, {NUM_PRIORITIES - 1}] (lower is evicted first; "
                              f"default {DEFAULT_PRIORITY}), got {shown(value)}")
    return value


def check_extra_keys(extra: object) -> ExtraKeys:
    if not isinstance(extra, ExtraKeys):
        raise InvalidArgument(f"extra_keys must be ExtraKeys, got {type(extra).__name__}")
    check_int(extra.adapter_id, "extra_keys.adapter_id", -(2**63), 2**63 - 1)
    for text in (extra.model_id, extra.model_revision, extra.adapter_name, extra.cache_salt, *extra.mm_hashes):
        if type(text) is not str or len(text) > MAX_EXTRA_KEY_LEN:
            raise InvalidArgument(f"extra_keys fields must be strings of at most {MAX_EXTRA_KEY_LEN} characters")
    return extra


def check_config(cfg: PoolConfig) -> None:
    """Refuse sizes that are non-positive, absurd, or inconsistent."""
    check_name(cfg.name, "pool name")
    check_int(cfg.block_size, "block_size", 1, MAX_BLOCK_SIZE)
    check_int(cfg.num_blocks, "num_blocks", 1, MAX_NUM_BLOCKS)
    check_int(cfg.num_layers, "num_layers", 1, MAX_GEOMETRY)
    check_int(cfg.num_kv_heads, "num_kv_heads", 1, MAX_GEOMETRY)
    check_int(cfg.head_dim, "head_dim", 1, MAX_GEOMETRY)
    check_int(cfg.watermark_blocks, "watermark_blocks", 0, cfg.num_blocks)
    check_int(cfg.num_host_blocks, "num_host_blocks (host-tier blocks; 0: no host tier)", 0, MAX_NUM_BLOCKS)
    check_int(cfg.max_retained_versions, "max_retained_versions", 1, 1 << 20)
    if cfg.tenant != "" and (type(cfg.tenant) is not str or not SAFE_NAME_RE.match(cfg.tenant)):
        raise InvalidArgument(f"tenant must be 1-128 of letters, digits, '.', '-', '_' (starting with a letter or "
                              f"digit), got {shown(cfg.tenant)}")
    if cfg.dtype not in DTYPE_BYTES:
        raise InvalidArgument(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {shown(cfg.dtype)}")
