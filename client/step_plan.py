"""What one scheduler step sends: the batch of blockd operations, planned from
the scheduler's state, and what each part of it stands for (so the scheduler
can apply blockd's answer).

:func:`plan_step` is a pure function of the state it is given (the running
and waiting requests, the pending releases, the config, the admission
policy): it does no I/O and changes no state, so a batch blockd refuses is
planned again after the refusal is dealt with (fewer admissions, or a request
preempted), and the planning is tested by tables of cases. The one thing it
writes is a memo, each waiting or running sequence's prompt block hashes
(``SeqState.block_hashes``), which no later plan can tell from a recomputation.
The order of a batch::

    Fork      samples drawn when their request's prompt ended, from sample 0
              (before the releases: sample 0 may have ended at its first token)
    Commit + Free of sequences finished or preempted since the last step
    Commit    prompt tokens the last step computed (chunked prefill)
    DecodeAppend the last token of every decoding sequence (forked ones included)
    Allocate  waiting requests, FCFS, while the token budget lasts; with
              ``config.prefix_block_size``, a prompt sharing full blocks that
              an admission of this step computes in it is admitted beside it
              and takes them from it (``Allocate.share_seq_id``: computed
              once, in this step, as vLLM shares blocks within a step),
              and past them copies the agreeing tokens' K/V from it
              (``StepPlan.agreeing``, :func:`in_step_copy`);
              admission stops at one sharing a block computed in no step
              yet, or in a later chunk: it waits for that block's commit

With nothing running, the requests at the head of the queue that could never
start (more sequences than ``max_num_seqs``, or refused by the admission
policy on an empty pool) are named in :attr:`StepPlan.rejected` for the
scheduler to fail: nothing would ever make room for them.

Imports only the allocator core and plain data (:mod:`client.serving`,
:mod:`client.scheduler_config`): never the scheduler, a backend or grpc.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from blockd.core.hashing import hash_full_blocks
from blockd.core.types import Allocate, Commit, DecodeAppend, Fork, Op
from client.scheduler_config import SchedulerConfig
from client.serving import PagingAdmission, RequestState, ReservationAdmission, SeqState


@dataclass
class StepPlan:
    """One step's batch and what each of its parts stands for."""

    ops: list[Op]
    has_frees: bool
    commits: list[SeqState] = field(default_factory=list)
    forks: list[tuple[RequestState, list[SeqState]]] = field(default_factory=list)
    decode: list[SeqState] = field(default_factory=list)
    decode_op: int = -1
    prefill: list[tuple[SeqState, int]] = field(default_factory=list)
    #: admitted requests with each live sequence's Allocate op index and token budget
    admitted: list[tuple[RequestState, list[tuple[int, int]]]] = field(default_factory=list)
    admit_at: dict[int, int] = field(default_factory=dict)  # Allocate op index -> admitted position
    #: admitted seq_id -> [(an admission of this step before it whose prompt agrees with its own,
    #: through how many tokens)]: past their shared full blocks it copies those (:func:`in_step_copy`)
    agreeing: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    #: the head of the queue, ``(request, why)``, to fail before the batch is sent; the
    #: admitted requests come right after them in the queue
    rejected: list[tuple[RequestState, str]] = field(default_factory=list)


def plan_step(config: SchedulerConfig, admission: PagingAdmission | ReservationAdmission, *,
              running: Sequence[RequestState], waiting: Sequence[RequestState], releases: Sequence[Op],
              admission_blocked: bool = False, admit_limit: int | None = None) -> StepPlan:
    """This step's batch from the given state (see the module docstring).

    ``releases``: the Commit/Free ops of sequences finished or preempted since
    the last batch; ``admission_blocked``: an admission was refused and no
    Free has been sent since (admit nothing); ``admit_limit``: admit at most
    this many requests (None: no limit).
    """
    plan = StepPlan([], has_frees=bool(releases))
    ops = plan.ops
    for state in running:
        if state.pending:
            # sample 0 holds exactly the prompt (it is decoding its first token,
            # or ended there and its Free follows): each child shares its blocks
            parent = state.samples[0]
            children = [child.forked_from(parent) for child in state.pending]
            plan.forks.append((state, children))
            ops += [Fork(parent.seq_id, child.seq_id) for child in children]
        plan.decode += [seq for seq in state.live if seq.is_decoding]
    for _, children in plan.forks:
        plan.decode += children
    ops += releases
    prefilling = [seq for state in running for seq in state.live if seq.num_to_prefill > 0]
    for seq in prefilling:
        if seq.num_computed > seq.num_committed:
            ops.append(Commit(seq.seq_id, seq.num_computed))
            plan.commits.append(seq)
    if plan.decode:
        plan.decode_op = len(ops)
        ops.append(DecodeAppend([s.seq_id for s in plan.decode], [s.token_ids[-1] for s in plan.decode]))
    budget = config.max_num_batched_tokens - len(plan.decode)
    for seq in prefilling:
        chunk = min(budget, seq.num_to_prefill)
        if chunk > 0:
            plan.prefill.append((seq, chunk))
            budget -= chunk
    if not running:
        # with nothing running nothing will ever make room: it would wait forever
        for head in waiting:
            reason = _never_admitted(head, config, admission)
            if reason is None:
                break
            plan.rejected.append((head, reason))
    if not admission_blocked:
        queue = islice(waiting, len(plan.rejected), None)
        _plan_admissions(plan, config, admission, running, queue, budget, admit_limit)
    return plan


