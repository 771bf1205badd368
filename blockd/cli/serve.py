"""``blockd serve``: the daemon's process, from parsed flags to a graceful stop.

Builds the engine (recovering its data dir), the replica when ``--etcd`` is
given, the metrics endpoint, the gRPC server; prints the listen and advertise
lines; handles SIGTERM/SIGINT (graceful stop), SIGHUP (reload the identities
file, answering ``blockd reload`` through the pid file's neighbour,
:mod:`blockd.cli.reload`) and the pid file.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import logging
import os
import signal
import threading
import time

from blockd import core
from blockd.cli.reload import remove_status, write_status
from blockd.core.errors import BlockdError
from blockd.engine.guardrails import Guardrails
from blockd.engine.idempotency import IdempotencyLimits
from blockd.rpc import addresses
from blockd.storage import fsyncer

log = logging.getLogger("blockd")

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



def _peered(args: argparse.Namespace) -> str:
    """The flag that makes this daemon call its peers (in the messages of :func:`_peer_security`)."""
    return "--etcd" if args.etcd else "--cluster"


def _peer_security(args: argparse.Namespace, tls) -> tuple:
    """``(TlsConfig | None, token | None)`` a follower dials its leader with (or a
    ``--cluster`` group another, to move a pool); ValueError when the daemon's own
    security would refuse the stream."""
    from blockd.auth.config import TlsConfig

    peer_tls = None
    if args.peer_tls_ca or args.peer_tls_cert or args.peer_tls_key or args.peer_tls_server_name:
        peer_tls = TlsConfig(cert=args.peer_tls_cert, key=args.peer_tls_key, ca=args.peer_tls_ca,
                             server_name=args.peer_tls_server_name)
    if tls is not None and (peer_tls is None or not peer_tls.ca):
        raise ValueError(f"{_peered(args)} with --tls-cert needs --peer-tls-ca: the CA bundle the other replicas' "
                         "server certificates chain to, so a follower can verify its leader")
    if tls is not None and tls.mutual and (peer_tls is None or not peer_tls.cert):
        raise ValueError(f"{_peered(args)} with --tls-client-ca needs --peer-tls-cert and --peer-tls-key: the client "
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
        raise ValueError(f"{_peered(args)} with --tokens-file needs --peer-token-file (an admin token a follower sends "
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


def _member(args: argparse.Namespace):
    """This daemon's place in ``--cluster`` (:mod:`blockd.service.groups`), or None
    (the default: nothing of it is imported); ValueError for flags that do not fit."""
    if not args.cluster:
        if args.cluster_etcd:
            raise ValueError("--cluster-etcd needs --cluster (the cluster's name)")
        return None
    if not args.cluster_etcd:
        raise ValueError("--cluster needs --cluster-etcd (the etcd endpoints holding its pool directory)")
    from blockd.service.groups import GroupMember
    # with --etcd, --group names both the replica group and the cluster's group: its leader announces it
    return GroupMember(args.cluster_etcd, args.cluster, args.group, args.lease_ttl_s, replicated=bool(args.etcd))


def _pin_cpus(cpus: frozenset[int] | None) -> str:
    """Run this process on ``cpus`` (``--cpus``): every thread it has now, and
    so every thread it starts; "" when done or not asked, else why not."""
    if cpus is None:
        return ""
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        return (f"--cpus names CPU {', '.join(map(str, sorted(cpus - allowed)))}, which this process may not use "
                f"(it may use {', '.join(map(str, sorted(allowed)))})")
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
    log.info("running on CPU %s", ", ".join(map(str, sorted(cpus))))
    return ""


def serve(args: argparse.Namespace) -> int:
    refused = _pin_cpus(args.cpus)  # before any thread of grpc's or ours starts: they inherit it
    if refused:
        log.error("cannot serve: %s", refused)
        return 2
    # imported here so `blockd --help` stays fast and grpc-free
    from blockd.auth import server_security
    from blockd.auth.config import server_tls
    from blockd.engine.config import EngineConfig
    from blockd.engine.machine import Engine
    from blockd.rpc import tracing
    from blockd.rpc.trace_grpc import server_interceptors
    from blockd.service.server import BlockdServer
    from blockd.storage.reader import DataDirError, advice

    try:  # before the data dir is touched: a refusal changes nothing
        tls = server_tls(args)
        security = server_security(args.listen, tls, args.tokens_file, args.insecure)
        tracing.set_up("blockd")  # only when OTEL_* variables ask for it (docs/operations.md, "Tracing")
    except ValueError as err:  # InsecureListen, TlsError, IdentitiesFileError, TracingConfigError
        log.error("cannot serve: %s", err)
        return 2
    try:
        if args.etcd or (args.cluster and (tls is not None or args.tokens_file)):
            _peer_security(args, tls)  # a follower's credentials, or those a pool's move calls another group with
        member = _member(args)
    except ValueError as err:
        log.error("cannot serve: %s", err)
        return 2
    log.info("data dir: %s; fsync: %s; allocator core: %s; the step lane's fsync thread: %s",
             args.data_dir or "none (in memory)", args.fsync, core.BUILD, fsyncer.BUILD)
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
    gate = _gate(member, security.quota_source())
    try:
        server = BlockdServer(engine, args.listen, max_workers=args.max_workers, grace_s=args.grace_s,
                              interceptors=[*server_interceptors(),
                                            *([metrics.interceptor()] if metrics is not None else []),
                                            *security.interceptors, *gate],
                              credentials=security.credentials, step_lane_port=args.step_lane_port, lane_tls=tls,
                              extra_services=[*([replica.servicer()] if replica is not None else []),
                                              *_group_service(engine, gate, member, args, tls)])
        advertise = _advertise_address(args.advertise_address, server.address)
        http = _start_metrics(engine, args.metrics_port, metrics, args)
    except (OSError, ValueError, RuntimeError) as err:
        log.error("cannot serve on %s (metrics port %d): %s", args.listen, args.metrics_port, err)
        engine.close()
        return 1
    if member is not None and not _join(member, advertise, engine, http):
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
        if member is not None:
            _announce_when_leading(replica, member)
        replica.start(engine, advertise)
        if metrics is not None:
            _register_replication_metrics(metrics, replica)
    print(f"blockd listening on {server.address}", flush=True)
    if server.lane is not None:
        print(f"blockd step lane on {server.lane.address}", flush=True)
    print(f"blockd advertising {advertise}", flush=True)
    # wait in short slices so the signal handler runs promptly
    while not stop.wait(0.2):
        if reload.is_set():
            reload.clear()
            _reload(security, http, pid_file)
    if replica is not None:
        replica.stop()  # resign first: the next leader is elected within a poll
    if member is not None:
        member.leave()  # callers learn at once that this group's pools are down
    server.stop()
    if http is not None:
        http.close()
    _remove_pid_file(pid_file)
    return 0


def _gate(member, quotas) -> list:
    """The interceptor that serves only the group's pools and counts tenants' quotas
    over every group (last: after authentication)."""
    if member is None:
        return []
    from blockd.service.groups import PoolGate
    return [PoolGate(member, quotas)]


def _announce_when_leading(replica, member) -> None:
    """A replicated group in a cluster: the replica that leads announces the group."""
    health = replica.on_role

    def on_role(leading: bool) -> None:
        health(leading)
        member.announce(leading)

    replica.on_role = on_role


def _group_service(engine, gate: list, member, args: argparse.Namespace, tls) -> list:
    """``GroupService`` (a pool's move) with the credentials a move calls the other group with."""
    if member is None:
        return []
    from blockd.service.moves import GroupServicer
    from blockd.v1 import groups_pb2
    peer = _peer_security(args, tls) if tls is not None or args.tokens_file else (None, None)
    return [(GroupServicer(engine, gate[0], member, peer), groups_pb2.DESCRIPTOR.services_by_name["GroupService"])]


def _join(member, advertise: str, engine, http) -> bool:
    """Join the cluster before serving; False (logged, everything closed) when etcd refuses."""
    from blockd.ha.etcd import EtcdUnavailable
    from blockd.ha.keys import BadValue
    try:
        member.join(advertise, [stats.name for stats in engine.list_pools(local=True)])
        return True
    except (EtcdUnavailable, BadValue) as err:
        log.error("cannot join cluster %s as group %s: %s", member.directory.cluster, member.group, err)
        engine.close()
        if http is not None:
            http.close()
        return False


def _reload(security, http, pid_file: str | None) -> None:
    """SIGHUP: re-read the identities file, the metrics users file and certificate; with a
    pid file, write the answer ``blockd reload`` waits for (:mod:`blockd.cli.reload`)."""
    began_ns = time.monotonic_ns()  # after the flag was cleared: this reload reads the files from now on
    ok, message = security.reload()
    problems = http.reload() if http is not None else []
    if pid_file is not None:
        try:
            write_status(pid_file, began_ns, ok and not problems, [message, *problems])
        except OSError as err:
            log.error("cannot write the reload answer next to the pid file: %s", err)


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
            remove_status(path)
    except OSError:
        pass
