"""The SDK over a cluster of daemon groups: :class:`ClusterClient` routes each call by pool.

A cluster (``blockd serve --cluster NAME --group G --cluster-etcd URL``,
docs/operations.md) spreads its pools over groups; etcd holds the directory
of which group owns which pool (:mod:`blockd.ha.directory`). The target
``cluster://HOST:PORT[,HOST:PORT...]/NAME`` names that etcd and the cluster
(:func:`client.groups.routes.parse_cluster_target`).

The client keeps a route per pool (pool -> the owning group's address),
read from the directory on a miss and again whenever a group refuses a
pool as another group's (``WRONG_GROUP``) or a group does not answer; a
call then goes to a :class:`~client.sdk.BlockdClient` of that group's
address (one per group, made on first use). A step costs a dict lookup
and a method call more than on a plain client (``bench/rpc.py --part
groups`` measures it). A pool whose group has no live daemon in the
directory fails at once with UnavailableError saying so, while the other
groups' pools keep serving.

Calls that name no pool span the groups: :meth:`ClusterClient.list_pools`
and :meth:`ClusterClient.lookup_prefix` ask every live group at once (a
thread per group beyond the first, so a router's cluster-wide lookup takes
the slowest group's time, not the sum) and merge the answers;
:meth:`ClusterClient.create_pool` places a new pool on the live group
with the fewest pools (:func:`blockd.ha.directory.place`).
:meth:`ClusterClient.move_pool` hands a pool to another group
(:mod:`blockd.service.moves`); while it moves, calls for it are answered
``POOL_MOVING`` and retried here (nothing was applied), then go to the new
owner.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from blockd.core.types import PoolConfig, PoolStats, WorkerInfo, WorkerStatus
from blockd.v1 import groups_pb2 as gpb
from blockd.v1 import groups_pb2_grpc as gpb_grpc
from client.channel import DEFAULT_MAX_ATTEMPTS, DEFAULT_TIMEOUT_S, dial, new_request_id
from client.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError, from_rpc_error
from client.groups.routes import (
    CLUSTER_SCHEME,
    MAX_REROUTES,
    MOVING_PAUSE_S,
    POOL_CALLS,
    RouteTable,
    pools_by_address,
)
from client.sdk import BlockdClient

if TYPE_CHECKING:
    from typing_extensions import Self

    from blockd.auth.config import TlsConfig
    from client.groups.stream import ClusterStepStream

T = TypeVar("T")


@dataclass(frozen=True)
class Moved:
    """Where :meth:`ClusterClient.move_pool` put a pool: its group, the directory
    entry's epoch, and the pool's version when it was handed over."""

    group: str
    epoch: int
    version: int


class NotOverCluster(InvalidArgumentError, AttributeError):
    """A plain client's method that a cluster cannot route (a replica's status).
    An AttributeError too, so ``getattr(client, name, None)`` (how
    the scheduler asks whether a backend offers ``step_stream``) answers None."""


def connect(target: str, **kwargs: Any) -> Any:
    """A :class:`ClusterClient` for a ``cluster://`` target, else a
    :class:`~client.sdk.BlockdClient` (what ``blockctl`` and ``blockd-worker`` dial)."""
    return ClusterClient(target, **kwargs) if target.strip().startswith(CLUSTER_SCHEME) else \
        BlockdClient(target, **kwargs)


def _routed(name: str, mutates: bool = False) -> Callable[..., Any]:
    """``BlockdClient.<name>(pool, ...)`` at the group that owns ``pool``. A change
    (``mutates``) gets its request id here, once: a resend to the pool's new owner
    after a move carries the same id, which the move handed over, so a change the
    old owner applied is answered, never applied twice."""

    def method(self: ClusterClient, pool: str, *args: Any, **kwargs: Any) -> Any:
        if mutates and not kwargs.get("request_id") and not kwargs.get("dry_run"):
            kwargs["request_id"] = new_request_id()
        return self.on_pool(pool, lambda client: getattr(client, name)(pool, *args, **kwargs))

    method.__name__ = name
    method.__doc__ = f":meth:`client.sdk.BlockdClient.{name}`, at the group that owns ``pool``."
    return method


class ClusterClient:
    """A client of every group of one cluster; thread-safe. Pool calls take the
    same arguments and give the same answers as :class:`~client.sdk.BlockdClient`'s."""

    def __init__(self, target: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS, tls: TlsConfig | None = None,
                 token: str | None = None) -> None:
        self._table = RouteTable(target)
        self.target, self.cluster = target, self._table.cluster
        self.timeout_s, self.tls, self.token = timeout_s, tls, token
        self._dial = lambda address: BlockdClient(address, timeout_s=timeout_s, max_attempts=max_attempts,
                                                  tls=tls, token=token)
        self._lock = threading.Lock()
        self._clients: dict[str, BlockdClient] = {}
        #: the threads that ask several groups at once (made on the first such call)
        self._fan_out_pool: ThreadPoolExecutor | None = None
        self.refresh()

    def __getattr__(self, name: str) -> Any:
        """What a plain client has and a cluster cannot route (a replica's status,
        a step stream): refused in words rather than with an AttributeError."""
        if not name.startswith("_") and hasattr(BlockdClient, name):
            raise NotOverCluster(f"{name} is not offered over a cluster target ({self.target}): call one "
                                 f"group's daemon at its address")
        raise AttributeError(name)

    def step_stream(self, timeout_s: float | None = None) -> ClusterStepStream:
        """Steps over StepStreams, one per group, each step at its pool's owner
        (:class:`client.groups.stream.ClusterStepStream`); the scheduler's default way
        to step (``SchedulerConfig.stream_steps``). Close it when done."""
        from client.groups.stream import ClusterStepStream

        return ClusterStepStream(self, timeout_s or self.timeout_s)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            fan_out, self._fan_out_pool = self._fan_out_pool, None
        self._table.close()
        if fan_out is not None:
            fan_out.shutdown(wait=False)
        for client in clients:
            client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the routes -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the directory again (every pool's group, every live group's address)."""
        self._table.refresh()

    def groups(self) -> dict[str, str]:
        """The live groups and the address each serves at (a replicated group's leader), read now."""
        self._table.refresh()
        return dict(self._table.groups)

    def group_of(self, pool: str) -> str:
        """The group the directory gives ``pool`` (as last read)."""
        return self._table.route(pool)[0]

    def _client(self, address: str) -> BlockdClient:
        client = self._clients.get(address)
        if client is None:
            with self._lock:
                client = self._clients.get(address)
                if client is None:
                    client = self._clients[address] = self._dial(address)
        return client

    def on_pool(self, pool: str, call: Callable[[BlockdClient], T]) -> T:
        """``call(client of pool's group)``, re-routed when the group refuses the pool
        as another's or does not answer, and retried while the pool is moving
        (UNAVAILABLE ``POOL_MOVING``: nothing was applied) within this client's timeout."""
        deadline, reroutes, pause = time.monotonic() + self.timeout_s, 0, MOVING_PAUSE_S[0]
        while True:
            try:
                return call(self._client(self._table.route(pool)[1]))
            except (FailedPreconditionError, UnavailableError) as err:
                wait, rerouted = self._table.retry(pool, err, reroutes, deadline, pause)  # or raises err
                reroutes += rerouted
                if wait:
                    time.sleep(wait)
                    pause = min(2 * pause, MOVING_PAUSE_S[1])

    def _live(self) -> list[BlockdClient]:
        return [self._client(address) for address in self._table.live_addresses()]

    def _each(self, clients: Sequence[BlockdClient], call: Callable[[BlockdClient], T]) -> list[T]:
        """``call`` on every client at once, the answers in ``clients``' order; the first
        failure in that order is raised (as asking them one by one would)."""
        if len(clients) <= 1:
            return [call(client) for client in clients]
        with self._lock:
            if self._fan_out_pool is None:
                self._fan_out_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="blockd-cluster")
            fan_out = self._fan_out_pool
        futures = [fan_out.submit(call, client) for client in clients]
        return [future.result() for future in futures]

    # --- calls that span the groups ----------------------------------------------------------
    def create_pool(self, config: PoolConfig, *, request_id: str | None = None) -> PoolStats:
        """Create ``config``'s pool on the live group with the fewest pools."""
        group, address = self._table.placement(config.name)
        stats = self._client(address).create_pool(config, request_id=request_id)
        self._table.remember(config.name, group, address)
        return stats

    def delete_pool(self, pool: str, *, request_id: str | None = None) -> None:
        """Delete ``pool`` at its group (which removes it from the directory)."""
        self.on_pool(pool, lambda client: client.delete_pool(pool, request_id=request_id))
        self._table.forget(pool)

    def move_pool(self, pool: str, to_group: str, *, timeout_s: float = 60.0) -> Moved:
        """Move ``pool`` to group ``to_group`` (asked of its owner, which drains it,
        hands its state over and switches the directory entry; docs/operations.md).
        Steps of other callers wait meanwhile (POOL_MOVING) and then go to the new owner."""

        def move(client: BlockdClient) -> Moved:
            channel = dial(client.target, tls=self.tls, token=self.token, max_attempts=1)
            try:
                reply = gpb_grpc.GroupServiceStub(channel).MovePool(
                    gpb.MovePoolRequest(pool=pool, to_group=to_group), timeout=timeout_s)
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None
            finally:
                channel.close()
            return Moved(reply.group, reply.epoch, reply.version)

        moved = self.on_pool(pool, move)
        self.refresh()
        return moved

    def list_pools(self) -> list[PoolStats]:
        """Every live group's pools, by name."""
        answers = self._each(self._live(), lambda client: client.list_pools())
        return sorted((s for pools in answers for s in pools), key=lambda s: s.name)

    def lookup_prefix(self, token_ids: Sequence[int], extra_keys=None, pools: Sequence[str] = (), *,
                      tiers: bool = False) -> dict:
        """Cached tokens of this prompt per pool, across the groups (the named
        pools at their groups; with none named, every pool of every live group)."""
        found: dict = {}
        if not pools:
            for answer in self._each(self._live(),
                                     lambda client: client.lookup_prefix(token_ids, extra_keys, tiers=tiers)):
                found.update(answer)
            return found
        for attempt in range(2):  # a pool moved since the directory was read: read it again, once
            by_group = pools_by_address(self._table, pools)
            try:
                clients = [self._client(address) for address in by_group]
                named = dict(zip(clients, by_group.values()))

                def ask(client: BlockdClient, named: dict[BlockdClient, list[str]] = named) -> dict:
                    return client.lookup_prefix(token_ids, extra_keys, named[client], tiers=tiers)

                for answer in self._each(clients, ask):
                    found.update(answer)
                return found
            except FailedPreconditionError as err:
                if err.reason != "WRONG_GROUP" or attempt:
                    raise
                self.refresh()
        raise AssertionError("unreachable: the second attempt returns or raises")

    def list_workers(self, pool: str | None = None) -> list[WorkerStatus]:
        if pool:
            return self.on_pool(pool, lambda client: client.list_workers(pool))
        return [w for workers in self._each(self._live(), lambda client: client.list_workers()) for w in workers]

    # --- calls by pool (the POOL_CALLS set on the class below), and streams ------------------

    def watch(self, pool: str, from_version: int = 0, **kwargs: Any) -> Generator[Any, None, None]:
        """:meth:`~client.sdk.BlockdClient.watch` at the pool's group; a refusal by a
        group that no longer owns it opens the stream again at the owner."""
        return self._stream(pool, lambda client: client.watch(pool, from_version, **kwargs))

    def events(self, pool: str, from_seq_no: int = 0, **kwargs: Any) -> Generator[Any, None, None]:
        return self._stream(pool, lambda client: client.events(pool, from_seq_no, **kwargs))

    def _stream(self, pool: str, open_: Callable[[BlockdClient], Iterator[T]]) -> Generator[T, None, None]:
        for attempt in range(MAX_REROUTES + 1):
            items = open_(self._client(self._table.route(pool)[1]))
            try:
                first = next(items)
            except StopIteration:
                return
            except FailedPreconditionError as err:
                if err.reason != "WRONG_GROUP" or attempt == MAX_REROUTES:
                    raise
                self.refresh()
                continue
            yield first
            yield from items
            return

    def register_worker(self, info: WorkerInfo, **kwargs: Any) -> WorkerStatus:
        status = self.on_pool(info.pool, lambda client: client.register_worker(info, **kwargs))
        self._table.remember_worker(info.worker_id, info.pool)
        return status

    def heartbeat(self, worker_id: str, applied_version: int, **kwargs: Any) -> WorkerStatus:
        pool = self._table.pool_of_worker(worker_id)
        return self.on_pool(pool, lambda client: client.heartbeat(worker_id, applied_version, **kwargs))

    def get_hash_spec(self, pool: str | None = None):
        if pool:
            return self.on_pool(pool, lambda client: client.get_hash_spec(pool))
        live = self._live()
        if not live:
            raise UnavailableError(f"cluster {self.cluster} has no live group to ask")
        return live[0].get_hash_spec()


for _name, _mutates in POOL_CALLS.items():  # BlockdClient's calls by pool, each at the pool's owner
    setattr(ClusterClient, _name, _routed(_name, _mutates))
