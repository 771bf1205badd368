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
    return p.parse_args(argv)


def _metrics(pool: str, port: int):
    if not port:
        return None
    from worker.metrics import WorkerMetrics

    metrics = WorkerMetrics(pool)
    server = metrics.start_http(port)
    log.info("worker metrics on http://%s:%d/metrics", server.addr, server.port)
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    client = BlockdClient(args.blockd)
    config = client.pool_config(args.pool)
    layers = _range(args.layers, config.num_layers, "layers")
    heads = _range(args.kv_heads, config.num_kv_heads, "kv-heads")
    metrics = _metrics(config.name, args.metrics_port)
    runtime = WorkerRuntime(config, ShardSpec(*layers, *heads),
                            device=None if args.device == "auto" else args.device, metrics=metrics)
    if metrics is not None:
        metrics.set_pool_bytes(runtime.pool_bytes)
    server = WorkerServer(runtime, args.worker_id, args.listen)
    info = WorkerInfo(args.worker_id, config.name, server.address, *layers, *heads,
                      pool_bytes=runtime.pool_bytes, device=str(runtime.device))
    follower = Follower(client, runtime, info, args.heartbeat_s, metrics)
    runtime.latest_committed = follower.latest_committed
    follower.start()
    server.start()
    log.info("worker %s holds layers %s and KV heads %s of pool %s: %d bytes on %s", args.worker_id,
             layers, heads, config.name, runtime.pool_bytes, runtime.device)
    print(f"blockd-worker listening on {server.address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    log.info("shutting down")
    server.stop()
    follower.stop()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
