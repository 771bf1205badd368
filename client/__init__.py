"""blockd's client side: the SDK for schedulers and workers, and ``blockctl``.

* :class:`client.sdk.BlockdClient` - synchronous SDK;
* :class:`client.aio.AsyncBlockdClient` - the same calls for asyncio;
* :mod:`client.errors` - exceptions by gRPC status code;
* :mod:`client.cli` - the ``blockctl`` operator CLI.

The names below are loaded on first use (PEP 562), so importing a submodule
does not import grpc: ``blockctl`` and ``blockd-worker`` set
``GRPC_VERBOSITY`` before grpc's C core loads and reads it, once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from client.aio import AsyncBlockdClient
    from client.errors import (
        AlreadyExistsError,
        BlockdClientError,
        DeadlineExceededError,
        FailedPreconditionError,
        InternalError,
        InvalidArgumentError,
        NotFoundError,
        ResourceExhaustedError,
        UnavailableError,
    )
    from client.sdk import BlockdClient

#: each exported name and the submodule that defines it
_HOMES = {"AsyncBlockdClient": "client.aio", "BlockdClient": "client.sdk",
          **dict.fromkeys(("AlreadyExistsError", "BlockdClientError", "DeadlineExceededError",
                           "FailedPreconditionError", "InternalError", "InvalidArgumentError", "NotFoundError",
                           "ResourceExhaustedError", "UnavailableError"), "client.errors")}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'client' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next look-up is a plain one
    return value


__all__ = [
    "AlreadyExistsError", "AsyncBlockdClient", "BlockdClient", "BlockdClientError", "DeadlineExceededError",
    "FailedPreconditionError", "InternalError", "InvalidArgumentError", "NotFoundError",
    "ResourceExhaustedError", "UnavailableError",
]
