"""What one scheduler step sends: the batch of blockd operations, planned from
the scheduler's state, and what each part of it stands for (so the
scheduler can apply blockd's answer). A mixin of
:class:`client.scheduler.Scheduler`, apart from the stepping it feeds.

Planning changes nothing: a batch blockd refuses is planned again after the
refusal is dealt with (fewer admissions, or a request preempted). The order
of a batch::

    Fork      samples drawn when their request's prompt ended, from sample 0
              (before the releases: sample 0 may have ended at its first token)
    Commit + Free of sequences finished or preempted since the last step
    Commit    prompt tokens the last step computed (chunked prefill)
    DecodeAppend the last token of every decoding sequence (forked ones included)
    Allocate  waiting requests, FCFS, while the token budget lasts; with
              ``config.prefix_block_size``, not past a request whose prompt
              shares a full block with a prompt still being computed: it
              waits for that block's commit and takes it from the prefix cache

Works on the scheduler's own state (``running``, ``waiting``, the pending
releases, ``config``, ``admission``); it has no state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from blockd.core.hashing import hash_full_blocks
from blockd.core.types import Allocate, Commit, DecodeAppend, Fork, Op
from client.serving import RequestState, SeqState

if TYPE_CHECKING:
    from collections import deque

    from client.scheduler_config import SchedulerConfig
    from client.serving import PagingAdmission, ReservationAdmission


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


class StepPlanner:
    """The scheduler's planning (see the module docstring)."""

    if TYPE_CHECKING:  # the scheduler's state this mixin reads (client.scheduler.Scheduler)
        config: SchedulerConfig
        admission: PagingAdmission | ReservationAdmission
        waiting: deque[RequestState]
        running: list[RequestState]
        _release: list[Op]
        _admission_blocked: bool

        def _reject(self, state: RequestState, reason: str) -> None: ...

    def _plan(self, admit_limit: int | None) -> StepPlan:
        """This step's batch from the current state; changes nothing, so a
        refused batch is planned again after the refusal is dealt with."""
        plan = StepPlan([], has_frees=bool(self._release))
        ops = plan.ops
        for state in self.running:
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
        ops += self._release
        for seq in self._prefilling():
            if seq.num_computed > seq.num_committed:
                ops.append(Commit(seq.seq_id, seq.num_computed))
                plan.commits.append(seq)
        if plan.decode:
            plan.decode_op = len(ops)
            ops.append(DecodeAppend([s.seq_id for s in plan.decode], [s.token_ids[-1] for s in plan.decode]))
        budget = self.config.max_num_batched_tokens - len(plan.decode)
        for seq in self._prefilling():
            chunk = min(budget, seq.num_to_prefill)
            if chunk > 0:
                plan.prefill.append((seq, chunk))
                budget -= chunk
        self._plan_admissions(plan, budget, admit_limit)
        return plan

    def _prefilling(self) -> list[SeqState]:
        return [seq for state in self.running for seq in state.live if seq.num_to_prefill > 0]

    def _plan_admissions(self, plan: StepPlan, budget: int, admit_limit: int | None) -> None:
        """FCFS: stop at the first request that does not fit, so a long prompt
        is not starved by short ones behind it."""
        while self.waiting and not self.running:
            # with nothing running nothing will ever make room: it would wait forever
            head = self.waiting[0]
            if head.num_seqs_when_running > self.config.max_num_seqs:
                reason = f"its {head.num_seqs_when_running} sequences exceed max_num_seqs"
            elif not self.admission.can_admit(head):
                reason = f"the {self.admission.name} admission policy can never admit it"
            else:
                break
            self._reject(self.waiting.popleft(), reason)
        num_seqs = sum(state.num_seqs_when_running for state in self.running)
        block_size = self.config.prefix_block_size
        in_flight, committed = self._prompt_blocks(block_size) if block_size else (set(), set())
        for state in self.waiting:
            if budget <= 0 or self._admission_blocked or admit_limit == len(plan.admitted):
                return
            if num_seqs + state.num_seqs_when_running > self.config.max_num_seqs:
                return
            if not self.admission.can_admit(state, [admitted for admitted, _ in plan.admitted]):
                return
            if block_size:
                blocks = {h for seq in state.live for h in _full_blocks(state, seq, block_size)}
                if not in_flight.isdisjoint(blocks):
                    return  # computed already in this or an earlier step: wait for its commit
                in_flight |= blocks - committed
            allocations = []
            for seq in state.live:
                plan.admit_at[len(plan.ops)] = len(plan.admitted)
                chunk = min(budget, len(seq.token_ids))
                allocations.append((len(plan.ops), chunk))
                plan.ops.append(Allocate(seq.seq_id, list(seq.token_ids), state.request.extra_keys))
                budget -= chunk
            plan.admitted.append((state, allocations))
            num_seqs += state.num_seqs_when_running

    def _prompt_blocks(self, block_size: int) -> tuple[set[bytes], set[bytes]]:
        """Hashes of the running sequences' full blocks: those this step's batch
        does not commit (their prefill is not done: a waiting prompt sharing one
        would compute it again if admitted now), and those committed by the
        end of the batch (an admitted prompt takes them from the prefix cache).
        Blocks cached by sequences no longer running are not known here: a
        prompt sharing them with one admitted in the same step waits a step
        it need not."""
        in_flight: set[bytes] = set()
        committed: set[bytes] = set()
        for state in self.running:
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
    if len(known) < count:  # extend the chain from the last block hashed
        known += hash_full_blocks(tokens[len(known) * block_size : count * block_size], block_size,
                                  state.request.extra_keys.digest(), parent=known[-1] if known else None)
    return known[:count]
