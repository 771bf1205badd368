"""Synthetic serving workloads: the one place requests are drawn for the
simulations, the demos and the benchmarks.

* request-length distributions: lognormal fits of published chat-trace
  statistics (:class:`LengthDist`, :data:`SHAREGPT`, :data:`ALPACA`) or
  uniform ranges (:class:`UniformDist`, the cluster demo's small lengths),
  combined per workload as a :class:`TraceSpec` that clips prompt + output to
  ``max_len``;
* shared system prompts (:func:`system_prompts`, :func:`with_bare`), so the
  prefix cache has something to hit;
* :func:`request_stream`: :class:`TimedRequest` s (a
  :class:`client.serving.GenerationRequest` and its arrival step), optionally
  starting with one of the shared prefixes, with parallel sampling
  (``n > 1``) and Poisson arrivals.

Deterministic for a given ``random.Random``. Imports only the standard
library and :mod:`client.serving` (plain data).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from client.serving import GenerationRequest

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
class UniformDist:
    """A token count drawn uniformly from ``[low, high]``."""

    low: int
    high: int

    def draw(self, rng: random.Random, lo: int, hi: int) -> int:
        return min(hi, max(lo, rng.randint(self.low, self.high)))

    def params(self) -> dict:
        return {"dist": "uniform", "low": self.low, "high": self.high}


@dataclass(frozen=True)
class TraceSpec:
    """Prompt and output lengths of one workload; prompt + output <= ``max_len``."""

    name: str
    prompt: LengthDist | UniformDist
    output: LengthDist | UniformDist
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
class TimedRequest:
    """A request and the scheduler step at which it arrives."""

    arrival: int
    request: GenerationRequest


def random_tokens(rng: random.Random, count: int, vocab_size: int = VOCAB_SIZE) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(count)]


def system_prompts(rng: random.Random, count: int, lengths: tuple[int, int],
                   vocab_size: int = VOCAB_SIZE) -> list[tuple[int, ...]]:
    """``count`` shared prompt prefixes, each of ``lengths[0] .. lengths[1]`` tokens."""
    return [tuple(random_tokens(rng, rng.randint(*lengths), vocab_size)) for _ in range(count)]


def with_bare(prefixes: Sequence[tuple[int, ...]], share_prefixed: float) -> list[tuple[int, ...]]:
    """``prefixes`` plus empty ones, so that about ``share_prefixed`` of the
    requests drawn with :func:`request_stream` start with a shared prefix."""
    num_bare = round(len(prefixes) * (1 - share_prefixed) / share_prefixed)
    return [*prefixes, *[()] * max(1, num_bare)]


def request_stream(spec: TraceSpec, rng: random.Random, *, prefixes: Sequence[Sequence[int]] = (),
                   n_choices: Sequence[tuple[int, float]] = ((1, 1.0),), rate: float | None = None,
                   limit: int | None = None, vocab_size: int = VOCAB_SIZE,
                   id_prefix: str = "r") -> Iterator[TimedRequest]:
    """Requests ``r0, r1, ...`` (at most ``limit``). With ``prefixes`` each
    prompt starts with one of them; ``n_choices`` weighs the sample counts;
    with ``rate`` (requests per step) arrivals are Poisson, else all at step 0.
    ``max_new_tokens`` is the drawn output length."""
    ns, weights = zip(*n_choices)
    clock = 0.0
    index = 0
    while limit is None or index < limit:
        prefix = tuple(rng.choice(prefixes)) if prefixes else ()
        num_prompt, num_output = spec.draw(rng, len(prefix))
        if rate is not None:
            clock += rng.expovariate(rate)
        prompt = prefix + tuple(random_tokens(rng, num_prompt, vocab_size))
        request = GenerationRequest(f"{id_prefix}{index}", prompt, num_output, n=rng.choices(ns, weights)[0])
        yield TimedRequest(int(clock), request)
        index += 1
