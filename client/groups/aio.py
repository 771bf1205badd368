"""The asyncio SDK over a cluster of daemon groups: :class:`AsyncClusterClient`.

The asyncio twin of :class:`client.groups.router.ClusterClient`, as
:class:`client.aio.AsyncBlockdClient` is of the plain client: the same target
(``cluster://HOST:PORT[,HOST:PORT...]/NAME``), the same calls as coroutines,
answered by an :class:`~client.aio.AsyncBlockdClient` of the group that owns
the pool. The routes and what a failed call means for them are the shared
:class:`~client.groups.routes.RouteTable`'s (a cached route costs a dict
lookup; a directory read runs on a thread, so the event loop's other calls go
on meanwhile); calls that span the groups ask them at once
(``asyncio.gather``). :meth:`AsyncClusterClient.step_stream` gives
:class:`AsyncClusterStepStream`, one :class:`~client.step_stream.AsyncStepStream`
per group. Moving a pool is the thread client's (or ``blockctl pools move``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from blockd.core.types import DecodeAppend, Op, OpResult, PoolConfig, PoolStats, StepResult, WorkerInfo, WorkerStatus
from client.aio import AsyncBlockdClient
from client.channel import DEFAULT_MAX_ATTEMPTS, DEFAULT_TIMEOUT_S, new_request_id
from client.errors import FailedPreconditionError, UnavailableError
from client.groups.router import NotOverCluster
from client.groups.routes import MAX_REROUTES, MOVING_PAUSE_S, POOL_CALLS, RouteTable, pools_by_address
from client.step_stream import AsyncStepStream

if TYPE_CHECKING:
    from typing_extensions import Self

    from blockd.auth.config import TlsConfig

T = TypeVar("T")


def _routed(name: str, mutates: bool = False) -> Callable[..., Any]:
    """``AsyncBlockdClient.<name>(pool, ...)`` at the group that owns ``pool``; a
    change gets its request id here, once (as :func:`client.groups.router._routed`)."""

    async def method(self: AsyncClusterClient, pool: str, *args: Any, **kwargs: Any) -> Any:
        if mutates and not kwargs.get("request_id") and not kwargs.get("dry_run"):
            kwargs["request_id"] = new_request_id()
        return await self.on_pool(pool, lambda client: getattr(client, name)(pool, *args, **kwargs))

    method.__name__ = name
    method.__doc__ = f":meth:`client.aio.AsyncBlockdClient.{name}`, at the group that owns ``pool``."
    return method


class AsyncClusterClient:
    """A client of every group of one cluster for one event loop (module docstring)."""

    def __init__(self, target: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS, tls: TlsConfig | None = None,
                 token: str | None = None) -> None:
        """As :class:`~client.groups.router.ClusterClient`; the directory is read on first use."""
        self._table = RouteTable(target)
        self.target, self.cluster, self.timeout_s = target, self._table.cluster, timeout_s
        self._dial = lambda address: AsyncBlockdClient(address, timeout_s=timeout_s, max_attempts=max_attempts,
                                                       tls=tls, token=token)
        self._clients: dict[str, AsyncBlockdClient] = {}

    def __getattr__(self, name: str) -> Any:
        """What a plain client has and a cluster cannot route: refused in words (as ClusterClient's)."""
        if not name.startswith("_") and hasattr(AsyncBlockdClient, name):
            raise NotOverCluster(f"{name} is not offered over a cluster target ({self.target}): call one "
                                 f"group's daemon at its address")
        raise AttributeError(name)

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
        self._table.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def step_stream(self, timeout_s: float | None = None) -> AsyncClusterStepStream:
        """Steps over an AsyncStepStream per group, each at its pool's owner; close it when done."""
        return AsyncClusterStepStream(self, timeout_s or self.timeout_s)

    # --- the routes -------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the directory again (on a thread)."""
        await asyncio.to_thread(self._table.refresh)

    async def groups(self) -> dict[str, str]:
        """The live groups and the address each serves at, read now."""
        await self.refresh()
        return dict(self._table.groups)

    async def group_of(self, pool: str) -> str:
        return (await asyncio.to_thread(self._table.route, pool))[0]

    async def _address(self, pool: str) -> str:
        cached = self._table.cached(pool)
        return cached if cached is not None else (await asyncio.to_thread(self._table.route, pool))[1]

    def _client(self, address: str) -> AsyncBlockdClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = self._dial(address)
        return client

    async def on_pool(self, pool: str, call: Callable[[AsyncBlockdClient], Awaitable[T]]) -> T:
        """``await call(client of pool's group)``, re-routed and retried as
        :meth:`client.groups.router.ClusterClient.on_pool` does."""
        deadline, reroutes, pause = time.monotonic() + self.timeout_s, 0, MOVING_PAUSE_S[0]
        while True:
            try:
                return await call(self._client(await self._address(pool)))
            except (FailedPreconditionError, UnavailableError) as err:
                wait, rerouted = await asyncio.to_thread(self._table.retry, pool, err, reroutes, deadline, pause)
                reroutes += rerouted
                if wait:
                    await asyncio.sleep(wait)
                    pause = min(2 * pause, MOVING_PAUSE_S[1])

    async def _each(self, addresses: Sequence[str], call: Callable[[AsyncBlockdClient], Awaitable[T]]) -> list[T]:
        """``call`` on every address's client at once, answers in order; the first failure in that order raised."""
        answers = await asyncio.gather(*(call(self._client(a)) for a in addresses), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return list(answers)  # type: ignore[arg-type]

    async def _live(self) -> list[str]:
        return await asyncio.to_thread(self._table.live_addresses)

    # --- calls that span the groups ----------------------------------------------------------
    async def create_pool(self, config: PoolConfig, *, request_id: str | None = None) -> PoolStats:
        """Create ``config``'s pool on the live group with the fewest pools."""
        group, address = await asyncio.to_thread(self._table.placement, config.name)
        stats = await self._client(address).create_pool(config, request_id=request_id)
        self._table.remember(config.name, group, address)
        return stats

    async def delete_pool(self, pool: str, *, request_id: str | None = None) -> None:
        await self.on_pool(pool, lambda client: client.delete_pool(pool, request_id=request_id))
        self._table.forget(pool)

    async def list_pools(self) -> list[PoolStats]:
        """Every live group's pools, by name."""
        answers = await self._each(await self._live(), lambda client: client.list_pools())
        return sorted((s for pools in answers for s in pools), key=lambda s: s.name)

    async def lookup_prefix(self, token_ids: Sequence[int], extra_keys=None, pools: Sequence[str] = (), *,
                            tiers: bool = False) -> dict:
        """Cached tokens of this prompt per pool, across the groups (the named pools at their
        groups; with none named, every pool of every live group)."""
        found: dict = {}
        if not pools:
            for answer in await self._each(await self._live(),
                                           lambda client: client.lookup_prefix(token_ids, extra_keys, tiers=tiers)):
                found.update(answer)
            return found
        for attempt in range(2):  # a pool moved since the directory was read: read it again, once
            by_address = await asyncio.to_thread(pools_by_address, self._table, pools)

            def ask(client: AsyncBlockdClient, named: dict[str, list[str]] = by_address) -> Awaitable[dict]:
                return client.lookup_prefix(token_ids, extra_keys, named[client.target], tiers=tiers)
            try:
                for answer in await self._each(list(by_address), ask):
                    found.update(answer)
                return found
            except FailedPreconditionError as err:
                if err.reason != "WRONG_GROUP" or attempt:
                    raise
                await self.refresh()
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def list_workers(self, pool: str | None = None) -> list[WorkerStatus]:
        if pool:
            return await self.on_pool(pool, lambda client: client.list_workers(pool))
        answers = await self._each(await self._live(), lambda client: client.list_workers())
        return [w for workers in answers for w in workers]

    # --- calls by pool (the POOL_CALLS set on the class below), and streams ------------------

    def watch(self, pool: str, from_version: int = 0, **kwargs: Any) -> AsyncGenerator[Any, None]:
        """:meth:`~client.aio.AsyncBlockdClient.watch` at the pool's group; a refusal by a
        group that no longer owns it opens the stream again at the owner."""
        return self._stream(pool, lambda client: client.watch(pool, from_version, **kwargs))

    def events(self, pool: str, from_seq_no: int = 0, **kwargs: Any) -> AsyncGenerator[Any, None]:
        return self._stream(pool, lambda client: client.events(pool, from_seq_no, **kwargs))

    async def _stream(self, pool: str,
                      open_: Callable[[AsyncBlockdClient], AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
        for attempt in range(MAX_REROUTES + 1):
            items = open_(self._client(await self._address(pool)))
            try:
                first = await items.__anext__()
            except StopAsyncIteration:
                return
            except FailedPreconditionError as err:
                if err.reason != "WRONG_GROUP" or attempt == MAX_REROUTES:
                    raise
                await self.refresh()
                continue
            yield first
            async for item in items:
                yield item
            return

    async def register_worker(self, info: WorkerInfo, **kwargs: Any) -> WorkerStatus:
        status = await self.on_pool(info.pool, lambda client: client.register_worker(info, **kwargs))
        self._table.remember_worker(info.worker_id, info.pool)
        return status

    async def heartbeat(self, worker_id: str, applied_version: int, **kwargs: Any) -> WorkerStatus:
        pool = self._table.pool_of_worker(worker_id)
        return await self.on_pool(pool, lambda client: client.heartbeat(worker_id, applied_version, **kwargs))

    async def get_hash_spec(self, pool: str | None = None):
        if pool:
            return await self.on_pool(pool, lambda client: client.get_hash_spec(pool))
        live = await self._live()
        if not live:
            raise UnavailableError(f"cluster {self.cluster} has no live group to ask")
        return await self._client(live[0]).get_hash_spec()


for _name, _mutates in POOL_CALLS.items():  # AsyncBlockdClient's calls by pool, each at the pool's owner
    setattr(AsyncClusterClient, _name, _routed(_name, _mutates))


class AsyncClusterStepStream:
    """``AsyncClusterClient.step`` over an :class:`~client.step_stream.AsyncStepStream`
    per group (as :class:`client.groups.stream.ClusterStepStream`); close it when done."""

    def __init__(self, cluster: AsyncClusterClient, timeout_s: float) -> None:
        self._cluster, self.timeout_s = cluster, timeout_s
        self._streams: dict[str, AsyncStepStream] = {}  # group address -> its stream
        self._closed = False

    async def __aenter__(self) -> AsyncClusterStepStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.close()

    def _stream(self, client: AsyncBlockdClient) -> AsyncStepStream:
        if self._closed:
            raise ValueError("this AsyncClusterStepStream is closed")
        stream = self._streams.get(client.target)
        if stream is None:
            stream = self._streams[client.target] = client.step_stream(self.timeout_s)
        return stream

    async def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
                   timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "",
                   previous_term: int = 0) -> StepResult:
        """As :meth:`client.aio.AsyncBlockdClient.step`, over the owner's stream."""
        if not request_id and not dry_run:
            request_id = new_request_id()
        return await self._cluster.on_pool(pool, lambda client: self._stream(client).step(
            pool, ops, request_id=request_id, timeout_s=timeout_s, dry_run=dry_run, incarnation=incarnation,
            previous_term=previous_term))

    async def decode_append(self, pool: str, seq_ids: Sequence[str], token_ids: Sequence[int], *,
                            request_id: str | None = None) -> OpResult:
        return (await self.step(pool, [DecodeAppend(list(seq_ids), list(token_ids))],
                                request_id=request_id)).results[0]
