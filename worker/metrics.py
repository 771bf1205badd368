"""A worker's Prometheus metrics: kernel time, throughput, replica lag, memory.

One :class:`WorkerMetrics` per worker process, labelled with the one pool the
worker serves; the ``kernel`` label takes its values from a fixed list
(:data:`KERNELS`), so a worker never creates unbounded series. Lives in its
own ``CollectorRegistry`` so tests can run several workers in one process,
with the standard ``process_*``, ``python_info`` and ``blockd_build_info``
(:mod:`blockd.build_info`) a process-global registry would have had.

Everything a worker reports is set from its own loop (the follower sets
applied version and lag as it applies deltas; the kernels time themselves),
so this module needs no view into worker state. It must stay free of torch:
``blockd-worker --help`` and the metric tests import it without a GPU stack.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from blockd.build_info import register_standard_metrics
from blockd.rpc import tracing
from blockd.rpc.metrics_http import ServedMetrics, serve_metrics

#: kernel label values; a kernel outside this list is a programming error
#: "attention" is a planned mixed batch (decode and prefill together); "model_forward"
#: is a whole ModelStep forward (attention and write_kv included) and "sampling" its
#: token choice, so a step's time splits into model, attention and sampling;
#: "offload_blocks" / "restore_blocks" are one batch of tier ops (device -> host / back);
#: "fetch_blocks" one cross-pool fetch (FetchBlocks: read from the source worker, written here)
KERNELS = ("write_kv", "copy_blocks", "offload_blocks", "restore_blocks", "fetch_blocks", "attention",
           "decode_attention", "prefill_attention", "model_forward", "sampling")
#: outcomes of cross-pool transfer blocks (``blockd_worker_transfer_blocks_total{result}``)
TRANSFER_RESULTS = ("served", "fetched", "failed")
#: ``kind`` label values of the tier op counter (blockd.core.types.OFFLOAD / RESTORE)
TIER_OP_KINDS = ("offload", "restore")
#: kernels run from a few µs (a small copy on CPU) to seconds (long CPU prefill)
KERNEL_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                  0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class WorkerMetrics:
    """The metrics of one worker of ``pool``."""

    def __init__(self, pool: str, registry: CollectorRegistry | None = None,
                 kernels: Sequence[str] = KERNELS) -> None:
        if not isinstance(pool, str) or not pool:
            raise ValueError(f"pool must be a non-empty string, got {pool!r}")
        self.pool = pool
        self.registry = registry if registry is not None else CollectorRegistry()
        register_standard_metrics(self.registry)  # process_*, python_info, blockd_build_info
        self._kernel_names = frozenset(kernels)
        self.kernel_duration = Histogram(
            "blockd_worker_kernel_duration_seconds", "Wall time of one kernel call (synchronised on GPU).",
            ("pool", "kernel"), buckets=KERNEL_BUCKETS, registry=self.registry)
        tokens = Counter("blockd_worker_tokens_processed", "Query tokens run through attention.",
                         ("pool",), registry=self.registry)
        copies = Counter("blockd_worker_copy_ops", "Copy-on-write block copies executed.",
                         ("pool",), registry=self.registry)
        lag = Gauge("blockd_worker_replica_lag_versions",
                    "Versions the worker's table mirror is behind the pool's latest known version.",
                    ("pool",), registry=self.registry)
        applied = Gauge("blockd_worker_applied_version", "Latest pool version the replica has applied.",
                        ("pool",), registry=self.registry)
        pool_bytes = Gauge("blockd_worker_pool_bytes", "Bytes of KV memory this worker's pool shard holds.",
                           ("pool",), registry=self.registry)
        host_bytes = Gauge("blockd_worker_host_pool_bytes",
                           "Bytes of host memory (pinned beside a GPU) this worker's host tier holds; 0: no tier.",
                           ("pool",), registry=self.registry)
        tier_ops = Counter("blockd_worker_tier_ops", "Blocks copied between the device pool and the host tier, "
                           "by kind (offload: device -> host, restore: host -> device).",
                           ("pool", "kind"), registry=self.registry)
        transfers = Counter("blockd_worker_transfer_blocks", "Blocks of cross-pool transfers: served to another "
                            "pool's worker, fetched from one, or failed to fetch (the tokens were computed).",
                            ("pool", "result"), registry=self.registry)
        self._transfers = {r: transfers.labels(pool, r) for r in TRANSFER_RESULTS}
        # one pool per worker: bind the children once, off the hot path
        self._tokens = tokens.labels(pool)
        self._copies = copies.labels(pool)
        self._lag = lag.labels(pool)
        self._applied = applied.labels(pool)
        self._pool_bytes = pool_bytes.labels(pool)
        self._host_bytes = host_bytes.labels(pool)
        self._tier_ops = {kind: tier_ops.labels(pool, kind) for kind in TIER_OP_KINDS}
        self._kernels = {name: self.kernel_duration.labels(pool, name) for name in self._kernel_names}

    def observe_kernel(self, kernel: str, seconds: float) -> None:
        child = self._kernels.get(kernel)
        if child is None:
            raise ValueError(f"unknown kernel {kernel!r}; metrics know {', '.join(sorted(self._kernel_names))}")
        child.observe(seconds)
        if tracing.tracer is not None:
            trace_kernel(kernel, seconds)

    def add_tokens(self, n: int) -> None:
        self._tokens.inc(n)

    def add_copy_ops(self, n: int) -> None:
        self._copies.inc(n)

    def set_replica_lag(self, versions: int) -> None:
        self._lag.set(versions)

    def set_applied_version(self, version: int) -> None:
        self._applied.set(version)

    def set_pool_bytes(self, num_bytes: int) -> None:
        self._pool_bytes.set(num_bytes)

    def set_host_pool_bytes(self, num_bytes: int) -> None:
        self._host_bytes.set(num_bytes)

    def add_tier_ops(self, kind: str, n: int) -> None:
        self._tier_ops[kind].inc(n)

    def add_transfer_blocks(self, result: str, n: int) -> None:
        self._transfers[result].inc(n)

    def start_http(self, port: int, addr: str | None = None) -> ServedMetrics:
        """Serve ``/metrics`` on ``addr:port`` (port 0 picks one; see ``.port``).

        ``addr`` defaults to ``$BLOCKD_METRICS_ADDR`` or 127.0.0.1, as for
        blockd itself: loopback unless a deployment (a container) opens it.
        """
        return serve_metrics(self.registry, port, addr)


def trace_kernel(kernel: str, seconds: float) -> None:
    """A kernel's timed part as a span under the current one (write_kv and
    attention per layer, sampling, copies): the measurement the histogram
    takes, so tracing reads no clock of its own. model_forward is not: it
    is a span of its own around its layers' (:mod:`worker.service`).
    Call only when tracing is on (:data:`blockd.rpc.tracing.tracer`)."""
    if kernel != "model_forward":
        tracing.record(kernel, seconds)
