"""The pool directory of a cluster of daemon groups, kept in etcd.

A cluster spreads its pools over daemon groups (``blockd serve --cluster
NAME --group G --cluster-etcd URL``). etcd holds which group owns which
pool; every key lives under ``/blockd-clusters/<cluster>/`` (apart from the
replica groups' ``/blockd/<group>/``, so that no cluster name can collide
with a group name):

===================  ==========  ==========================================================
key                  lease       value (JSON)
===================  ==========  ==========================================================
``groups/<g>``       daemon's    :class:`GroupEntry`: the address callers dial. Bound to
                                 the daemon's lease: a group whose daemon is gone has no
                                 key, and its pools are unavailable, not silently elsewhere.
``pools/<p>``        none        :class:`PoolEntry`: the owning group and the entry's
                                 ``epoch``, raised by one at every move of the pool.
``tenants/<t>``      none        a counter rewritten by every claim of tenant ``t``'s pools:
                                 what a quota-checked claim compares (below).
===================  ==========  ==========================================================

Pool names are percent-encoded in keys (a pool name may hold ``/``).

Writes are etcd transactions, never read-then-write: a pool is claimed by
"put if absent" (:meth:`Directory.claim`), so two groups creating the same
name at once cannot both own it. A claim under a tenant's quota reads the
tenant's pools and its ``tenants/<t>`` key in one transaction, checks the
quota on what it read, and commits only if that key is unchanged (every claim
of the tenant rewrites it), retrying on a fresh read otherwise: two groups
creating pools of one tenant at once cannot both pass a check that only one
of them fits. An entry is switched or removed only if it
is unchanged since it was read (compare-and-swap on its ``mod_revision``,
:meth:`Directory.switch`, :meth:`Directory.release`).

:func:`place` is the placement rule for a new pool: the live group with the
fewest pools (ties: the first name).

Imports the standard library and :mod:`blockd.ha.etcd`; nothing of the
engine or the service.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from urllib.parse import quote, unquote

from blockd.ha.etcd import EtcdClient, EtcdUnavailable, cmp_absent, cmp_mod_revision, op_delete, op_put, op_range
from blockd.ha.keys import BadValue, check_name

ROOT = "/blockd-clusters/"
#: claims of one tenant that lost the race to another claim of the same tenant, before giving up
CLAIM_TRIES = 32


@dataclass(frozen=True)
class GroupEntry:
    """A live group: its name and the gRPC address callers dial."""

    group: str
    address: str

    def encode(self) -> bytes:
        return json.dumps({"address": self.address}, sort_keys=True).encode()

    @classmethod
    def decode(cls, group: str, raw: bytes) -> GroupEntry:
        doc = _load(raw, f"group {group}")
        address = doc.get("address")
        if not isinstance(address, str) or not address:
            raise BadValue(f"group {group}'s entry lacks an address: {doc}")
        return cls(group, address)


@dataclass(frozen=True)
class PoolEntry:
    """Who owns ``pool``: ``group``, since the move that set ``epoch``
    (1 at creation). ``mod_revision``: etcd's revision of the entry as read,
    what a compare-and-swap compares (0 for an entry not read from etcd).
    ``tenant``, ``num_blocks`` and ``num_bytes`` (of KV) say what the pool
    takes of its tenant's quota, counted over every group."""

    pool: str
    group: str
    epoch: int
    mod_revision: int = 0
    tenant: str = ""
    num_blocks: int = 0
    num_bytes: int = 0

    def encode(self) -> bytes:
        return json.dumps({"group": self.group, "epoch": self.epoch, "tenant": self.tenant,
                           "num_blocks": self.num_blocks, "num_bytes": self.num_bytes}, sort_keys=True).encode()

    @classmethod
    def decode(cls, pool: str, raw: bytes, mod_revision: int) -> PoolEntry:
        doc = _load(raw, f"pool {pool}'s entry")
        group, epoch = doc.get("group"), doc.get("epoch")
        if not isinstance(group, str) or not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
            raise BadValue(f"pool {pool}'s entry needs a group and an epoch >= 1: {doc}")
        tenant, sizes = doc.get("tenant", ""), [doc.get(name, 0) for name in ("num_blocks", "num_bytes")]
        if not isinstance(tenant, str) or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in sizes):
            raise BadValue(f"pool {pool}'s entry has a bad tenant or size: {doc}")
        return cls(pool, group, epoch, mod_revision, tenant, *sizes)


def _load(raw: bytes, what: str) -> dict:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadValue(f"{what} in etcd is not JSON ({err}): {raw[:80]!r}") from None
    if not isinstance(doc, dict):
        raise BadValue(f"{what} in etcd is not a JSON object: {raw[:80]!r}")
    return doc


def place(groups: Iterable[str], pools: Iterable[PoolEntry]) -> str | None:
    """The group a new pool goes to: of ``groups`` (the live ones), the one
    owning the fewest of ``pools``, ties broken by name; None without groups."""
    counts = dict.fromkeys(groups, 0)
    for entry in pools:
        if entry.group in counts:
            counts[entry.group] += 1
    return min(counts, key=lambda g: (counts[g], g)) if counts else None


