"""What each role may do, and which permission each RPC needs.

Permissions are coarse verbs, each covering RPCs that reveal or change the
same kind of thing:

=================  ===========================================================
permission         RPCs
=================  ===========================================================
``pool.admin``     CreatePool, DeletePool, ResetPrefixCache, GroupService.MovePool
``pool.read``      GetPool, ListPools, ListPins, ListWorkers, GetReplicaStatus, GetHashSpec (sizes, versions,
                   the hash spec and a pool's block size and tenant)
``tables.read``    GetTables, GetSequence, Watch (block tables)
``cache.read``     Events, LookupPrefix (block hashes and token ids: prompts)
``step``           Step, StepStream, GetStepLane (allocate/append/commit/fork/free), PinPrefix, UnpinPrefix,
                   SetPrefixPriority (what is cached, and kept)
``worker.join``    RegisterWorker, Heartbeat
``kv.stats``       KVShardService.GetWorkerStats
``kv.compute``     KVShardService.WriteKV, Attention, ModelStep, FetchBlocks
``kv.read``        KVShardService.ReadBlocks (another pool's worker fetching blocks: its tenant's KV)
``replicate``      ReplicationService.ReplicateLog, AckLog, StreamAcks, GroupService.ImportPool (admin only:
                   one daemon handing another its log or a pool)
``authenticated``  server reflection (any valid identity, no role needed)
``open``           grpc.health.v1.Health (no credentials at all)
=================  ===========================================================

Roles (:data:`ROLE_PERMISSIONS`): ``admin`` has every permission on every
tenant; ``scheduler`` steps and reads its tenant's pools and drives its
tenant's workers; ``worker`` joins (register, heartbeat), reads pool
metadata, follows tables (Watch) of its tenant's pools and reads blocks of
its tenant's other pools' workers (a cross-pool fetch), and nothing of the
prefix cache; ``reader`` reads stats, tables and events of its tenant. Tenant
scoping is not decided here: the interceptor checks the role, the engine
checks a pool's owner (:func:`blockd.auth.identity.require_tenant`).

Health is open because probes (kubelet, compose healthchecks, load balancers)
carry no token, and it reveals only SERVING / NOT_SERVING of service names
that are public anyway; under mTLS the handshake still demands a client
certificate for it. Reflection needs an identity: it reveals nothing a
published ``.proto`` does not, but nobody unknown needs it.

:data:`METHOD_PERMISSIONS` has an entry for every RPC of every service
blockd and the worker serve; :func:`required_permission` refuses to guess for
a method without one (a test walks the service descriptors, so a new RPC
without an entry fails CI rather than being served open). Imports the
standard library only.
"""

from __future__ import annotations

from types import MappingProxyType

OPEN = "open"
AUTHENTICATED = "authenticated"
POOL_ADMIN = "pool.admin"
POOL_READ = "pool.read"
TABLES_READ = "tables.read"
CACHE_READ = "cache.read"
STEP = "step"
WORKER_JOIN = "worker.join"
KV_STATS = "kv.stats"
KV_COMPUTE = "kv.compute"
KV_READ = "kv.read"
REPLICATE = "replicate"

PERMISSIONS = (POOL_ADMIN, POOL_READ, TABLES_READ, CACHE_READ, STEP, WORKER_JOIN, KV_STATS, KV_COMPUTE, KV_READ,
               REPLICATE)

ROLE_PERMISSIONS = MappingProxyType({
    "admin": frozenset(PERMISSIONS),
    "scheduler": frozenset({POOL_READ, TABLES_READ, CACHE_READ, STEP, KV_STATS, KV_COMPUTE}),
    "worker": frozenset({POOL_READ, TABLES_READ, WORKER_JOIN, KV_READ}),
    "reader": frozenset({POOL_READ, TABLES_READ, CACHE_READ, KV_STATS}),
})

_BLOCKD = {
    "blockd.v1.PoolService": {
        "CreatePool": POOL_ADMIN, "GetPool": POOL_READ, "ListPools": POOL_READ, "DeletePool": POOL_ADMIN,
        "ResetPrefixCache": POOL_ADMIN, "PinPrefix": STEP, "UnpinPrefix": STEP, "ListPins": POOL_READ,
        "SetPrefixPriority": STEP,
    },
    "blockd.v1.BlockService": {
        "Step": STEP, "StepStream": STEP, "GetTables": TABLES_READ, "GetSequence": TABLES_READ, "Watch": TABLES_READ,
        "Events": CACHE_READ, "LookupPrefix": CACHE_READ, "GetHashSpec": POOL_READ, "GetStepLane": STEP,
    },
    "blockd.v1.WorkerService": {
        "RegisterWorker": WORKER_JOIN, "Heartbeat": WORKER_JOIN, "ListWorkers": POOL_READ,
    },
    "blockd.v1.KVShardService": {
        "GetWorkerStats": KV_STATS, "WriteKV": KV_COMPUTE, "Attention": KV_COMPUTE, "ModelStep": KV_COMPUTE,
        "FetchBlocks": KV_COMPUTE, "ReadBlocks": KV_READ,
    },
    # replicas' log stream (blockd serve --etcd): a follower's peer credentials
    # (--peer-tls-*, --peer-token-file) must name an admin
    "blockd.v1.ReplicationService": {"ReplicateLog": REPLICATE, "AckLog": REPLICATE,
                                     "StreamAcks": REPLICATE, "GetReplicaStatus": POOL_READ},
    # a pool's move between a cluster's groups (blockd serve --cluster): ImportPool is daemon to daemon
    "blockd.v1.GroupService": {"MovePool": POOL_ADMIN, "ImportPool": REPLICATE},
    "grpc.health.v1.Health": {"Check": OPEN, "Watch": OPEN, "List": OPEN},
    "grpc.reflection.v1alpha.ServerReflection": {"ServerReflectionInfo": AUTHENTICATED},
}

#: ``/package.Service/Method`` (gRPC's method path) -> the permission it needs
METHOD_PERMISSIONS = MappingProxyType({
    f"/{service}/{method}": permission
    for service, methods in _BLOCKD.items() for method, permission in methods.items()
})

#: admin actions: every call of these is audited, allowed or not
ADMIN_PERMISSIONS = frozenset({POOL_ADMIN})


class UnknownMethod(LookupError):
    """A method with no entry in :data:`METHOD_PERMISSIONS`: refused, never guessed."""


def required_permission(method: str) -> str:
    """The permission ``method`` (``/pkg.Service/Method``) needs."""
    try:
        return METHOD_PERMISSIONS[method]
    except KeyError:
        raise UnknownMethod(f"no permission is defined for {method}") from None


def permissions_of(roles) -> frozenset[str]:
    """Everything a caller with ``roles`` may do (unknown roles grant nothing)."""
    granted: set[str] = set()
    for role in roles:
        granted |= ROLE_PERMISSIONS.get(role, frozenset())
    return frozenset(granted)


def allows(roles, permission: str) -> bool:
    if permission in (OPEN, AUTHENTICATED):
        return True
    return any(permission in ROLE_PERMISSIONS.get(role, ()) for role in roles)