def _never_admitted(state: RequestState, config: SchedulerConfig,
                    admission: PagingAdmission | ReservationAdmission) -> str | None:
    """Why ``state`` could not start even on an empty pool (None: it could)."""
    if state.num_seqs_when_running > config.max_num_seqs:
        return f"its {state.num_seqs_when_running} sequences exceed max_num_seqs"
    if not admission.can_admit(state):
        return f"the {admission.name} admission policy can never admit it"
    return None


def _plan_admissions(plan: StepPlan, config: SchedulerConfig, admission: PagingAdmission | ReservationAdmission,
                     running: Sequence[RequestState], queue: Iterable[RequestState], budget: int,
                     admit_limit: int | None) -> None:
    """FCFS: stop at the first request that does not fit, so a long prompt
    is not starved by short ones behind it."""
    num_seqs = sum(state.num_seqs_when_running for state in running)
    block_size = config.prefix_block_size or 0  # None is resolved before the first plan; 0: off
    in_flight, committed = _prompt_blocks(running, block_size) if block_size else (set(), set())
    #: full blocks an admission of this step computes in it: hash -> (sequence, tokens through that block)
    in_step: dict[bytes, tuple[str, int]] = {}
    #: this step's admissions by (extra keys, prompt), sorted, and (sequence, tokens it computes through)
    prompts: list[tuple[bytes, tuple[int, ...]]] = []
    computing: list[tuple[str, int]] = []
    for state in queue:
        if budget <= 0 or admit_limit == len(plan.admitted):
            return
        if num_seqs + state.num_seqs_when_running > config.max_num_seqs:
            return
        if not admission.can_admit(state, [admitted for admitted, _ in plan.admitted]):
            return
        hashes = [_full_blocks(state, seq, block_size) if block_size else [] for seq in state.live]
        if not in_flight.isdisjoint(h for seq_hashes in hashes for h in seq_hashes):
            return  # computed in an earlier step or past this step's chunk: wait for its commit
        allocations = []
        for seq, seq_hashes in zip(state.live, hashes):
            plan.admit_at[len(plan.ops)] = len(plan.admitted)
            chunk = min(budget, len(seq.token_ids))
            allocations.append((len(plan.ops), chunk))
            share_seq_id, share_tokens = _shared_in_step(seq, seq_hashes, in_step)
            plan.ops.append(Allocate(seq.seq_id, list(seq.token_ids), state.request.extra_keys,
                                     config.source_pool, priority=state.request.priority,
                                     share_seq_id=share_seq_id, share_tokens=share_tokens))
            if block_size:
                _agree_in_step(plan, seq, state.request.extra_keys.digest(), chunk, prompts, computing)
            budget -= chunk
            for i, h in enumerate(seq_hashes):
                if h in committed or h in in_step:
                    continue
                if (i + 1) * block_size <= chunk:  # its tokens are cached or computed in this step
                    in_step[h] = (seq.seq_id, (i + 1) * block_size)
                else:
                    in_flight.add(h)
        plan.admitted.append((state, allocations))
        num_seqs += state.num_seqs_when_running


def _shared_in_step(seq: SeqState, hashes: list[bytes], in_step: dict[bytes, tuple[str, int]]) -> tuple[str, int]:
    """``(share_seq_id, share_tokens)`` of ``seq``'s Allocate: the admission of
    this step that computes the deepest of its full blocks, and how far. blockd
    gives ``seq`` that sequence's blocks where their tokens agree (counted as
    cached, not published until committed), and the worker writes each layer's
    new K/V before that layer's attention reads any, so they are computed once,
    in this step, as vLLM shares blocks within a step. ``("", 0)``: none."""
    found = ("", 0)
    for h in hashes:  # seq's full blocks (:func:`_full_blocks`)
        owner = in_step.get(h)
        if owner is not None and owner[0] != seq.seq_id:
            found = owner
    return found


