"""Continuous batching over blockd: the reference user of the SDK.

Owns the serving loop of one model replica: which requests run, what each
step sends to blockd and to the workers, preemption, and the per-request
results. Request and sequence state is :mod:`client.serving`; blockd and the
workers are behind the protocols of :mod:`client.backends` (over gRPC, or in
process for simulations). One scheduler step::

    plan     Fork the samples drawn when their request's prompt ended (n > 1)
             Commit + Free of sequences finished (or preempted) since the last step
             Commit of the prompt tokens the last step computed (chunked prefill)
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
             ``max_num_batched_tokens`` tokens in all; back come the next tokens,
             drawn as each request's sampling says
    apply    the tokens extend the sequences (and feed their requests' streams); a sample
             that drew an end token or reached max_new_tokens is released (Commit + Free) next step

The workers choose the tokens (:mod:`worker.sampling`): greedy, or seeded draws keyed by (request seed, sample index,
position), so recomputed sequences continue exactly as an uninterrupted run would. The step that computes a prompt's
last token draws the first token of all ``n`` samples; the samples then fork from sample 0 (forks go before the
releases in the batch, so sample 0 may end at its first token and still be forked from).

Outputs are had two ways: :meth:`Scheduler.run` returns every request's :class:`~client.serving.RequestOutput` at the
end; :meth:`Scheduler.submit` returns a :class:`~client.streaming.RequestStream` of tokens as they are applied
(stepped by its consumer, or by a :class:`~client.streaming.ServingLoop`).

The scheduler is this module (``Scheduler``: the requests' state, the I/O to blockd and the model, carrying out plans
and recoveries) and parts that own their own state or none and never import back: ``client.streaming``
(RequestStream, ServingLoop), ``client.faults`` (a refusal or fault -> a Recovery), ``client.step_plan`` (the state
-> a StepPlan) and ``client.scheduler_config`` (SchedulerConfig, SchedulerCounters, also imported from here). Faults
(a worker restarted, the pool re-created) are dealt with as :mod:`client.faults` says. With ``config.source_pool``,
an admission's missed prefix blocks cached in that pool are fetched by the workers instead of computed, where they
can (:meth:`Scheduler._fetch`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from blockd.core.types import Commit, Free, Op, StepResult, TransferPlan
from blockd.rpc.tracing import span
from client.backends import BlockdBackend, ModelBatch, ModelExecutor, pool_block_size, stream_step
from client.errors import BlockdClientError, FailedPreconditionError, NotFoundError, ResourceExhaustedError
from client.faults import (
    SOURCE_RETRY_S,
    PoolGone,
    Recovery,
    on_kv_lost,
    on_model_fault,
    on_no_room,
    on_pool_gone,
    on_source_unusable,
    on_term_changed,
)
from client.scheduler_config import SchedulerConfig, SchedulerCounters
from client.serving import (
    GenerationRequest,
    PagingAdmission,
    RequestOutput,
    RequestState,
    ReservationAdmission,
    SeqState,
    check_request,
    finish,
    new_state,
)
from client.step_plan import StepPlan, in_step_copy, plan_step
from client.streaming import RequestStream, ServingLoop, StreamToken

__all__ = ["RECENT_FREE_STEPS", "Scheduler", "SchedulerConfig", "SchedulerCounters"]
log = logging.getLogger("blockd.scheduler")

#: steps whose Frees are resent when a failover may have lost them (``async`` followers trail <= 100 records)
RECENT_FREE_STEPS = 1024

_DEFAULT_CONFIG = SchedulerConfig()  # frozen: one instance serves every scheduler that names none


class Scheduler:
    """Serves :class:`GenerationRequest` s on ``pool`` through ``client`` and ``executor``.

    ``admission`` decides who may start besides the pool's room:
    :class:`PagingAdmission` (default) or :class:`ReservationAdmission`.
    ``clock`` gives seconds for the timings (injected for tests).
    """

    def __init__(self, client: BlockdBackend, pool: str, executor: ModelExecutor,
                 config: SchedulerConfig = _DEFAULT_CONFIG, *,
                 admission: PagingAdmission | ReservationAdmission | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.client, self.pool, self.executor, self.config = client, pool, executor, config
        self.admission, self.clock = admission or PagingAdmission(), clock
        self.counters = SchedulerCounters()
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # admission order: the last is the newest
        self._finished: list[RequestOutput] = []
        self._known_ids: set[str] = set()
        self._release: list[Op] = []  # Commit/Free ops the next batch must carry
        self._admission_blocked = False
        self._source_off_until = 0.0  # until then admissions name no source pool (it was unusable)
        self.pool_incarnation = ""  # of the last step ("" before the first)
        self.term = 0  # the leader term of the last step (0 before the first, or without replication)
        #: the sequences each of the last steps of this term freed: an ``async`` failover may lose those Frees
        self._recent_frees: deque[list[str]] = deque(maxlen=RECENT_FREE_STEPS)
        self._streams: dict[str, RequestStream] = {}
        self._loop: ServingLoop | None = None  # a ServingLoop stepping this scheduler, if any
        self._lock = threading.RLock()  # steps and submissions may come from different threads (ServingLoop)
        self._seeds = random.SystemRandom()  # seeds of requests that name none
        self._spec_checked = False  # blockd's block-hash spec, checked before the first step
        self._pool_block = 0  # the pool's block size (0: unknown): a step's copies stay in one block
        self._step = client.step  # over a StepStream from the first step on (config.stream_steps)

    # --- public ------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        """Queue ``request``; its output comes from :meth:`run` or :meth:`take_finished`."""
        self._add(request, None)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue ``request`` and return the stream of its tokens (see :mod:`client.streaming`)."""
        check_request(request)
        stream = RequestStream(request.request_id, None if self._loop is not None else self.step)
        self._add(request, stream)
        return stream

    def _add(self, request: GenerationRequest, stream: RequestStream | None) -> None:
        check_request(request)
        with self._lock:
            if request.request_id in self._known_ids:
                raise ValueError(f"request id {request.request_id!r} was already given to this scheduler")
            self._known_ids.add(request.request_id)
            self.waiting.append(new_state(request, self.clock(), self.config.eos_token_ids, self._seeds))
            if stream is not None:
                self._streams[request.request_id] = stream
        if self._loop is not None:
            self._loop.notify()

    def attach_loop(self, loop: ServingLoop | None) -> None:
        """Streams submitted from now on wait for ``loop`` (a ServingLoop; None: their consumers step)."""
        self._loop = loop

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
        with self._lock, span("scheduler.step"):  # the root of the step's trace when tracing is on
            if not self._spec_checked:  # plans de-duplicate admissions by hashes that must be blockd's
                getattr(self.client, "check_hash_spec", lambda: None)()  # optional in a BlockdBackend
                self._pool_block = pool_block_size(self.client, self.pool) if self.config.prefix_block_size != 0 else 0
                if self.config.prefix_block_size is None:  # the default: the pool's block size
                    self.config = replace(self.config, prefix_block_size=self._pool_block)
                self._step = stream_step(self.client, self) if self.config.stream_steps else self.client.step
                self._spec_checked = True
            try:
                sent = self._send()
                if sent is None:
                    return False
                self._run_model(*sent)
            except PoolGone:
                pass
            self.counters.num_steps += 1
            return True

    def _run_model(self, plan: StepPlan, result: StepResult) -> None:
        self.pool_incarnation, self.term = result.incarnation, result.term
        entries, batch = self._apply_result(plan, result)
        if not batch.num_seqs:
            return
        try:
            tokens = self.executor.run(result.version, batch, pool_incarnation=result.incarnation, term=result.term)
        except BlockdClientError as err:
            self._recover(on_model_fault(self.pool, err, [state for state, *_ in entries], self.running))
            return
        if len(tokens) != batch.num_draws:
            raise RuntimeError(f"the model returned {len(tokens)} tokens for {batch.num_draws} draws of "
                               f"{batch.num_seqs} sequences")
        self._apply_tokens(entries, tokens)

    def fail_streams(self, error: str) -> None:
        """End every open stream with ``error`` (the loop that stepped them died)."""
        now = self.clock()
        for state in [*self.running, *self.waiting]:
            stream = self._streams.pop(state.request.request_id, None)
            if stream is not None:
                stream._close(finish(state, now, error=error))

    # --- blockd --------------------------------------------------------------------
    def _send(self) -> tuple[StepPlan, StepResult] | None:
        admit_limit: int | None = None
        refused_admission = False
        while True:
            off = self._source_off_until and self.clock() < self._source_off_until  # no clock read unless set
            config = replace(self.config, source_pool="") if off else self.config
            plan = plan_step(config, self.admission, running=self.running, waiting=self.waiting,
                             releases=self._release, admission_blocked=self._admission_blocked,
                             admit_limit=admit_limit)
            for state, reason in plan.rejected:
                self._reject_head(state, reason)
            if not plan.ops:
                return None
            try:
                result = self._step(self.pool, plan.ops, incarnation=self.pool_incarnation, previous_term=self.term)
            except ResourceExhaustedError as err:
                self.counters.num_refused_batches += 1
                recovery = on_no_room(err, plan, self.running)
                # only a refusal for room changes how many the next plan admits
                admit_limit = recovery.admit_limit
                refused_admission |= recovery.admission_refused
            except FailedPreconditionError as err:
                recovery = self._on_refused_precondition(err)
            except NotFoundError as err:
                # naming an op: one of the pool's sequences (raised again) or the source pool; else the pool
                recovery = on_source_unusable(err) if err.op_index is not None else on_pool_gone(self.pool, err)
            else:
                self._sent(plan, result, refused_admission)
                return plan, result
            self._recover(recovery)

    def _on_refused_precondition(self, err: FailedPreconditionError) -> Recovery:
        if err.reason == "KV_LOST":
            self.counters.num_refused_batches += 1
            return on_kv_lost(err, self.running, self._release)
        if err.reason == "TERM_CHANGED":
            self.counters.num_refused_batches += 1
            _, tables = self.client.get_tables(self.pool)
            return on_term_changed(err, self.running, self._release, self._recent_frees, tables)
        if err.reason == "POOL_INCARNATION_MISMATCH":
            return on_pool_gone(self.pool, err)
        return on_source_unusable(err)  # or raises err

    def _sent(self, plan: StepPlan, result: StepResult, refused_admission: bool) -> None:
        """blockd took ``plan``'s batch."""
        # Only a Free makes room for a refused admission (appends only take blocks).
        self._admission_blocked = refused_admission or (self._admission_blocked and not plan.has_frees)
        self._release.clear()
        if result.term != self.term:
            self._recent_frees.clear()
        self._recent_frees.append([op.seq_id for op in plan.ops if type(op) is Free])

    def _recover(self, recovery: Recovery) -> None:
        """Carry out ``recovery``, field by field in the order :class:`~client.faults.Recovery` declares them."""
        if recovery.fail_all is not None:
            self._fail_all(recovery.fail_all)
        if recovery.reject is not None:
            self._reject_head(*recovery.reject)
        for seq in recovery.lost:
            seq.evict()  # so the preemption sends no Free for it
        self.counters.num_lost_seqs += len(recovery.lost)
        if recovery.releases is not None:
            self._release = list(recovery.releases)
        if recovery.term is not None:
            self._recent_frees.clear()
            self.term = recovery.term
            self.counters.num_term_changes += 1
        self.counters.num_worker_faults += recovery.fault == "worker_fault"
        for state in recovery.preempt:
            self._preempt(state, kv_lost=not recovery.keep_kv)
        if recovery.reset_prefix_cache:
            self.client.reset_prefix_cache(self.pool)
        reconnect = getattr(self.executor, "reconnect", None)
        if recovery.reconnect_workers and reconnect is not None:
            reconnect(self.config.worker_restart_timeout_s)
        if recovery.source_off is not None:
            self._source_off_until = self.clock() + SOURCE_RETRY_S
            log.warning("admissions name no source pool for %g s: %s", SOURCE_RETRY_S, recovery.source_off)

    def _fail_all(self, error: str) -> None:
        """The pool is gone: fail every request held, then raise PoolGone (the step ends)."""
        now = self.clock()
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

    def _preempt(self, state: RequestState, *, kv_lost: bool = False) -> None:
        """Recompute preemption: free the request's sequences (committing what
        they computed, so the prefix cache may keep it, unless their KV was
        lost) and requeue it first."""
        self.running.remove(state)
        state.release_pending()
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

    # --- applying -------------------------------------------------------------------
    def _apply_result(self, plan: StepPlan, result: StepResult):
        """Bring the states to the committed batch; return the model batch and,
        per batch entry, ``(request, sequence, new tokens, tokens drawn)``."""
        entries: list[tuple[RequestState, SeqState, int, int]] = []
        batch = ModelBatch()
        owner = {id(seq): state for state in self.running for seq in state.live}
        for seq in plan.commits:
            seq.num_committed = seq.num_computed
        for state, children in plan.forks:
            state.samples += children
            state.pending = []
            owner.update((id(child), state) for child in children)
            self.counters.num_forks += len(children)
        if plan.decode:
            slots = result.results[plan.decode_op].slot_mapping
            for seq, slot in zip(plan.decode, slots):
                seq.num_committed = seq.num_computed  # DecodeAppend implies it
                seq.num_in_pool += 1
                state = owner[id(seq)]
                batch.add(seq.seq_id, seq.num_in_pool, [seq.token_ids[-1]], [slot], state.sampling_for(seq))
                entries.append((state, seq, 1, 1))
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
                if allocated.transfer is not None and chunk:
                    self._fetch(result, seq, allocated.transfer)
                copy = in_step_copy(plan, batch, seq, self._pool_block)
                self._add_prefill(batch, entries, state, seq, min(chunk, seq.num_to_prefill - copy[1]), copy)
        self.counters.peak_running_requests = max(self.counters.peak_running_requests, len(self.running))
        self.counters.peak_running_seqs = max(self.counters.peak_running_seqs, self.num_running_seqs)
        return entries, batch

    def _fetch(self, result: StepResult, seq: SeqState, plan: TransferPlan) -> None:
        """``plan``'s blocks into the workers: where every rank fetched them, their tokens count as
        computed (the next batch commits them like computed ones); else they are computed."""
        fetch = getattr(self.executor, "fetch_blocks", None)
        why = fetch(result.version, plan, pool_incarnation=result.incarnation, term=result.term) if fetch \
            else "the executor fetches no blocks"
        if why:
            self.counters.num_failed_transfers += 1
            log.info("pool %r: %s computes %d tokens it could not fetch: %s", self.pool, seq.seq_id,
                     plan.num_tokens, why)
        else:
            seq.num_computed = plan.first_token + plan.num_tokens
            self.counters.num_transferred_tokens += plan.num_tokens

    def _add_prefill(self, batch: ModelBatch, entries: list, state: RequestState, seq: SeqState,
                     chunk: int, copy: tuple[int, int] = (0, 0)) -> None:  # copy: (index, tokens): in_step_copy
        if chunk <= 0:
            return
        end = (start := seq.num_computed + copy[1]) + chunk  # copied tokens count as computed with the chunk
        # a chunk short of the end draws nothing that counts: plain greedy, no sampling cost
        draws = state.draws_at(seq, end) if end == len(seq.token_ids) else 1
        sampling = state.sampling_for(seq, draws) if end == len(seq.token_ids) else None
        batch.add(seq.seq_id, end, seq.token_ids[start:end], seq.prefill_slots(chunk + copy[1])[copy[1] :], sampling,
                  copy)
        entries.append((state, seq, copy[1] + chunk, draws))
        self.counters.num_prefill_tokens += chunk
        self.counters.num_copied_tokens += copy[1]

    def _apply_tokens(self, entries: list[tuple[RequestState, SeqState, int, int]], tokens: list[int]) -> None:
        now = self.clock()
        at = 0
        for state, seq, num_new, num_draws in entries:
            drawn, at = tokens[at : at + num_draws], at + num_draws
            seq.num_computed += num_new
            if seq.num_computed < len(seq.token_ids):
                continue  # a prompt chunk short of the prompt's end: its token means nothing
            if num_draws > 1:
                extended = state.draw_samples(seq, drawn)
            else:
                state.add_token(seq, drawn[0])
                extended = [seq]
            if state.first_token_s is None:
                state.first_token_s = now
            self.counters.num_output_tokens += len(extended)
            stream = self._streams.get(state.request.request_id)
            for sample in extended:
                if stream is not None:
                    stream._push(StreamToken(sample.sample_index, sample.token_ids[-1], sample.finish_reason))
            if seq.finish_reason is not None:
                self._release_seq(seq)
        for state in [state for state in self.running if state.is_finished]:
            self.running.remove(state)
            self.admission.on_release(state)
            self._complete(state, finish(state, now))
            self.counters.num_finished += 1

    def _complete(self, state: RequestState, output: RequestOutput) -> None:
        """Hand ``output`` to the request's stream, or to :meth:`take_finished`."""
        stream = self._streams.pop(state.request.request_id, None)
        (stream._close if stream is not None else self._finished.append)(output)

    def _reject_head(self, state: RequestState, reason: str) -> None:
        """Fail ``state``, the head of the queue: it can never start."""
        if not self.waiting or self.waiting[0] is not state:
            raise RuntimeError(f"request {state.request.request_id!r} is rejected but not first in the queue (a bug)")
        self.waiting.popleft()
        self._complete(state, finish(state, self.clock(), error=reason))
        self.counters.num_rejected += 1
