"""SDK for a worker's data plane (``blockd.v1.KVShardService``): what a model
runner in another process calls to write K/V and run attention for a batch at
a named pool version, and what a scheduler calls to run one model step on a
worker that runs a model (``model_step``).

Tensors go out as raw bytes (:mod:`blockd.rpc.tensors`, torch only, no worker
state); errors come back as :mod:`client.errors` exceptions, like the blockd
SDK's. Every call has a deadline.

Every data-plane call names the pool incarnation of its version (the caller
passes the one blockd's step returned) and the worker's incarnation: the
client learns it on first use (:meth:`WorkerClient.refresh`) and keeps it, so
a worker that restarts behind the same address refuses the next call
(``WORKER_INCARNATION_MISMATCH``) instead of answering for KV it lost. Call
:meth:`WorkerClient.refresh` once the loss is dealt with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
import torch

from blockd.auth.config import TlsConfig
from blockd.core.types import TransferPlan
from blockd.rpc.tensors import from_proto, to_proto
from blockd.v1 import worker_pb2 as pb
from blockd.v1 import worker_pb2_grpc
from client.backends import SamplingSpec
from client.channel import dial
from client.errors import from_rpc_error

if TYPE_CHECKING:
    from typing_extensions import Self


class WorkerClient:
    def __init__(self, target: str, *, timeout_s: float = 30.0, tls: TlsConfig | None = None,
                 token: str | None = None) -> None:
        """``tls``/``token``: the scheduler's credentials, as for
        :class:`client.sdk.BlockdClient` (the worker admits only its pool's
        tenant's schedulers, and admins)."""
        self.target = target
        self.timeout_s = timeout_s
        # tensors travel in messages: a prefill's K/V or logits can be large
        self._channel = dial(target, tls=tls, token=token, max_message_bytes=256 << 20)
        self._stub = worker_pb2_grpc.KVShardServiceStub(self._channel)
        #: the worker incarnation calls are planned against (learned on first use)
        self.incarnation: str | None = None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def stats(self) -> pb.GetWorkerStatsResponse:
        return self._call(self._stub.GetWorkerStats, pb.GetWorkerStatsRequest())

    def refresh(self) -> str:
        """Learn the worker's current incarnation; later calls name it."""
        self.incarnation = self.stats().worker_incarnation
        return self.incarnation

    def _worker_incarnation(self) -> str:
        return self.incarnation if self.incarnation is not None else self.refresh()

    def write_kv(self, pool: str, version: int, layer: int, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: Sequence[int], *, pool_incarnation: str, term: int = 0) -> None:
        """Write K/V rows (see ``WriteKVRequest``); ``term`` as :meth:`model_step`'s."""
        self._call(self._stub.WriteKV, pb.WriteKVRequest(
            pool=pool, version=version, layer=layer, key=to_proto(key), value=to_proto(value),
            slot_mapping=list(slot_mapping), pool_incarnation=pool_incarnation,
            worker_incarnation=self._worker_incarnation(), term=term))

    def attention(self, pool: str, version: int, layer: int, seq_ids: Sequence[str],
                  query_lens: Sequence[int], context_lens: Sequence[int], query: torch.Tensor, *,
                  pool_incarnation: str, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                  slot_mapping: Sequence[int] = (), scale: float = 0.0, term: int = 0) -> torch.Tensor:
        """``[sum(query_lens), q_heads, head_dim]`` (see ``AttentionRequest``); ``term``
        as :meth:`model_step`'s."""
        request = pb.AttentionRequest(pool=pool, version=version, layer=layer, seq_ids=list(seq_ids),
                                      query_lens=list(query_lens), context_lens=list(context_lens),
                                      query=to_proto(query), slot_mapping=list(slot_mapping), scale=scale,
                                      pool_incarnation=pool_incarnation,
                                      worker_incarnation=self._worker_incarnation(), term=term)
        if key is not None:
            request.key.CopyFrom(to_proto(key))
        if value is not None:
            request.value.CopyFrom(to_proto(value))
        return from_proto(self._call(self._stub.Attention, request).output, "output")

    def model_step(self, pool: str, version: int, seq_ids: Sequence[str], query_lens: Sequence[int],
                   context_lens: Sequence[int], token_ids: Sequence[int], slot_mapping: Sequence[int],
                   return_logits: bool = False, *, pool_incarnation: str,
                   sampling: Sequence[SamplingSpec] = (), term: int = 0, copy_lens: Sequence[int] = (),
                   copy_from: Sequence[int] = ()) -> tuple[list[int], torch.Tensor | None]:
        """One forward step of the worker's model (see ``ModelStepRequest``).

        ``token_ids`` and ``slot_mapping`` hold ``sum(query_lens)`` entries, the
        sequences' new tokens concatenated; ``sampling`` is empty (every
        sequence greedy) or has one entry per sequence. Returns the next
        tokens (one per sequence, ``num_samples`` where a sequence asks for
        more) and, with ``return_logits``, the ``[batch, vocab]`` float32
        logits of each sequence's last new token (else None). ``term``: the
        leader term of the Step response whose version this names (0: not
        replicated); the worker waits until it follows that leader.
        ``copy_lens``/``copy_from``: K/V copied within the step instead of
        computed (both empty, or one entry per sequence; see ``ModelStepRequest``).
        """
        request = pb.ModelStepRequest(
            pool=pool, version=version, seq_ids=list(seq_ids), query_lens=list(query_lens),
            context_lens=list(context_lens), token_ids=list(token_ids), slot_mapping=list(slot_mapping),
            return_logits=return_logits, pool_incarnation=pool_incarnation,
            worker_incarnation=self._worker_incarnation(), term=term, copy_lens=list(copy_lens),
            copy_from=list(copy_from),
            sampling=[pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                                        sample_index=s.sample_index, num_samples=s.num_samples)
                      for s in sampling])
        response = self._call(self._stub.ModelStep, request)
        logits = from_proto(response.logits, "logits") if response.HasField("logits") else None
        return list(response.next_token_ids), logits

    def fetch_blocks(self, pool: str, version: int, plan: TransferPlan, rank: int, *, pool_incarnation: str,
                     term: int = 0) -> int:
        """Fetch ``plan``'s blocks from its source worker of ``rank`` (this
        worker's shard) into this worker at ``version`` (see ``FetchBlocksRequest``);
        returns the blocks written. A failure raises: compute the tokens instead."""
        _, address, source_incarnation = plan.source_workers[rank]
        response = self._call(self._stub.FetchBlocks, pb.FetchBlocksRequest(
            pool=pool, pool_incarnation=pool_incarnation, worker_incarnation=self._worker_incarnation(),
            version=version, term=term, source_pool=plan.source_pool,
            source_pool_incarnation=plan.source_incarnation, source_version=plan.source_version,
            source_address=address, source_worker_incarnation=source_incarnation, src_tiers=list(plan.src_tiers),
            src_blocks=list(plan.src_blocks), dst_blocks=list(plan.dst_blocks)))
        return response.num_blocks