def _agree_in_step(plan: StepPlan, seq: SeqState, digest: bytes, chunk: int,
                   prompts: list[tuple[bytes, tuple[int, ...]]], computing: list[tuple[str, int]]) -> None:
    """Name in ``plan.agreeing`` the admission of this step whose prompt agrees
    with ``seq``'s through the most tokens (same extra keys; of a sorted set of
    strings, a string's two neighbours hold its longest common prefix), when
    ``seq`` is computed whole in this step; then add ``seq`` to ``prompts``.
    Past the full blocks they share, ``seq`` copies the K/V of the agreeing
    tokens of the partly filled block instead of computing it again, as a
    radix cache shares a prefix token by token."""
    tokens = tuple(seq.token_ids)
    key = (digest, tokens)
    at = bisect.bisect_left(prompts, key)
    found: list[tuple[str, int]] = []
    for k in (at - 1, at) if chunk >= len(tokens) else ():
        if 0 <= k < len(prompts) and prompts[k][0] == digest:
            (owner, end), other = computing[k], prompts[k][1]
            n = min(len(other), len(tokens) - 1, end)  # the last prompt token is always computed
            agreed = next((i for i in range(n) if other[i] != tokens[i]), n)
            # owner itself may copy its first agreeing tokens: then they come from where it takes them
            found += [(owner, agreed)] + [(root, min(agreed, upto)) for root, upto in plan.agreeing.get(owner, [])]
    if found:
        plan.agreeing[seq.seq_id] = sorted(found, key=lambda candidate: -candidate[1])[:4]  # a few suffice
    prompts.insert(at, key)
    computing.insert(at, (seq.seq_id, min(chunk, len(tokens))))


def in_step_copy(plan: StepPlan, batch: Any, seq: SeqState, block_size: int) -> tuple[int, int]:
    """``(batch index, tokens)`` for ``ModelBatch.add``'s ``copy``: the context
    tokens ``seq`` (admitted in ``plan``, its cached tokens known) takes from
    the new tokens of the agreeing admission already in ``batch``, the model
    batch being built (``(0, 0)``: none, e.g. the agreement ends inside the
    cached tokens, or that admission does not compute those positions now).
    The copies stay in the block of ``seq``'s first new token (a worker refuses
    others), ``block_size`` the pool's (0: unknown, no copies)."""
    for source, agreed in plan.agreeing.get(seq.seq_id, ()):  # the longest first
        if agreed <= seq.num_computed or not block_size or seq.num_computed < agreed // block_size * block_size:
            return 0, 0
        i = batch.seq_ids.index(source) if source in batch.seq_ids else -1
        if i >= 0 and batch.context_lens[i] - batch.query_lens[i] <= seq.num_computed and \
                agreed <= batch.context_lens[i]:
            return i, agreed - seq.num_computed
    return 0, 0


def _prompt_blocks(running: Sequence[RequestState], block_size: int) -> tuple[set[bytes], set[bytes]]:
    """Hashes of the running sequences' full blocks: those this step's batch
    does not commit (their prefill is not done: a waiting prompt sharing one
    would compute it again if admitted now), and those committed by the
    end of the batch (an admitted prompt takes them from the prefix cache)."""
    in_flight: set[bytes] = set()
    committed: set[bytes] = set()
    for state in running:
        for seq in state.live:
            hashes = _full_blocks(state, seq, block_size)
            done = seq.num_computed // block_size
            committed.update(hashes[:done])
            if seq.num_to_prefill > 0:
                in_flight.update(hashes[done:])
    return in_flight, committed


def _full_blocks(state: RequestState, seq: SeqState, block_size: int) -> list[bytes]:
    """The chained hashes of ``seq``'s full blocks as far as it is allocated
    (all its tokens while it waits). Only compared with each other, within the
    one pool: the pool's tenant, which blockd folds into its own hashes, is the
    same for all of them."""
    tokens = seq.token_ids[: seq.num_in_pool] if seq.num_in_pool else seq.token_ids
    known, count = seq.block_hashes, len(tokens) // block_size
    if len(known) < count:  # extend the memo from the last block hashed
        known += hash_full_blocks(tokens[len(known) * block_size : count * block_size], block_size,
                                  state.request.extra_keys.digest(), parent=known[-1] if known else None)
    return known[:count]
