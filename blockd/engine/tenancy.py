"""Which tenant owns each pool, what its callers may see, and its quotas.

Every pool belongs to one tenant (``PoolConfig.tenant``, logged with the
pool's create record and kept in snapshots). :class:`Tenancy` is the
engine's part of multi-tenancy, run under the engine's lock:

* **ownership**: a pool created without a tenant belongs to its creator's
  tenant (:func:`blockd.auth.identity.current_identity`), or to
  :data:`~blockd.core.hashing.DEFAULT_TENANT` when blockd authenticates
  nobody; only an admin may name another tenant. Records and snapshots
  written before tenants existed read as the default tenant;
* **isolation**: every call naming a pool checks the caller may touch the
  pool's tenant (PERMISSION_DENIED otherwise, without naming the owner);
  listings filter to the caller's tenant (an admin sees all). The allocator
  folds the tenant into every block hash (:func:`blockd.core.hashing.tenant_digest`),
  so equal prompts of two tenants never share, hit or reveal a cached block;
* **quotas** (:mod:`blockd.auth.quotas`): pools, blocks and bytes checked
  before a pool is built (a CreatePool far over quota costs no memory);
  sequences, ops and tokens per step, and the step rate checked before a
  step runs; pinned blocks (distinct blocks its pins hold, in all its pools)
  checked before a pin is made. A refusal is :class:`~blockd.core.errors.QuotaExceeded` and
  changes nothing. An idempotent retry answered from the request table is
  not checked again (it changes nothing either).

Imports the core and :mod:`blockd.auth`'s standard-library modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

from blockd.auth.identity import AccessDenied, current_identity, require_tenant, visible_to_caller
from blockd.auth.quotas import UNLIMITED, Quota
from blockd.core.errors import QuotaExceeded, shown
from blockd.core.hashing import DEFAULT_TENANT
from blockd.core.types import Allocate, Append, DecodeAppend, Fork, Free, Op, PoolConfig

#: the quota of each tenant, as the daemon's identities file says it now
QuotaSource = Callable[[str], Quota]


def owner_of(config: PoolConfig) -> str:
    """The tenant a pool belongs to ("" in a config written before tenants: the default)."""
    return config.tenant or DEFAULT_TENANT


def visible(config: PoolConfig) -> bool:
    """Whether the current caller may see a pool (listings filter with it)."""
    return visible_to_caller(owner_of(config))


def check_access(config: PoolConfig) -> None:
    """Refuse (PERMISSION_DENIED) a caller of another tenant than the pool's."""
    require_tenant(owner_of(config), f"pool {shown(config.name)}")


def with_owner(config: PoolConfig) -> PoolConfig:
    """``config`` with its tenant filled in for a CreatePool (module docstring)."""
    identity = current_identity()
    tenant = config.tenant
    if not tenant:
        tenant = identity.tenant if identity is not None else DEFAULT_TENANT
    elif identity is not None and not identity.may_access_tenant(tenant):
        raise AccessDenied(f"{identity.name!r} of tenant {identity.tenant!r} may create pools only for its own "
                           f"tenant: leave config.tenant empty (only an admin names another tenant)")
    return config if tenant == config.tenant else replace(config, tenant=tenant)


def step_tokens(ops: Iterable[Op]) -> int:
    """Token ids a batch carries."""
    total = 0
    for op in ops:
        if isinstance(op, Allocate):
            total += len(op.prompt_token_ids) if isinstance(op.prompt_token_ids, (list, tuple)) else 0
        elif isinstance(op, (Append, DecodeAppend)):
            total += len(op.token_ids) if isinstance(op.token_ids, (list, tuple)) else 0
    return total


def new_sequences(ops: Iterable[Op]) -> int:
    """How many more live sequences a batch leaves (at most; frees counted)."""
    added = freed = 0
    for op in ops:
        if isinstance(op, (Allocate, Fork)):
            added += 1
        elif isinstance(op, Free):
            freed += 1
    return added - freed if added else 0


