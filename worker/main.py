"""``blockd-worker``: one pool shard's process.

Connects to blockd, reads the pool's geometry, allocates its shard of the KV
memory (torch on CUDA when a GPU is present, else CPU), registers with its
layer and KV-head ranges and its bytes, follows the Watch stream, heartbeats,
and serves ``KVShardService``. Prints ``blockd-worker listening on HOST:PORT``
when ready. SIGTERM/SIGINT: stop serving, stop following, exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading

from blockd.workers import WorkerInfo
from client.sdk import BlockdClient
from worker.follower import Follower
from worker.runtime import ShardSpec, WorkerRuntime
from worker.service import WorkerServer

log = logging.getLogger("blockd.worker")


def _range(text: str | None, total: int, what: str) -> tuple[int, int]:
    if not text:
        return 0, total
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit():
        raise SystemExit(f"--{what} must be START:END (e.g. 0:4), got {text!r}")
    return int(lo), int(hi)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="blockd-worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--blockd", default=env("BLOCKD_TARGET", "127.0.0.1:50051"), help="blockd address")
    p.add_argument("--pool", default=env("BLOCKD_POOL"), required=env("BLOCKD_POOL") is None)
    p.add_argument("--worker-id", default=env("BLOCKD_WORKER_ID", f"{socket.gethostname()}-{os.getpid()}"))
    p.add_argument("--layers", default=env("BLOCKD_WORKER_LAYERS"), help="START:END (default: all)")
    p.add_argument("--kv-heads", default=env("BLOCKD_WORKER_KV_HEADS"), help="START:END (default: all)")
    p.add_argument("--listen", default=env("BLOCKD_WORKER_LISTEN", "127.0.0.1:0"))
    p.add_argument("--device", default=env("BLOCKD_WORKER_DEVICE", "auto"), help="auto, cpu or cuda[:N]")
    p.add_argument("--metrics-port", type=int, default=int(env("BLOCKD_WORKER_METRICS_PORT", "0")))
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--log-level", default=env("BLOCKD_LOG_LEVEL", "INFO"))
    p.add_argument("--model", default=env("BLOCKD_WORKER_MODEL"),
                   help="run a model: tiny-llama, tiny-qwen2, tiny-gpt2 or a local model directory")
    p.add_argument("--model-seed", type=int, default=0, help="weights seed of the tiny models")
    p.add_argument("--tp-rank", type=int, default=0, help="this worker's tensor-parallel rank")
    p.add_argument("--tp-world-size", type=int, default=1, help="workers in the tensor-parallel group")
    p.add_argument("--tp-init", default=env("BLOCKD_WORKER_TP_INIT"),
                   help="tcp://HOST:PORT where the tensor-parallel group meets (rank 0 listens)")
    p.add_argument("--tp-timeout-s", type=float, default=60.0, help="bound on joining and on each collective")
    args = p.parse_args(argv)
    if args.tp_world_size > 1 and not (args.model and args.tp_init):
        p.error("--tp-world-size > 1 needs --model and --tp-init")
    if not 0 <= args.tp_rank < args.tp_world_size:
        p.error(f"--tp-rank must be in [0, {args.tp_world_size})")
    return args


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    client = BlockdClient(args.blockd)
    config = client.pool_config(args.pool)
    layers = _range(args.layers, config.num_layers, "layers")
    heads = _kv_heads(args, config)
    model, tp = _load_model(args, config)
    metrics = _metrics(config.name, args.metrics_port)
    runtime = WorkerRuntime(config, ShardSpec(*layers, *heads),
                            device=None if args.device == "auto" else args.device, metrics=metrics)
    if metrics is not None:
        metrics.set_pool_bytes(runtime.pool_bytes)
    runner = None
    if model is not None:
        from worker.model import ModelRunner

        try:
            runner = ModelRunner(model, runtime, tp)
        except ValueError as err:
            raise SystemExit(f"cannot run model {args.model!r} on this shard: {err}") from None
        log.info("running model %s (TP rank %d of %d)", args.model, args.tp_rank, args.tp_world_size)
    server = WorkerServer(runtime, args.worker_id, args.listen, runner=runner)
    info = WorkerInfo(args.worker_id, config.name, server.address, *layers, *heads,
                      pool_bytes=runtime.pool_bytes, device=str(runtime.device), incarnation=runtime.incarnation)
    follower = Follower(client, runtime, info, args.heartbeat_s, metrics)
    runtime.latest_committed = follower.latest_committed
    follower.start()
    server.start()
    log.info("worker %s (incarnation %s) holds layers %s and KV heads %s of pool %s: %d bytes on %s",
             args.worker_id, runtime.incarnation, layers, heads, config.name, runtime.pool_bytes, runtime.device)
    print(f"blockd-worker listening on {server.address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
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
