"""One model replica's workers over gRPC, as the scheduler's
:class:`~client.backends.ModelExecutor`: a packed batch in, the next token(s)
of each sequence out.

:class:`WorkerGroup` sends a :class:`~client.backends.ModelBatch` to every
worker of the replica: one
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
from typing import TYPE_CHECKING

from blockd.auth.config import TlsConfig
from blockd.core.types import TransferPlan
from blockd.rpc.tracing import carry
from client.backends import ModelBatch
from client.errors import BlockdClientError, UnavailableError
from client.worker import WorkerClient

if TYPE_CHECKING:
    from typing_extensions import Self


class TensorParallelMismatch(RuntimeError):
    """Ranks of one tensor-parallel group returned different tokens."""


class WorkerGroup:
    """The workers of one model replica (rank order), as one :class:`~client.backends.ModelExecutor`."""

    def __init__(self, pool: str, targets: Sequence[str], *, timeout_s: float = 60.0,
                 tls: TlsConfig | None = None, token: str | None = None) -> None:
        if not targets:
            raise ValueError("a worker group needs at least one worker address")
        self.pool = pool
        self.workers = [WorkerClient(target, timeout_s=timeout_s, tls=tls, token=token) for target in targets]
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
        one changed (a worker restarted). Raises the last error after
        ``timeout_s``, naming the rank that does not answer."""
        deadline = time.monotonic() + timeout_s
        changed = False
        for rank, worker in enumerate(self.workers):
            before = worker.incarnation
            while True:
                try:
                    changed |= worker.refresh() != before
                    break
                except BlockdClientError as err:
                    if time.monotonic() > deadline:
                        raise self._group_error([(rank, err)]) from None  # names the rank and its address
                    time.sleep(0.2)
        return changed

    def _step(self, worker: WorkerClient, version: int, batch: ModelBatch, incarnation: str,
              term: int = 0) -> list[int]:
        tokens, _ = worker.model_step(self.pool, version, batch.seq_ids, batch.query_lens, batch.context_lens,
                                      batch.token_ids, batch.slot_mapping, pool_incarnation=incarnation,
                                      sampling=batch.wire_sampling, term=term, copy_lens=batch.copy_lens,
                                      copy_from=batch.copy_from)
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
        message = (f"rank {rank} ({self.workers[rank].target}) of the worker group of pool {self.pool!r}: "
                   f"{err.message}" + (f" [also failed: {others}]" if others else ""))
        return type(err)(message, code=err.code, details=err.details)

    def fetch_blocks(self, version: int, plan: TransferPlan, *, pool_incarnation: str = "",
                     term: int = 0) -> str:
        """Every rank fetches ``plan``'s blocks from the source worker of its
        shard (rank ``r`` from the source's rank ``r``); ``""`` when all did, else
        why not (the caller computes those tokens: a rank that fetched holds
        blocks the computation overwrites)."""
        if len(plan.source_workers) != len(self.workers):
            return (f"the source pool {plan.source_pool!r} has {len(plan.source_workers)} workers up, this "
                    f"group {len(self.workers)}: shards pair only between groups of one tensor-parallel size")
        def one(rank: int) -> int:
            return self.workers[rank].fetch_blocks(self.pool, version, plan, rank, pool_incarnation=pool_incarnation,
                                                   term=term)
        if self._threads is None:
            try:
                one(0)
            except BlockdClientError as err:
                return err.message
            return ""
        futures = [self._threads.submit(one, rank) for rank in range(len(self.workers))]
        wait(futures)
        failed = [(rank, f.exception()) for rank, f in enumerate(futures) if f.exception() is not None]
        return "; ".join(f"rank {rank}: {getattr(e, 'message', e)}" for rank, e in failed)

    def run(self, version: int, batch: ModelBatch, *, pool_incarnation: str = "", term: int = 0) -> list[int]:
        if self._threads is None:
            return self._step(self.workers[0], version, batch, pool_incarnation, term)
        # carry: each rank's ModelStep goes under the caller's span (itself when tracing is off)
        futures = [self._threads.submit(carry(self._step), worker, version, batch, pool_incarnation, term)
                   for worker in self.workers]
        # wait for every rank before raising any rank's error: no call is left running
        wait(futures)
        failed = [(rank, err) for rank, future in enumerate(futures) if (err := future.exception()) is not None]
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
