"""``GroupService``: moving a pool from this daemon group to another (``blockd serve --cluster``).

The move, asked of the pool's owner (:meth:`GroupServicer.MovePool`):

1. check the request against the directory (the pool is this group's, the
   target group is live and another one), changing nothing if not;
2. **drain**: the gate (:class:`~blockd.service.groups.PoolGate`) refuses new
   calls for the pool (UNAVAILABLE, ``POOL_MOVING``: the SDK retries) and
   waits for those under way, so the state read next is every answered step;
3. **hand over** the pool's exact state (:class:`blockd.engine.pools.PoolMoves`) to the
   target's :meth:`GroupServicer.ImportPool`, which logs it under the epoch
   the entry will carry next;
4. **switch** the directory entry to the target under ``epoch + 1``, a
   compare-and-swap on the entry as read in step 1: a concurrent move or
   delete makes it fail, and the pool stays here, serving again;
5. drop the local copy: calls from then on are refused with ``WRONG_GROUP``
   naming the new owner (read from the directory), Watch streams end and
   their workers reconnect there. The pool keeps its incarnation and version
   at the new owner, so a scheduler's next step continues.

A failure before step 4 leaves the pool here and serving; an import the
target made for a move that then failed is never served there (the
directory does not name it) and the next import replaces it.

The pool's request ids travel with its state (the answers kept for its
incarnation): a step resent to the new owner under the id of one the old
owner applied is answered, not applied again (:class:`client.groups.ClusterClient`
gives each change one id for all its resends).
"""

from __future__ import annotations

import json
import logging

import grpc

from blockd.auth.channels import open_channel
from blockd.auth.config import TlsConfig
from blockd.core.errors import NotFound, Unavailable, WrongState, shown
from blockd.engine.machine import Engine
from blockd.ha.etcd import EtcdUnavailable
from blockd.ha.keys import BadValue, check_name
from blockd.rpc.convert import require_id
from blockd.rpc.errors import BadField, unary
from blockd.service.groups import DirectoryUnavailable, GroupMember, PoolGate
from blockd.v1 import groups_pb2 as gpb
from blockd.v1 import groups_pb2_grpc as gpb_grpc

log = logging.getLogger("blockd.groups")

#: how long a move waits for the pool's calls under way
DRAIN_TIMEOUT_S = 10.0
#: how long the target may take to import the pool
IMPORT_TIMEOUT_S = 60.0


class GroupServicer(gpb_grpc.GroupServiceServicer):
    """MovePool and ImportPool (module docstring). ``peer``: the TLS settings
    and token this daemon calls another group with (None, None: plain text)."""

    def __init__(self, engine: Engine, gate: PoolGate, member: GroupMember,
                 peer: tuple[TlsConfig | None, str | None] = (None, None)) -> None:
        self._engine, self._gate, self._member = engine, gate, member
        self._peer = peer

    def _directory(self, what: str):
        return DirectoryUnavailable(f"cannot read the cluster directory to {what}; nothing changed")

    @unary
    def MovePool(self, request: gpb.MovePoolRequest, context) -> gpb.MovePoolResponse:
        pool = require_id(request.pool, "pool")
        to = require_id(request.to_group, "to_group")
        try:
            check_name("group name", to)
        except ValueError as err:
            raise BadField("to_group", str(err)) from None
        me = self._member.group
        if to == me:
            raise BadField("to_group", f"is {me}, the group asked to move the pool away")
        try:
            entry, groups = self._member.entry(pool), self._member.live_groups()
        except (EtcdUnavailable, BadValue):
            raise self._directory(f"move pool {shown(pool)}") from None
        if entry is None:
            raise NotFound(f"pool {shown(pool)} is in no group of cluster {self._member.directory.cluster}")
        if entry.group != me:
            raise self._member.elsewhere(entry)
        if to not in groups:
            raise NotFound(f"group {to} has no live daemon in cluster {self._member.directory.cluster} (live: "
                           f"{', '.join(sorted(groups)) or 'none'}); nothing moved")
        self._engine.get_pool(pool)  # a replica that does not lead refuses here (NOT_LEADER), before anything
        if not self._gate.freeze(pool, DRAIN_TIMEOUT_S):
            raise Unavailable(f"the calls under way on pool {shown(pool)} did not end within {DRAIN_TIMEOUT_S:g} "
                              f"s; nothing moved, the pool serves here")
        try:
            state = self._engine.export_pool(pool)
            version = self._engine.get_pool(pool).version
            self._import_at(groups[to].address, to, pool, state, entry.epoch + 1)
            try:
                moved = self._member.hand_over(entry, to)
            except (EtcdUnavailable, BadValue):
                raise self._directory(f"switch pool {shown(pool)} to group {to}") from None
            if moved is None:
                raise WrongState(f"pool {shown(pool)}'s directory entry changed during the move (another move or "
                                 f"a delete); nothing moved, the pool serves here")
        except BaseException:
            self._gate.thaw(pool)
            raise
        try:
            self._engine.delete_pool(pool)  # ends its Watch streams: the workers reconnect to the new owner
        finally:
            self._gate.thaw(pool)
        log.info("pool %s moved to group %s at version %d (epoch %d)", pool, to, version, moved.epoch)
        return gpb.MovePoolResponse(group=to, epoch=moved.epoch, version=version)

    def _import_at(self, address: str, group: str, pool: str, state: dict, epoch: int) -> None:
        channel = open_channel(address, *self._peer)
        try:
            request = gpb.ImportPoolRequest(pool=pool, state=json.dumps(state).encode(), epoch=epoch)
            gpb_grpc.GroupServiceStub(channel).ImportPool(request, timeout=IMPORT_TIMEOUT_S)
        except grpc.RpcError as err:
            what = f"group {group} at {address} did not take pool {shown(pool)} ({err.code().name}: {err.details()})"
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"{what}; nothing moved, the pool serves here") from None
            raise WrongState(f"{what}; nothing moved, the pool serves here") from None
        finally:
            channel.close()

    @unary
    def ImportPool(self, request: gpb.ImportPoolRequest, context) -> gpb.ImportPoolResponse:
        pool = require_id(request.pool, "pool")
        if request.epoch < 2:
            raise BadField("epoch", f"is {request.epoch}; a moved pool's entry has epoch 2 or more")
        try:
            state = json.loads(request.state)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise BadField("state", f"is not JSON: {err}") from None
        try:
            entry = self._member.entry(pool)
        except (EtcdUnavailable, BadValue):
            raise self._directory(f"import pool {shown(pool)}") from None
        if entry is None:
            raise NotFound(f"pool {shown(pool)} is in no group's directory entry: only a pool of the cluster "
                           f"can be handed over")
        if entry.group == self._member.group:
            raise WrongState(f"pool {shown(pool)} already belongs to group {entry.group}")
        if request.epoch != entry.epoch + 1:
            raise WrongState(f"epoch {request.epoch} does not follow the directory's epoch {entry.epoch} of pool "
                             f"{shown(pool)}: a stale or concurrent move; nothing imported")
        if any(stats.name == pool for stats in self._engine.list_pools(local=True)):
            # what an earlier move that failed after its import left: never served (the directory did not name us)
            self._engine.delete_pool(pool)
        self._engine.import_pool(pool, state)
        return gpb.ImportPoolResponse()
