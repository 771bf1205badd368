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

The spec a router outside blockd implements (:func:`hash_spec`, served by
``BlockService.GetHashSpec`` and shown by ``blockctl hash-spec``) is the
prose below :data:`HASH_SPEC_ID`, checked by its test vectors; bump the id
whenever any hash would change, so a worker or scheduler of another spec is
refused (:func:`check_hash_spec`) rather than silently missing every prefix.

Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from blockd.core.errors import InvalidArgument, WrongState, shown

HASH_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1
_DOMAIN = b"blockd.block.v1"
_EXTRA_PERSON = b"blockd.extra"
_TENANT_PERSON = b"blockd.tenant"
_ROOT = b"\0" * HASH_BYTES
#: a block's token ids as array("I") bytes: 0.6x the time of struct.pack(*ids), the same bytes where
#: its "I" is a little-endian uint32 (elsewhere struct packs them)
_ARRAY_IS_LE_U32 = array("I").itemsize == 4 and sys.byteorder == "little"
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
        h = hashlib.blake2b(digest_size=HASH_BYTES, person=_EXTRA_PERSON)
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
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=_TENANT_PERSON)
    h.update(struct.pack("<I", len(raw)))
    h.update(raw)
    h.update(extra_digest)
    return h.digest()


#: the hash state after the domain tag: each block's hash starts from a copy of it
_BLOCK_STATE = hashlib.blake2b(_DOMAIN, digest_size=HASH_BYTES)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_digest: bytes) -> bytes:
    """Hash of one full block, chained on its parent's hash (``None`` for the first)."""
    # a copy of the seeded state and one update of the joined parts: 0.65 us a block
    # against 1.0 for a new state and three updates (a decode step hashes 1 in 16 of its sequences)
    h = _BLOCK_STATE.copy()
    h.update(b"".join((parent if parent is not None else _ROOT, extra_digest,
                       array("I", token_ids) if _ARRAY_IS_LE_U32 else struct.pack(f"<{len(token_ids)}I", *token_ids))))
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


# --- the spec, for routers and for refusing another one ------------------------------
#: names every byte :func:`hash_block` hashes: change it whenever any hash changes
HASH_SPEC_ID = "blockd.block-hash.v1"
HASH_ALGORITHM = "blake2b-128 chained"
_SPEC_TEXT = {
    "block_hash_encoding": (
        "H(block i) = BLAKE2b (RFC 7693) with a 16-byte digest (digest_size=16), no key, no salt and no "
        f'personalization, over the concatenation of: the {len(_DOMAIN)} ASCII bytes "{_DOMAIN.decode()}"; '
        "the parent hash (16 bytes, parent_hash_encoding); the extra digest E (16 bytes, extra_keys_encoding "
        "then tenant_encoding); the block's token ids (token_ids_encoding). Only full blocks have a hash: "
        "block i holds tokens [i*block_size, (i+1)*block_size) of the sequence (its prompt, then its "
        "appended tokens); a partial last block has none. Hashes travel as 16 raw bytes (KVEvent.block_hash, "
        "parent_hash) and are written as 32 lowercase hex digits."),
    "token_ids_encoding": (
        "Each token id of the block, in order, as an unsigned 32-bit little-endian integer (4 bytes; ids are "
        "in [0, 2**32-1]), concatenated with no count or separator: block_size * 4 bytes."),
    "parent_hash_encoding": (
        "The hash of the previous block of the same sequence (16 bytes); for block 0, 16 zero bytes. A "
        "block's hash thus covers every token before it."),
    "extra_keys_encoding": (
        f'E0 = BLAKE2b with a 16-byte digest, no key, no salt, personalization "{_EXTRA_PERSON.decode()}" '
        f"(its {len(_EXTRA_PERSON)} ASCII bytes, zero-padded to the 16-byte personalization parameter), "
        "over: for each of model_id, model_revision, adapter_name and cache_salt, in this order, the length "
        "of its UTF-8 encoding in bytes as an unsigned 32-bit little-endian integer, then those bytes; then "
        "adapter_id as a signed 64-bit little-endian integer (8 bytes); then the number of mm_hashes as an "
        "unsigned 32-bit little-endian integer; then each mm_hash, in order, as its UTF-8 length (unsigned "
        "32-bit little-endian) and its UTF-8 bytes. E0 is computed from the sequence's Allocate extra_keys "
        "(none given: every string empty, adapter_id 0, no mm_hashes; E0 is still computed) and enters every "
        "block of that sequence."),
    "tenant_encoding": (
        "T is the pool's tenant (pool_tenant, PoolConfig.tenant), folded in by blockd itself: a caller's "
        f'cache_salt is an extra key beside it, never a replacement. If T is "" or "{DEFAULT_TENANT}", '
        "E = E0. Otherwise E = BLAKE2b with a 16-byte digest, no key, no salt, personalization "
        f'"{_TENANT_PERSON.decode()}" (its {len(_TENANT_PERSON)} ASCII bytes, zero-padded to 16), over: the '
        "length of T's UTF-8 encoding as an unsigned 32-bit little-endian integer, T's UTF-8 bytes, then E0 "
        "(16 bytes)."),
}


