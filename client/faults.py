"""What the scheduler does about a refused batch or a failed model step: each
case is a pure function of the error and the scheduler's state that returns
a :class:`Recovery`, a value saying what to do, which
:class:`client.scheduler.Scheduler` carries out (this module does no I/O and
changes no state, so each case is tested on its own).

* No room (``RESOURCE_EXHAUSTED`` naming an operation): an Allocate refused
  admits only the requests before it (and no more until a sequence is
  freed), or, if it is the first and nothing runs, fails that request (the
  pool will never hold it); a running sequence's append refused preempts the
  newest running request, keeping its KV for the prefix cache.

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
* The source pool of cross-pool sharing unusable (``SOURCE_POOL_NOT_FOUND``:
  deleted or never made; ``SOURCE_IN_OTHER_GROUP``: a cluster serves it from
  another group): nothing was applied; the scheduler names no source for
  ``SOURCE_RETRY_S`` (its admissions' prompts are computed, as after a failed
  transfer), says so once in its log, then tries the source again.
* The pool deleted or re-created under the scheduler (``POOL_INCARNATION_MISMATCH``
  or NOT_FOUND for the pool): its sequences are gone, so every request held
  fails with an error saying so; later requests run on the new pool.

An error that is not the scheduler's to mend (or names nothing it holds, so
that acting on it would loop) is raised again by the function given it.
Imports plain data, the SDK's errors and the plan: never the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import grpc

from blockd.core.types import Commit, Free, Op
from client.errors import BlockdClientError, FailedPreconditionError, ResourceExhaustedError
from client.serving import RequestState, SeqState
from client.step_plan import StepPlan

#: model-step refusals a worker fault explains: recompute and carry on
WORKER_FAULTS = frozenset({"KV_NOT_WRITTEN", "WORKER_INCARNATION_MISMATCH", "POOL_INCARNATION_UNAVAILABLE",
                           "TERM_NOT_SEEN"})
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

Fault = Literal["no_room", "kv_lost", "term_changed", "worker_fault", "pool_gone", "source_unusable"]
#: refusals of an Allocate's source_pool that the pool's state, not the caller's settings, explains
SOURCE_UNUSABLE = frozenset({"SOURCE_POOL_NOT_FOUND", "SOURCE_IN_OTHER_GROUP"})
#: how long a scheduler names no source pool after such a refusal, before it tries the source again
SOURCE_RETRY_S = 30.0


class PoolGone(Exception):
    """The pool was deleted or re-created: every request held has been failed."""


@dataclass(frozen=True)
class Recovery:
    """What the scheduler does about one refused batch or failed model step.

    It carries out the fields in the order they are declared, then plans
    the step again (or, after ``fail_all``, ends it with :class:`PoolGone`).
    """

    fault: Fault
    #: the pool is gone: fail every request held with this error
    fail_all: str | None = None
    #: ``(request, why)``: fail this request, the head of the queue (nothing would ever make room)
    reject: tuple[RequestState, str] | None = None
    #: sequences a new leader no longer holds: nothing of them is in the pool (no Free is sent)
    lost: tuple[SeqState, ...] = ()
    #: the pending Commit/Free ops become these (None: unchanged)
    releases: tuple[Op, ...] | None = None
    #: step on in this leader term, forgetting the Frees sent in the old one (None: unchanged)
    term: int | None = None
    #: requests to preempt with recompute, in this order (newest first: the oldest ends first in the queue)
    preempt: tuple[RequestState, ...] = ()
    #: whether the preempted requests' computed tokens are committed (their KV may enter the prefix cache)
    keep_kv: bool = False
    #: drop blockd's prefix cache: it may hold blocks whose KV a worker lost
    reset_prefix_cache: bool = False
    #: wait for the workers to be back (the executor's ``reconnect``, if it has one)
    reconnect_workers: bool = False
    #: (no room only) admit at most this many requests in the next plan (None: no limit) ...
    admit_limit: int | None = None
    #: ... and, once a batch is taken, none until a Free is sent (an Allocate was refused)
    admission_refused: bool = False
    #: why the source pool is unusable: name none in admissions for SOURCE_RETRY_S (None: unchanged)
    source_off: str | None = None


def on_no_room(err: ResourceExhaustedError, plan: StepPlan, running: Sequence[RequestState]) -> Recovery:
    """blockd had no room for operation ``err.op_index`` of ``plan``."""
    index = err.op_index
    if index is None:
        raise err
    if index in plan.admit_at:
        position = plan.admit_at[index]
        if position == 0 and not running:
            # the pool is this scheduler's alone: empty, it still cannot hold it, so it never will
            why = f"needs more blocks than the pool can give one request ({err.message})"
            return Recovery("no_room", reject=(plan.admitted[0][0], why))
        return Recovery("no_room", admit_limit=position, admission_refused=True)
    if not running:
        raise err  # only running sequences append; anything else is a bug
    return Recovery("no_room", preempt=(running[-1],), keep_kv=True, admit_limit=0)


def on_kv_lost(err: FailedPreconditionError, running: Sequence[RequestState],
               releases: Sequence[Op]) -> Recovery:
    """blockd refused the batch: sequences it names lost their KV. Recompute
    their requests; a finished one is only freed (its Commit would be refused)."""
    lost = set(err.seq_ids)
    owners = [state for state in running if any(seq.seq_id in lost for seq in state.samples)]
    kept = tuple(op for op in releases if not (type(op) is Commit and op.seq_id in lost))
    if not owners and len(kept) == len(releases):
        raise err  # names nothing this scheduler holds: acting on it would loop
    return Recovery("kv_lost", releases=kept, preempt=tuple(reversed(owners)))


def on_term_changed(err: FailedPreconditionError, running: Sequence[RequestState], releases: Sequence[Op],
                    recent_frees: Iterable[Sequence[str]], tables: Mapping[str, object]) -> Recovery:
    """The group's leader changed, and its failover may have lost steps this
    scheduler was told were acknowledged (``async``): on the new leader its
    sequences may lack tokens or be missing. Recompute every running request:
    free (without committing) the sequences the new leader holds (``tables``:
    its block tables), send nothing for the others, and step on in the new
    term. ``recent_frees``: the sequences each recent step of the old term freed."""
    lost, running_ids = [], set()
    for state in running:
        for seq in state.samples:
            running_ids.add(seq.seq_id)
            if seq.seq_id not in tables:
                lost.append(seq)
    # a finished sequence's Commit may name tokens the new leader lacks: only Frees stay
    frees = [op for op in releases if isinstance(op, Free) and op.seq_id in tables]
    # and a Free the old leader acknowledged may be lost: the new leader still holds that sequence
    pending = {op.seq_id for op in frees}
    freed = {seq_id for step in recent_frees for seq_id in step}
    resent = sorted(freed & tables.keys() - pending - running_ids)
    return Recovery("term_changed", lost=tuple(lost), releases=(*frees, *(Free(seq_id) for seq_id in resent)),
                    term=int(err.metadata.get("term", "0")), preempt=tuple(reversed(running)))


def on_model_fault(pool: str, err: BlockdClientError, batch_requests: Iterable[RequestState],
                   running: Sequence[RequestState]) -> Recovery:
    """The model step over ``batch_requests`` failed. A worker fault
    (restarted, unreachable, KV not written) means none of the batch was
    computed and the KV the workers hold is unknown: recompute the batch's
    requests and wait for the workers. Anything else is not the scheduler's
    to mend: raise it."""
    if err.reason == "POOL_INCARNATION_MISMATCH":
        return on_pool_gone(pool, err)
    if err.reason not in WORKER_FAULTS and err.code not in _UNREACHABLE:
        raise err
    states = list({id(state): state for state in batch_requests}.values())
    return Recovery("worker_fault", preempt=tuple(reversed([state for state in states if state in running])),
                    # blockd may still cache blocks the worker no longer holds (a prefix hit
                    # taken before it learnt of the loss): recomputing would hit them again
                    reset_prefix_cache=err.reason == "KV_NOT_WRITTEN", reconnect_workers=True)


def on_pool_gone(pool: str, err: BlockdClientError) -> Recovery:
    """The pool was deleted or re-created: fail every request held."""
    return Recovery("pool_gone", fail_all=(f"pool {pool!r} was deleted or re-created while this request ran, "
                                           f"so its sequences are gone: {err.message}"))


def on_source_unusable(err: BlockdClientError) -> Recovery:
    """An Allocate's ``source_pool`` is gone or in another group (:data:`SOURCE_UNUSABLE`;
    nothing was applied): step on without it for :data:`SOURCE_RETRY_S`, computing those prompts."""
    if err.reason not in SOURCE_UNUSABLE:
        raise err
    return Recovery("source_unusable", source_off=err.message)
