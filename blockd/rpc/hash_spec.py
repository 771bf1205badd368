"""``GetHashSpecResponse`` <-> :class:`blockd.core.hashing.HashSpec`, both ways.

The daemon answers ``BlockService.GetHashSpec`` with
:func:`hash_spec_to_proto`; the SDKs read the answer with
:func:`hash_spec_from_proto`. The extra keys of a test vector go through
:mod:`blockd.rpc.convert` like any other.
"""

from __future__ import annotations

from blockd.core.hashing import HashSpec, HashTestVector
from blockd.rpc.convert import extra_keys_from_proto, extra_keys_to_proto
from blockd.v1 import blockd_pb2 as pb

#: the fields a spec and its message share by name (the test vectors aside)
_FIELDS = ("spec_id", "algorithm", "block_hash_encoding", "token_ids_encoding", "parent_hash_encoding",
           "extra_keys_encoding", "tenant_encoding", "block_size", "pool_tenant")


def hash_spec_to_proto(spec: HashSpec) -> pb.GetHashSpecResponse:
    vectors = [pb.HashTestVector(token_ids=list(v.token_ids), extra_keys=extra_keys_to_proto(v.extra_keys),
                                 tenant=v.tenant, block_size=v.block_size, block_hashes=list(v.block_hashes))
               for v in spec.test_vectors]
    return pb.GetHashSpecResponse(**{f: getattr(spec, f) for f in _FIELDS}, test_vectors=vectors)


def hash_spec_from_proto(msg: pb.GetHashSpecResponse) -> HashSpec:
    vectors = tuple(HashTestVector(tuple(v.token_ids), extra_keys_from_proto(v.extra_keys, "test_vectors.extra_keys"),
                                   v.tenant, v.block_size, tuple(v.block_hashes)) for v in msg.test_vectors)
    return HashSpec(**{f: getattr(msg, f) for f in _FIELDS}, test_vectors=vectors)
