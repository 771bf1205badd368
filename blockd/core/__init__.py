"""blockd's allocator core: pools, block tables, ref counts, copy-on-write,
the prefix cache, atomic batches, versions and KV events.

Python over the standard library: it must never import grpc, torch or
prometheus_client (a test checks ``sys.modules`` in a fresh interpreter), so
the daemon, the workers, the benchmarks and the tests can all use it as is.

The modules a decode step runs through (:data:`COMPILED`) are compiled with
mypyc where the install could (``setup.py``); :data:`BUILD` says which build
this process runs. A compiled module runs only if it was built from the
source beside it: when any source differs from ``compiled_from.sha256`` (the
sources' SHA-256 at build time, so an edit since the last ``make setup``) or
``BLOCKD_PURE_PYTHON=1`` is set, all of them run from source, because the
compiled modules check the types of each other's objects and cannot be mixed
with sources.
"""

import collections.abc as _abc
import hashlib as _hashlib
import importlib.machinery as _machinery
import importlib.util as _util
import logging as _logging
import os as _os
import sys as _sys
import types as _types
from pathlib import Path as _Path

#: the core's modules that ``setup.py`` compiles (keep the two lists equal)
COMPILED = ("batch", "blocks", "decode", "sequence")


def _choose_build() -> str:
    """``"compiled"``, or ``"python"`` with why; installs the sources' finder when a build is present but unusable."""
    here = _Path(__file__).parent
    built = [name for name in COMPILED
             if any((here / f"{name}{suffix}").exists() for suffix in _machinery.EXTENSION_SUFFIXES)]
    if not built:
        return "python (not compiled)"
    why = ""
    if _os.environ.get("BLOCKD_PURE_PYTHON") == "1":
        why = "BLOCKD_PURE_PYTHON=1"
    elif len(built) < len(COMPILED):
        why = f"only {', '.join(built)} compiled"
    else:
        try:
            recorded = dict(line.split()[::-1] for line in (here / "compiled_from.sha256").read_text().splitlines())
        except (OSError, ValueError):  # missing, or not "<sha256>  <name>.py" lines
            recorded = None
        edited = [name for name in COMPILED if (recorded or {}).get(f"{name}.py")
                  != _hashlib.sha256((here / f"{name}.py").read_bytes()).hexdigest()]
        if recorded is None:
            why = "compiled_from.sha256 is missing or damaged, so the build cannot be matched to its sources"
        elif edited:
            why = f"{', '.join(f'{name}.py' for name in edited)} changed since it was compiled"
        if why:
            why += "; `make setup` compiles it again"
            _logging.getLogger("blockd.core").warning("the compiled core is stale (%s): running it from source", why)
    if not why:
        return "compiled"
    _sys.meta_path.insert(0, _Sources(here))
    return f"python ({why})"


class _Sources:
    """A finder that loads :data:`COMPILED` from their ``.py`` files, ahead of any compiled module."""

    def __init__(self, here: _Path) -> None:
        self.paths = {f"{__name__}.{name}": here / f"{name}.py" for name in COMPILED}

    def find_spec(self, fullname: str, path: _abc.Sequence[str] | None = None,
                  target: _types.ModuleType | None = None) -> _machinery.ModuleSpec | None:
        source = self.paths.get(fullname)
        return None if source is None else _util.spec_from_file_location(fullname, source)


#: which build of the core this process runs: ``compiled`` or ``python (why)``
BUILD = _choose_build()

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
    "BUILD",
    "COMPILED",
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
