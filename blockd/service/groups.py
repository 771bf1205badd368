"""A daemon as one group of a cluster (``blockd serve --cluster NAME --group G
--cluster-etcd URL``): its membership and the gate that serves only its own pools.

:class:`GroupMember` keeps the group's key in the cluster's directory
(:mod:`blockd.ha.directory`) alive on an etcd lease (a replicated group,
``--etcd`` too: its leader's key and address, put when a replica starts to
lead, gone with its lease when it stops), and the set of pools the
directory gives this group (read when it joins, then changed only by this
daemon: a pool it creates is claimed in etcd first, a pool it deletes is
released after). :class:`PoolGate`, a server interceptor, looks at the pool a
call names:

* a pool this group owns: served, at the cost of a dict lookup;
* a pool another group owns (read from etcd on a miss): refused with
  FAILED_PRECONDITION, reason ``WRONG_GROUP``, naming the owner's group,
  address and epoch, so a caller routes there (CreatePool of such a name:
  ALREADY_EXISTS, reason ``EXISTS_ON_OTHER_GROUP``); a pool in no entry: the
  engine answers (NOT_FOUND); a step whose Allocate names another group's
  source pool: FAILED_PRECONDITION ``SOURCE_IN_OTHER_GROUP``
  (:mod:`blockd.service.sources`);
* CreatePool claims the name in etcd ("put if absent") before the engine
  builds the pool, and gives the claim back if the engine refuses;
  DeletePool releases the entry once the engine deleted the pool.

A refusal replaces the request (a :class:`~blockd.core.errors.BlockdError` in its place is what every
servicer wrapper of :mod:`blockd.rpc.errors` answers with the one error mapping), so it leaves exactly as
an engine refusal does, in band on a StepStream. ListPools and a LookupPrefix that names no pool answer
for this group's pools only. Without ``--cluster`` none of this is built or imported.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from blockd.auth.quotas import UNLIMITED, Quota
from blockd.core.errors import BlockdError, ExistsOnOtherGroup, Unavailable, WrongGroup, shown
from blockd.core.types import PoolConfig
from blockd.engine.tenancy import check_cluster_create, owner_of, with_owner
from blockd.ha.directory import Directory, GroupEntry, PoolEntry
from blockd.ha.etcd import EtcdClient, EtcdUnavailable
from blockd.ha.keys import BadValue, check_name
from blockd.rpc import convert
from blockd.service.sources import source_refusal
from blockd.v1 import blockd_pb2 as pb

log = logging.getLogger("blockd.groups")

_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
          (False, True): grpc.unary_stream_rpc_method_handler,
          (True, False): grpc.stream_unary_rpc_method_handler,
          (True, True): grpc.stream_stream_rpc_method_handler}


class DirectoryUnavailable(Unavailable):
    """etcd, which holds the cluster's directory, did not answer: retry."""

    reason = "DIRECTORY_UNAVAILABLE"


