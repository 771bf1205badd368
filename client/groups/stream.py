"""A scheduler's steps over StepStreams across a cluster: :class:`ClusterStepStream`.

:meth:`client.groups.router.ClusterClient.step_stream` gives one. Each step goes
to the group that owns its pool over that group's own
:class:`~client.step_stream.StepStream` (opened on first use, one per group
address), so a scheduler in a cluster pays the stream's daemon CPU per step,
not unary Step's. The routing is :meth:`ClusterClient.on_pool`'s: a step a
group refuses in band as another group's pool (``WRONG_GROUP``, nothing
applied) is sent again at the owner the directory names now, and one while
the pool moves (``POOL_MOVING``) waits and is sent again. A change gets its
request id here, once, so a resend to the new owner after a move is answered,
never applied twice (the move hands the pool's request ids over).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from blockd.core.types import DecodeAppend, Op, OpResult, StepResult
from client.channel import new_request_id
from client.step_stream import StepStream

if TYPE_CHECKING:
    from client.sdk import BlockdClient


class Routes(Protocol):
    """What a :class:`ClusterStepStream` asks of its :class:`~client.groups.router.ClusterClient`
    (a protocol, not an import: the router makes streams, so importing it back would be a cycle)."""

    def on_pool(self, pool: str, call: Callable[[BlockdClient], Any]) -> Any: ...


class ClusterStepStream:
    """``ClusterClient.step`` over a StepStream per group (module docstring); close it when done."""

    def __init__(self, cluster: Routes, timeout_s: float) -> None:
        self._cluster, self.timeout_s = cluster, timeout_s
        self._streams: dict[str, StepStream] = {}  # group address -> its stream
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> ClusterStepStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()

    def _stream(self, client: BlockdClient) -> StepStream:
        with self._lock:
            if self._closed:
                raise ValueError("this ClusterStepStream is closed")
            stream = self._streams.get(client.target)
            if stream is None:
                stream = self._streams[client.target] = client.step_stream(self.timeout_s)
            return stream

    def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
             timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "",
             previous_term: int = 0) -> StepResult:
        """As :meth:`client.sdk.BlockdClient.step`, over the owner's stream."""
        if not request_id and not dry_run:
            request_id = new_request_id()
        return self._cluster.on_pool(pool, lambda client: self._stream(client).step(
            pool, ops, request_id=request_id, timeout_s=timeout_s, dry_run=dry_run, incarnation=incarnation,
            previous_term=previous_term))

    def decode_append(self, pool: str, seq_ids: Sequence[str], token_ids: Sequence[int], *,
                      request_id: str | None = None) -> OpResult:
        return self.step(pool, [DecodeAppend(list(seq_ids), list(token_ids))], request_id=request_id).results[0]
