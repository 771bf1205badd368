"""What :mod:`client.scheduler` serves and reports: requests, their sequences,
their outputs and timings, and the admission policies.

A :class:`GenerationRequest` becomes a :class:`RequestState` holding one
:class:`SeqState` per sample. Sample 0 (``"<request_id>.0"``) holds the
prompt; samples ``1 .. n-1`` are forked from it once its prompt is computed.
Each sequence's tokens are split into three ranges the scheduler moves
forward every step::

    token_ids   [ prompt ........................ | generated ........ ]
    in pool     [0 .................................... num_in_pool)
    computed    [0 ........................ num_computed)
    committed   [0 ........... num_committed)          blockd's knowledge

    num_committed <= num_computed <= num_in_pool <= len(token_ids)

A decoding sequence holds every token but the last sampled one in the pool
(``num_in_pool == len(token_ids) - 1``); its next step appends that token.
Preemption by recompute resets the three counters to 0: the tokens so far
(prompt + generated) become the new prompt.

Plain data and arithmetic: no grpc, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from blockd.core.arith import num_blocks_for
from blockd.core.hashing import NO_EXTRA_KEYS, ExtraKeys


@dataclass(frozen=True)
class GenerationRequest:
    """Greedy generation of ``max_new_tokens`` tokens for ``n`` samples."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    n: int = 1
    #: what besides the tokens changes the KV (model, adapter, tenant): prefix reuse respects it
    extra_keys: ExtraKeys = NO_EXTRA_KEYS

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id or "." in self.request_id:
            raise ValueError(f"request_id must be a non-empty string without '.', got {self.request_id!r}")
        tokens = tuple(self.prompt_token_ids)
        if not tokens or not all(type(t) is int and t >= 0 for t in tokens):
            raise ValueError(f"request {self.request_id}: the prompt must be a non-empty list of token ids >= 0")
        object.__setattr__(self, "prompt_token_ids", tokens)
        if type(self.max_new_tokens) is not int or self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if type(self.n) is not int or self.n < 1:
            raise ValueError(f"request {self.request_id}: n must be >= 1, got {self.n!r}")
        if not isinstance(self.extra_keys, ExtraKeys):
            raise TypeError(f"request {self.request_id}: extra_keys must be an ExtraKeys")

    @property
    def max_len(self) -> int:
        return len(self.prompt_token_ids) + self.max_new_tokens


@dataclass
class SeqState:
    """One sample's tokens and how far the pool and the model have got."""

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_in_pool: int = 0
    num_computed: int = 0
    num_committed: int = 0
    #: physical slots of the tokens from ``slot_start`` on (from Allocate)
    slots: tuple[int, ...] = ()
    slot_start: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        """All tokens but the last sampled one are in the pool and computed."""
        return 0 < self.num_in_pool == self.num_computed == len(self.token_ids) - 1

    @property
    def num_to_prefill(self) -> int:
        return self.num_in_pool - self.num_computed

    def prefill_slots(self, num_tokens: int) -> tuple[int, ...]:
        start = self.num_computed - self.slot_start
        return self.slots[start : start + num_tokens]

    def fork(self, seq_id: str) -> SeqState:
        return SeqState(seq_id, list(self.token_ids), self.num_prompt_tokens, self.num_in_pool,
                        self.num_computed, self.num_committed)

    def evict(self) -> None:
        """Preempted: nothing of it is in the pool any more."""
        self.num_in_pool = self.num_computed = self.num_committed = 0
        self.slots, self.slot_start = (), 0


@dataclass
class RequestState:
    """A request while the scheduler holds it (waiting or running)."""

    request: GenerationRequest
    arrival_s: float
    samples: list[SeqState] = field(default_factory=list)
    first_token_s: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.samples:
            req = self.request
            self.samples = [SeqState(f"{req.request_id}.0", list(req.prompt_token_ids),
                                     len(req.prompt_token_ids))]

    @property
    def needs_fork(self) -> bool:
        return len(self.samples) < self.request.n

    def is_done(self, seq: SeqState) -> bool:
        return seq.num_generated >= self.request.max_new_tokens

    @property
    def live(self) -> list[SeqState]:
        return [seq for seq in self.samples if not self.is_done(seq)]

    @property
    def is_finished(self) -> bool:
        return not self.live

    @property
    def num_seqs_when_running(self) -> int:
        return self.request.n if self.needs_fork else len(self.live)


