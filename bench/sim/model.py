"""A model replica that makes up its tokens: the simulations' :class:`~client.backends.ModelExecutor`.

:class:`StubModel` answers a :class:`~client.backends.ModelBatch` with one
token per draw (one per sequence; more where a prompt ends and its samples
take their first tokens), a function of the sequence id and its context length
only (CRC-32, never Python's salted ``hash()``): the same in every run and
process, the same for a sequence recomputed after a preemption, different
for forked samples (so they diverge and copy on write as real samples do).
It computes nothing and holds no KV: what it costs is the scheduler's and
the allocator's alone. No torch.
"""

from __future__ import annotations

import zlib

from bench.sim.workload import VOCAB_SIZE
from client.backends import ModelBatch


def stub_token(seq_id: str, context_len: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The token :class:`StubModel` samples after ``context_len`` tokens of ``seq_id``."""
    return zlib.crc32(f"{seq_id}:{context_len}".encode()) % vocab_size


class StubModel:
    """Deterministic made-up next tokens; counts what it was asked to compute."""

    def __init__(self, vocab_size: int = VOCAB_SIZE) -> None:
        self.vocab_size = vocab_size
        self.num_steps = 0
        self.num_tokens = 0

    def run(self, version: int, batch: ModelBatch, *, pool_incarnation: str = "", term: int = 0) -> list[int]:
        self.num_steps += 1
        self.num_tokens += batch.num_tokens
        tokens = []
        for seq_id, n, sampling in zip(batch.seq_ids, batch.context_lens, batch.sampling):
            # a prompt's end draws the first token of each of its samples: draw j is sample j's
            tokens.append(stub_token(seq_id, n, self.vocab_size))
            tokens += [stub_token(f"{seq_id}/{j}", n, self.vocab_size) for j in range(1, sampling.num_samples)]
        return tokens
