"""Finding the leader of a replicated blockd group (``blockd serve --etcd``, docs/ha.md).

A client's target may name several replicas, comma-separated
(``"10.0.0.5:50051,10.0.0.6:50051,10.0.0.7:50051"``). :class:`Targets`
holds them and the one in use, and decides, for each failed attempt of a
call, whether and where to try again:

* FAILED_PRECONDITION with reason ``NOT_LEADER``: a follower answered; its
  ErrorInfo names the leader's address: use it, at once;
* UNAVAILABLE with reason ``NO_LEADER`` (an election is under way) or
  ``NOT_REPLICATED`` (the step is logged but no follower confirmed it yet):
  the same replica again, after a backoff;
* UNAVAILABLE otherwise (the replica is down) with several targets: the next
  one, after a backoff.

A target may instead name the group in etcd, ``etcd://HOST:PORT[,HOST:PORT]/GROUP``
(:func:`parse_etcd_target`): the leader's address is read from etcd's leader
key (:func:`blockd.ha.group.read_leader`, the ``ha`` extra) when the client
is made and again whenever the replica it calls is down or refuses without
naming a leader, so replicas need no stable addresses.

The caller resends the *same* request, so its request id is the same: a step
the old leader logged is answered from the replicated request table, never
applied twice (docs/ha.md 2.7). A single plain target behaves as before:
nothing but ``NOT_LEADER`` and the two reasons above (which only a
replicated daemon sends) is retried here.

:class:`ReplicaStubs` keeps one channel and its stubs per replica address
for a client, sync or asyncio alike, and turns a failed stub method into the
same method at the replica to try next (:meth:`ReplicaStubs.next_call`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from blockd.v1 import blockd_pb2_grpc as pb_grpc
from blockd.v1 import replication_pb2_grpc as rpb_grpc
from client.errors import BlockdClientError, FailedPreconditionError, InvalidArgumentError, UnavailableError

C = TypeVar("C")

#: first and longest pause between attempts against the same group
BACKOFF_S = (0.05, 0.5)
RETRY_REASONS = ("NO_LEADER", "NOT_REPLICATED")


ETCD_SCHEME = "etcd://"
ETCD_FORM = "etcd://HOST:PORT[,HOST:PORT...]/GROUP"


def parse_etcd_target(target: str) -> tuple[list[str], str] | None:
    """``(etcd endpoints as http://HOST:PORT, group)`` of an ``etcd://HOST:PORT[,...]/GROUP``
    target; None for a list of replica addresses; :class:`InvalidArgumentError`
    (a ``ValueError``) naming what is wrong for a malformed one."""
    return parse_etcd_named_target(target, ETCD_SCHEME, "group", f"an etcd target is {ETCD_FORM}")


def parse_etcd_named_target(target: str, scheme: str, noun: str, form: str) -> tuple[list[str], str] | None:
    """``(etcd endpoints as http://HOST:PORT, NAME)`` of a ``SCHEME HOST:PORT[,...]/NAME`` target
    (an HA group's ``etcd://``, a cluster's ``cluster://``); None when it has another scheme;
    :class:`InvalidArgumentError` naming what is wrong (``noun``: what NAME is; ``form``: the
    sentence that ends the message)."""
    if not target.startswith(scheme):
        return None
    hosts, _, name = target[len(scheme):].partition("/")
    endpoints = [f"http://{h.strip()}" for h in hosts.split(",") if h.strip()]
    problem = ("names no etcd endpoint" if not endpoints else f"names no {noun}" if not name
               else f"has a '/' in its {noun} {name!r}" if "/" in name else "")
    if problem:
        raise InvalidArgumentError(f"target {target!r} {problem}: {form}")
    return endpoints, name


def etcd_leader(endpoints: list[str], group: str, timeout_s: float = 2.0) -> str:
    """The address etcd's leader key names now; UnavailableError when there is none or etcd does not answer."""
    try:
        from blockd.ha.etcd import EtcdUnavailable
        from blockd.ha.group import read_leader
    except ImportError as err:
        raise ValueError(f"an etcd:// target needs the ha extra (pip install 'blockd[ha]'): {err}") from None
    where = ",".join(endpoints)
    try:
        leader = read_leader(endpoints, group, timeout_s)
    except EtcdUnavailable as err:
        raise UnavailableError(f"cannot find the leader of group {group}: etcd at {where} does not answer "
                               f"({err})") from None
    if leader is None:
        raise UnavailableError(f"group {group} has no leader in etcd at {where} now (an election may be under "
                               f"way): retry shortly")
    return leader.address


class Targets:
    """The replicas a client may call and the one it calls now; thread-safe."""

    def __init__(self, target: str) -> None:
        self._lock = threading.Lock()
        self._etcd = parse_etcd_target(target.strip())
        if self._etcd is not None:
            self.all = [etcd_leader(*self._etcd)]
        else:
            self.all = [t.strip() for t in target.split(",") if t.strip()]
        if not self.all:
            raise InvalidArgumentError(f"target {target!r} names no address: give HOST:PORT[,HOST:PORT...] "
                                       f"or {ETCD_FORM}")
        self.current = self.all[0]

    @property
    def reads_etcd(self) -> bool:
        """Leader look-ups read etcd (blocking): see :meth:`ReplicaStubs.next_target`."""
        return self._etcd is not None

    def next_attempt(self, err: BlockdClientError, tried_on: str, attempt: int) -> tuple[str, float] | None:
        """``(address, pause in seconds)`` for the next attempt after ``err``
        (the ``attempt``-th failure, from 0, against ``tried_on``), or None:
        give up and raise it."""
        pause = min(BACKOFF_S[0] * 2 ** attempt, BACKOFF_S[1])
        if isinstance(err, FailedPreconditionError) and err.reason == "NOT_LEADER":
            leader = err.metadata.get("leader_address", "")
            if leader and leader != tried_on:
                return self._use(leader), 0.0
            return self._from_etcd(tried_on, pause)
        if not isinstance(err, UnavailableError):
            return None
        if err.reason in RETRY_REASONS:
            return tried_on, pause
        if self._etcd is not None:
            return self._from_etcd(tried_on, pause)
        if len(self.all) < 2:
            return None
        with self._lock:
            if self.current == tried_on:  # another thread may have moved on already
                i = self.all.index(tried_on) if tried_on in self.all else -1
                self.current = self.all[(i + 1) % len(self.all)]
            return self.current, pause

    def _from_etcd(self, tried_on: str, pause: float) -> tuple[str, float] | None:
        """The leader etcd names now (the same replica again while etcd names it or none:
        an election takes a lease TTL); None without an etcd target."""
        if self._etcd is None:
            return None
        try:
            return self._use(etcd_leader(*self._etcd)), pause
        except UnavailableError:
            return tried_on, pause

    def _use(self, address: str) -> str:
        with self._lock:
            if address not in self.all:
                self.all.append(address)
            self.current = address
            return address


class ReplicaStubs(Generic[C]):
    """The channel (made by ``dial(address)``) and pool, block, worker and
    replication stubs of each replica a client has called; thread-safe. Stub
    methods are looked up at call time through :attr:`pools`, :attr:`blocks`,
    :attr:`workers` and :attr:`replication`, so a call goes to the replica
    :attr:`targets` names now."""

    def __init__(self, target: str, dial: Callable[[str], C]) -> None:
        self.targets = Targets(target)
        self._dial = dial
        self._lock = threading.Lock()
        # the stubs are sync or asyncio ones, as the channel is
        self._stubs: dict[str, tuple[C, Any, Any, Any, Any]] = {}
        self.at(self.targets.current)  # bad TLS settings or a token in plain text fail here, not at a call

    def at(self, address: str) -> tuple[C, Any, Any, Any, Any]:
        with self._lock:
            found = self._stubs.get(address)
            if found is None:
                channel: Any = self._dial(address)
                found = self._stubs[address] = (channel, pb_grpc.PoolServiceStub(channel),
                                                pb_grpc.BlockServiceStub(channel), pb_grpc.WorkerServiceStub(channel),
                                                rpb_grpc.ReplicationServiceStub(channel))
            return found

    @property
    def channel(self) -> C:
        """The channel to the replica calls go to now."""
        return self.at(self.targets.current)[0]

    @property
    def pools(self) -> Any:
        return self.at(self.targets.current)[1]

    @property
    def blocks(self) -> Any:
        return self.at(self.targets.current)[2]

    @property
    def workers(self) -> Any:
        return self.at(self.targets.current)[3]

    @property
    def replication(self) -> Any:
        return self.at(self.targets.current)[4]

    def channels(self) -> list[C]:
        with self._lock:
            return [channel for channel, *_ in self._stubs.values()]

    def next_call(self, method: Callable[..., Any], err: BlockdClientError,
                  attempt: int) -> tuple[Callable[..., Any], float] | None:
        """After ``method`` failed with ``err`` (the ``attempt``-th failure, from 0):
        ``(the same method at the replica to try next, pause in seconds)``, or
        None: give up. Either way :attr:`targets` now names where the next call goes."""
        return self.method_at(self.next_target(method, err, attempt))

    def next_target(self, method: Callable[..., Any], err: BlockdClientError,
                    attempt: int) -> tuple[str, int, str, float] | None:
        """:meth:`next_call`'s choice, ``(address, stub index, method name, pause)``,
        without dialing: with an ``etcd://`` target it may read etcd (blocking,
        up to 2 s), so an asyncio caller runs it off its event loop and dials
        on it (:meth:`method_at`)."""
        where = self._locate(method)
        if where is None:
            return None
        address, index, name = where
        step = self.targets.next_attempt(err, address, attempt)
        if step is None:
            return None
        return step[0], index, name, step[1]

    def method_at(self, target: tuple[str, int, str, float] | None) -> tuple[Callable[..., Any], float] | None:
        """``(the stub method, pause)`` for a :meth:`next_target` answer (None: None)."""
        if target is None:
            return None
        address, index, name, pause = target
        return getattr(self.at(address)[index], name), pause

    def _locate(self, method: Callable[..., Any]) -> tuple[str, int, str] | None:
        """``(address, stub index, method name)`` of a stub method made here."""
        with self._lock:
            for address, stubs in self._stubs.items():
                for index, stub in enumerate(stubs[1:], 1):
                    name = next((n for n, v in vars(stub).items() if v is method), None)
                    if name is not None:
                        return address, index, name
        return None
