"""What :mod:`client.scheduler` serves and reports: requests, their sampling
and stop rules, their sequences, their outputs and timings, and the
admission policies.

A :class:`GenerationRequest` becomes a :class:`RequestState` holding one
:class:`SeqState` per sample. Sample 0 (``"<request_id>.0"``) holds the
prompt. The step that computes the prompt's last token draws the first token
of every sample from those logits (sample indices 0 .. n-1); samples
``1 .. n-1`` wait in ``pending`` until the next batch forks them from sample
0, so they share its blocks, and from then on each draws its own tokens.
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
(prompt + generated) become the new prompt. A sample stops at an end token
(the model's EOS unless ``ignore_eos``, or one of ``stop_token_ids``; the
token is kept in its output, as transformers' ``generate`` does) or after
``max_new_tokens``.

Plain data and arithmetic: no grpc, no torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from blockd.core.arith import num_blocks_for
from blockd.core.hashing import NO_EXTRA_KEYS, ExtraKeys
from blockd.core.lru import DEFAULT_PRIORITY, NUM_PRIORITIES
from client.backends import PLAIN_GREEDY, SamplingSpec

#: the largest seed the workers take (uint64)
MAX_SEED = (1 << 64) - 1
FINISH_STOP = "stop"  #: ended at an end token (EOS or a stop token id)
FINISH_LENGTH = "length"  #: ended after max_new_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen, and which tokens end a sample.

    ``temperature`` 0 is greedy (argmax, token-exact with transformers'
    ``generate(do_sample=False)``); above 0 the workers draw from
    ``softmax(logits / temperature)`` cut to the ``top_k`` most likely tokens
    (0: no cut) and to the nucleus of mass ``top_p`` (1: no cut). A draw is a
    pure function of the logits and ``(seed, sample index, position)``, so a
    request with a ``seed`` gets the same tokens on every run, after
    preemption and on a tensor-parallel group; without one the scheduler
    picks a seed per request (samples still differ from each other).
    ``stop_token_ids`` end a sample like EOS does; ``ignore_eos`` lets the
    model's EOS pass (benchmarks with a fixed output length).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no cut), got {self.top_k!r}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if not all(type(t) is int and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


@dataclass(frozen=True)
class GenerationRequest:
    """Up to ``max_new_tokens`` tokens for each of ``n`` samples, chosen and
    stopped as ``sampling`` says (greedy by default)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    n: int = 1
    #: what besides the tokens changes the KV (model, adapter, tenant): prefix reuse respects it
    extra_keys: ExtraKeys = NO_EXTRA_KEYS
    sampling: SamplingParams = GREEDY
    #: retention priority of its blocks once freed, 0..7: lower is evicted first (docs/protocol.md, Priorities)
    priority: int = DEFAULT_PRIORITY

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
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"request {self.request_id}: sampling must be a SamplingParams")
        if type(self.priority) is not int or not 0 <= self.priority < NUM_PRIORITIES:
            raise ValueError(f"request {self.request_id}: priority must be an integer in [0, {NUM_PRIORITIES - 1}] "
                             f"(lower is evicted first), got {self.priority!r}")

    @property
    def max_len(self) -> int:
        return len(self.prompt_token_ids) + self.max_new_tokens


def check_request(request) -> None:
    """Refuse anything but a :class:`GenerationRequest` (what a scheduler queues)."""
    if not isinstance(request, GenerationRequest):
        raise TypeError(f"the scheduler takes GenerationRequest s, got {type(request).__name__}")


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
    #: which of the request's samples (the sampling key's sample index)
    sample_index: int = 0
    #: FINISH_STOP or FINISH_LENGTH once the sample has ended
    finish_reason: str | None = None
    #: chained hashes of its first full blocks, memoised by the scheduler's
    #: prefix sharing (SchedulerConfig.prefix_block_size); tokens only ever append
    block_hashes: list[bytes] = field(default_factory=list, repr=False, compare=False)

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

    def forked_from(self, parent: SeqState) -> SeqState:
        """This pending sample as a child of ``parent``: its blocks (the
        prompt's), its own first token."""
        return SeqState(self.seq_id, list(self.token_ids), self.num_prompt_tokens, parent.num_in_pool,
                        parent.num_computed, parent.num_committed, sample_index=self.sample_index)

    def evict(self) -> None:
        """Preempted: nothing of it is in the pool any more."""
        self.num_in_pool = self.num_computed = self.num_committed = 0
        self.slots, self.slot_start = (), 0


