"""A sequence's allocator-side record: its block table, tokens and hash chain.

Internal to the core; callers only ever see plain lists copied out of it.
Imports only the standard library.
"""

from __future__ import annotations

from blockd.core.hashing import ExtraKeys


class Sequence:
    """A sequence's table and tokens (internal; callers see plain lists)."""

    __slots__ = ("extra", "extra_digest", "hashes", "num_committed", "seq_id", "table", "token_ids")

    def __init__(self, seq_id: str, extra: ExtraKeys, extra_digest: bytes) -> None:
        self.seq_id = seq_id
        self.table: list[int] = []
        self.token_ids: list[int] = []
        self.num_committed = 0
        #: hashes of the committed full blocks, ``len == num_committed // b``
        self.hashes: list[bytes] = []
        self.extra = extra
        self.extra_digest = extra_digest