@dataclass(frozen=True)
class RequestOutput:
    """A finished (or rejected) request: its samples' tokens and timings.

    ``ttft_s``: arrival to first generated token; ``tpot_s``: mean time per
    output token after the first; ``tokens_per_s``: output tokens of all
    samples over arrival-to-finish. ``error`` is set when the pool could
    never hold the request (the tokens are what it had got so far).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[tuple[int, ...], ...]
    ttft_s: float
    tpot_s: float
    e2e_s: float
    tokens_per_s: float
    num_preemptions: int
    error: str | None = None


def finish(state: RequestState, now_s: float, error: str | None = None) -> RequestOutput:
    req = state.request
    outputs = [tuple(seq.token_ids[seq.num_prompt_tokens:]) for seq in state.samples]
    if error is None and len(outputs) < req.n:
        # every token came with the first one (max_new_tokens == 1): greedy
        # samples are equal, so the unforked samples copy sample 0
        outputs += [outputs[0]] * (req.n - len(outputs))
    first = state.first_token_s if state.first_token_s is not None else now_s
    num_out = len(outputs[0])
    e2e = now_s - state.arrival_s
    return RequestOutput(
        req.request_id, req.prompt_token_ids, tuple(outputs), ttft_s=first - state.arrival_s,
        tpot_s=(now_s - first) / (num_out - 1) if num_out > 1 else 0.0, e2e_s=e2e,
        tokens_per_s=sum(map(len, outputs)) / e2e if e2e > 0 else 0.0,
        num_preemptions=state.num_preemptions, error=error)


class PagingAdmission:
    """Admit whenever blockd has room: the pool and its watermark decide (an
    Allocate beyond the watermark is refused with RESOURCE_EXHAUSTED)."""

    name = "paging"

    def can_admit(self, state: RequestState, planned: Sequence[RequestState] = ()) -> bool:
        return True

    def on_admit(self, state: RequestState) -> None: ...

    def on_release(self, state: RequestState) -> None: ...


class ReservationAdmission:
    """Max-length reservation, as contiguous allocators (Orca, FasterTransformer)
    do it, emulated on the same pool: every running sequence counts
    ``ceil(max_len / block_size)`` blocks as its own from admission to finish,
    and a request is admitted only if its sequences' reservations fit in the
    pool's blocks above the watermark. The pool itself still allocates
    blocks as tokens arrive; this only bounds how many requests run at once,
    which is all the reservation changes about serving.
    """

    name = "max_reservation"

    def __init__(self, num_blocks: int, block_size: int, max_len: int, watermark_blocks: int = 0) -> None:
        if min(num_blocks, block_size, max_len) < 1 or not 0 <= watermark_blocks < num_blocks:
            raise ValueError("ReservationAdmission needs num_blocks, block_size, max_len >= 1 and "
                             "0 <= watermark_blocks < num_blocks")
        self.blocks_per_seq = num_blocks_for(max_len, block_size)
        self.budget_blocks = num_blocks - watermark_blocks
        self.num_reserved_blocks = 0
        self._held: dict[str, int] = {}

    def _need(self, state: RequestState) -> int:
        return state.num_seqs_when_running * self.blocks_per_seq

    def can_admit(self, state: RequestState, planned: Sequence[RequestState] = ()) -> bool:
        """Whether ``state`` fits besides the admitted requests and ``planned``
        (admitted earlier in the same step, not yet confirmed)."""
        need = self._need(state) + sum(map(self._need, planned))
        return self.num_reserved_blocks + need <= self.budget_blocks

    def on_admit(self, state: RequestState) -> None:
        need = self._need(state)
        self._held[state.request.request_id] = need
        self.num_reserved_blocks += need

    def on_release(self, state: RequestState) -> None:
        self.num_reserved_blocks -= self._held.pop(state.request.request_id, 0)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]