class Directory:
    """Reads and transactions on one cluster's directory. Like its
    :class:`~blockd.ha.etcd.EtcdClient`, not thread-safe: each thread (or a
    lock) has its own. Every call raises :class:`~blockd.ha.etcd.EtcdUnavailable`
    when etcd does not answer, and :class:`~blockd.ha.keys.BadValue` for an
    entry this layout did not write."""

    def __init__(self, etcd: EtcdClient, cluster: str) -> None:
        self.etcd = etcd
        self.cluster = check_name("cluster name", cluster)
        self.prefix = f"{ROOT}{cluster}/"

    @property
    def groups_prefix(self) -> str:
        return self.prefix + "groups/"

    @property
    def pools_prefix(self) -> str:
        return self.prefix + "pools/"

    def group_key(self, group: str) -> str:
        return self.groups_prefix + check_name("group name", group)

    def pool_key(self, pool: str) -> str:
        return self.pools_prefix + quote(pool, safe="")

    def tenant_key(self, tenant: str) -> str:
        return self.prefix + "tenants/" + quote(tenant, safe="")

    # --- groups -------------------------------------------------------------------------------
    def join(self, entry: GroupEntry, lease: int) -> None:
        """Announce a live group (its key bound to ``lease``: it goes with the daemon)."""
        self.etcd.put(self.group_key(entry.group), entry.encode(), lease)

    def groups(self) -> dict[str, GroupEntry]:
        """The live groups by name."""
        kvs, _ = self.etcd.get_prefix(self.groups_prefix)
        found = {}
        for kv in kvs:
            name = kv.key[len(self.groups_prefix):]
            found[name] = GroupEntry.decode(name, kv.value)
        return found

    # --- pools --------------------------------------------------------------------------------
    def pools(self) -> dict[str, PoolEntry]:
        """Every pool's entry by pool name."""
        kvs, _ = self.etcd.get_prefix(self.pools_prefix)
        found = {}
        for kv in kvs:
            name = unquote(kv.key[len(self.pools_prefix):])
            found[name] = PoolEntry.decode(name, kv.value, kv.mod_revision)
        return found

    def pool(self, name: str) -> PoolEntry | None:
        kv = self.etcd.get(self.pool_key(name))
        return None if kv is None else PoolEntry.decode(name, kv.value, kv.mod_revision)

    def claim(self, pool: str, group: str, *, tenant: str = "", num_blocks: int = 0, num_bytes: int = 0,
              admit: Callable[[list[PoolEntry]], None] | None = None) -> tuple[PoolEntry, bool]:
        """Make ``group`` the owner of a new ``pool`` (epoch 1) unless an entry
        exists: ``(the entry now, whether this call made it)``.

        ``admit`` (a quota check) gets the tenant's other pools as one
        transaction read them and raises to refuse; the claim then commits
        only if no other claim of ``tenant`` committed since that read, and
        reads and checks again if one did (:data:`CLAIM_TRIES` times at most,
        then :class:`~blockd.ha.etcd.EtcdUnavailable`)."""
        key = self.pool_key(pool)
        wanted = PoolEntry(pool, check_name("group name", group), 1, 0, tenant, num_blocks, num_bytes)
        for _ in range(CLAIM_TRIES):
            guard: list[dict] = []
            bump: list[dict] = []
            if tenant:  # every claim of the tenant rewrites its key: the claims of one tenant are ordered
                tkey = self.tenant_key(tenant)
                seen = self.etcd.txn([], [op_range(tkey), op_range(self.pools_prefix, prefix=True)])
                counter = next(iter(seen.ranges[0] or ()), None)
                if admit is not None:
                    others = [PoolEntry.decode(name, kv.value, kv.mod_revision) for kv in seen.ranges[1] or []
                              if (name := unquote(kv.key[len(self.pools_prefix):])) != pool]
                    admit([e for e in others if e.tenant == tenant])
                guard = [cmp_mod_revision(tkey, counter.mod_revision) if counter is not None else cmp_absent(tkey)]
                bump = [op_put(tkey, str(seen.revision).encode())]  # the value is never read; the write is the point
            result = self.etcd.txn([cmp_absent(key), *guard], [op_put(key, wanted.encode()), *bump], [op_range(key)])
            if result.succeeded:
                return replace(wanted, mod_revision=result.revision), True
            kvs = result.ranges[0] or []
            if kvs:  # the pool exists: its owner
                return PoolEntry.decode(pool, kvs[0].value, kvs[0].mod_revision), False
            if not tenant:  # deleted between the compare and the range: impossible within one txn
                raise BadValue(f"pool {pool}'s entry was neither absent nor present")
            # another claim of the tenant's committed since our read: read and check again
        raise EtcdUnavailable(f"pool {pool}'s claim lost to other claims of tenant {tenant} {CLAIM_TRIES} times")

    def switch(self, entry: PoolEntry, group: str) -> PoolEntry | None:
        """Hand ``entry``'s pool to ``group`` under ``epoch + 1`` if the entry is
        unchanged since it was read; the new entry, or None if it had changed."""
        key = self.pool_key(entry.pool)
        moved = replace(entry, group=check_name("group name", group), epoch=entry.epoch + 1)
        result = self.etcd.txn([cmp_mod_revision(key, entry.mod_revision)], [op_put(key, moved.encode())])
        return replace(moved, mod_revision=result.revision) if result.succeeded else None

    def release(self, entry: PoolEntry) -> bool:
        """Remove ``entry``'s pool from the directory if the entry is unchanged since it was read."""
        key = self.pool_key(entry.pool)
        return self.etcd.txn([cmp_mod_revision(key, entry.mod_revision)], [op_delete(key)]).succeeded
