"""A fake model for scheduler tests, against a real in-process blockd.

:class:`SlotModel` stands in for the workers: it writes every new token id into
the slot the step names (after checking that slot against the sequence's
table), runs the step's copy-on-write copies and its copies within the step
(``ModelBatch.copy_lens``), and computes the logits of a
sequence's next token from a hash of its whole context *as read back through
its block table*; it then chooses the next token(s) with the workers' own
sampler (:mod:`worker.sampling`), greedy or seeded. So a wrong slot, a missed
copy, a prefix hit on blocks that were never written or a recompute that lost
a token all change the generated tokens, and the tests compare them with
:func:`reference`, the same computation over the plain token list. Like a
worker, it refuses (``KV_NOT_WRITTEN``) to compute over a slot it holds
nothing for, so a "restart" (its slots cleared, a new worker incarnation
registered) must be recovered by recomputing.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from google.rpc import error_details_pb2

from blockd.core import PoolConfig
from client.backends import ModelBatch, SamplingSpec
from client.errors import FailedPreconditionError
from client.scheduler import Scheduler
from client.serving import GREEDY, SamplingParams
from worker.sampling import next_tokens

VOCAB = 1000
BLOCK = 4


def context_hash(context: list[int]) -> int:
    acc = len(context)
    for token in context:
        acc = (acc * 131 + token + 7) % 1_000_003
    return acc


def logits_of(context: list[int]) -> torch.Tensor:
    """``[VOCAB]`` logits that depend on every token of ``context`` and its length."""
    generator = torch.Generator().manual_seed(context_hash(context))
    return torch.randn(VOCAB, generator=generator) * 3


def next_token(context: list[int]) -> int:
    return int(logits_of(context).argmax())


def reference(prompt: tuple[int, ...], max_new_tokens: int, sampling: SamplingParams = GREEDY, *,
              seed: int = 0, sample_index: int = 0, eos: tuple[int, ...] = ()) -> tuple[int, ...]:
    """What sample ``sample_index`` of a request generates, computed plainly."""
    spec = SamplingSpec(sampling.temperature, sampling.top_p, sampling.top_k, seed, sample_index)
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos))
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        (token,) = next_tokens(logits_of(tokens)[None], [spec], [len(tokens)])
        tokens.append(token)
        if token in stops:
            break
    return tuple(tokens[len(prompt):])


def check_outputs(outputs, requests) -> None:
    """Every request ended without error, each sample with the reference greedy tokens."""
    by_id = {out.request_id: out for out in outputs}
    assert set(by_id) == {req.request_id for req in requests}
    for req in requests:
        out = by_id[req.request_id]
        assert out.error is None, out.error
        assert out.output_token_ids == (reference(req.prompt_token_ids, req.max_new_tokens),) * req.n


class SlotModel:
    """The fake model; ``step`` wraps the client's so it sees each version's copy ops."""

    def __init__(self, client, pool: str) -> None:
        self.client, self.pool = client, pool
        self.slots: dict[int, int] = {}
        self.num_steps = 0
        self.batches: list[ModelBatch] = []

    def step(self, pool, ops, *, via=None, **kwargs):
        """``via``: the call that sends the step (default: the client's unary step)."""
        result = (via or self.client.step)(pool, ops, **kwargs)
        for src, dst in result.copy_ops:
            for offset in range(BLOCK):
                if src * BLOCK + offset in self.slots:
                    self.slots[dst * BLOCK + offset] = self.slots[src * BLOCK + offset]
        return result

    def run(self, version: int, batch: ModelBatch, *, pool_incarnation: str = "", term: int = 0) -> list[int]:
        self.num_steps += 1
        self.batches.append(batch)
        _, tables = self.client.get_tables(self.pool, batch.seq_ids)
        rows, row, firsts = [], 0, []
        # every new token first, as a worker writes a layer's K/V before its attention reads any
        for seq_id, q, n in zip(batch.seq_ids, batch.query_lens, batch.context_lens):
            table = tables[seq_id]
            firsts.append(row)
            for pos in range(n - q, n):
                slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
                assert batch.slot_mapping[row] == slot, f"{seq_id} token {pos}: wrong slot"
                self.slots[slot] = batch.token_ids[row]
                row += 1
        # then the copies (ModelStepRequest.copy_lens): the source's new token at the same position
        for j, (c, i) in enumerate(zip(batch.copy_lens, batch.copy_from)):
            start = batch.context_lens[j] - batch.query_lens[j] - c
            source_start = batch.context_lens[i] - batch.query_lens[i]
            assert c == 0 or (source_start <= start and start + c <= batch.context_lens[i]), "copy of no new tokens"
            table = tables[batch.seq_ids[j]]
            for pos in range(start, start + c):
                self.slots[table[pos // BLOCK] * BLOCK + pos % BLOCK] = batch.token_ids[firsts[i] + pos - source_start]
        for seq_id, n in zip(batch.seq_ids, batch.context_lens):
            table = tables[seq_id]
            context = [self.slots.get(table[pos // BLOCK] * BLOCK + pos % BLOCK) for pos in range(n)]
            if None in context:
                raise _not_written(seq_id)
            rows.append(logits_of(context))
        specs = [SamplingSpec(**dataclasses.asdict(s)) for s in batch.wire_sampling]
        return next_tokens(torch.stack(rows), specs, batch.context_lens)


def _not_written(seq_id: str) -> FailedPreconditionError:
    info = error_details_pb2.ErrorInfo(reason="KV_NOT_WRITTEN", metadata={"seq_ids": json.dumps([seq_id])})
    return FailedPreconditionError(f"{seq_id}: KV not written", details=(info,))


class StepThrough:
    """The client as the scheduler sees it, with ``step`` going through the model."""

    def __init__(self, client, model: SlotModel) -> None:
        self._client, self._model = client, model

    def step(self, pool, ops, **kwargs):
        return self._model.step(pool, ops, **kwargs)

    def step_stream(self) -> StreamThrough:
        """The scheduler's StepStream (``SchedulerConfig.stream_steps``), through the model too."""
        return StreamThrough(self._client.step_stream(), self._model)

    def __getattr__(self, name):
        return getattr(self._client, name)


class StreamThrough:
    """A client's StepStream whose steps go through the model (copy ops applied)."""

    def __init__(self, stream, model: SlotModel) -> None:
        self._stream, self._model = stream, model

    def step(self, pool, ops, **kwargs):
        return self._model.step(pool, ops, via=self._stream.step, **kwargs)

    def close(self) -> None:
        self._stream.close()


def make(client, num_blocks: int, config, *, watermark: int = 0, admission=None, **kwargs):
    """A pool ``p`` of ``num_blocks`` and a scheduler serving it with a :class:`SlotModel`."""
    client.create_pool(PoolConfig("p", num_blocks, BLOCK, watermark_blocks=watermark))
    model = SlotModel(client, "p")
    return Scheduler(StepThrough(client, model), "p", model, config, admission=admission, **kwargs), model
