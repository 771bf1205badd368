"""The worker's gRPC server: ``blockd.v1.KVShardService`` over a
:class:`~worker.runtime.WorkerRuntime` (and, when the worker runs a model, a
:class:`~worker.model.ModelRunner` for ``ModelStep``), plus the stock health
and reflection services (:mod:`blockd.rpc.stock`: malformed requests are
INVALID_ARGUMENT there too, without a logged traceback).

The servicer is a thin adapter: decode tensors (:mod:`blockd.rpc.tensors`), call
the runtime, encode the result; ``ModelStep``'s next tokens are chosen from
the logits by :mod:`worker.sampling` (greedy, or seeded draws). Failures leave
through blockd's one error mapping (:mod:`blockd.rpc.errors`): bad shapes or dtypes are
INVALID_ARGUMENT, unknown sequences NOT_FOUND, stale or never-arriving
versions FAILED_PRECONDITION; nothing leaks as UNKNOWN. Every data-plane call
must name the worker incarnation it planned against (another one means this
process restarted and lost the KV: WORKER_INCARNATION_MISMATCH) and the pool
incarnation of its version.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from blockd.auth.identity import require_tenant
from blockd.auth.security import ServerSecurity
from blockd.core.errors import InvalidArgument, NotFound, WrongState, shown
from blockd.core.hashing import DEFAULT_TENANT
from blockd.core.incarnations import WorkerIncarnationMismatch, short
from blockd.core.types import DTYPE_BYTES
from blockd.rpc.convert import require_id, require_ids
from blockd.rpc.endpoint import GrpcEndpoint
from blockd.rpc.errors import BadField, server_stream, unary
from blockd.rpc.tensors import from_proto, to_proto
from blockd.rpc.trace_grpc import server_interceptors
from blockd.rpc.tracing import carry, span
from blockd.v1 import worker_pb2 as pb
from client.backends import SamplingSpec
from worker import transfer
from worker.runtime import WorkerRuntime
from worker.sampling import check_spec, next_tokens

log = logging.getLogger("blockd.worker")

SERVICE = pb.DESCRIPTOR.services_by_name["KVShardService"]
#: the longest source worker address a FetchBlocks may name
MAX_ADDRESS_LEN = 256
#: tensors travel in messages: a prefill's K/V or logits can be large
MAX_MESSAGE_BYTES = 256 << 20


class KVShardServicer:
    def __init__(self, runtime: WorkerRuntime, worker_id: str, device: str, runner=None,
                 peers: transfer.Peers | None = None, compute: ThreadPoolExecutor | None = None) -> None:
        self.runtime = runtime
        #: other pools' workers, for FetchBlocks
        self.peers = peers or transfer.Peers(runtime)
        self.runner = runner
        self.worker_id = worker_id
        self.device = device
        # Every model step runs on this one thread, whichever RPC thread took
        # the call: an OpenMP team belongs to the thread that opens its
        # regions, so steps taken by different RPC threads kept a team each.
        # With libgomp's default wait (a worker started without
        # OMP_WAIT_POLICY=PASSIVE) a team's threads spin ~7 ms after a step,
        # so the next step, on another thread's team, found the cores taken:
        # bench/serve.py's row read 0.847x vLLM that way, 0.908x with this
        # thread (one run each, 2-core AVX2 machine). blockd-worker passes the
        # one-thread executor its start-up ran on (worker/main.py), so that
        # thread's team is the only one.
        self.compute = compute or ThreadPoolExecutor(1, thread_name_prefix="worker-model")

    def _check_tenant(self) -> None:
        """Only the pool's tenant (or an admin) may use this worker: its KV is
        that tenant's prompts (PERMISSION_DENIED; no identity: auth is off)."""
        require_tenant(self.runtime.config.tenant or DEFAULT_TENANT, "this worker's pool")

    def _check_pool(self, pool: str, seq_ids=()) -> None:
        """The ids of a request, checked before anything echoes them: the pool
        must be this worker's, each id at most MAX_ID_LEN long."""
        require_id(pool, "pool")
        require_ids(seq_ids, "seq_ids")
        if pool != self.runtime.config.name:
            raise NotFound(f"this worker holds pool {shown(self.runtime.config.name)}, not {shown(pool)}")

    def _check_call(self, request) -> str:
        """The pool, the ids, and the incarnations the caller planned against;
        returns the pool incarnation it names."""
        self._check_pool(request.pool, getattr(request, "seq_ids", ()))
        if not request.pool_incarnation:
            raise BadField("pool_incarnation", "is required: the pool incarnation of the Step response (or "
                           "GetPool) whose version you name")
        if not request.worker_incarnation:
            raise BadField("worker_incarnation", "is required: this worker's incarnation from GetWorkerStats "
                           "or ListWorkers, so a restarted worker cannot answer for KV it lost")
        require_id(request.pool_incarnation, "pool_incarnation")
        require_id(request.worker_incarnation, "worker_incarnation")
        # before the incarnation check: a resync on the new leader's stream changes the incarnation
        self.runtime.mirror.wait_term(getattr(request, "term", 0), self.runtime.version_timeout_s)
        mine = self.runtime.incarnation
        if request.worker_incarnation != mine:
            raise WorkerIncarnationMismatch(
                f"worker {shown(self.worker_id)} is incarnation {short(mine)}, not "
                f"{short(request.worker_incarnation)}: it restarted since you planned and lost the KV written "
                "before; blockd reports the affected sequences (KV_LOST): recompute them, then name the new "
                "incarnation (GetWorkerStats)",
                metadata={"worker_incarnation": mine, "planned_incarnation": request.worker_incarnation[:64]})
        return request.pool_incarnation

    @unary
    def GetWorkerStats(self, request, context):
        self._check_tenant()
        shard, stats = self.runtime.shard, self.runtime.stats()
        return pb.GetWorkerStatsResponse(
            worker_id=self.worker_id, pool=self.runtime.config.name, layer_start=shard.layer_start,
            layer_end=shard.layer_end, kv_head_start=shard.kv_head_start, kv_head_end=shard.kv_head_end,
            device=self.device, dtype=self.runtime.config.dtype, **stats)

    @unary
    def WriteKV(self, request, context):
        self._check_tenant()
        # malformed tensors are the caller's mistake whatever incarnation it names
        key, value = from_proto(request.key, "key"), from_proto(request.value, "value")
        incarnation = self._check_call(request)
        self.runtime.write_kv(request.version, request.layer, key, value, list(request.slot_mapping),
                              pool_incarnation=incarnation)
        return pb.WriteKVResponse(version=request.version)

    @unary
    def Attention(self, request, context):
        self._check_tenant()
        has_kv = request.HasField("key") or request.HasField("value")
        if has_kv and not (request.HasField("key") and request.HasField("value")):
            raise InvalidArgument("key and value go together")
        query = from_proto(request.query, "query")
        key = from_proto(request.key, "key") if has_kv else None
        value = from_proto(request.value, "value") if has_kv else None
        incarnation = self._check_call(request)
        out = self.runtime.attention(
            request.version, request.layer, list(request.seq_ids), list(request.query_lens),
            list(request.context_lens), query, key=key, value=value,
            slot_mapping=list(request.slot_mapping) if has_kv else None,
            scale=request.scale or None, pool_incarnation=incarnation)
        return pb.AttentionResponse(output=to_proto(out), version=request.version)

    @unary
    def ModelStep(self, request, context):
        self._check_tenant()
        incarnation = self._check_call(request)
        if self.runner is None:
            raise WrongState("this worker runs no model (start blockd-worker with --model)")
        specs = _sampling_specs(request)  # refused before the model runs
        # carry: the compute thread's spans go under this call's (a no-op when tracing is off)
        logits, tokens = self.compute.submit(carry(self._model_step), request, specs, incarnation).result()
        response = pb.ModelStepResponse(version=request.version, next_token_ids=tokens)
        if request.return_logits:
            response.logits.CopyFrom(to_proto(logits.float()))
        return response


    @server_stream
    def ReadBlocks(self, request, context):
        self._check_tenant()
        incarnation = self._check_call(request)
        _check_tiers(request.tiers, "tiers")
        if request.dtype not in DTYPE_BYTES:
            raise BadField("dtype", f"must be one of {sorted(DTYPE_BYTES)}: the reader's pool dtype")
        expected = (request.layer_start, request.layer_end, request.kv_head_start, request.kv_head_end,
                    request.block_size, request.head_dim, request.dtype)
        blocks = transfer.read_blocks(self.runtime, request.version, incarnation, list(request.tiers),
                                      list(request.block_ids), expected)
        for index, offset, data, crc, size in transfer.chunks(blocks):
            yield pb.ReadBlocksResponse(index=index, offset=offset, data=data, crc32=crc, block_bytes=size)
        self.runtime.metrics.add_transfer_blocks("served", len(blocks))

    @unary
    def FetchBlocks(self, request, context):
        self._check_tenant()
        incarnation = self._check_call(request)
        n = len(request.dst_blocks)
        if not n or len(request.src_blocks) != n or len(request.src_tiers) != n:
            raise BadField("dst_blocks", f"needs one source block and tier per destination block (got {n} "
                           f"destinations, {len(request.src_blocks)} sources, {len(request.src_tiers)} tiers)")
        if not request.source_address or not request.source_worker_incarnation:
            raise BadField("source_address", "and source_worker_incarnation are required (the plan's source "
                           "worker of this shard)")
        if len(request.source_address) > MAX_ADDRESS_LEN:
            raise BadField("source_address", f"is longer than {MAX_ADDRESS_LEN} characters")
        require_id(request.source_pool, "source_pool")
        require_id(request.source_pool_incarnation, "source_pool_incarnation")
        require_id(request.source_worker_incarnation, "source_worker_incarnation")
        _check_tiers(request.src_tiers, "src_tiers")
        start = time.perf_counter()
        shard, config = self.runtime.shard, self.runtime.config
        read = pb.ReadBlocksRequest(
            pool=request.source_pool, pool_incarnation=request.source_pool_incarnation,
            worker_incarnation=request.source_worker_incarnation, version=request.source_version,
            tiers=list(request.src_tiers), block_ids=list(request.src_blocks), layer_start=shard.layer_start,
            layer_end=shard.layer_end, kv_head_start=shard.kv_head_start, kv_head_end=shard.kv_head_end,
            block_size=config.block_size, head_dim=config.head_dim, dtype=config.dtype)
        try:
            blobs = self.peers.read(request.source_address, read, n)
            transfer.write_blocks(self.runtime, request.version, incarnation, list(request.dst_blocks), blobs)
        except Exception:
            self.runtime.metrics.add_transfer_blocks("failed", n)
            raise
        metrics = self.runtime.metrics
        metrics.add_transfer_blocks("fetched", n)
        metrics.observe_kernel("fetch_blocks", time.perf_counter() - start)
        return pb.FetchBlocksResponse(num_blocks=n, num_bytes=blobs.numel())

    def _model_step(self, request, specs: list[SamplingSpec], incarnation: str | None):
        """The forward and the token choice of one ModelStep (on :attr:`compute`)."""
        start = time.perf_counter()
        # no logits asked for and some rows greedy: the runner picks theirs without the float32
        # LM head where it can (worker.model.greedy_head), and gives the logits of the others only
        greedy = [spec.is_greedy for spec in specs] if specs else [True] * len(request.seq_ids)
        split = not request.return_logits and any(greedy)
        args = (request.version, list(request.seq_ids), list(request.query_lens), list(request.context_lens),
                list(request.token_ids), list(request.slot_mapping))
        kwargs = {"pool_incarnation": incarnation, "copy_lens": list(request.copy_lens),
                  "copy_from": list(request.copy_from)}
        chosen: list[int] | None = None
        with span("model_forward"):  # the parent of the layers' write_kv and attention spans
            if split:  # logits of the sampled rows alone
                picked, logits = self.runner.split_step(*args, **kwargs, greedy=greedy)
                chosen = picked.tolist()
            else:
                logits = self.runner.step(*args, **kwargs)
        forward_done = time.perf_counter()
        tokens = next_tokens(logits, specs, list(request.context_lens), chosen=chosen)
        metrics = self.runtime.metrics
        metrics.observe_kernel("model_forward", forward_done - start)
        metrics.observe_kernel("sampling", time.perf_counter() - forward_done)
        return None if split else logits, tokens


