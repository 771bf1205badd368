"""blockd's client side: the SDK for schedulers and workers, and ``blockctl``.

* :class:`client.sdk.BlockdClient` - synchronous SDK;
* :class:`client.aio.AsyncBlockdClient` - the same calls for asyncio;
* :mod:`client.errors` - exceptions by gRPC status code;
* :mod:`client.cli` - the ``blockctl`` operator CLI.
"""

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

__all__ = [
    "AlreadyExistsError", "AsyncBlockdClient", "BlockdClient", "BlockdClientError", "DeadlineExceededError",
    "FailedPreconditionError", "InternalError", "InvalidArgumentError", "NotFoundError",
    "ResourceExhaustedError", "UnavailableError",
]
