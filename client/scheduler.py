"""Continuous batching over blockd: the reference user of the SDK.

Owns the serving loop of one model replica: which requests run, what each
step sends to blockd and to the workers, preemption, and the per-request
results. Request and sequence state is :mod:`client.serving`; blockd and the
workers are behind the protocols of :mod:`client.backends` (over gRPC, or in
process for simulations). One scheduler step::

    plan     Commit + Free of sequences finished (or preempted) since the last step
             Commit of the prompt tokens the last step computed (chunked prefill)
             Fork the samples of requests whose prompt is done (n > 1)
             DecodeAppend the last sampled token of every decoding sequence
             Allocate waiting requests, FCFS, while the token budget lasts
             (prefix reuse: the pool says how many leading tokens are cached)
    blockd   ONE BlockdBackend.step with all of it, atomic; on RESOURCE_EXHAUSTED
             nothing changed, so: an Allocate refused -> admit only the requests
             before it (and no more until a sequence is freed); a running
             sequence's append refused -> preempt the newest running request
             (free it; its prompt + generated tokens become its new prompt);
             plan again and resend
    model    ONE ModelStep at the version blockd returned: one token per decoding
             sequence, a prompt chunk per prefilling one, within
             ``max_num_batched_tokens`` tokens in all
    apply    the greedy tokens extend the sequences; finished ones are released
             in the next step's batch

Sampling is greedy, so forked samples (which copy sample 0's tokens) and
recomputed sequences continue exactly as an uninterrupted run would.

Faults (a worker restarted, the pool re-created) are dealt with as
:mod:`client.faults` says.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from blockd.core.types import Allocate, Commit, DecodeAppend, Fork, Free, Op, StepResult
from client.backends import BlockdBackend, ModelBatch, ModelExecutor
from client.errors import BlockdClientError, FailedPreconditionError, NotFoundError, ResourceExhaustedError
from client.faults import FaultRecovery, PoolGone
from client.serving import (
    GenerationRequest,
    PagingAdmission,
    RequestOutput,
    RequestState,
    ReservationAdmission,
    SeqState,
    finish,
)


@dataclass(frozen=True)
class SchedulerConfig:
    #: tokens one model step computes at most: decode tokens + prompt chunks
    max_num_batched_tokens: int = 256
    #: sequences running at once at most (forked samples count)
    max_num_seqs: int = 64
    #: how long to wait for unreachable or restarted workers before giving up
    worker_restart_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if type(self.max_num_seqs) is not int or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if type(self.max_num_batched_tokens) is not int or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be an integer >= max_num_seqs (every running "
                             f"sequence decodes each step), got {self.max_num_batched_tokens!r}")


@dataclass
class SchedulerCounters:
    num_steps: int = 0
    num_refused_batches: int = 0
    num_preemptions: int = 0
    num_admissions: int = 0
    num_forks: int = 0
    num_finished: int = 0
    num_rejected: int = 0
    #: prompt tokens the model computed (recomputed ones included) / the prefix cache spared
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    peak_running_requests: int = 0
    peak_running_seqs: int = 0
    #: requests preempted with recompute because a worker lost (or may have lost) their KV
    num_kv_loss_preemptions: int = 0
    #: model steps that failed on a worker fault (and were recomputed)
    num_worker_faults: int = 0
    #: requests failed because the pool was deleted or re-created under them
    num_failed: int = 0


@dataclass
class _Plan:
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


class Scheduler(FaultRecovery):
    """Serves :class:`GenerationRequest` s on ``pool`` through ``client`` and ``executor``.

    ``admission`` decides who may start besides the pool's room:
    :class:`PagingAdmission` (default) or :class:`ReservationAdmission`.
    ``clock`` gives seconds for the timings (injected for tests).
    """

    def __init__(self, client: BlockdBackend, pool: str, executor: ModelExecutor,
                 config: SchedulerConfig = SchedulerConfig(), *,
                 admission: PagingAdmission | ReservationAdmission | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.client = client
        self.pool = pool
        self.executor = executor
        self.config = config
        self.admission = admission or PagingAdmission()
        self.clock = clock
        self.counters = SchedulerCounters()
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # admission order: the last is the newest
        self._finished: list[RequestOutput] = []
        self._known_ids: set[str] = set()
        self._release: list[Op] = []  # Commit/Free ops the next batch must carry
        self._admission_blocked = False
        #: the pool incarnation of the last step ("" before the first)
        self.pool_incarnation = ""

    # --- public ------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        if not isinstance(request, GenerationRequest):
            raise TypeError("add_request takes a GenerationRequest")
        if request.request_id in self._known_ids:
            raise ValueError(f"request id {request.request_id!r} was already given to this scheduler")
        self._known_ids.add(request.request_id)
        self.waiting.append(RequestState(request, self.clock()))

    @property
    def is_idle(self) -> bool:
        """No request left and every finished sequence freed in blockd."""
        return not (self.waiting or self.running or self._release)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(state.live) for state in self.running)

    def take_finished(self) -> list[RequestOutput]:
        done, self._finished = self._finished, []
        return done

    def run(self, on_step: Callable[[Scheduler], None] | None = None) -> list[RequestOutput]:
        """Step until every request is finished and freed; the outputs in finishing order."""
        outputs: list[RequestOutput] = []
        while not self.is_idle:
            if not self.step():
                raise RuntimeError("scheduler made no progress with requests left (a bug)")
            outputs += self.take_finished()
            if on_step is not None:
                on_step(self)
        return outputs + self.take_finished()

    def step(self) -> bool:
        """One scheduler step (see the module docstring); False if there was nothing to send."""
        try:
            sent = self._send()
            if sent is None:
                return False
            plan, result = sent
            self.pool_incarnation = result.incarnation
            entries, batch = self._apply_result(plan, result)
            if batch.num_seqs:
                try:
                    tokens = self.executor.run(result.version, batch, pool_incarnation=result.incarnation)
                except BlockdClientError as err:
                    self._on_model_fault(err, entries)
                else:
                    if len(tokens) != batch.num_seqs:
                        raise RuntimeError(f"the model returned {len(tokens)} tokens for {batch.num_seqs} "
                                           "sequences")
                    self._apply_tokens(entries, tokens)
        except PoolGone:
            pass
        self.counters.num_steps += 1
        return True

    # --- blockd --------------------------------------------------------------------
    def _send(self) -> tuple[_Plan, StepResult] | None:
        admit_limit: int | None = None
        refused_admission = False
        while True:
            plan = self._plan(admit_limit)
            if not plan.ops:
                return None
            try:
                result = self.client.step(self.pool, plan.ops, incarnation=self.pool_incarnation)
            except ResourceExhaustedError as err:
                self.counters.num_refused_batches += 1
                admit_limit, refused = self._on_refused(plan, err)
                refused_admission |= refused
                continue
            except FailedPreconditionError as err:
                if err.reason == "KV_LOST":
                    self.counters.num_refused_batches += 1
                    self._on_kv_lost(err)
                    continue
                if err.reason == "POOL_INCARNATION_MISMATCH":
                    self._pool_gone(err)
                raise
            except NotFoundError as err:
                if err.op_index is None:  # the pool itself, not one of its sequences
                    self._pool_gone(err)
                raise
            # Only a Free makes room for a refused admission (appends only take blocks).
            if refused_admission:
                self._admission_blocked = True
            elif plan.has_frees:
                self._admission_blocked = False
            self._release.clear()
            return plan, result

    def _on_refused(self, plan: _Plan, err: ResourceExhaustedError) -> tuple[int | None, bool]:
        """Change the plan's inputs after a refused batch: ``(admit_limit, an admission was refused)``."""
        index = err.op_index
        if index is None:
            raise err
        if index in plan.admit_at:
            position = plan.admit_at[index]
            if position == 0 and not self.running:
                # the pool is this scheduler's alone: empty, it still cannot hold it, so it never will
                state = self.waiting.popleft()
                self._reject(state, f"needs more blocks than the pool can give one request ({err.message})")
                return None, False
            return position, True
        if not self.running:
            raise err  # only running sequences append; anything else is a bug
        self._preempt(self.running[-1])
        return 0, False

    def _preempt(self, state: RequestState, *, kv_lost: bool = False) -> None:
        """Recompute preemption: free the request's sequences (committing what
        they computed, so the prefix cache may keep it, unless their KV was
        lost) and requeue it first."""
        self.running.remove(state)
        for seq in state.live:
            self._release_seq(seq, commit=not kv_lost)
            seq.evict()
        state.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.counters.num_kv_loss_preemptions += kv_lost
        self.admission.on_release(state)
        self.waiting.appendleft(state)

    def _release_seq(self, seq: SeqState, *, commit: bool = True) -> None:
        if seq.num_in_pool == 0:
            return
        if commit and seq.num_computed > seq.num_committed:
            self._release.append(Commit(seq.seq_id, seq.num_computed))
        self._release.append(Free(seq.seq_id))

    # --- planning -------------------------------------------------------------------
    def _plan(self, admit_limit: int | None) -> _Plan:
        """This step's batch from the current state; changes nothing, so a
        refused batch is planned again after the refusal is dealt with."""
        plan = _Plan(list(self._release), has_frees=bool(self._release))
        ops = plan.ops
        for state in self.running:
            plan.decode += [seq for seq in state.live if seq.is_decoding]
            parent = state.samples[0]
            if state.needs_fork and parent.is_decoding:
                children = [parent.fork(f"{state.request.request_id}.{i}")
                            for i in range(len(state.samples), state.request.n)]
                plan.forks.append((state, children))
                plan.decode += children
        for seq in self._prefilling():
            if seq.num_computed > seq.num_committed:
                ops.append(Commit(seq.seq_id, seq.num_computed))
                plan.commits.append(seq)
        for state, children in plan.forks:
            ops += [Fork(state.samples[0].seq_id, child.seq_id) for child in children]
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

    def _plan_admissions(self, plan: _Plan, budget: int, admit_limit: int | None) -> None:
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
        for state in self.waiting:
            if budget <= 0 or self._admission_blocked or admit_limit == len(plan.admitted):
                return
            if num_seqs + state.num_seqs_when_running > self.config.max_num_seqs:
                return
            if not self.admission.can_admit(state, [admitted for admitted, _ in plan.admitted]):
                return
            allocations = []
            for seq in state.live:
                plan.admit_at[len(plan.ops)] = len(plan.admitted)
                chunk = min(budget, len(seq.token_ids))
                allocations.append((len(plan.ops), chunk))
                plan.ops.append(Allocate(seq.seq_id, list(seq.token_ids), state.request.extra_keys))
                budget -= chunk
            plan.admitted.append((state, allocations))
            num_seqs += state.num_seqs_when_running

    # --- applying -------------------------------------------------------------------
    def _apply_result(self, plan: _Plan, result: StepResult):
        """Bring the states to the committed batch; return the model batch and,
        per batch entry, ``(request, sequence, new tokens)``."""
        entries: list[tuple[RequestState, SeqState, int]] = []
        batch = ModelBatch()
        owner = {id(seq): state for state in self.running for seq in state.live}
        for seq in plan.commits:
            seq.num_committed = seq.num_computed
        for state, children in plan.forks:
            state.samples += children
            owner.update((id(child), state) for child in children)
            self.counters.num_forks += len(children)
        if plan.decode:
            slots = result.results[plan.decode_op].slot_mapping
            for seq, slot in zip(plan.decode, slots):
                seq.num_committed = seq.num_computed  # DecodeAppend implies it
                seq.num_in_pool += 1
                batch.add(seq.seq_id, seq.num_in_pool, [seq.token_ids[-1]], [slot])
                entries.append((owner[id(seq)], seq, 1))
        for seq, chunk in plan.prefill:
            self._add_prefill(batch, entries, owner[id(seq)], seq, chunk)
        for state, allocations in plan.admitted:
            self.waiting.popleft()  # admissions are a prefix of the queue
            self.running.append(state)
            self.admission.on_admit(state)
            self.counters.num_admissions += 1
            for seq, (op_index, chunk) in zip(state.live, allocations):
                allocated = result.results[op_index]
                seq.num_in_pool = len(seq.token_ids)
                seq.num_computed = seq.num_committed = allocated.num_cached_tokens
                seq.slots, seq.slot_start = allocated.slot_mapping, allocated.slot_start
                self.counters.num_cached_tokens += allocated.num_cached_tokens
                self._add_prefill(batch, entries, state, seq, min(chunk, seq.num_to_prefill))
        self.counters.peak_running_requests = max(self.counters.peak_running_requests, len(self.running))
        self.counters.peak_running_seqs = max(self.counters.peak_running_seqs, self.num_running_seqs)
        return entries, batch

    def _add_prefill(self, batch: ModelBatch, entries: list, state: RequestState, seq: SeqState,
                     chunk: int) -> None:
        if chunk <= 0:
            return
        end = seq.num_computed + chunk
        batch.add(seq.seq_id, end, seq.token_ids[seq.num_computed : end], seq.prefill_slots(chunk))
        entries.append((state, seq, chunk))
        self.counters.num_prefill_tokens += chunk

    def _apply_tokens(self, entries: list[tuple[RequestState, SeqState, int]], tokens: list[int]) -> None:
        now = self.clock()
        for (state, seq, num_new), token in zip(entries, tokens):
            seq.num_computed += num_new
            if seq.num_computed < len(seq.token_ids):
                continue  # a prompt chunk short of the prompt's end: its token means nothing
            seq.token_ids.append(token)
            self.counters.num_output_tokens += 1
            if state.first_token_s is None:
                state.first_token_s = now
            if state.is_done(seq):
                self._release_seq(seq)
        for state in [state for state in self.running if state.is_finished]:
            self.running.remove(state)
            self.admission.on_release(state)
            self._finished.append(finish(state, now))
            self.counters.num_finished += 1

    def _reject(self, state: RequestState, reason: str) -> None:
        self._finished.append(finish(state, self.clock(), error=reason))
        self.counters.num_rejected += 1
