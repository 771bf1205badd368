"""``blockctl workers list`` and ``blockctl health``: who is there, and is it up.

    blockctl workers list [--pool POOL]
    blockctl health [--service NAME]     # blockd's or a worker's: --target WORKER:PORT

``health`` asks the stock gRPC health service (``grpc.health.v1.Health``,
which blockd and ``blockd-worker`` both serve) for ``--service`` ("" = the
whole server) and prints its status: exit 0 when SERVING, 69 otherwise
(NOT_SERVING while a daemon shuts down, or unreachable), 3 for a service
the server does not know. Containers use it as their HEALTHCHECK; it is
cheap (one unary call, no retries) and needs no gRPC tool in the image.
"""

from __future__ import annotations

import argparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.channel import dial
from client.cli.common import CommandFailed, Exit, emit, render_table
from client.errors import from_rpc_error
from client.sdk import BlockdClient

_WORKER_COLUMNS = ("worker_id", "pool", "address", "layers", "kv_heads", "device", "state", "heartbeat_age_s",
                   "applied_version")


def _workers_list(client: BlockdClient, args: argparse.Namespace) -> None:
    workers = sorted(client.list_workers(args.pool), key=lambda w: (w.info.pool, w.info.worker_id))

    def row(w) -> list[object]:
        i = w.info
        return [i.worker_id, i.pool, i.address or "-", f"{i.layer_start}:{i.layer_end}",
                f"{i.kv_head_start}:{i.kv_head_end}", i.device, "up" if w.is_up else "down",
                f"{w.last_heartbeat_age_s:.1f}", w.applied_version]

    emit(args, workers, lambda: render_table(_WORKER_COLUMNS, [row(w) for w in workers]))


def check_health(target: str, service: str = "", timeout_s: float = 5.0, tls=None, token=None) -> str:
    """The health status name of ``service`` at ``target`` (``SERVING``, ...);
    the SDK's exceptions when the call fails (NOT_FOUND: unknown service).
    ``tls``/``token`` as for :class:`~client.sdk.BlockdClient` (health needs
    no token, but a mutual-TLS server needs the client certificate)."""
    with dial(target, tls=tls, token=token, max_attempts=1) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            # the stubs declare HealthStub's methods on a generic base mypy does not see through
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service),  # type: ignore[attr-defined]
                               timeout=timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _health(client: BlockdClient, args: argparse.Namespace) -> None:
    status = check_health(client.target, args.service, client.timeout_s, client.tls, client.token)
    emit(args, {"target": client.target, "service": args.service, "status": status},
         lambda: f"{client.target} {args.service or '(server)'}: {status}")
    if status != "SERVING":
        raise CommandFailed(f"{client.target} is {status}", Exit.UNAVAILABLE)


def add_workers(sub: argparse._SubParsersAction) -> None:
    workers = sub.add_parser("workers", help="registered workers").add_subparsers(dest="action", required=True)
    listing = workers.add_parser("list", help="every registered worker: shard, address, up or down")
    listing.add_argument("--pool", default=None, help="only this pool's workers")
    listing.set_defaults(run=_workers_list)


def add_health(sub: argparse._SubParsersAction) -> None:
    health = sub.add_parser("health", help="is --target (blockd or a worker) serving? exit 0 if so, 69 if not")
    health.add_argument("--service", default="", help='a service name; "" asks about the whole server')
    health.set_defaults(run=_health)


__all__ = ["add_health", "add_workers", "check_health"]