class GroupMember:
    """This daemon's place in the cluster: its lease, its key, the pools it owns.

    Directory reads and writes run under one lock (the etcd client is not
    thread-safe); the hot path reads only :attr:`owned`, a dict replaced or
    changed whole under that lock."""

    def __init__(self, etcd_endpoints: str, cluster: str, group: str, lease_ttl_s: int = 5,
                 replicated: bool = False) -> None:
        self.directory = Directory(EtcdClient(etcd_endpoints), cluster)
        self.group = check_name("group name", group)
        self.lease_ttl_s = lease_ttl_s
        #: a replica announces the group only while it leads (:meth:`announce`); a single daemon: from the start
        self._leading = not replicated
        self._announced = False
        self._wake = threading.Event()
        #: pool name -> epoch of the directory entry that gives it to this group
        self.owned: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._lease = 0
        self._entry: GroupEntry | None = None
        self._thread: threading.Thread | None = None

    # --- lifetime -----------------------------------------------------------------------------
    def join(self, address: str, local_pools: list[str]) -> None:
        """Take a lease, announce this group at ``address`` (a replica: once it
        leads) and learn its pools; a pool in the data dir that the directory
        has no entry for is claimed (a daemon that joins with pools it already
        had). Raises EtcdUnavailable / BadValue."""
        self._entry = GroupEntry(self.group, address)
        with self._lock:
            self._lease, _ = self.directory.etcd.grant(self.lease_ttl_s)
            entries = self.directory.pools()
            for name in local_pools:
                if name not in entries:
                    entries[name], _ = self.directory.claim(name, self.group)
            for name, entry in entries.items():
                if name in local_pools and entry.group != self.group:
                    log.error("pool %s is in the data dir but the directory gives it to group %s (epoch %d): "
                              "not served here", name, entry.group, entry.epoch)
            self._announce_now()
            self.owned = {name: e.epoch for name, e in entries.items() if e.group == self.group}
        self._thread = threading.Thread(target=self._keepalive, name="blockd-group-lease", daemon=True)
        self._thread.start()
        log.info("joined cluster %s as group %s at %s, owning %d pools", self.directory.cluster, self.group,
                 address, len(self.owned))

    def announce(self, leading: bool) -> None:
        """A replica's role changed (its election's callback: no etcd call here,
        the lease thread does it at once)."""
        self._leading = leading
        self._wake.set()

    def _announce_now(self) -> None:
        """Under the lock: put the group's key while leading; on stepping down, end
        the lease it is bound to (so a successor's key is never the one removed)."""
        if self._leading and not self._announced and self._entry is not None:
            self.directory.join(self._entry, self._lease)
            self._announced = True
            # a new leader of a replicated group: its pools as the directory says now
            self.owned = {name: e.epoch for name, e in self.directory.pools().items() if e.group == self.group}
        elif not self._leading and self._announced:
            self.directory.etcd.revoke(self._lease)
            self._announced = False
            self._lease, _ = self.directory.etcd.grant(self.lease_ttl_s)

    def _keepalive(self) -> None:
        """Renew the lease a few times per TTL (and announce a change of role at
        once); a lease etcd lost (a long pause) is granted again and the key put back."""
        while not self._stop.is_set():
            self._wake.wait(max(0.2, self.lease_ttl_s / 3))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self._lock:
                    if self.directory.etcd.keepalive(self._lease) <= 0:
                        log.warning("the group's etcd lease was lost; joining again")
                        self._lease, _ = self.directory.etcd.grant(self.lease_ttl_s)
                        self._announced = False
                    self._announce_now()
            except (EtcdUnavailable, BadValue) as err:
                log.warning("cannot renew the group's etcd lease or key: %s", err)

    def leave(self) -> None:
        """Stop renewing and revoke the lease: the group's key goes at once."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            try:
                if self._lease:
                    self.directory.etcd.revoke(self._lease, timeout_s=1.0)
            except EtcdUnavailable as err:
                log.warning("cannot revoke the group's lease (its key goes with its TTL): %s", err)
            self.directory.etcd.close()

    # --- the gate's slow path -----------------------------------------------------------------
    def refusal(self, pool: str) -> BlockdError | None:
        """Why this group must not serve ``pool`` (it is another group's, or etcd
        cannot say), or None: serve it (it is ours, or no group has it)."""
        try:
            with self._lock:
                entry = self.directory.pool(pool)
                if entry is None or entry.group == self.group:
                    if entry is not None:
                        self.owned = {**self.owned, pool: entry.epoch}
                    return None
                return self._elsewhere(entry, WrongGroup, "is served by")
        except (EtcdUnavailable, BadValue) as err:
            return DirectoryUnavailable(f"cannot read the cluster directory for pool {shown(pool)}: {err}")

    def _elsewhere(self, entry: PoolEntry, cls: type, says: str) -> BlockdError:
        """Under the lock: the refusal naming ``entry``'s group and its address."""
        group = self.directory.groups().get(entry.group)
        address = group.address if group is not None else ""
        state = f"at {address}" if address else "which is down now (no live daemon in the directory)"
        return cls(f"pool {shown(entry.pool)} {says} group {entry.group} {state} (epoch {entry.epoch}), not "
                   f"group {self.group}: call that group (an SDK given the cluster target routes by pool)",
                   group=entry.group, address=address, epoch=entry.epoch)

    def claim(self, pool: str, config: PoolConfig | None = None,
              quota: Quota | None = None) -> tuple[PoolEntry | None, BlockdError | None]:
        """Before CreatePool: ``(the entry this call made, or None; the refusal, or None)``.
        ``config`` (its tenant filled in): what the entry records of the pool's size;
        ``quota``: its tenant's, checked over every group's pools first."""
        tenant = owner_of(config) if config is not None else ""
        sizes = (config.num_blocks, config.num_blocks * config.bytes_per_block) if config is not None else (0, 0)
        try:
            with self._lock:
                admit = None
                if config is not None and quota is not None and quota != UNLIMITED:
                    def admit(held: list[PoolEntry]) -> None:  # raises the refusal; checked against claims racing it
                        check_cluster_create(config, quota, [(e.num_blocks, e.num_bytes) for e in held])
                try:
                    entry, made = self.directory.claim(pool, self.group, tenant=tenant, num_blocks=sizes[0],
                                                       num_bytes=sizes[1], admit=admit)
                except BlockdError as err:
                    return None, err
                if entry.group != self.group:
                    return None, self._elsewhere(entry, ExistsOnOtherGroup, "already exists on")
                self.owned = {**self.owned, pool: entry.epoch}
                return (entry if made else None), None
        except (EtcdUnavailable, BadValue) as err:
            return None, DirectoryUnavailable(f"cannot claim pool {shown(pool)} in the cluster directory "
                                              f"(nothing was created): {err}")

    # --- moves (blockd.service.moves) -----------------------------------------------------------
    def entry(self, pool: str) -> PoolEntry | None:
        """``pool``'s directory entry now (EtcdUnavailable / BadValue)."""
        with self._lock:
            return self.directory.pool(pool)

    def live_groups(self) -> dict[str, GroupEntry]:
        with self._lock:
            return self.directory.groups()

    def elsewhere(self, entry: PoolEntry) -> BlockdError:
        """WRONG_GROUP naming ``entry``'s group."""
        with self._lock:
            return self._elsewhere(entry, WrongGroup, "is served by")

    def hand_over(self, entry: PoolEntry, group: str) -> PoolEntry | None:
        """Switch ``entry`` to ``group`` under the next epoch if it is unchanged
        (None if not), and stop owning the pool."""
        with self._lock:
            moved = self.directory.switch(entry, group)
            if moved is not None:
                self.owned = {name: epoch for name, epoch in self.owned.items() if name != entry.pool}
            return moved

    def release(self, pool: str, entry: PoolEntry | None = None) -> None:
        """After a DeletePool, or a CreatePool the engine refused (``entry``: the claim it made)."""
        try:
            with self._lock:
                self.owned = {name: epoch for name, epoch in self.owned.items() if name != pool}
                found = entry or self.directory.pool(pool)
                if found is not None and found.group == self.group and not self.directory.release(found):
                    log.warning("pool %s's directory entry changed while it was released; left as is", pool)
        except (EtcdUnavailable, BadValue) as err:
            log.error("pool %s is gone here but its directory entry could not be removed: %s; a CreatePool "
                      "of that name on this group claims it again", pool, err)


