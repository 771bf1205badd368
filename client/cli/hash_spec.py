"""``blockctl hash-spec``: how blockd hashes blocks, for a router that computes the same hashes.

    blockctl hash-spec [--pool POOL] [--json]

Prints ``BlockService.GetHashSpec``: the spec id, the algorithm, how token
ids, the parent hash, the extra keys and the tenant are encoded, and the
test vectors (a prompt, its extra keys, tenant and block size, and the hex
hashes of its full blocks). ``--pool`` adds that pool's block size and
tenant, the inputs its hashes take besides a prompt (exit 3 if there is no
such pool). ``--json`` prints the whole answer as one object, field names as
in the protocol.
"""

from __future__ import annotations

import argparse
import textwrap

from blockd.core.hashing import NO_EXTRA_KEYS, HashSpec, HashTestVector
from client.cli.common import emit, render_table
from client.sdk import BlockdClient

_WIDTH = 100
_PARTS = (("block hash", "block_hash_encoding"), ("token ids", "token_ids_encoding"),
          ("parent hash", "parent_hash_encoding"), ("extra keys", "extra_keys_encoding"),
          ("tenant", "tenant_encoding"))


def _vector(index: int, vector: HashTestVector) -> str:
    extra = "none" if vector.extra_keys == NO_EXTRA_KEYS else repr(vector.extra_keys)
    lines = [f"test vector {index}: block_size {vector.block_size}, tenant {vector.tenant!r}",
             f"  token_ids   {' '.join(map(str, vector.token_ids))}",
             *textwrap.wrap(f"extra_keys  {extra}", _WIDTH, initial_indent="  ", subsequent_indent="    ",
                           break_on_hyphens=False),
             *(f"  block {i}     {h}" for i, h in enumerate(vector.block_hashes))]
    return "\n".join(lines)


def describe(spec: HashSpec, pool: str | None) -> str:
    """The human form: a head table, each encoding as a wrapped paragraph, the vectors."""
    rows: list[tuple[str, object]] = [("spec_id", spec.spec_id), ("algorithm", spec.algorithm)]
    if pool:
        rows += [("pool", pool), ("block_size", spec.block_size), ("pool_tenant", spec.pool_tenant)]
    parts = [render_table(("field", "value"), rows)]
    parts += [textwrap.fill(f"{title}: {getattr(spec, name)}", _WIDTH, subsequent_indent="  ", break_on_hyphens=False)
              for title, name in _PARTS]
    parts += [_vector(i, v) for i, v in enumerate(spec.test_vectors)]
    return "\n\n".join(parts)


def _hash_spec(client: BlockdClient, args: argparse.Namespace) -> None:
    spec = client.get_hash_spec(args.pool)
    emit(args, spec, lambda: describe(spec, args.pool))


def add_hash_spec(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser("hash-spec", help="how blockd hashes blocks (for routers), with test vectors")
    cmd.add_argument("--pool", default=None, help="also this pool's block size and tenant")
    cmd.set_defaults(run=_hash_spec)


__all__ = ["add_hash_spec", "describe"]
