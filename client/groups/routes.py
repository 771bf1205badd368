"""A cluster's routes, shared by the thread and asyncio clients: :class:`RouteTable`.

The table holds, per pool, the group that owns it and that group's address
(``""`` when the group has no live daemon), read from the cluster's etcd
directory (:mod:`blockd.ha.directory`) on a miss and again whenever a call
says the routes are stale. :meth:`RouteTable.retry` is the one place that
says what a failed call at a pool's owner means: re-route it (``WRONG_GROUP``,
or a group gone from the directory), wait and send it again (``POOL_MOVING``:
nothing was applied), or give up. :class:`~client.groups.router.ClusterClient`
and :class:`~client.groups.aio.AsyncClusterClient` make the calls; this table
makes none. Its reads of etcd block (the asyncio client runs them in a thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from client.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, UnavailableError
from client.leader import parse_etcd_named_target

if TYPE_CHECKING:
    from blockd.ha.directory import Directory

CLUSTER_SCHEME = "cluster://"
CLUSTER_FORM = "cluster://HOST:PORT[,HOST:PORT...]/CLUSTER"
#: a call re-routed this many times in a row gives up (pools moving back and forth)
MAX_REROUTES = 4
#: first and longest pause before calling a moving pool again
MOVING_PAUSE_S = (0.01, 0.2)
#: the plain clients' calls that name a pool, each sent to the pool's owner, and whether it is a
#: change: a change gets its request id in the cluster client, once, so a resend to the pool's new
#: owner after a move carries the same id (which the move handed over) and is answered, not applied again
POOL_CALLS: dict[str, bool] = {
    "get_pool": False,
    "pool_config": False,
    "reset_prefix_cache": True,
    "pin_prefix": True,
    "set_prefix_priority": True,
    "unpin_prefix": True,
    "list_pins": False,
    "step": True,
    "allocate": True,
    "append": True,
    "decode_append": True,
    "commit": True,
    "fork": True,
    "free": True,
    "get_tables": False,
    "get_sequence": False,
}


def parse_cluster_target(target: str) -> tuple[list[str], str] | None:
    """``(etcd endpoints as http://HOST:PORT, cluster name)`` of a ``cluster://`` target;
    None for any other target; :class:`InvalidArgumentError` naming what is wrong."""
    return parse_etcd_named_target(target, CLUSTER_SCHEME, "cluster name", f"a cluster target is {CLUSTER_FORM}")


class RouteTable:
    """One cluster's routes (module docstring); thread-safe."""

    def __init__(self, target: str) -> None:
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
        self.cluster = cluster
        self.lock = threading.Lock()
        #: pool -> (group, address); address "" when the group has no live daemon
        self.routes: dict[str, tuple[str, str]] = {}
        #: live group -> the address it serves at
        self.groups: dict[str, str] = {}
        #: worker id -> its pool, so a heartbeat (which names no pool) goes where the worker registered
        self.workers: dict[str, str] = {}

    def close(self) -> None:
        with self.lock:
            self._directory.etcd.close()

    def refresh(self) -> None:
        """Read the directory again (every pool's group, every live group's address)."""
        from blockd.ha.etcd import EtcdUnavailable
        from blockd.ha.keys import BadValue

        with self.lock:
            try:
                groups = {name: entry.address for name, entry in self._directory.groups().items()}
                pools = self._directory.pools()
            except (EtcdUnavailable, BadValue) as err:
                raise UnavailableError(f"cannot read cluster {self.cluster}'s directory: {err}") from None
            self.groups = groups
            self.routes = {name: (entry.group, groups.get(entry.group, "")) for name, entry in pools.items()}

    def cached(self, pool: str) -> str | None:
        """``pool``'s owner's address as last read, or None when a read is needed first."""
        route = self.routes.get(pool)
        return route[1] if route is not None and route[1] else None

    def route(self, pool: str) -> tuple[str, str]:
        """``(group, address)`` of ``pool``'s owner, reading the directory on a miss;
        NotFoundError for a pool in no group, UnavailableError for a group that is down."""
        route = self.routes.get(pool)
        if route is None or not route[1]:
            self.refresh()
            route = self.routes.get(pool)
        if route is None:
            raise NotFoundError(f"pool {pool!r} is in no group of cluster {self.cluster} (create it first)")
        if not route[1]:
            raise UnavailableError(f"pool {pool!r} lives on group {route[0]} of cluster {self.cluster}, which "
                                   f"has no live daemon now: its pools are unavailable until it is back (the "
                                   f"other groups' pools are served)")
        return route

    def retry(self, pool: str, err: Exception, reroutes: int, deadline: float, pause: float) -> tuple[float, bool]:
        """After a call at ``pool``'s owner failed with ``err``: ``(seconds to wait
        before the next try, whether the next try is re-routed)``, or ``err`` raised
        when there is none. May read the directory (it blocks)."""
        if isinstance(err, FailedPreconditionError):
            if err.reason != "WRONG_GROUP" or reroutes >= MAX_REROUTES:
                raise err
            self.refresh()
            return 0.0, True
        if isinstance(err, UnavailableError):
            if err.reason == "POOL_MOVING" and time.monotonic() + pause < deadline:
                return pause, False
            # a group gone down: the directory says so once its lease ends; until then, this error
            if err.reason or reroutes >= MAX_REROUTES or not self._group_gone(pool):
                raise err
            return 0.0, True
        raise err

    def _group_gone(self, pool: str) -> bool:
        """After a group did not answer: True when the directory now routes ``pool`` elsewhere
        (or says its group is down, which the next :meth:`route` raises)."""
        before = self.routes.get(pool)
        self.refresh()
        return self.routes.get(pool) != before

    def live_addresses(self) -> list[str]:
        """Every live group's address, read now."""
        self.refresh()
        return sorted(set(self.groups.values()))

    def placement(self, pool: str) -> tuple[str, str]:
        """``(group, address)`` a new ``pool`` goes to, read now (the live group with the fewest pools)."""
        from blockd.ha.directory import PoolEntry, place

        self.refresh()
        group = place(self.groups, [PoolEntry(p, g, 1) for p, (g, _) in self.routes.items()])
        if group is None:
            raise UnavailableError(f"cluster {self.cluster} has no live group to create pool {pool!r} on")
        return group, self.groups[group]

    def remember(self, pool: str, group: str, address: str) -> None:
        with self.lock:
            self.routes = {**self.routes, pool: (group, address)}

    def forget(self, pool: str) -> None:
        with self.lock:
            self.routes = {name: route for name, route in self.routes.items() if name != pool}

    def remember_worker(self, worker_id: str, pool: str) -> None:
        with self.lock:
            self.workers[worker_id] = pool

    def pool_of_worker(self, worker_id: str) -> str:
        pool = self.workers.get(worker_id)
        if pool is None:
            raise NotFoundError(f"worker {worker_id!r} did not register through this client: register it "
                                f"first (a heartbeat names no pool to route by)")
        return pool


def pools_by_address(table: RouteTable, pools: Sequence[str]) -> dict[str, list[str]]:
    """The named pools grouped by their owners' addresses (reading the directory on a miss)."""
    by_address: dict[str, list[str]] = {}
    for pool in pools:
        by_address.setdefault(table.route(pool)[1], []).append(pool)
    return by_address
