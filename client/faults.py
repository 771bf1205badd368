"""How :class:`client.scheduler.Scheduler` survives faults: a mixin holding its
fault policy, apart from the planning it interrupts.

Faults (see docs/protocol.md, Incarnations). Every step names the pool incarnation
of the previous one, and every model step the incarnation its version belongs
to, so nothing planned on one pool runs on another:

* KV lost (a worker restarted): blockd refuses a batch naming a sequence whose
  KV is gone (``KV_LOST``, with the sequence ids), a worker refuses attention
  over slots it has not written (``KV_NOT_WRITTEN``) or a call planned
  against its previous life (``WORKER_INCARNATION_MISMATCH``), or cannot be
  reached. The requests concerned are preempted with recompute (freed without
  committing: their KV must not enter the prefix cache), the workers are
  waited for, and serving carries on; ``counters.num_kv_loss_preemptions``
  counts them.
* A leader change that may have lost acknowledged steps (``async``): each
  step names the term of the previous one, and a new leader of such a group
  refuses it (``TERM_CHANGED``). Every running request is recomputed (the
  workers resync and re-register too); ``counters.num_term_changes`` counts
  these.
* The pool deleted or re-created under the scheduler (``POOL_INCARNATION_MISMATCH``
  or NOT_FOUND for the pool): its sequences are gone, so every request held
  fails with an error saying so; later requests run on the new pool.

The mixin works on the scheduler's own state (``running``, ``waiting``, the
pending releases, ``_preempt``); it has no state of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from blockd.core.types import Commit, Free
from client.errors import BlockdClientError, FailedPreconditionError
from client.serving import finish

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Callable

    from blockd.core.types import Op
    from client.backends import BlockdBackend, ModelExecutor
    from client.scheduler_config import SchedulerConfig, SchedulerCounters
    from client.serving import PagingAdmission, RequestOutput, RequestState, ReservationAdmission

#: model-step refusals a worker fault explains: recompute and carry on
WORKER_FAULTS = frozenset({"KV_NOT_WRITTEN", "WORKER_INCARNATION_MISMATCH", "POOL_INCARNATION_UNAVAILABLE",
                           "TERM_NOT_SEEN"})
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class PoolGone(Exception):
    """The pool was deleted or re-created: every request held has been failed."""


class FaultRecovery:
    """The scheduler's reactions to lost KV and to a pool gone (see the module docstring)."""

    if TYPE_CHECKING:  # the scheduler's state this mixin works on (client.scheduler.Scheduler)
        client: BlockdBackend
        pool: str
        executor: ModelExecutor
        config: SchedulerConfig
        clock: Callable[[], float]
        counters: SchedulerCounters
        admission: PagingAdmission | ReservationAdmission
        waiting: deque[RequestState]
        running: list[RequestState]
        pool_incarnation: str
        term: int
        _finished: list[RequestOutput]
        _release: list[Op]
        _recent_frees: deque[list[str]]
        _admission_blocked: bool

        def _preempt(self, state: RequestState, *, kv_lost: bool = False) -> None: ...

        def _complete(self, state: RequestState, output: RequestOutput) -> None: ...

    def _preempt_lost(self, states: list[RequestState]) -> None:
        for state in reversed(states):  # newest first, so the oldest ends first in the queue
            self._preempt(state, kv_lost=True)

    def _on_kv_lost(self, err: FailedPreconditionError) -> None:
        """blockd refused the batch: sequences it names lost their KV. Recompute
        their requests; a finished one is only freed (its Commit is refused)."""
        lost = set(err.seq_ids)
        owners = [state for state in self.running if any(seq.seq_id in lost for seq in state.samples)]
        kept = [op for op in self._release if not (type(op) is Commit and op.seq_id in lost)]
        if not owners and len(kept) == len(self._release):
            raise err  # names nothing this scheduler holds: acting on it would loop
        self._release = kept
        self._preempt_lost(owners)

    def _on_term_changed(self, err: FailedPreconditionError) -> None:
        """The group's leader changed, and its failover may have lost steps this
        scheduler was told were acknowledged (``async``): on the new leader its
        sequences may lack tokens or be missing. Recompute every running request:
        free (without committing) the sequences the new leader holds, send
        nothing for the others, and step on in the new term."""
        _, tables = self.client.get_tables(self.pool)
        running = set()
        for state in self.running:
            for seq in state.samples:
                running.add(seq.seq_id)
                if seq.seq_id not in tables:
                    self.counters.num_lost_seqs += 1
                    seq.evict()  # so the preemption sends no Free for it
        # a finished sequence's Commit may name tokens the new leader lacks: only Frees stay
        frees = [op for op in self._release if isinstance(op, Free) and op.seq_id in tables]
        # and a Free the old leader acknowledged may be lost: the new leader still holds that sequence
        pending = {op.seq_id for op in frees}
        freed = {seq_id for step in self._recent_frees for seq_id in step}
        self._release = [*frees, *(Free(seq_id) for seq_id in sorted(freed & tables.keys() - pending - running))]
        self._recent_frees.clear()
        self.term = int(err.metadata.get("term", "0"))
        self.counters.num_term_changes += 1
        self._preempt_lost(list(self.running))

    def _on_model_fault(self, err: BlockdClientError, entries: list) -> None:
        """The model step failed. A worker fault (restarted, unreachable, KV
        not written) means none of the batch was computed and the KV the
        workers hold is unknown: recompute the batch's requests and wait for
        the workers. Anything else is not the scheduler's to mend: raise it."""
        if err.reason == "POOL_INCARNATION_MISMATCH":
            self._pool_gone(err)
        if err.reason not in WORKER_FAULTS and err.code not in _UNREACHABLE:
            raise err
        self.counters.num_worker_faults += 1
        states = list({id(state): state for state, *_ in entries}.values())
        self._preempt_lost([state for state in states if state in self.running])
        if err.reason == "KV_NOT_WRITTEN":
            # blockd may still cache blocks the worker no longer holds (a prefix hit
            # taken before it learnt of the loss): recomputing would hit them again
            self.client.reset_prefix_cache(self.pool)
        reconnect = getattr(self.executor, "reconnect", None)
        if reconnect is not None:
            reconnect(self.config.worker_restart_timeout_s)

    def _pool_gone(self, err: BlockdClientError) -> None:
        """The pool was deleted or re-created: fail every request held, then raise PoolGone."""
        now, error = self.clock(), (f"pool {self.pool!r} was deleted or re-created while this request ran, "
                                    f"so its sequences are gone: {err.message}")
        for state in [*self.running, *self.waiting]:
            self.admission.on_release(state)
            self._complete(state, finish(state, now, error=error))
            self.counters.num_failed += 1
        self.running.clear()
        self.waiting.clear()
        self._release.clear()
        self._admission_blocked = False
        self.pool_incarnation = ""
        raise PoolGone(error)
