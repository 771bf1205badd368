"""A sequence's allocator-side record: its block table, tokens and hash chain.

Internal to the core; callers only ever see plain lists copied out of it.
Between operations a sequence of ``T`` tokens, ``C`` of them committed, holds
``ceil(T / b)`` blocks and ``C // b`` hashes (the invariant checker verifies
both; a batch's undo marks rely on them). Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from blockd.core.errors import NotFound, WrongState, shown
from blockd.core.hashing import ExtraKeys
from blockd.core.lru import DEFAULT_PRIORITY


class Sequence:
    """A sequence's table and tokens (internal; callers see plain lists)."""

    __slots__ = ("extra", "extra_digest", "hashes", "num_committed", "priority", "seq_id", "table", "token_ids")

    def __init__(self, seq_id: str, extra: ExtraKeys, extra_digest: bytes, priority: int = DEFAULT_PRIORITY) -> None:
        self.seq_id = seq_id
        self.table: list[int] = []
        self.token_ids: list[int] = []
        self.num_committed = 0
        #: hashes of the committed full blocks, ``len == num_committed // b``
        self.hashes: list[bytes] = []
        self.extra = extra
        self.extra_digest = extra_digest
        #: the retention priority its blocks are released at (:mod:`blockd.core.lru`)
        self.priority = priority


def find_seq(seqs: Mapping[str, Sequence], seq_id: object, pool_name: str,
             freed_at: Callable[[str], int | None]) -> Sequence:
    """The live sequence ``seq_id``; :class:`WrongState` if ``freed_at`` says
    it was freed recently, :class:`NotFound` if it is unknown."""
    seq = seqs.get(seq_id) if type(seq_id) is str else None
    if seq is None:
        version = freed_at(seq_id) if type(seq_id) is str else None
        if version is not None:
            raise WrongState(f"sequence {shown(seq_id)} was freed at version {version} of pool "
                             f"{shown(pool_name)}; allocate it again to reuse the id")
        raise NotFound(f"pool {shown(pool_name)} has no sequence {shown(seq_id)}",
                       seq_id=seq_id if type(seq_id) is str else None)
    return seq
