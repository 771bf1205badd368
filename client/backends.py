"""What the scheduler drives, as protocols: blockd and a model replica.

:class:`client.scheduler.Scheduler` needs two collaborators and names them
only through these protocols, so it imports neither the workers nor a
transport:

* a :class:`BlockdBackend` takes each step's batch: :class:`client.sdk.BlockdClient`
  over gRPC, or the allocator in process (:class:`bench.sim.backend.InProcessBlockd`,
  the same engine without the network). Both fail with the SDK's exceptions
  (:mod:`client.errors`), so the scheduler handles one set of errors;
* a :class:`ModelExecutor` computes one step of the model for a
  :class:`ModelBatch`: the workers of a replica over gRPC
  (:class:`client.model_group.WorkerGroup`) or a stub that makes up tokens
  (:class:`bench.sim.model.StubModel`).

:class:`ModelBatch` is the step contract of the workers' ``ModelStep`` RPC
(see :meth:`client.worker.WorkerClient.model_step`)::

    seq i:  |<------------- context_lens[i] ------------->|
            |  already in the pool (cached)  | query_lens[i] new tokens |

``token_ids`` and ``slot_mapping`` hold the sequences' new tokens, packed in
batch order; ``sampling`` says how each sequence chooses its next token
(:class:`SamplingSpec`: greedy, or seeded draws, several where
a prompt ends and its samples fork), and the answer has ``num_draws`` tokens.
Plain data and protocols: no grpc, no torch.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from blockd.core.types import Op, StepResult
from client.errors import BlockdClientError

log = logging.getLogger("blockd.scheduler")


@dataclass(frozen=True)
class SamplingSpec:
    """How one sequence of a model step chooses its next token(s): the
    ``SamplingParams`` message of ``ModelStep`` (see worker.proto), shared by
    the scheduler that asks and the worker that draws. The worker draws
    ``num_samples`` tokens, for sample indices ``sample_index`` onwards (more
    than one only where a prompt ends and its samples fork)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    sample_index: int = 0
    num_samples: int = 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """One argmax token: what a ModelStep without sampling answers."""
        return self.temperature == 0.0 and self.num_samples == 1


PLAIN_GREEDY = SamplingSpec()


@dataclass
class ModelBatch:
    """One step's sequences and their new tokens, in batch order."""

    seq_ids: list[str] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    sampling: list[SamplingSpec] = field(default_factory=list)
    #: ModelStep's copies: both empty, or one entry per sequence (``ModelStepRequest.copy_lens``)
    copy_lens: list[int] = field(default_factory=list)
    copy_from: list[int] = field(default_factory=list)

    def add(self, seq_id: str, context_len: int, token_ids: Sequence[int], slots: Sequence[int],
            sampling: SamplingSpec | None = None, copy: tuple[int, int] = (0, 0)) -> None:
        """Sequence ``seq_id`` computes ``token_ids`` at positions
        ``context_len - len(token_ids) .. context_len - 1`` into ``slots``
        and chooses its next token(s) as ``sampling`` says (default: one, greedy).
        ``copy``: ``(batch index, tokens)``: its that many context tokens just
        before the new ones are copied from that earlier entry's new tokens."""
        if not token_ids or len(token_ids) != len(slots) or context_len < len(token_ids):
            raise ValueError(f"sequence {seq_id!r}: need 1 <= {len(token_ids)} new tokens <= context "
                             f"{context_len}, one slot each (got {len(slots)})")
        if copy[1]:
            if not self.copy_lens:
                self.copy_lens, self.copy_from = [0] * len(self.seq_ids), [0] * len(self.seq_ids)
            self.copy_lens.append(copy[1])
            self.copy_from.append(copy[0])
        elif self.copy_lens:
            self.copy_lens.append(0)
            self.copy_from.append(0)
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
    def wire_sampling(self) -> list[SamplingSpec]:
        """What ModelStep's ``sampling`` carries: nothing when every sequence is plain greedy."""
        return [] if all(s.is_plain_greedy for s in self.sampling) else list(self.sampling)


class ModelExecutor(Protocol):
    """What the scheduler needs from a model replica."""

    def run(self, version: int, batch: ModelBatch, *, pool_incarnation: str = "", term: int = 0) -> list[int]:
        """The ``batch.num_draws`` next tokens of ``batch`` (in batch order, a
        sequence's draws together), at pool ``version`` of ``pool_incarnation``,
        acknowledged in leader ``term`` (a replicated blockd; 0: not).
        May also have ``reconnect(timeout_s)``, which the scheduler calls
        after a worker fault (see :class:`client.model_group.WorkerGroup`)."""
        ...


class BlockdBackend(Protocol):
    """What the scheduler needs from blockd (a subset of :class:`client.sdk.BlockdClient`)."""

    def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
             timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "",
             previous_term: int = 0) -> StepResult:
        """Apply ``ops`` atomically (see :meth:`client.sdk.BlockdClient.step`)."""
        ...

    def reset_prefix_cache(self, pool: str, *, request_id: str | None = None) -> None:
        """Drop every cached prefix block of ``pool``."""
        ...

    def get_tables(self, pool: str, seq_ids: Sequence[str] = ()) -> tuple[int, dict[str, list[int]]]:
        """``(version, block table per sequence)``: the named sequences, or every one."""
        ...


def pool_block_size(backend: BlockdBackend, pool: str) -> int:
    """``SchedulerConfig.prefix_block_size``'s default: ``pool``'s block size, or 0 (off)
    when the backend has no ``pool_config`` (it is optional) or cannot answer; sharing
    prompt prefixes within a burst is an optimisation, never needed for a right answer."""
    pool_config = getattr(backend, "pool_config", None)
    if pool_config is None:
        return 0
    try:
        return int(pool_config(pool).block_size)
    except BlockdClientError as err:
        log.warning("pool %s: cannot read its block size (%s); prompt prefixes within a burst are not "
                    "shared (set SchedulerConfig.prefix_block_size)", pool, err)
        return 0


def stream_step(backend: BlockdBackend, owner: object) -> Callable[..., StepResult]:
    """The scheduler's step call with ``SchedulerConfig.stream_steps``: ``step`` of one
    :class:`client.step_stream.StepStream` when the backend offers ``step_stream``
    (the same answers, refusals and request ids as unary ``step``, for less of the
    daemon's CPU per step; closed once ``owner`` is collected), else ``backend.step``.
    Only when both methods belong to the same object: a wrapper that overrides
    ``step`` (to watch or change steps) and hands other attributes through keeps its
    ``step`` unless it offers a ``step_stream`` of its own."""
    opener = getattr(backend, "step_stream", None)  # optional in a BlockdBackend
    if opener is None or getattr(opener, "__self__", None) is not getattr(backend.step, "__self__", None):
        return backend.step
    stream = opener()
    weakref.finalize(owner, stream.close)
    return stream.step
