"""The ``blockd`` console script: ``blockd serve`` runs the daemon; ``check-data``,
``repair-data`` and ``compact`` work on a data directory offline
(:mod:`blockd.repair`, :mod:`blockd.compact`).

Settings come from flags, falling back to environment variables:

==================  =====================  ==================================
flag                env                    default
==================  =====================  ==================================
``--listen``        ``BLOCKD_LISTEN``      ``127.0.0.1:50051`` (port 0: any)
``--data-dir``      ``BLOCKD_DATA_DIR``    none: state in memory only
``--fsync``         ``BLOCKD_FSYNC``       ``always`` (``interval``, ``never``)
``--metrics-port``  ``BLOCKD_METRICS_PORT``  ``0``: no metrics endpoint
==================  =====================  ==================================

With a metrics port, :mod:`blockd.metrics` (optional) times RPCs through a
server interceptor and WAL fsyncs through the engine, and serves ``/metrics``.

When the server is up it prints ``blockd listening on HOST:PORT`` (the real
port when 0 was asked for) on stdout; tests and scripts wait for that line.
SIGTERM and SIGINT shut down gracefully: stop accepting calls, give in-flight
ones a grace period, flush and close the log.

A damaged data directory (anything but a torn tail of the last log segment)
makes ``serve`` exit 1 with an ERROR line naming the file, byte offset and
record, having changed nothing; ``blockd check-data DIR`` reports the same
offline, and ``blockd repair-data DIR --truncate-at-first-bad`` is the
explicit way to cut the log there. While serving, the daemon holds
``DIR/blockd.lock``, so a second daemon (or a repair) on the same directory
is refused.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading

from blockd.core.errors import BlockdError

log = logging.getLogger("blockd")

FSYNC_POLICIES = ("always", "interval", "never")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockd", description="blockd: a cluster's paged KV cache manager")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--listen", default=os.environ.get("BLOCKD_LISTEN", "127.0.0.1:50051"),
                       help="HOST:PORT to serve gRPC on; port 0 picks a free one [env BLOCKD_LISTEN]")
    serve.add_argument("--data-dir", default=os.environ.get("BLOCKD_DATA_DIR") or None,
                       help="directory for the write-ahead log and snapshots; "
                            "without it state is in memory only [env BLOCKD_DATA_DIR]")
    serve.add_argument("--fsync", default=os.environ.get("BLOCKD_FSYNC", "always"),
                       help="when the log is fsynced: always | interval | never [env BLOCKD_FSYNC]")
    serve.add_argument("--fsync-interval-s", type=float, default=0.05,
                       help="batching interval for --fsync interval")
    serve.add_argument("--snapshot-every", type=int, default=10000,
                       help="log records between snapshots (replayed records count too)")
    serve.add_argument("--snapshot-log-ratio", type=float, default=0.25,
                       help="and only once the log since the last snapshot is this many times its size in bytes "
                            "(replaying a byte of log costs ~4x loading a byte of snapshot: at 0.25 replay "
                            "takes about as long as loading the snapshot)")
    serve.add_argument("--metrics-port", type=int, default=_env_int("BLOCKD_METRICS_PORT", 0),
                       help="Prometheus metrics port; 0 = off [env BLOCKD_METRICS_PORT]")
    serve.add_argument("--max-workers", type=int, default=128,
                       help="most RPC threads; each open Watch/Events stream holds one while open")
    serve.add_argument("--grace-s", type=float, default=5.0,
                       help="seconds in-flight calls get to finish on shutdown")
    serve.add_argument("--gc-freeze-interval-s", type=float, default=1.0,
                       help="move surviving objects out of the cyclic garbage collector's reach this often, "
                            "so a full collection never walks the whole state (0: leave the collector alone)")
    serve.add_argument("--log-level", default=os.environ.get("BLOCKD_LOG_LEVEL", "INFO"))
    check = sub.add_parser("check-data", help="verify a data directory offline (exit 0: blockd would start)")
    check.add_argument("data_dir")
    repair = sub.add_parser("repair-data", help="cut a damaged log at its first bad record, keeping a copy")
    repair.add_argument("data_dir")
    repair.add_argument("--truncate-at-first-bad", action="store_true",
                        help="do it (without this flag it only says what it would cut)")
    compact = sub.add_parser("compact", help="write a snapshot from the log (blockd serve runs this itself)")
    compact.add_argument("data_dir")
    compact.add_argument("--upto", type=int, default=None, help="LSN the snapshot covers (default: the last)")
    compact.add_argument("--no-prune", action="store_true",
                         help="keep the files the snapshot replaces (the daemon prunes them itself)")
    compact.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by this much")
    compact.add_argument("--max-request-ids", type=int, default=16384,
                         help="the idempotency table's size; must match the daemon's")
    for p in (check, repair, compact):
        p.add_argument("--log-level", default=os.environ.get("BLOCKD_LOG_LEVEL", "WARNING"))
    return parser


def _load_metrics(port: int):
    """``blockd.metrics.BlockdMetrics`` when a port is asked for and the module
    exists (it is optional); None otherwise."""
    if not port:
        return None
    if importlib.util.find_spec("blockd.metrics") is None:
        log.warning("--metrics-port %d given but blockd.metrics is not installed; metrics are off", port)
        return None
    return importlib.import_module("blockd.metrics").BlockdMetrics()


def _start_metrics(engine, port: int, metrics):
    """Serve ``/metrics``; returns the HTTP server (``close()``), or None."""
    if metrics is None:
        return None
    _, http = importlib.import_module("blockd.metrics").start_metrics_server(engine, port, metrics)
    log.info("metrics on http://%s:%d/metrics", http.addr, http.port)
    return http


def _freeze_gc(stop: threading.Event, interval_s: float) -> None:
    """Keep CPython's full collections short.

    A full (generation 2) collection walks every tracked object while holding
    the GIL: with 100k sequences that is ~600k objects and 0.5-1.6 s during
    which no step is served, and it fires whenever enough new objects have
    survived (snapshots used to allocate millions at once). The state is
    long-lived and, in the engine, free of reference cycles (it is freed by
    reference counting), so each interval the young generations are
    collected and whatever survived is frozen: full collections then walk
    only what the last interval left behind. The cost is that a cycle which
    survives an interval and dies later is never collected.
    """
    gc.freeze()  # the recovered state
    while not stop.wait(interval_s):
        gc.collect(1)
        gc.freeze()


def _lock_data_dir(data_dir: str):
    """The daemon's lock on its data dir, or False (logged) when another holds it."""
    from blockd.wal import DAEMON_LOCK, DirLock

    try:
        os.makedirs(data_dir, exist_ok=True)
        lock = DirLock(data_dir, DAEMON_LOCK)
        # a daemon just killed may take a moment to let go
        if lock.acquire(timeout_s=10):
            return lock
    except OSError as err:
        log.error("cannot use the data dir %s: %s", data_dir, err)
        return False
    log.error("the data dir %s is in use by another blockd (it holds %s); stop that one first",
              data_dir, os.path.join(data_dir, DAEMON_LOCK))
    return False


