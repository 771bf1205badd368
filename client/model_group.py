"""One model replica's workers as the scheduler sees them: a packed batch in,
the next token(s) of each sequence out.

:class:`ModelBatch` is the step contract of the workers' ``ModelStep`` RPC
(see :meth:`client.worker.WorkerClient.model_step`)::

    seq i:  |<------------- context_lens[i] ------------->|
            |  already in the pool (cached)  | query_lens[i] new tokens |

``token_ids`` and ``slot_mapping`` hold the sequences' new tokens, packed in
batch order; ``sampling`` says how each sequence chooses its next token
(:class:`~client.serving.SeqSampling`: greedy, or seeded draws, several where
a prompt ends and its samples fork), and the answer has ``num_draws`` tokens. :class:`WorkerGroup` sends it to every worker of the replica: one
worker holding the whole model, or a tensor-parallel group whose ranks each
hold a share of the KV heads and must all run the same step at once (their
collectives wait for each other). Rank 0's tokens are the answer; every other
rank must agree, else the group raises :class:`TensorParallelMismatch`. When
ranks fail, the error raised names the rank and its address, an unreachable
rank's first (a dead worker also breaks its peers' collectives).

Each worker client names the worker incarnation it learned first; after a
worker restarted (a refusal with reason ``WORKER_INCARNATION_MISMATCH``, or a
worker that cannot be reached) :meth:`WorkerGroup.reconnect` waits until every
worker answers again and learns the new incarnations.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from client.errors import BlockdClientError, UnavailableError
from client.serving import PLAIN_GREEDY, SeqSampling
from client.worker import WorkerClient

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass
class ModelBatch:
    """One step's sequences and their new tokens, in batch order."""

    seq_ids: list[str] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    sampling: list[SeqSampling] = field(default_factory=list)

    def add(self, seq_id: str, context_len: int, token_ids: Sequence[int], slots: Sequence[int],
            sampling: SeqSampling | None = None) -> None:
        """Sequence ``seq_id`` computes ``token_ids`` at positions
        ``context_len - len(token_ids) .. context_len - 1`` into ``slots``
        and chooses its next token(s) as ``sampling`` says (default: one, greedy)."""
        if not token_ids or len(token_ids) != len(slots) or context_len < len(token_ids):
            raise ValueError(f"sequence {seq_id!r}: need 1 <= {len(token_ids)} new tokens <= context "
                             f"{context_len}, one slot each (got {len(slots)})")
        self.seq_ids.append(seq_id)
        self.query_lens.append(len(token_ids))
        self.context_lens.append(context_len)
        self.token_ids.extend(token_ids)
        self.slot_mapping.extend(slots)
        self.sampling.append(sampling or PLAIN_GREEDY)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_draws(self) -> int:
        """Tokens the workers answer: one per sequence, more where several are drawn."""
        return sum(s.num_samples for s in self.sampling)

    @property
    def wire_sampling(self) -> list[SeqSampling]:
        """What ModelStep's ``sampling`` carries: nothing when every sequence is plain greedy."""
        return [] if all(s.is_plain_greedy for s in self.sampling) else list(self.sampling)


class ModelExecutor(Protocol):
    """What the scheduler needs from a model replica."""

    def run(self, version: int, batch: ModelBatch, *, pool_incarnation: str = "") -> list[int]:
        """The ``batch.num_draws`` next tokens of ``batch`` (in batch order, a
        sequence's draws together), at pool ``version`` of ``pool_incarnation``.
        May also have ``reconnect(timeout_s)``, which the scheduler calls
        after a worker fault (see :class:`WorkerGroup`)."""
        ...


class TensorParallelMismatch(RuntimeError):
    """Ranks of one tensor-parallel group returned different tokens."""


class WorkerGroup:
    """The workers of one model replica (rank order), as one :class:`ModelExecutor`."""

    def __init__(self, pool: str, targets: Sequence[str], *, timeout_s: float = 60.0) -> None:
        if not targets:
            raise ValueError("a worker group needs at least one worker address")
        self.pool = pool
        self.workers = [WorkerClient(target, timeout_s=timeout_s) for target in targets]
        # one thread per rank: every rank must be inside its step at once
        self._threads = ThreadPoolExecutor(len(self.workers), thread_name_prefix="model-step") \
            if len(self.workers) > 1 else None

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
        for worker in self.workers:
            worker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reconnect(self, timeout_s: float = 120.0) -> bool:
        """Wait until every worker answers, and learn its incarnation; True if
        one changed (a worker restarted). Raises the last error after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        changed = False
        for worker in self.workers:
            before = worker.incarnation
            while True:
                try:
                    changed |= worker.refresh() != before
                    break
                except BlockdClientError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        return changed

    def _step(self, worker: WorkerClient, version: int, batch: ModelBatch, incarnation: str) -> list[int]:
        tokens, _ = worker.model_step(self.pool, version, batch.seq_ids, batch.query_lens, batch.context_lens,
                                      batch.token_ids, batch.slot_mapping, pool_incarnation=incarnation,
                                      sampling=batch.wire_sampling)
        return tokens

    def _group_error(self, failed: list[tuple[int, BaseException]]) -> BaseException:
        """The error to raise when ranks failed: an unreachable rank's first (the
        others' failures -- a collective whose peer died -- follow from it),
        naming the rank and its address, with the other ranks' status codes."""
        rank, err = next(((r, e) for r, e in failed if isinstance(e, UnavailableError)), failed[0])
        if not isinstance(err, BlockdClientError):
            return err
        others = "; ".join(f"rank {r} ({self.workers[r].target}): "
                           + (e.code.name if isinstance(e, BlockdClientError) else type(e).__name__)
                           for r, e in failed if r != rank)
        message = f"rank {rank} ({self.workers[rank].target}) of the worker group of pool {self.pool!r}: " \
                  f"{err.message}" + (f" [also failed: {others}]" if others else "")
        return type(err)(message, code=err.code, details=err.details)

    def run(self, version: int, batch: ModelBatch, *, pool_incarnation: str = "") -> list[int]:
        if self._threads is None:
            return self._step(self.workers[0], version, batch, pool_incarnation)
        futures = [self._threads.submit(self._step, worker, version, batch, pool_incarnation)
                   for worker in self.workers]
        # wait for every rank before raising any rank's error: no call is left running
        wait(futures)
        failed = [(rank, future.exception()) for rank, future in enumerate(futures) if future.exception()]
        if failed:
            raise self._group_error(failed)
        answers = [future.result() for future in futures]
        for rank, tokens in enumerate(answers[1:], start=1):
            if tokens != answers[0]:
                first = next(i for i, (a, b) in enumerate(zip(answers[0], tokens)) if a != b) \
                    if len(tokens) == len(answers[0]) else min(len(tokens), len(answers[0]))
                raise TensorParallelMismatch(
                    f"at version {version} rank {rank} ({self.workers[rank].target}) disagrees with rank 0 "
                    f"on sequence {batch.seq_ids[first] if first < batch.num_seqs else first!r}")
        return answers[0]