@dataclass
class RequestState:
    """A request while the scheduler holds it (waiting or running).

    ``stop_token_ids``: the tokens that end a sample (the request's stop ids,
    and the model's EOS ids unless it ignores them); ``seed``: the request's
    seed, or one picked for it.
    """

    request: GenerationRequest
    arrival_s: float
    samples: list[SeqState] = field(default_factory=list)
    first_token_s: float | None = None
    num_preemptions: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    seed: int = 0
    #: samples 1 .. n-1 drawn when the prompt ended, waiting to be forked from sample 0
    pending: list[SeqState] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.samples:
            req = self.request
            self.samples = [SeqState(f"{req.request_id}.0", list(req.prompt_token_ids),
                                     len(req.prompt_token_ids))]

    @property
    def has_drawn(self) -> bool:
        """Whether every sample has its first token (the prompt was computed)."""
        return len(self.samples) + len(self.pending) == self.request.n

    def add_token(self, seq: SeqState, token: int) -> None:
        """Extend ``seq`` by ``token`` and end it if that token ends it."""
        seq.token_ids.append(token)
        if token in self.stop_token_ids:
            seq.finish_reason = FINISH_STOP
        elif seq.num_generated >= self.request.max_new_tokens:
            seq.finish_reason = FINISH_LENGTH

    def draw_samples(self, parent: SeqState, tokens: Sequence[int]) -> list[SeqState]:
        """The prompt ended: sample 0 takes ``tokens[0]``, samples 1.. are born
        with ``tokens[1:]`` (the live ones wait to be forked); all of them, in
        sample order."""
        self.add_token(parent, tokens[0])
        born = [parent]
        for index, token in enumerate(tokens[1:], start=1):
            child = SeqState(f"{self.request.request_id}.{index}", parent.token_ids[:-1],
                             parent.num_prompt_tokens, sample_index=index)
            self.add_token(child, token)
            (self.samples if child.finish_reason else self.pending).append(child)
            born.append(child)
        return born

    def release_pending(self) -> None:
        """Preempted before the fork: the pending samples become ordinary
        sequences, each allocated on its own when the request runs again."""
        self.samples += self.pending
        self.pending = []

    def sampling_for(self, seq: SeqState, num_samples: int = 1) -> SamplingSpec:
        sp = self.request.sampling
        if sp.is_greedy and num_samples == 1:
            return PLAIN_GREEDY
        return SamplingSpec(sp.temperature, sp.top_p, sp.top_k, self.seed, seq.sample_index, num_samples)

    def draws_at(self, seq: SeqState, end: int) -> int:
        """How many tokens the model draws for ``seq`` when its computed tokens
        reach ``end``: every sample's first one where sample 0's prompt ends."""
        if seq.sample_index == 0 and not self.has_drawn and end == len(seq.token_ids):
            return self.request.n
        return 1

    @property
    def live(self) -> list[SeqState]:
        return [seq for seq in self.samples if seq.finish_reason is None]

    @property
    def is_finished(self) -> bool:
        return self.has_drawn and not self.live and not self.pending

    @property
    def num_seqs_when_running(self) -> int:
        return len(self.live) + len(self.pending) if self.has_drawn else self.request.n


@dataclass(frozen=True)
class RequestOutput:
    """A finished (or rejected) request: its samples' tokens and timings.

    ``output_token_ids[i]`` is sample ``i``'s tokens (an end token that
    stopped it included) and ``finish_reasons[i]`` why it ended
    (``"stop"``: an end token; ``"length"``: max_new_tokens). ``ttft_s``:
    arrival to first generated token; ``tpot_s``: mean time per output token
    after the first (of the longest sample); ``tokens_per_s``: output tokens
    of all samples over arrival-to-finish. ``error`` is set when the request
    failed (the tokens are what it had got so far).
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
    finish_reasons: tuple[str | None, ...] = ()


def finish(state: RequestState, now_s: float, error: str | None = None) -> RequestOutput:
    req = state.request
    samples = sorted(state.samples + state.pending, key=lambda seq: seq.sample_index)
    outputs = [tuple(seq.token_ids[seq.num_prompt_tokens:]) for seq in samples]
    first = state.first_token_s if state.first_token_s is not None else now_s
    num_out = max(map(len, outputs))
    e2e = now_s - state.arrival_s
    return RequestOutput(
        req.request_id, req.prompt_token_ids, tuple(outputs), ttft_s=first - state.arrival_s,
        tpot_s=(now_s - first) / (num_out - 1) if num_out > 1 else 0.0, e2e_s=e2e,
        tokens_per_s=sum(map(len, outputs)) / e2e if e2e > 0 else 0.0,
        num_preemptions=state.num_preemptions, error=error,
        finish_reasons=tuple(seq.finish_reason for seq in samples))


def new_state(request: GenerationRequest, arrival_s: float, eos_token_ids: Sequence[int],
              rng: random.Random) -> RequestState:
    """The state of a request just given to the scheduler: its end tokens and its seed."""
    sp = request.sampling
    stops = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(eos_token_ids))
    seed = sp.seed if sp.seed is not None else rng.getrandbits(64)
    return RequestState(request, arrival_s, stop_token_ids=stops, seed=seed)


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
