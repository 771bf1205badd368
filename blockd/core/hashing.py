"""Block hashes for the prefix cache: the one hash function of blockd.

``hash_block(parent, tokens, extra)`` is BLAKE2b-128 over a domain tag, the
parent block's hash (the root has none), a digest of the extra keys and the
block's token ids packed as little-endian uint32. It is stable across
processes, machines and restarts (no Python ``hash()``, no pickling), so a
router may compare hashes from different daemons.

Extra keys are everything besides the token ids that changes the KV a block
holds: model id and revision, LoRA adapter name and id, a cache salt (tenant),
and the hashes of multimodal inputs. They are folded into *every* block's hash,
so equal tokens under different extra keys never share a block.

The pool's **tenant** is folded in too (:func:`tenant_digest`), by the
allocator rather than by the caller: a caller's ``cache_salt`` cannot undo
it, and equal prompts of two tenants hash differently everywhere (prefix
index, KV events, lookups), as vLLM's per-request ``cache_salt`` does. The
default tenant (``""`` or :data:`DEFAULT_TENANT`) folds nothing, so pools
made before tenants existed keep their hashes.

Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from blockd.core.errors import InvalidArgument, shown

HASH_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1
_DOMAIN = b"blockd.block.v1"
#: the tenant of pools nobody assigned one (no authentication, or data from before tenants)
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class ExtraKeys:
    """What besides token ids makes two blocks' KV differ."""

    model_id: str = ""
    model_revision: str = ""
    adapter_name: str = ""
    adapter_id: int = 0
    cache_salt: str = ""
    mm_hashes: tuple[str, ...] = field(default_factory=tuple)

    def digest(self) -> bytes:
        """Canonical, length-prefixed encoding hashed once per sequence."""
        h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"blockd.extra")
        for text in (self.model_id, self.model_revision, self.adapter_name, self.cache_salt):
            raw = text.encode()
            h.update(struct.pack("<I", len(raw)))
            h.update(raw)
        h.update(struct.pack("<qI", self.adapter_id, len(self.mm_hashes)))
        for mm in self.mm_hashes:
            raw = mm.encode()
            h.update(struct.pack("<I", len(raw)))
            h.update(raw)
        return h.digest()


NO_EXTRA_KEYS = ExtraKeys()
NO_EXTRA_DIGEST = NO_EXTRA_KEYS.digest()


def tenant_digest(extra_digest: bytes, tenant: str) -> bytes:
    """``extra_digest`` with ``tenant`` folded in; unchanged for the default tenant."""
    if not tenant or tenant == DEFAULT_TENANT:
        return extra_digest
    raw = tenant.encode()
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"blockd.tenant")
    h.update(struct.pack("<I", len(raw)))
    h.update(raw)
    h.update(extra_digest)
    return h.digest()


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_digest: bytes) -> bytes:
    """Hash of one full block, chained on its parent's hash (``None`` for the first)."""
    h = hashlib.blake2b(_DOMAIN, digest_size=HASH_BYTES)
    h.update(parent if parent is not None else b"\0" * HASH_BYTES)
    h.update(extra_digest)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_digest: bytes,
    *,
    parent: bytes | None = None,
    limit: int | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (at most ``limit``)."""
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    hashes = []
    for i in range(count):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_digest)
        hashes.append(parent)
    return hashes


def check_token_ids(token_ids: Sequence[int]) -> None:
    """Refuse token ids that are not ints in ``[0, 2**32)``."""
    try:
        # array() range- and type-checks in C; the loop below only runs to
        # name the offending id for the error message
        array("I", token_ids)
        return
    except (TypeError, OverflowError):
        pass
    for t in token_ids:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise InvalidArgument(f"token id {shown(t)} is not an integer in [0, {MAX_TOKEN_ID}]")
