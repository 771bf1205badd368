"""The ``blockd`` console script: ``blockd serve`` runs the daemon; ``check-data``,
``repair-data`` and ``compact`` work on a data directory offline
(:mod:`blockd.offline.repair`, :mod:`blockd.offline.compact`).

Every flag falls back to an environment variable named after it,
``BLOCKD_<FLAG>`` (``--fsync-interval-s`` -> ``BLOCKD_FSYNC_INTERVAL_S``; one
rule for all, :mod:`blockd.config_env`; ``blockd serve --help`` lists them);
a variable that does not parse is a one-line error, exit status 2. Main ones:

=======================  ============================  ====================================
flag                     env                           default
=======================  ============================  ====================================
``--listen``             ``BLOCKD_LISTEN``             ``127.0.0.1:50051`` (port 0: any)
``--advertise-address``  ``BLOCKD_ADVERTISE_ADDRESS``  the listen address
``--data-dir``           ``BLOCKD_DATA_DIR``           none: state in memory only
``--fsync``              ``BLOCKD_FSYNC``              ``always`` (``interval``, ``never``)
``--metrics-port``       ``BLOCKD_METRICS_PORT``       ``0``: no metrics endpoint
=======================  ============================  ====================================

A data dir is locked (:mod:`blockd.storage.lock`) for the daemon's life: a
second daemon on the same directory exits with status 1 and names the holder.

The idempotency table (:mod:`blockd.engine.idempotency`) is bounded by
``--max-request-ids`` (``BLOCKD_MAX_REQUEST_IDS``, 16384),
``--max-request-bytes`` (``BLOCKD_MAX_REQUEST_BYTES``, 64 MiB) and
``--request-ttl-s`` (``BLOCKD_REQUEST_TTL_S``, 3600): a retry is recognised
while its id is among the newest ids and younger than the TTL, and gets its
first answer while that answer also fits the byte cap.

With a metrics port, :mod:`blockd.service.metrics` (optional) times RPCs through a
server interceptor and WAL fsyncs through the engine, and serves ``/metrics``.

When the server is up it prints ``blockd listening on HOST:PORT`` (the real
port when 0 was asked for) on stdout, then ``blockd advertising HOST:PORT``
(the address others should dial: ``--advertise-address``, its port defaulting
to the bound one); tests and scripts wait for these lines.
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

from blockd import build_info, config_env, logs
from blockd.auth.cli import add_commands as add_auth_commands
from blockd.auth.config import add_tls_flags
from blockd.core.errors import BlockdError
from blockd.engine.guardrails import Guardrails
from blockd.engine.idempotency import IdempotencyLimits
from blockd.rpc import addresses

log = logging.getLogger("blockd")

FSYNC_POLICIES = ("always", "interval", "never")


def listen_address(text: str) -> str:
    """A flag type: ``HOST:PORT`` to bind (port 0: any free one). Checked at parse
    time so a malformed one is named as such, not refused later for its (absent) TLS."""
    try:
        addresses.split_listen(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"malformed address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:50051 (port 0: any free "
            "port; an IPv6 host in brackets, [::1]:50051)") from None
    return text


def data_dir_path(text: str) -> str:
    """A flag type: a directory, or a path where one can be made. A regular file
    there (or in place of a parent) is named, not reported as errno 17 or 20."""
    if not text:
        return text  # as before: empty means no data dir (state in memory)
    path = os.path.abspath(text)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # the nearest part that exists must be a directory
    if not os.path.isdir(path):
        where = "" if path == os.path.abspath(text) else f" (in {text!r})"
        raise argparse.ArgumentTypeError(f"{path!r}{where} is a file, not a directory")
    return text


def _add_replication(serve: argparse.ArgumentParser) -> None:
    """The flags of a replicated group (docs/ha.md); without --etcd none applies."""
    serve.add_argument("--etcd", default="",
                       help="etcd endpoints (http://HOST:PORT,...): run as one replica of a group, with leader "
                            "election and log replication; needs --data-dir and --replica-id")
    serve.add_argument("--replica-id", default="", help="this replica's name in its group (with --etcd)")
    serve.add_argument("--group", default="main", help="the replica group (with --etcd)")
    serve.add_argument("--replication", default="sync", choices=("sync", "async"),
                       help="sync: a step is acknowledged once an in-sync follower persisted it; async: once "
                            "the leader logged it (followers trail)")
    serve.add_argument("--min-in-sync", type=config_env.positive_int, default=2,
                       help="replicas (the leader included) that must hold a step before it is acknowledged")
    serve.add_argument("--ack-timeout-s", type=config_env.positive_float, default=1.0,
                       help="how long a step waits for the in-sync followers before they are dropped from the set")
    serve.add_argument("--max-lag-records", type=config_env.non_negative_int, default=100,
                       help="async: a step waits (up to --ack-timeout-s) while a live follower trails the leader "
                            "by more records than this, bounding what a failover can lose; 0: unbounded")
    serve.add_argument("--sync-followers", type=config_env.non_negative_int, default=0,
                       help="sync: at most this many followers in the in-sync set; a step waits for them, not "
                            "for the slower others (they replicate without holding steps back and fill a place "
                            "that opens). 0: every follower that has caught up (a failover keeps every "
                            "acknowledged step while any one of them lives)")
    serve.add_argument("--replication-transport", default="socket", choices=("socket", "grpc"),
                       help="how a follower's feed travels once ReplicateLog has opened it: socket (records "
                            "and acknowledgements framed on a TCP connection to the leader's replication port, "
                            "about a fifth of gRPC's cost per message; with TLS when the server has it) or grpc "
                            "(on the call's stream)")
    serve.add_argument("--replication-port", type=config_env.port, default=0,
                       help="the replication port, on the host of --listen (0: any free port; followers learn "
                            "it from the leader's ReplicateLog answer)")
    serve.add_argument("--lease-ttl-s", type=config_env.positive_int, default=2,
                       help="the leader's etcd lease; failover takes about this plus 1 s")
    peers = serve.add_argument_group(
        "replication between replicas", "how a follower's stream authenticates to its leader when the group "
        "serves TLS or tokens: the leader checks it like any call (the replicate permission: an admin identity)")
    peers.add_argument("--peer-tls-ca", default=None,
                       help="CA bundle the other replicas' server certificates chain to (needed with --tls-cert)")
    peers.add_argument("--peer-tls-cert", default=None,
                       help="client certificate a follower presents to its leader (needed with --tls-client-ca); "
                            "an admin identity")
    peers.add_argument("--peer-tls-key", default=None, help="the key of --peer-tls-cert")
    peers.add_argument("--peer-tls-server-name", default=None,
                       help="the name to check in the leader's certificate, when not the address dialled")
    peers.add_argument("--peer-token-file", default=None,
                       help="a file holding an admin bearer token a follower sends its leader (needed with "
                            "--tokens-file and no --peer-tls-cert)")


def _add_request_limits(parser: argparse.ArgumentParser, note: str = "") -> None:
    """The idempotency table's three bounds (:class:`IdempotencyLimits`)."""
    parser.add_argument("--max-request-ids", type=config_env.positive_int, default=IdempotencyLimits.max_entries,
                        help="most request ids remembered for retries" + note)
    parser.add_argument("--max-request-bytes", type=config_env.positive_int, default=IdempotencyLimits.max_bytes,
                        help="memory cap of the remembered answers; past it the oldest answers are dropped "
                             "and their retries refused" + note)
    parser.add_argument("--request-ttl-s", type=config_env.positive_float, default=IdempotencyLimits.ttl_s,
                        help="seconds a request id is remembered for retries" + note)


