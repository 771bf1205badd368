"""Synthetic serving workloads and a small continuous-batching loop over one Pool.

Owns what ``bench/memory.py`` and ``blockd.demo`` both need, written once:

* request-length distributions modelled on published chat-trace statistics
  (lognormal fits with a given mean, clipped so prompt + output fits
  ``max_len``), as :class:`TraceSpec`;
* endless request streams (:func:`request_stream`), optionally with prompts
  that start with one of a few shared system prompts, parallel sampling
  (``n > 1``) and Poisson arrivals;
* :class:`Scheduler`, a vLLM-style step loop driving a
  :class:`blockd.core.Pool` through its public operations only, and
  :class:`Meter`, which averages pool statistics over steps.

One scheduler step, in order::

    free finished requests      one Free batch
    admit waiting requests      FCFS, can_allocate -> Allocate (prefix reuse)
    compute                     one batch: Commit (chunked prefill),
                                Fork n-1 samples when a prompt completes,
                                DecodeAppend one token per decoding sequence
    on NoRoom                   the batch changed nothing (atomic): preempt
                                the newest request (free it, requeue it at the
                                front, recompute from scratch) and retry

Deterministic for a given ``random.Random``. Imports only the standard
library and ``blockd.core`` (no grpc, torch or metrics).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from blockd.core import Allocate, Commit, Fork, Free, NoRoom, Pool, PoolStats
from blockd.core.types import DecodeAppend

VOCAB_SIZE = 32000


@dataclass(frozen=True)
class LengthDist:
    """Lognormal token count with the given mean and log-space ``sigma``."""

    mean: float
    sigma: float

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma**2 / 2

    def draw(self, rng: random.Random, lo: int, hi: int) -> int:
        return min(hi, max(lo, round(rng.lognormvariate(self.mu, self.sigma))))

    def params(self) -> dict:
        return {"dist": "lognormal", "mean": self.mean, "sigma": self.sigma, "mu": round(self.mu, 4)}


@dataclass(frozen=True)
class TraceSpec:
    """Prompt and output lengths of one workload; prompt + output <= ``max_len``."""

    name: str
    prompt: LengthDist
    output: LengthDist
    max_len: int = 2048

    def draw(self, rng: random.Random, prefix_len: int = 0) -> tuple[int, int]:
        """``(prompt tokens after the prefix, output tokens)``, both >= 1."""
        num_prompt = self.prompt.draw(rng, 1, self.max_len - prefix_len - 1)
        return num_prompt, self.output.draw(rng, 1, self.max_len - prefix_len - num_prompt)

    def params(self) -> dict:
        return {"prompt": self.prompt.params(), "output": self.output.params(),
                "clip": [1, self.max_len], "max_len": self.max_len}


#: ShareGPT conversations as reported for vLLM (mean input ~161, output ~338, long tails)
SHAREGPT = TraceSpec("sharegpt_like", LengthDist(160, 1.0), LengthDist(340, 0.9))
#: Alpaca instructions (mean input ~19, output ~58, short)
ALPACA = TraceSpec("alpaca_like", LengthDist(20, 0.6), LengthDist(60, 0.8))


@dataclass(frozen=True)
class Request:
    req_id: str
    prompt: tuple[int, ...]
    output_len: int
    n: int = 1
    arrival: int = 0


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(count)]


def request_stream(
    spec: TraceSpec,
    rng: random.Random,
    *,
    prefixes: Sequence[Sequence[int]] = (),
    n_choices: Sequence[tuple[int, float]] = ((1, 1.0),),
    rate: float | None = None,
    limit: int | None = None,
) -> Iterator[Request]:
    """Requests ``r0, r1, ...`` (at most ``limit``). With ``prefixes`` each
    prompt starts with one of them; ``n_choices`` weighs the sample counts;
    with ``rate`` (requests per step) arrivals are Poisson, else all at step 0."""
    ns, weights = zip(*n_choices)
    clock = 0.0
    index = 0
    while limit is None or index < limit:
        prefix = tuple(rng.choice(prefixes)) if prefixes else ()
        num_prompt, num_output = spec.draw(rng, len(prefix))
        if rate is not None:
            clock += rng.expovariate(rate)
        yield Request(f"r{index}", prefix + tuple(random_tokens(rng, num_prompt)), num_output,
                      rng.choices(ns, weights)[0], int(clock))
        index += 1


@dataclass
class _Running:
    """A request holding sequences in the pool. ``seq_ids[0]`` holds the prompt;
    the others are forked from it once the prompt is computed."""

    req: Request
    seq_ids: list[str]
    computed: int  # prompt tokens whose KV is written
    generated: int = 0

    @property
    def is_decoding(self) -> bool:
        return self.computed == len(self.req.prompt)

    @property
    def is_finished(self) -> bool:
        return self.generated >= self.req.output_len


@dataclass
class Counters:
    num_arrived: int = 0
    num_admitted: int = 0
    num_served: int = 0
    num_seqs_served: int = 0
    num_forks: int = 0
    num_preempted: int = 0
    num_rejected: int = 0
    num_decode_tokens: int = 0
    num_kv_events: int = 0


class Scheduler:
    """Continuous batching over one pool (see the module docstring).

    ``prefill_budget`` caps prompt tokens computed per step (chunked prefill;
    None = whole prompts); ``max_waiting`` bounds how much of an endless
    stream is pulled into the queue at once.
    """

    def __init__(self, pool: Pool, requests: Iterator[Request], rng: random.Random, *,
                 prefill_budget: int | None = None, max_waiting: int = 256) -> None:
        self.pool = pool
        self.rng = rng
        self.prefill_budget = prefill_budget
        self.max_waiting = max_waiting
        self.now = 0
        self.waiting: deque[Request] = deque()
        self.running: list[_Running] = []
        self.counters = Counters()
        self._requests = requests
        self._next: Request | None = next(requests, None)

    @property
    def is_done(self) -> bool:
        return self._next is None and not self.waiting and not self.running

    @property
    def num_running_seqs(self) -> int:
        return sum(len(item.seq_ids) for item in self.running)

    def step(self) -> None:
        self._pull_arrivals()
        self._free_finished()
        self._admit()
        self._compute()
        # nobody follows this pool's event stream here: count and drop it
        self.counters.num_kv_events += len(self.pool.take_events())
        self.now += 1

    def _pull_arrivals(self) -> None:
        while (self._next is not None and self._next.arrival <= self.now
               and len(self.waiting) < self.max_waiting):
            self.waiting.append(self._next)
            self.counters.num_arrived += 1
            self._next = next(self._requests, None)

    def _free_finished(self) -> None:
        done = [item for item in self.running if item.is_decoding and item.is_finished]
        if not done:
            return
        self.pool.step([Free(seq_id) for item in done for seq_id in item.seq_ids])
        self.running = [item for item in self.running if not item.is_finished]
        self.counters.num_served += len(done)
        self.counters.num_seqs_served += sum(len(item.seq_ids) for item in done)

    def _admit(self) -> None:
        """FCFS: stop at the first request that does not fit, so a long prompt
        is not starved by short ones behind it."""
        pool = self.pool
        while self.waiting:
            req = self.waiting[0]
            if not pool.can_allocate(req.prompt):
                if not self.running:  # an idle pool cannot hold it: it never will
                    self.waiting.popleft()
                    self.counters.num_rejected += 1
                    continue
                return
            self.waiting.popleft()
            seq_id = f"{req.req_id}.0"
            result = pool.step([Allocate(seq_id, req.prompt)]).results[0]
            self.running.append(_Running(req, [seq_id], result.num_cached_tokens))
            self.counters.num_admitted += 1

    def _plan(self) -> tuple[list, dict[int, int], list[int]]:
        """This step's compute batch: the ops, new prompt progress by running
        index, and the running indices that decode (one token per sequence)."""
        ops: list = []
        progress: dict[int, int] = {}
        decoding: list[int] = []
        budget = self.prefill_budget
        for index, item in enumerate(self.running):
            if item.is_decoding:
                decoding.append(index)
                continue
            chunk = len(item.req.prompt) - item.computed
            if budget is not None:
                chunk = min(chunk, budget)
                budget -= chunk
            if chunk <= 0:
                continue
            progress[index] = item.computed + chunk
            ops.append(Commit(item.seq_ids[0], progress[index]))
            if progress[index] == len(item.req.prompt):  # prompt done: start the samples
                ops.extend(Fork(item.seq_ids[0], f"{item.req.req_id}.{i}") for i in range(1, item.req.n))
        seq_ids = [seq_id for index in decoding for seq_id in self.running[index].seq_ids]
        if seq_ids:
            ops.append(DecodeAppend(seq_ids, random_tokens(self.rng, len(seq_ids))))
        return ops, progress, decoding

    def _compute(self) -> None:
        while self.running:
            ops, progress, decoding = self._plan()
            if not ops:
                return
            try:
                self.pool.step(ops)
            except NoRoom:
                self._preempt_newest()
                continue
            self._apply(progress, decoding)
            return

    def _apply(self, progress: dict[int, int], decoding: list[int]) -> None:
        for index in decoding:
            item = self.running[index]
            item.generated += 1
            self.counters.num_decode_tokens += len(item.seq_ids)
        for index, computed in progress.items():
            item = self.running[index]
            item.computed = computed
            if item.is_decoding and item.req.n > 1:
                item.seq_ids.extend(f"{item.req.req_id}.{i}" for i in range(1, item.req.n))
                self.counters.num_forks += item.req.n - 1

    def _preempt_newest(self) -> None:
        """Recompute-style preemption: free the newest request's sequences and
        put it back at the head of the queue; it restarts from its prompt
        (whose full blocks the prefix cache may still hold)."""
        victim = self.running.pop()
        self.pool.step([Free(seq_id) for seq_id in victim.seq_ids])
        if self.running:
            self.waiting.appendleft(victim.req)
            self.counters.num_preempted += 1
        else:  # alone and still no room: this pool can never serve it
            self.counters.num_rejected += 1


@dataclass
class Meter:
    """Means of pool statistics over the steps it was given.

    ``utilisation`` = slots holding tokens / all slots of the pool (a block
    shared by several tables counts once); ``tail_waste_ratio`` = tail waste /
    slots of used blocks; ``free_ratio`` = free + evictable blocks / all.
    """

    num_samples: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    peak_utilisation: float = 0.0

    def add(self, stats: PoolStats) -> None:
        b = stats.block_size
        total = stats.num_blocks * b
        allocated = stats.num_used_blocks * b
        utilisation = (allocated - stats.tail_waste_slots) / total
        sample = {
            "utilisation": utilisation,
            "allocated_ratio": stats.num_used_blocks / stats.num_blocks,
            "free_ratio": (stats.num_free_blocks + stats.num_evictable_blocks) / stats.num_blocks,
            "tail_waste_slots": stats.tail_waste_slots,
            "tail_waste_ratio": stats.tail_waste_slots / allocated if allocated else 0.0,
            "num_seqs": stats.num_seqs,
            "num_used_blocks": stats.num_used_blocks,
        }
        for key, value in sample.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.num_samples += 1
        self.peak_utilisation = max(self.peak_utilisation, utilisation)

    def means(self) -> dict[str, float]:
        return {key: value / self.num_samples for key, value in self.sums.items()} if self.num_samples else {}