def serve(args: argparse.Namespace) -> int:
    # imported here so `blockd --help` stays fast and grpc-free
    from blockd.datadir import DataDirError, advice
    from blockd.engine import Engine
    from blockd.service.server import BlockdServer

    if args.fsync not in FSYNC_POLICIES:
        raise SystemExit(f"--fsync must be one of {', '.join(FSYNC_POLICIES)}, got {args.fsync!r}")
    log.info("data dir: %s; fsync: %s", args.data_dir or "none (in memory)", args.fsync)
    metrics = _load_metrics(args.metrics_port)
    # held until this process exits (the kernel releases it even on SIGKILL)
    dir_lock = _lock_data_dir(args.data_dir) if args.data_dir else None
    if dir_lock is False:
        return 1
    try:
        engine = Engine(data_dir=args.data_dir, fsync=args.fsync, fsync_interval_s=args.fsync_interval_s,
                        snapshot_every=args.snapshot_every, snapshot_log_ratio=args.snapshot_log_ratio,
                        observe_wal_sync=metrics.observe_wal_sync if metrics is not None else None,
                        observe_step=metrics.observe_step if metrics is not None else None)
    except DataDirError as err:
        log.error("cannot start: the data dir is damaged: %s; nothing on disk was changed. %s", err, advice(err))
        return 1
    except (BlockdError, OSError, ValueError) as err:
        log.error("cannot open the engine: %s", err)
        return 1
    for stats in sorted(engine.list_pools(), key=lambda s: s.name):
        log.info("pool %s: %d blocks of %d, %d sequences, version %d", stats.name, stats.num_blocks,
                 stats.block_size, stats.num_seqs, stats.version)
    try:
        server = BlockdServer(engine, args.listen, max_workers=args.max_workers, grace_s=args.grace_s,
                              interceptors=[metrics.interceptor()] if metrics is not None else [])
        http = _start_metrics(engine, args.metrics_port, metrics)
    except (OSError, ValueError, RuntimeError) as err:
        log.error("cannot serve on %s (metrics port %d): %s", args.listen, args.metrics_port, err)
        engine.close()
        return 1

    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.gc_freeze_interval_s > 0:
        threading.Thread(target=_freeze_gc, args=(stop, args.gc_freeze_interval_s), name="blockd-gc",
                         daemon=True).start()
    server.start()
    print(f"blockd listening on {server.address}", flush=True)
    # wait in short slices so the signal handler runs promptly
    while not stop.wait(0.5):
        pass
    server.stop()
    if http is not None:
        http.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    if args.command == "compact":
        from blockd.compact import main as compact_main

        return compact_main(args)
    from blockd import repair

    if args.command == "check-data":
        return repair.check(args.data_dir, sys.stdout)
    if args.command == "repair-data":
        return repair.repair(args.data_dir, args.truncate_at_first_bad, sys.stdout)
    return 2


if __name__ == "__main__":
    sys.exit(main())