def _add_guardrails(serve: argparse.ArgumentParser) -> None:
    """The size bounds of every request (:class:`blockd.engine.guardrails.Guardrails`),
    in force with or without tenants' quotas."""
    bounds = Guardrails()
    group = serve.add_argument_group("guardrails (every caller, with or without quotas)")
    group.add_argument("--max-ops-per-step", type=config_env.positive_int, default=bounds.max_ops_per_step,
                       help="most operations in one step; a bigger one is INVALID_ARGUMENT before it is read")
    group.add_argument("--max-tokens-per-step", type=config_env.positive_int, default=bounds.max_tokens_per_step,
                       help="most token ids one step carries (prompts and appended tokens)")
    group.add_argument("--max-blocks-per-pool", type=config_env.positive_int, default=bounds.max_blocks_per_pool,
                       help="most blocks a new pool may have")
    group.add_argument("--max-name-length", type=config_env.positive_int, default=bounds.max_name_length,
                       help="longest name of a new pool (letters, digits, '.', '_', '-')")


def build_parser() -> argparse.ArgumentParser:
    """Every flag also reads an environment variable, ``BLOCKD_<FLAG>``
    (:mod:`blockd.config_env`; ``--help`` names each)."""
    parser = argparse.ArgumentParser(prog="blockd", description="blockd: a cluster's paged KV cache manager")
    parser.add_argument("--version", action="version", version=build_info.describe("blockd"))
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--listen", type=listen_address, default="127.0.0.1:50051",
                       help="HOST:PORT to serve gRPC on; port 0 picks a free one")
    serve.add_argument("--advertise-address", default=None,
                       help="HOST[:PORT] others dial to reach this daemon (e.g. the pod IP); "
                            "the port defaults to the bound one. Default: the listen address")
    serve.add_argument("--data-dir", type=data_dir_path, default=None,
                       help="directory for the write-ahead log and snapshots, locked while serving; "
                            "without it state is in memory only")
    serve.add_argument("--fsync", default="always", choices=FSYNC_POLICIES,
                       help="when the log is fsynced")
    serve.add_argument("--fsync-interval-s", type=config_env.positive_float, default=0.05,
                       help="batching interval for --fsync interval")
    serve.add_argument("--snapshot-every", type=config_env.positive_int, default=10000,
                       help="log records between snapshots (replayed records count too)")
    serve.add_argument("--snapshot-log-ratio", type=config_env.non_negative_float, default=0.25,
                       help="and only once the log since the last snapshot is this many times its size in bytes "
                            "(replaying a byte of log costs ~4x loading a byte of snapshot: at 0.25 replay "
                            "takes about as long as loading the snapshot)")
    _add_request_limits(serve)
    _add_guardrails(serve)
    serve.add_argument("--metrics-port", type=config_env.port, default=0,
                       help="Prometheus metrics port; 0 = off")
    serve.add_argument("--pid-file", default=None,
                       help="write the daemon's pid here once it serves (for kill -HUP \"$(cat FILE)\"); "
                            "removed at exit")
    serve.add_argument("--max-workers", type=config_env.positive_int, default=128,
                       help="most RPC threads; each open Watch/Events stream holds one while open")
    serve.add_argument("--worker-timeout-s", type=config_env.positive_float, default=10.0,
                       help="a worker whose last heartbeat is older is reported down")
    serve.add_argument("--grace-s", type=config_env.non_negative_float, default=5.0,
                       help="seconds in-flight calls get to finish on shutdown")
    serve.add_argument("--gc-freeze-interval-s", type=config_env.non_negative_float, default=1.0,
                       help="move surviving objects out of the cyclic garbage collector's reach this often, "
                            "so a full collection never walks the whole state (0: leave the collector alone)")
    _add_replication(serve)
    serve.add_argument("--log-level", type=config_env.log_level, default="INFO",
                       help="DEBUG, INFO, WARNING or ERROR")
    _add_log_format(serve)
    add_tls_flags(serve, server=True)
    _add_metrics_security(serve)
    check = sub.add_parser("check-data", help="verify a data directory offline (exit 0: blockd would start)")
    check.add_argument("data_dir")
    repair = sub.add_parser("repair-data", help="cut a damaged log at its first bad record, keeping a copy")
    repair.add_argument("data_dir")
    repair.add_argument("--truncate-at-first-bad", action="store_true",
                        help="do it (without this flag it only says what it would cut)")
    compact = sub.add_parser("compact", help="write a snapshot from the log (blockd serve runs this itself)")
    compact.add_argument("data_dir")
    compact.add_argument("--upto", type=config_env.non_negative_int, default=None,
                         help="LSN the snapshot covers (default: the last)")
    compact.add_argument("--no-prune", action="store_true",
                         help="keep the files the snapshot replaces (the daemon prunes them itself)")
    compact.add_argument("--nice", type=config_env.non_negative_int, default=0,
                         help="lower this process's CPU priority by this much")
    _add_request_limits(compact, " (must match the daemon's: the table is part of the snapshot)")
    for p in (check, repair, compact):
        p.add_argument("--log-level", type=config_env.log_level, default="WARNING",
                       help="DEBUG, INFO, WARNING or ERROR")
        _add_log_format(p)
    add_auth_commands(sub)
    return parser