class Tenancy:
    """Quota checks against the engine's pools (module docstring).

    ``quotas``: tenant -> :class:`Quota` (None: no quotas); ``clock``:
    monotonic seconds, for the step-rate buckets."""

    def __init__(self, quotas: QuotaSource | None, clock: Callable[[], float]) -> None:
        self._quotas = quotas
        self._clock = clock
        #: tenant -> (steps left in the bucket, when it was last filled)
        self._buckets: dict[str, tuple[float, float]] = {}

    def quota(self, tenant: str) -> Quota:
        return self._quotas(tenant) if self._quotas is not None else UNLIMITED

    def check_create(self, config: PoolConfig, pools: Iterable[PoolConfig]) -> None:
        """Refuse a new pool over its tenant's pools, blocks or bytes quota."""
        tenant = owner_of(config)
        quota = self.quota(tenant)
        if quota == UNLIMITED:
            return
        own = [c for c in pools if owner_of(c) == tenant]
        wanted = {
            "pools": (len(own) + 1, quota.pools, "pools"),
            "blocks": (sum(c.num_blocks for c in own) + config.num_blocks, quota.blocks, "blocks"),
            "bytes": (sum(c.num_blocks * c.bytes_per_block for c in own) + config.num_blocks * config.bytes_per_block,
                      quota.bytes, "bytes of KV"),
        }
        _refuse_over(tenant, "creating pool " + shown(config.name), wanted)

    def check_step(self, config: PoolConfig, ops: list[Op], live_seqs: Callable[[], int],
                   *, consume: bool = True) -> None:
        """Refuse a step over its tenant's per-step limits, sequences or rate
        (``consume``: take a step from the rate bucket when it passes)."""
        tenant = owner_of(config)
        quota = self.quota(tenant)
        if quota == UNLIMITED or not isinstance(ops, (list, tuple)):
            return
        wanted = {"ops_per_step": (len(ops), quota.ops_per_step, "operations in one step"),
                  "tokens_per_step": (step_tokens(ops), quota.tokens_per_step, "token ids in one step")}
        if quota.sequences is not None:
            more = new_sequences(ops)
            if more > 0:
                wanted["sequences"] = (live_seqs() + more, quota.sequences, "live sequences")
        _refuse_over(tenant, f"a step of pool {shown(config.name)}", wanted)
        if quota.steps_per_s is not None and consume:
            self._take_step(tenant, quota.steps_per_s)

    def check_pins(self, config: PoolConfig, pinned: int, more: int) -> None:
        """Refuse a pin in pool ``config`` that would take its tenant's pinned
        blocks from ``pinned`` past its quota by pinning ``more``."""
        tenant = owner_of(config)
        limit = self.quota(tenant).pinned_blocks
        if more:
            _refuse_over(tenant, f"a pin in pool {shown(config.name)}",
                         {"pinned_blocks": (pinned + more, limit, "pinned blocks")})

    def _take_step(self, tenant: str, rate: float) -> None:
        """One step from ``tenant``'s bucket (capacity: one second's worth, at least one)."""
        now = self._clock()
        capacity = max(rate, 1.0)
        left, last = self._buckets.get(tenant, (capacity, now))
        left = min(capacity, left + (now - last) * rate)
        if left < 1.0:
            wait = math.inf if rate <= 0 else (1.0 - left) / rate
            self._buckets[tenant] = (left, now)
            raise QuotaExceeded(
                f"tenant {tenant!r} is over its step rate of {rate:g} steps per second; retry in "
                f"{min(wait, 3600.0):.3f} s (or ask the operator for a higher quota)",
                ((f"tenant:{tenant}/steps_per_s", f"at most {rate:g} steps per second"),),
                retry_after_s=min(wait, 3600.0))
        self._buckets[tenant] = (left - 1.0, now)

    def forget(self, tenants: set[str]) -> None:
        """Drop rate buckets of tenants that own no pool any more (bounded state)."""
        for tenant in [t for t in self._buckets if t not in tenants]:
            del self._buckets[tenant]


def _refuse_over(tenant: str, what: str, wanted: dict[str, tuple[int, int | None, str]]) -> None:
    violations = tuple((f"tenant:{tenant}/{name}", f"{value} {noun} asked for; the quota is {limit}")
                       for name, (value, limit, noun) in wanted.items() if limit is not None and value > limit)
    if violations:
        first = violations[0][1]
        raise QuotaExceeded(f"{what} would exceed tenant {tenant!r}'s quota: {first}. Free or delete what it "
                            f"no longer needs, or ask the operator for a higher quota", violations)


def check_cluster_create(config: PoolConfig, quota: Quota, held: Iterable[tuple[int, int]]) -> None:
    """Refuse a new pool over its tenant's pools, blocks or bytes quota counted over
    a cluster's groups (``blockd serve --cluster``): ``held`` is ``(blocks, bytes)``
    of each pool the tenant has on any group, as the cluster's directory says."""
    held = list(held)
    tenant = owner_of(config)
    wanted = {
        "pools": (len(held) + 1, quota.pools, "pools across the cluster's groups"),
        "blocks": (sum(b for b, _ in held) + config.num_blocks, quota.blocks, "blocks across the cluster's groups"),
        "bytes": (sum(n for _, n in held) + config.num_blocks * config.bytes_per_block, quota.bytes,
                  "bytes of KV across the cluster's groups"),
    }
    _refuse_over(tenant, "creating pool " + shown(config.name), wanted)

