"""Terms: which leader wrote which part of a history, and the refusals that name them.

A *term* is the epoch of one leader of a replica group (the create revision
of its etcd leader key, :mod:`blockd.ha.election`): it only grows. A history
-- the daemon's log by LSN, a pool's versions, a worker's table mirror --
is cut into runs, each written by one term. :class:`TermHistory` keeps the
first position of every run, ``[(term, first), ...]`` ascending in both, so
``term_at(position)`` is a bisection and the whole history of a group that
failed over a hundred times is a hundred pairs. Positions before the first
run (a log written before terms existed) have term 0.

:func:`common_prefix` is where two logs stop agreeing. It relies on the
*log matching* property the replication keeps: a term writes at most one
record per LSN and a follower only appends after a prefix it shares with the
leader, so two logs that hold a record of the same term at the same LSN hold
the same records up to it (Raft's argument, with Kafka's per-epoch ranges).

Imports only the standard library.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable


class TermHistory:
    """The runs of one history: ``(term, first position)`` pairs, both ascending."""

    __slots__ = ("_firsts", "_terms")

    def __init__(self, runs: Iterable[tuple[int, int]] = ()) -> None:
        self._terms: list[int] = []
        self._firsts: list[int] = []
        for term, first in runs:
            self.observe(term, first)

    def observe(self, term: int, position: int) -> None:
        """Position ``position`` was written by ``term``. ValueError if that
        would make terms go down, or a run begin before the previous one."""
        if type(term) is not int or type(position) is not int or term < 0 or position < 0:
            raise ValueError(f"term and position must be non-negative ints, got {term!r}, {position!r}")
        last = self.last_term
        if term == last:
            return
        if term < last:
            raise ValueError(f"term {term} at {position} follows term {last}: terms never go down")
        if self._firsts and position <= self._firsts[-1]:
            raise ValueError(f"term {term} begins at {position}, not after term {last} (at {self._firsts[-1]})")
        self._terms.append(term)
        self._firsts.append(position)

    @property
    def last_term(self) -> int:
        return self._terms[-1] if self._terms else 0

    def term_at(self, position: int) -> int:
        """The term that wrote ``position`` (0 before the first run)."""
        i = bisect_right(self._firsts, position) - 1
        return self._terms[i] if i >= 0 else 0

    def run_start(self, position: int) -> int:
        """The first position of the run holding ``position`` (1 for term 0's)."""
        i = bisect_right(self._firsts, position) - 1
        return self._firsts[i] if i >= 0 else 1

    def truncate_after(self, position: int) -> None:
        """Forget the runs that begin after ``position``."""
        keep = bisect_right(self._firsts, position)
        del self._terms[keep:], self._firsts[keep:]

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._terms, self._firsts))

    def dump(self) -> list[list[int]]:
        """JSON form: ``[[term, first], ...]``."""
        return [[t, f] for t, f in zip(self._terms, self._firsts)]

    @classmethod
    def load(cls, data: object) -> TermHistory:
        """From :meth:`dump`'s output; ValueError for anything else."""
        if not isinstance(data, list) or not all(isinstance(r, list) and len(r) == 2 for r in data):
            raise ValueError(f"a term history is a list of [term, first] pairs, got {str(data)[:80]}")
        return cls((r[0], r[1]) for r in data)

    def copy(self) -> TermHistory:
        return TermHistory(self.runs())

    def __repr__(self) -> str:
        return f"TermHistory({self.runs()})"


def common_prefix(a: TermHistory, a_last: int, b: TermHistory, b_last: int) -> int:
    """The last position up to which two histories agree (0: none).

    ``a_last``, ``b_last``: where each ends. Runs where both histories name
    the same term at the same position hold the same records (log matching,
    see the module docstring), so the answer is the highest position, at
    most the shorter end, whose terms are equal; between run boundaries the
    terms are constant, so the scan jumps from boundary to boundary.
    """
    position = min(a_last, b_last)
    while position > 0:
        if a.term_at(position) == b.term_at(position):
            return position
        position = max(a.run_start(position), b.run_start(position)) - 1
    return 0


__all__ = ["TermHistory", "common_prefix"]
