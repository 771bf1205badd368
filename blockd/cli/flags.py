"""Every flag of the ``blockd`` console script, its parser and its argument types.

:func:`build_parser` builds ``serve``, ``check-data``, ``repair-data``,
``compact``, ``tokens`` and ``certs``; each flag's environment variable and
range come from :mod:`blockd.config_env`. What the flags mean: the package's
docstring (:mod:`blockd.cli`) and ``blockd serve --help``.
"""

from __future__ import annotations

import argparse
import os

from blockd import build_info, config_env, logs
from blockd.auth.cli import add_commands as add_auth_commands
from blockd.auth.config import add_tls_flags
from blockd.cli.reload import add_command as add_reload_command
from blockd.engine.guardrails import Guardrails
from blockd.engine.idempotency import IdempotencyLimits
from blockd.rpc import addresses

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
    serve.add_argument("--group", default="main",
                       help="the replica group (with --etcd); with --cluster, this daemon's group in the cluster")
    serve.add_argument("--cluster", default="",
                       help="serve the pools a cluster's directory gives --group (needs --cluster-etcd; with --etcd, "
                            "the replica group is the cluster's group); "
                            "without it the daemon serves every pool it holds, as always")
    serve.add_argument("--cluster-etcd", default="",
                       help="etcd endpoints (http://HOST:PORT,...) holding --cluster's pool directory")
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
                       help="the leader's etcd lease (and a --cluster group's: its pools are reported down "
                            "this long after its daemon dies); failover takes about this plus 1 s")
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
                       help="write the daemon's pid here once it serves, and each reload's answer to "
                            "FILE.reload (blockd reload --pid-file FILE); both removed at exit")
    serve.add_argument("--max-workers", type=config_env.positive_int, default=128,
                       help="most RPC threads; each open Watch/Events/StepStream stream holds one while open "
                            "(step streams at most half: the SDK steps by unary Step beyond that)")
    serve.add_argument("--cpus", type=config_env.cpu_list, default=None,
                       help="run the daemon on these CPUs only (as taskset -c: 0, 0-3, 0,2-3): a central daemon "
                            "on cores of its own keeps its caches warm between steps, where schedulers or "
                            "workers sharing its cores would slow each step. Default: any CPU")
    serve.add_argument("--step-lane-port", type=config_env.port, default=None,
                       help="also serve StepStream as the step lane on this port of the --listen host (0: a free "
                            "one): the same steps, checks and answers for a fraction of gRPC's CPU per step; "
                            "TLS with the same files when gRPC has them. The SDK finds it by itself and falls "
                            "back to the gRPC stream when it cannot reach it. Default: no lane")
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
    add_reload_command(sub)
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
