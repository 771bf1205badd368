"""The SDK over a cluster of daemon groups: :class:`ClusterClient` routes each call by pool.

A cluster (``blockd serve --cluster NAME --group G --cluster-etcd URL``,
docs/operations.md) spreads its pools over groups; etcd holds the directory
of which group owns which pool (:mod:`blockd.ha.directory`). The target
``cluster://HOST:PORT[,HOST:PORT...]/NAME`` names that etcd and the cluster
(:func:`parse_cluster_target`).

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
from client.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    from_rpc_error,
)
from client.leader import parse_etcd_named_target
from client.sdk import BlockdClient

if TYPE_CHECKING:
    from typing_extensions import Self

    from blockd.auth.config import TlsConfig
    from blockd.ha.directory import Directory
    from client.groups.stream import ClusterStepStream

T = TypeVar("T")

CLUSTER_SCHEME = "cluster://"
CLUSTER_FORM = "cluster://HOST:PORT[,HOST:PORT...]/CLUSTER"
#: a call re-routed this many times in a row gives up (pools moving back and forth)
MAX_REROUTES = 4
#: first and longest pause before calling a moving pool again
MOVING_PAUSE_S = (0.01, 0.2)


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


def parse_cluster_target(target: str) -> tuple[list[str], str] | None:
    """``(etcd endpoints as http://HOST:PORT, cluster name)`` of a ``cluster://`` target;
    None for any other target; :class:`InvalidArgumentError` naming what is wrong."""
    return parse_etcd_named_target(target, CLUSTER_SCHEME, "cluster name", f"a cluster target is {CLUSTER_FORM}")


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
        parsed = parse_cluster_target(target.strip())
        if parsed is None:
            raise InvalidArgumentError(f"target {target!r} is not a cluster target: {CLUSTER_FORM}")
        try:
            from blockd.ha.directory import Directory
            from blockd.ha.etcd import EtcdClient
        except ImportError as err:
            raise ValueError(f"a cluster:// target needs the ha extra (pip install 'blockd[ha]'): {err}") from None
        endpoints, cluster = parsed
        try:
            self._directory: Directory = Directory(EtcdClient(endpoints), cluster)
        except ValueError as err:
            raise InvalidArgumentError(f"target {target!r}: {err}") from None
        self.target, self.cluster = target, cluster
        self.timeout_s, self.tls, self.token = timeout_s, tls, token
        self._dial = lambda address: BlockdClient(address, timeout_s=timeout_s, max_attempts=max_attempts,
                                                  tls=tls, token=token)
        self._lock = threading.Lock()
        #: pool -> (group, address); address "" when the group has no live daemon
        self._routes: dict[str, tuple[str, str]] = {}
        self._groups: dict[str, str] = {}
        self._clients: dict[str, BlockdClient] = {}
        #: worker id -> its pool, so a heartbeat (which names no pool) goes where the worker registered
        self._workers: dict[str, str] = {}
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
            self._directory.etcd.close()
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
        from blockd.ha.etcd import EtcdUnavailable
        from blockd.ha.keys import BadValue

        with self._lock:
            try:
                groups = {name: entry.address for name, entry in self._directory.groups().items()}
                pools = self._directory.pools()
            except (EtcdUnavailable, BadValue) as err:
                raise UnavailableError(f"cannot read cluster {self.cluster}'s directory: {err}") from None
            self._groups = groups
            self._routes = {name: (entry.group, groups.get(entry.group, "")) for name, entry in pools.items()}

    def groups(self) -> dict[str, str]:
        """The live groups and the address each serves at (a replicated group's leader), read now."""
        self.refresh()
        return dict(self._groups)

    def group_of(self, pool: str) -> str:
        """The group the directory gives ``pool`` (as last read)."""
        return self._route(pool)[0]

    def _route(self, pool: str) -> tuple[str, str]:
        route = self._routes.get(pool)
        if route is None or not route[1]:
            self.refresh()
            route = self._routes.get(pool)
        if route is None:
            raise NotFoundError(f"pool {pool!r} is in no group of cluster {self.cluster} (create it first)")
        if not route[1]:
            raise UnavailableError(f"pool {pool!r} lives on group {route[0]} of cluster {self.cluster}, which "
                                   f"has no live daemon now: its pools are unavailable until it is back (the "
                                   f"other groups' pools are served)")
        return route

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
                return call(self._client(self._route(pool)[1]))
            except FailedPreconditionError as err:
                if err.reason != "WRONG_GROUP" or reroutes >= MAX_REROUTES:
                    raise
                reroutes += 1
                self.refresh()
            except UnavailableError as err:
                if err.reason == "POOL_MOVING" and time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    pause = min(2 * pause, MOVING_PAUSE_S[1])
                    continue
                # a group gone down: the directory says so once its lease ends; until then, this error
                if err.reason or reroutes >= MAX_REROUTES or not self._group_gone(pool):
                    raise
                reroutes += 1

    def _group_gone(self, pool: str) -> bool:
        """After a group did not answer: True when the directory now routes ``pool`` elsewhere
        (or says its group is down, which the next :meth:`_route` raises)."""
        before = self._routes.get(pool)
        self.refresh()
        return self._routes.get(pool) != before

    def _live(self) -> list[BlockdClient]:
        self.refresh()
        return [self._client(address) for address in sorted(set(self._groups.values()))]

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
        from blockd.ha.directory import PoolEntry, place

        self.refresh()
        group = place(self._groups, [PoolEntry(p, g, 1) for p, (g, _) in self._routes.items()])
        if group is None:
            raise UnavailableError(f"cluster {self.cluster} has no live group to create pool {config.name!r} on")
        stats = self._client(self._groups[group]).create_pool(config, request_id=request_id)
        with self._lock:
            self._routes = {**self._routes, config.name: (group, self._groups[group])}
        return stats

    def delete_pool(self, pool: str, *, request_id: str | None = None) -> None:
        """Delete ``pool`` at its group (which removes it from the directory)."""
        self.on_pool(pool, lambda client: client.delete_pool(pool, request_id=request_id))
        with self._lock:
            self._routes = {name: route for name, route in self._routes.items() if name != pool}

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
            by_group: dict[str, list[str]] = {}
            for pool in pools:
                by_group.setdefault(self._route(pool)[1], []).append(pool)
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

    # --- calls by pool -------------------------------------------------------------------------
    get_pool = _routed("get_pool")
    pool_config = _routed("pool_config")
    reset_prefix_cache = _routed("reset_prefix_cache", mutates=True)
    pin_prefix = _routed("pin_prefix", mutates=True)
    set_prefix_priority = _routed("set_prefix_priority", mutates=True)
    unpin_prefix = _routed("unpin_prefix", mutates=True)
    list_pins = _routed("list_pins")
    step = _routed("step", mutates=True)
    allocate = _routed("allocate", mutates=True)
    append = _routed("append", mutates=True)
    decode_append = _routed("decode_append", mutates=True)
    commit = _routed("commit", mutates=True)
    fork = _routed("fork", mutates=True)
    free = _routed("free", mutates=True)
    get_tables = _routed("get_tables")
    get_sequence = _routed("get_sequence")

    def watch(self, pool: str, from_version: int = 0, **kwargs: Any) -> Generator[Any, None, None]:
        """:meth:`~client.sdk.BlockdClient.watch` at the pool's group; a refusal by a
        group that no longer owns it opens the stream again at the owner."""
        return self._stream(pool, lambda client: client.watch(pool, from_version, **kwargs))

    def events(self, pool: str, from_seq_no: int = 0, **kwargs: Any) -> Generator[Any, None, None]:
        return self._stream(pool, lambda client: client.events(pool, from_seq_no, **kwargs))

    def _stream(self, pool: str, open_: Callable[[BlockdClient], Iterator[T]]) -> Generator[T, None, None]:
        for attempt in range(MAX_REROUTES + 1):
            items = open_(self._client(self._route(pool)[1]))
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
        with self._lock:
            self._workers[info.worker_id] = info.pool
        return status

    def heartbeat(self, worker_id: str, applied_version: int, **kwargs: Any) -> WorkerStatus:
        pool = self._workers.get(worker_id)
        if pool is None:
            raise NotFoundError(f"worker {worker_id!r} did not register through this client: register it "
                                f"first (a heartbeat names no pool to route by)")
        return self.on_pool(pool, lambda client: client.heartbeat(worker_id, applied_version, **kwargs))

    def get_hash_spec(self, pool: str | None = None):
        if pool:
            return self.on_pool(pool, lambda client: client.get_hash_spec(pool))
        live = self._live()
        if not live:
            raise UnavailableError(f"cluster {self.cluster} has no live group to ask")
        return live[0].get_hash_spec()