def _add_log_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=logs.LOG_FORMATS, default="text",
                        help="text, or json: one object per line (time, level, logger, message; an audit "
                             "line's fields merged in), for a log collector")


def _add_metrics_security(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics endpoint security")
    group.add_argument("--metrics-tls-cert", default=None, help="serve /metrics over TLS with this certificate")
    group.add_argument("--metrics-tls-key", default=None, help="the key of --metrics-tls-cert")
    group.add_argument("--metrics-tls-client-ca", default=None,
                       help="require scrapers' client certificates signed by this CA")
    group.add_argument("--metrics-basic-auth-file", default=None,
                       help="require basic auth: user:sha256 lines (blockd tokens metrics-user); reloaded on SIGHUP")


def _load_metrics(port: int):
    """``blockd.service.metrics.BlockdMetrics`` when a port is asked for and the module
    exists (it is optional); None otherwise."""
    if not port:
        return None
    if importlib.util.find_spec("blockd.service.metrics") is None:
        log.warning("--metrics-port %d given but blockd.service.metrics is not installed; metrics are off", port)
        return None
    return importlib.import_module("blockd.service.metrics").BlockdMetrics()


def _start_metrics(engine, port: int, metrics, args: argparse.Namespace):
    """Serve ``/metrics``; returns the HTTP server (``close()``), or None."""
    if metrics is None:
        return None
    from blockd.auth import TlsConfig

    tls = None
    if args.metrics_tls_cert or args.metrics_tls_key or args.metrics_tls_client_ca:
        tls = TlsConfig(args.metrics_tls_cert, args.metrics_tls_key, args.metrics_tls_client_ca)
    _, http = importlib.import_module("blockd.service.metrics").start_metrics_server(
        engine, port, metrics, tls=tls, users_file=args.metrics_basic_auth_file)
    log.info("metrics on http://%s:%d/metrics", http.addr, http.port)
    return http


#: a health service name SERVING only on the replica that leads (load balancers, probes); the
#: stock "" and per-service names stay SERVING on every live replica
LEADER_HEALTH = "blockd.v1.Leader"


def _leader_health(server, replica) -> None:
    from grpc_health.v1 import health_pb2

    status = health_pb2.HealthCheckResponse

    def on_role(leading: bool) -> None:
        if not server.stopping:
            server.health.set(LEADER_HEALTH, status.SERVING if leading else status.NOT_SERVING)

    on_role(False)
    replica.on_role = on_role


def _register_replication_metrics(metrics, replica) -> None:
    """The election's and replication's collectors on the daemon's registry (read at scrape time)."""
    from blockd.ha.metrics import ElectionCollector
    from blockd.replication.metrics import ReplicationCollector

    metrics.registry.register(ElectionCollector(replica.election))
    metrics.registry.register(ReplicationCollector(replica))


def _advertise_address(advertise: str | None, bound: str) -> str:
    """What others should dial; ``ValueError`` for an ``--advertise-address``
    nobody could. Without one, a wildcard bind is only warned about: clients
    on this host can still reach it."""
    address = addresses.advertised(advertise, bound)
    reason = addresses.unroutable_reason(address)
    if reason is not None and advertise:
        raise ValueError(f"--advertise-address {advertise!r} cannot be used: {reason}")
    if reason is not None:
        log.warning("listening on %s, which other hosts cannot dial (%s); set --advertise-address "
                    "(env BLOCKD_ADVERTISE_ADDRESS) to the address they should use", bound, reason)
    return address


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



def _peer_security(args: argparse.Namespace, tls) -> tuple:
    """``(TlsConfig | None, token | None)`` a follower dials its leader with;
    ValueError when the group's own security would refuse the stream."""
    from blockd.auth.config import TlsConfig

    peer_tls = None
    if args.peer_tls_ca or args.peer_tls_cert or args.peer_tls_key or args.peer_tls_server_name:
        peer_tls = TlsConfig(cert=args.peer_tls_cert, key=args.peer_tls_key, ca=args.peer_tls_ca,
                             server_name=args.peer_tls_server_name)
    if tls is not None and (peer_tls is None or not peer_tls.ca):
        raise ValueError("--etcd with --tls-cert needs --peer-tls-ca: the CA bundle the other replicas' server "
                         "certificates chain to, so a follower can verify its leader")
    if tls is not None and tls.mutual and (peer_tls is None or not peer_tls.cert):
        raise ValueError("--etcd with --tls-client-ca needs --peer-tls-cert and --peer-tls-key: the client "
                         "certificate (an admin identity) a follower presents to its leader")
    token = None
    if args.peer_token_file:
        try:
            with open(args.peer_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as err:
            raise ValueError(f"cannot read --peer-token-file {args.peer_token_file}: {err.strerror}") from None
        if not token:
            raise ValueError(f"--peer-token-file {args.peer_token_file} is empty")
    elif args.tokens_file and (peer_tls is None or not peer_tls.cert):
        raise ValueError("--etcd with --tokens-file needs --peer-token-file (an admin token a follower sends "
                         "its leader) or a --peer-tls-cert the leader accepts")
    return peer_tls, token


def _replica(args: argparse.Namespace, tls):
    """The replica of ``--etcd``'s group, or None (the embedded default: nothing of it is imported)."""
    if not args.etcd:
        return None
    if not args.data_dir or not args.replica_id:
        raise SystemExit("blockd serve --etcd needs --data-dir (the replica's own log) and --replica-id")
    from blockd.replication.replica import Replica, ReplicaConfig
    try:
        peer_tls, peer_token = _peer_security(args, tls)
        config = ReplicaConfig(args.etcd, args.replica_id, args.group, args.replication, args.min_in_sync,
                               args.ack_timeout_s, args.lease_ttl_s, max_lag_records=args.max_lag_records,
                               sync_followers=args.sync_followers, peer_tls=peer_tls, peer_token=peer_token,
                               transport=args.replication_transport, server_tls=tls,
                               listen=args.listen, replication_port=args.replication_port)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return Replica(config, args.data_dir)


def serve(args: argparse.Namespace) -> int:
    # imported here so `blockd --help` stays fast and grpc-free
    from blockd.auth import server_security
    from blockd.auth.config import server_tls
    from blockd.engine.config import EngineConfig
    from blockd.engine.machine import Engine
    from blockd.service.server import BlockdServer
    from blockd.storage.reader import DataDirError, advice

    try:  # before the data dir is touched: a refusal changes nothing
        tls = server_tls(args)
        security = server_security(args.listen, tls, args.tokens_file, args.insecure)
    except ValueError as err:  # InsecureListen, TlsError, IdentitiesFileError
        log.error("cannot serve: %s", err)
        return 2
    if args.etcd:
        try:
            _peer_security(args, tls)
        except ValueError as err:
            log.error("cannot serve: %s", err)
            return 2
    log.info("data dir: %s; fsync: %s", args.data_dir or "none (in memory)", args.fsync)
    try:
        limits = IdempotencyLimits(args.max_request_ids, args.max_request_bytes, args.request_ttl_s)
        guardrails = Guardrails(args.max_ops_per_step, args.max_tokens_per_step, args.max_blocks_per_pool,
                                args.max_name_length)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    metrics = _load_metrics(args.metrics_port)
    replica = _replica(args, tls)
    try:
        engine = Engine(EngineConfig(
            replication=replica, log_observer=replica.tail if replica is not None else None,
            data_dir=args.data_dir, fsync=args.fsync, fsync_interval_s=args.fsync_interval_s,
            snapshot_every=args.snapshot_every, snapshot_log_ratio=args.snapshot_log_ratio,
            idempotency=limits, guardrails=guardrails, worker_timeout_s=args.worker_timeout_s,
            quotas=security.quota_source(),
            observe_wal_sync=metrics.observe_wal_sync if metrics is not None else None,
            observe_step=metrics.observe_step if metrics is not None else None))
    except DataDirError as err:
        log.error("cannot start: the data dir is damaged: %s; nothing on disk was changed. %s", err, advice(err))
        return 1
    except (BlockdError, OSError, ValueError) as err:
        log.error("cannot open the engine: %s", err)
        return 1
    for stats in sorted(engine.list_pools(local=True), key=lambda s: s.name):
        log.info("pool %s: %d blocks of %d, %d sequences, version %d", stats.name, stats.num_blocks,
                 stats.block_size, stats.num_seqs, stats.version)
    try:
        server = BlockdServer(engine, args.listen, max_workers=args.max_workers, grace_s=args.grace_s,
                              interceptors=[*([metrics.interceptor()] if metrics is not None else []),
                                            *security.interceptors], credentials=security.credentials,
                              extra_services=[replica.servicer()] if replica is not None else [])
        advertise = _advertise_address(args.advertise_address, server.address)
        http = _start_metrics(engine, args.metrics_port, metrics, args)
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
    reload = threading.Event()  # SIGHUP: the identities file (and metrics users and certificate)
    signal.signal(signal.SIGHUP, lambda signum, frame: reload.set())
    if args.gc_freeze_interval_s > 0:
        threading.Thread(target=_freeze_gc, args=(stop, args.gc_freeze_interval_s), name="blockd-gc",
                         daemon=True).start()
    server.start()
    try:  # once serving, after the handlers: whoever reads the file may call or signal at once
        pid_file = _write_pid_file(args.pid_file)
    except OSError as err:
        log.error("cannot write the pid file: %s", err)
        server.stop()
        if http is not None:
            http.close()
        return 1
    if replica is not None:
        _leader_health(server, replica)
        replica.start(engine, advertise)
        if metrics is not None:
            _register_replication_metrics(metrics, replica)
    print(f"blockd listening on {server.address}", flush=True)
    print(f"blockd advertising {advertise}", flush=True)
    # wait in short slices so the signal handler runs promptly
    while not stop.wait(0.2):
        if reload.is_set():
            reload.clear()
            security.reload()
            if http is not None:
                http.reload()
    if replica is not None:
        replica.stop()  # resign first: the next leader is elected within a poll
    server.stop()
    if http is not None:
        http.close()
    _remove_pid_file(pid_file)
    return 0


def _write_pid_file(path: str | None) -> str | None:
    """Write this process's pid to ``path`` (atomically: a reader never sees half a number)."""
    if not path:
        return None
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)
    return path


def _remove_pid_file(path: str | None) -> None:
    """Remove the pid file if it still names this process (another daemon may have taken it over)."""
    if not path:
        return
    try:
        with open(path) as f:
            ours = f.read().strip() == str(os.getpid())
        if ours:
            os.remove(path)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = config_env.parse_args(build_parser(), argv, "BLOCKD_")
    if args.command in ("tokens", "certs"):  # print their results on stdout; no log set-up
        return args.run(args)
    logs.configure(args.log_level, args.log_format, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    if args.command == "compact":
        from blockd.offline.compact import main as compact_main

        return compact_main(args)
    from blockd.offline import repair

    if args.command == "check-data":
        return repair.check(args.data_dir, sys.stdout)
    if args.command == "repair-data":
        return repair.repair(args.data_dir, args.truncate_at_first_bad, sys.stdout)
    return 2


if __name__ == "__main__":
    sys.exit(main())
