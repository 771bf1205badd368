"""How the SDK's clients reach blockd: the channel settings they share and
:func:`dial`, the one place a client channel is made.

Retries of UNAVAILABLE are left to gRPC's own retry policy in the channel's
service config (exponential backoff, at most 5 attempts), and every mutation
carries a request id (a fresh uuid4 unless the caller gives one:
:func:`new_request_id`), so a retried mutation is answered with its first
result and changes nothing. Used by :class:`~client.sdk.BlockdClient`,
:class:`~client.aio.AsyncBlockdClient` and
:class:`~client.worker.WorkerClient`.

Security (:func:`dial`): ``tls`` (a :class:`blockd.auth.config.TlsConfig`:
the CA bundle that verifies the server, and a client certificate for mutual
TLS) and ``token`` (a bearer token sent with every call) are handed to
:func:`blockd.auth.channels.open_channel`, which refuses to send a token in
plain text beyond loopback and remakes a sync channel when its TLS files
rotate. Neither: a plain channel (loopback development).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from blockd.auth.channels import open_channel
from blockd.auth.config import TlsConfig
from blockd.rpc.addresses import dial_target
from blockd.rpc.trace_grpc import intercept
from blockd.v1 import blockd_pb2 as pb
from client.errors import InvalidArgumentError

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_ATTEMPTS = 5
MAX_MESSAGE_BYTES = 64 << 20
SERVICE_NAMES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())


def new_request_id() -> str:
    return uuid.uuid4().hex


def channel_options(max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                    max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Retry UNAVAILABLE with exponential backoff (gRPC caps attempts at 5)."""
    retry = {
        "maxAttempts": max(2, min(max_attempts, 5)),
        "initialBackoff": "0.05s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    config = {"methodConfig": [{"name": [{"service": s} for s in SERVICE_NAMES], "retryPolicy": retry}]}
    return [
        ("grpc.service_config", json.dumps(config)),
        ("grpc.enable_retries", 1 if max_attempts > 1 else 0),
        # reconnect quickly after a daemon restart (gRPC's default waits ~1 s, then longer)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def dial(target: str, *, tls: TlsConfig | None = None, token: str | None = None,
         max_attempts: int = DEFAULT_MAX_ATTEMPTS, max_message_bytes: int = MAX_MESSAGE_BYTES,
         aio: bool = False) -> Any:
    """A channel to ``target`` with :func:`channel_options` and the credentials
    above (``aio``: a ``grpc.aio`` channel). :class:`blockd.auth.config.TlsError`
    for settings that cannot work (unreadable files, a token in plain text to
    another host)."""
    try:
        target = dial_target(target)
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None
    channel = open_channel(target, tls, token, options=channel_options(max_attempts, max_message_bytes), aio=aio)
    # trace context in the metadata of unary calls, once the process has switched tracing on
    return intercept(channel)