@dataclass(frozen=True)
class HashTestVector:
    """A prompt under ``extra_keys`` in a pool of ``tenant`` and ``block_size``:
    the hex hashes of its full blocks."""

    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys
    tenant: str
    block_size: int
    block_hashes: tuple[str, ...]


@dataclass(frozen=True)
class HashSpec:
    """The hash as :func:`hash_block` implements it, in words (see ``GetHashSpecResponse``)."""

    spec_id: str
    algorithm: str
    block_hash_encoding: str
    token_ids_encoding: str
    parent_hash_encoding: str
    extra_keys_encoding: str
    tenant_encoding: str
    #: a named pool's block size and tenant (0 and "": no pool named)
    block_size: int = 0
    pool_tenant: str = ""
    test_vectors: tuple[HashTestVector, ...] = ()


def make_test_vector(token_ids: Sequence[int], extra_keys: ExtraKeys, tenant: str, block_size: int) -> HashTestVector:
    """The hashes blockd gives the full blocks of ``token_ids``, computed by the functions above."""
    digest = tenant_digest(extra_keys.digest(), tenant)
    hashes = hash_full_blocks(token_ids, block_size, digest)
    return HashTestVector(tuple(token_ids), extra_keys, tenant, block_size, tuple(h.hex() for h in hashes))


def hash_spec(block_size: int = 0, pool_tenant: str = "") -> HashSpec:
    """This build's spec, with two test vectors: a plain prompt of the default
    tenant, and one with every extra key (non-ASCII text too) and a tenant."""
    vectors = (
        make_test_vector(range(1, 11), NO_EXTRA_KEYS, "", 4),
        make_test_vector([0, 1, MAX_TOKEN_ID, 65536, 7, 8, 9],
                    ExtraKeys("llama-3-8b", "r\u00e9v1", "sql-lora", 7, "salt", ("img0", "img1")), "acme", 3),
    )
    return HashSpec(HASH_SPEC_ID, HASH_ALGORITHM, **_SPEC_TEXT, block_size=block_size, pool_tenant=pool_tenant,
                    test_vectors=vectors)


class HashSpecMismatch(WrongState):
    """A peer built for another hash spec (FAILED_PRECONDITION): its hashes would never match blockd's."""

    reason = "HASH_SPEC_MISMATCH"

    def __init__(self, message: str, *, theirs: str, ours: str = HASH_SPEC_ID) -> None:
        super().__init__(message)
        self.metadata = {"hash_spec": theirs, "blockd_hash_spec": ours}


def check_hash_spec(theirs: str, who: str) -> None:
    """Refuse ``who`` (e.g. "worker 'w0'") built for hash spec ``theirs``; an
    empty ``theirs`` (a peer older than the check) passes."""
    if theirs and theirs != HASH_SPEC_ID:
        raise HashSpecMismatch(
            f"{who} hashes blocks by spec {shown(theirs)}, this blockd by {HASH_SPEC_ID!r}: run a worker release "
            f"built for {HASH_SPEC_ID!r} (upgrade the worker, or the daemon if the worker is newer; "
            f"`blockctl hash-spec` shows the daemon's spec)", theirs=theirs)
