"""Checks a step passes before it runs that belong to no one module of the engine.

* :func:`check_previous_term` - a step planned on another leader term's answer
  (``StepRequest.previous_term``, ``docs/ha.md``);
* :func:`refuse_malformed` - a batch's own mistake, reported before the pool's
  history (a stale planned incarnation) is.

Both run under the engine lock and change nothing.
"""

from __future__ import annotations

from blockd.core import BlockdError, InvalidArgument, Op, Pool
from blockd.core.incarnations import TermChanged
from blockd.engine.config import Replication


def check_previous_term(gate: Replication | None, previous_term: int) -> None:
    """Under the lock: refuse a step planned on what a leader of another
    term acknowledged when this term may lack it (see StepRequest.previous_term).
    A retried request id this leader logged is answered before this check:
    its log then holds the caller's earlier steps too."""
    if gate is None or not previous_term or not gate.term or previous_term == gate.term:
        return
    if previous_term > gate.term:
        # writable() passed: this replica leads and can prove its lease, so no newer term exists
        raise InvalidArgument(f"previous_term {previous_term} is newer than any term of this group (its "
                              f"leader serves term {gate.term}): name the term of your previous step's answer")
    if not gate.keeps_committed:
        raise TermChanged(f"the leader changed since the caller's previous step (term {previous_term}, now "
                          f"{gate.term}) and this group's failover may lose acknowledged steps (async "
                          f"replication or --min-in-sync 1): its sequences may lack steps it was told of; "
                          f"rebuild them (a scheduler recomputes its requests) and step again naming term "
                          f"{gate.term}", metadata={"term": str(gate.term)})


def refuse_malformed(pool: Pool, ops: list[Op]) -> None:
    """Raise the batch's InvalidArgument, if it has one (a dry run: nothing changes)."""
    try:
        pool.step(ops, dry_run=True)
    except InvalidArgument:
        raise
    except BlockdError:
        pass