def _check_tiers(tiers, field: str) -> None:
    for i, tier in enumerate(tiers):
        if tier not in transfer.TIERS:
            raise BadField(f"{field}[{i}]", f"must be one of {transfer.TIERS}")


def _sampling_specs(request) -> list[SamplingSpec]:
    if not request.sampling:
        return []
    if len(request.sampling) != len(request.seq_ids):
        raise BadField("sampling", f"needs one entry per sequence ({len(request.seq_ids)}) or none (greedy), "
                       f"got {len(request.sampling)}")
    return [check_spec(p.temperature, p.top_p, p.top_k, p.seed, p.sample_index, p.num_samples)
            for p in request.sampling]


class WorkerServer:
    """The worker's gRPC endpoint (port 0 picks a free port). ``security``
    (:func:`blockd.auth.server_security`, as blockd's): TLS credentials and
    the auth interceptor; None serves plain text to anyone (loopback).
    ``peers``: how FetchBlocks dials other pools' workers (default: plain text)."""

    def __init__(self, runtime: WorkerRuntime, worker_id: str, listen: str = "127.0.0.1:0",
                 max_workers: int = 8, runner=None, security: ServerSecurity | None = None,
                 peers: transfer.Peers | None = None, compute: ThreadPoolExecutor | None = None) -> None:
        servicer = self._servicer = KVShardServicer(runtime, worker_id, str(runtime.device), runner, peers,
                                                    compute)
        self._endpoint = GrpcEndpoint([(servicer, SERVICE)], listen, max_workers=max_workers,
                                      max_message_bytes=MAX_MESSAGE_BYTES, thread_name_prefix="worker-rpc",
                                      interceptors=[*server_interceptors(),
                                                    *(security.interceptors if security is not None else ())],
                                      credentials=security.credentials if security is not None else None)
        self.health = self._endpoint.health
        self.port = self._endpoint.port
        self.address = self._endpoint.address

    def start(self) -> None:
        self._endpoint.start()

    def stop(self, grace_s: float = 2.0) -> None:
        self._endpoint.stop(grace_s)
        self._servicer.compute.shutdown(wait=False)