def _pools_named(method: str, request) -> list[str]:
    """The pools a request names (empty: none, or a request that did not parse)."""
    if isinstance(request, BlockdError):
        return []
    if method == "RegisterWorker":
        return [request.info.pool] if request.info.pool else []
    if method == "LookupPrefix":
        return list(request.pools)
    pool = getattr(request, "pool", "")
    return [pool] if isinstance(pool, str) and pool else []


class PoolMoving(Unavailable):
    """The pool is being handed to another group: retry shortly (the SDK does)."""

    reason = "POOL_MOVING"


class PoolGate(grpc.ServerInterceptor):
    """Serve only this group's pools (module docstring); count the calls under
    way per pool, so a move can hold new ones back and wait for those to end
    (:meth:`freeze`)."""

    def __init__(self, member: GroupMember, quotas: Callable[[str], Quota] | None = None) -> None:
        self.member = member
        self.quotas = quotas  # each tenant's quota (the identities file's), or None: no quotas
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._changed = threading.Condition(threading.Lock())
        self._busy: dict[str, int] = {}  # pool -> calls admitted and not yet answered
        #: pools being moved away: new calls are refused with POOL_MOVING
        self._frozen: set[str] = set()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or not full.startswith(("/blockd.v1.PoolService/", "/blockd.v1.BlockService/",
                                                   "/blockd.v1.WorkerService/")):
            return handler
        cached = self._wrapped.get(full)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, full.rsplit("/", 1)[-1])
        self._wrapped[full] = (handler, wrapped)
        return wrapped

    # --- admission ----------------------------------------------------------------------------
    def admit(self, method: str, request) -> tuple[Any, list[str]]:
        """``(request or the refusal to answer it with, the pools it holds busy)``;
        the caller hands those pools to :meth:`done` once answered."""
        pools = _pools_named(method, request)
        # a source pool another group serves (checked once the call's own pool is ours: else WRONG_GROUP)
        if method in ("Step", "StepStream") and pools and pools[0] in self.member.owned:
            refusal = source_refusal(self.member, request)
            if refusal is not None:
                return refusal, []
        for _ in range(2):  # a pool learnt from the directory is admitted on the second pass
            with self._changed:
                owned = self.member.owned
                missing = ""
                for pool in pools:
                    if pool in self._frozen:
                        return PoolMoving(f"pool {shown(pool)} is being moved to another group; retry in a "
                                          f"moment (the SDK does, and then calls the new owner)"), []
                    if pool not in owned:
                        missing = pool
                        break
                if not missing:
                    for pool in pools:
                        self._busy[pool] = self._busy.get(pool, 0) + 1
                    return request, pools
            refusal = self.member.refusal(missing)  # reads etcd: outside the lock
            if refusal is not None:
                return refusal, []
            if missing not in self.member.owned:
                return request, []  # no group has it: the engine answers (NOT_FOUND)
        return request, []

    def done(self, pools: list[str]) -> None:
        if not pools:
            return
        with self._changed:
            for pool in pools:
                left = self._busy.get(pool, 1) - 1
                if left:
                    self._busy[pool] = left
                else:
                    self._busy.pop(pool, None)
            self._changed.notify_all()

    def freeze(self, pool: str, timeout_s: float) -> bool:
        """Refuse new calls for ``pool`` and wait for those under way; False (and
        unfrozen again) if they did not end within ``timeout_s``."""
        with self._changed:
            self._frozen.add(pool)
            if self._changed.wait_for(lambda: not self._busy.get(pool), timeout_s):
                return True
            self._frozen.discard(pool)
            return False

    def thaw(self, pool: str) -> None:
        with self._changed:
            self._frozen.discard(pool)

    # --- the special calls --------------------------------------------------------------------
    def _create(self, behavior: Callable, request, context):
        name = request.config.name if not isinstance(request, BlockdError) else ""
        if not name:
            return behavior(request, context)  # the servicer says what is wrong with it
        try:
            config: PoolConfig | None = with_owner(convert.pool_config_from_proto(request.config))
        except BlockdError:
            config = None  # the engine refuses it, saying why
        quota = self.quotas(owner_of(config)) if config is not None and self.quotas is not None else None
        made, refusal = self.member.claim(name, config, quota)
        if refusal is not None:
            return behavior(refusal, context)
        try:
            return behavior(request, context)
        except BaseException:  # the engine refused (gRPC's abort raises): the claim goes back
            if made is not None:
                self.member.release(name, made)
            raise

    def _delete(self, behavior: Callable, request, context):
        checked, busy = self.admit("DeletePool", request)
        try:
            response = behavior(checked, context)  # a refusal raises (abort): nothing to release
        finally:
            self.done(busy)
        self.member.release(request.pool)
        return response

    def _list(self, behavior: Callable, request, context):
        response = behavior(request, context)
        owned = self.member.owned
        return pb.ListPoolsResponse(pools=[stats for stats in response.pools if stats.name in owned])

    def _lookup(self, behavior: Callable, request, context):
        """LookupPrefix: named pools are checked as any call's; with none named, the
        answer covers this group's pools only (not a copy a move left behind)."""
        checked, busy = self.admit("LookupPrefix", request)
        try:
            response = behavior(checked, context)
        finally:
            self.done(busy)
        owned = self.member.owned
        return pb.LookupPrefixResponse(
            num_cached_tokens={p: n for p, n in response.num_cached_tokens.items() if p in owned},
            num_host_tokens={p: n for p, n in response.num_host_tokens.items() if p in owned})

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        kind = (handler.request_streaming, handler.response_streaming)
        behavior = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
                    (True, False): handler.stream_unary, (True, True): handler.stream_stream}[kind]
        assert behavior is not None  # gRPC sets the one matching the handler's kind
        special = {"CreatePool": self._create, "DeletePool": self._delete, "ListPools": self._list,
                   "LookupPrefix": self._lookup}.get(method)
        admit, done = self.admit, self.done

        if special is not None:
            def serve(request, context):
                return special(behavior, request, context)
        elif kind[0]:
            def serve(requests, context):
                # one answer per request (StepStream): a pool is busy from its request's
                # admission until its answer is made, not until the next request comes, so a
                # stream idle between steps never holds a move's drain up
                held: list[list[str]] = [[]]

                def release() -> None:
                    busy, held[0] = held[0], []
                    done(busy)

                def each() -> Iterator:
                    for request in requests:
                        release()
                        checked, held[0] = admit(method, request)
                        yield checked

                try:
                    for answer in behavior(each(), context):
                        release()
                        yield answer
                finally:
                    release()
        elif kind[1]:
            def serve(request, context):  # Watch, Events: long-lived reads, checked when they open
                checked, busy = admit(method, request)
                done(busy)
                return behavior(checked, context)
        else:
            def serve(request, context):
                checked, busy = admit(method, request)
                try:
                    return behavior(checked, context)
                finally:
                    done(busy)

        return _KINDS[kind](serve, request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
