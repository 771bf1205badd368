"""The state the engine's records change: the pools by name and the request ids' answers.

:class:`State` is the state machine proper: :meth:`State.apply` runs one
record (:mod:`blockd.engine.records`) against it, the same way for a
caller's request and for recovery's replay, and :meth:`State.capture` /
:meth:`State.load_snapshot` are its snapshot form. It holds no lock, writes
no log and knows no replication: :class:`blockd.engine.machine.Engine` owns
those, calls this under its lock, and replaces the whole state when a
follower's log is re-read (``Engine.reload``).
"""

from __future__ import annotations

from dataclasses import replace

from blockd.core import AlreadyExists, Op, Pool, PoolConfig, PoolStats, StepResult, check_invariants
from blockd.core.errors import InvalidArgument, NotFound, shown
from blockd.core.validate import check_config, check_name
from blockd.engine import records
from blockd.engine.idempotency import IdempotencyTable, fingerprint
from blockd.engine.incarnations import PoolIncarnations
from blockd.engine.pools import PoolEntry
from blockd.engine.retention.retain import freed_prompts, retained_pin, to_retain, track_retained
from blockd.engine.tenancy import check_access, owner_of
from blockd.engine.worker_registry import WorkerRegistry


class State:
    """Pools by name, the request-id table, and the registry a deleted pool's workers leave."""

    def __init__(self, requests: IdempotencyTable, workers: WorkerRegistry) -> None:
        self.pools: dict[str, PoolEntry] = {}
        self.requests = requests
        self.workers = workers

    # --- recovery (blockd.engine.durability.Replayable) ---------------------------------
    def load_snapshot(self, snapshot: dict) -> None:
        for data in snapshot["pools"]:
            entry = PoolEntry.load(data, snapshot["lsn"])
            self.pools[entry.pool.config.name] = entry
        self.requests.load(snapshot["requests"])

    def apply_record(self, body: dict) -> None:
        record, rid, t = records.decode(body)
        result = self.apply(record)
        if rid:
            # the record's own time, never the clock now: replay rebuilds the same table
            self.requests.put(rid, self.fingerprint(record), t, result, self.block_size(record.pool),
                              self.scope(record.pool))

    def capture(self) -> dict:
        """The whole state as plain data (what a snapshot holds)."""
        return {"pools": [entry.dump() for entry in self.pools.values()], "requests": self.requests.dump()}

    # --- records ---------------------------------------------------------------------------
    def apply(self, record: records.Record) -> object:
        """Run one record against the state (a request's, or a replayed one's)."""
        if isinstance(record, records.TermStart):
            return None
        if isinstance(record, records.Step):
            return self.run_step(self.pools[record.pool], record.ops)
        if isinstance(record, records.CreatePool):
            return self._create_pool(record.config, record.incarnation)
        if isinstance(record, records.ImportPool):
            return self._import_pool(record.pool, record.state)
        if isinstance(record, records.DeletePool):
            self._delete_pool(record.pool)
            return None
        if isinstance(record, records.PinPrefix):
            return retained_pin(self.entry(record.pool), record)
        if isinstance(record, records.UnpinPrefix):
            return self.entry(record.pool).pool.unpin(record.pin_id)
        if isinstance(record, records.SetPrefixPriority):
            return self.entry(record.pool).pool.set_prefix_priority(record.token_ids, record.extra_keys,
                                                                    record.priority)
        if isinstance(record, records.ResetPrefixCache):
            entry = self.entry(record.pool)
            entry.pool.reset_prefix_cache()
            entry.drain_events()
            return None
        entry = self.entry(record.pool)
        num_lost = entry.identity.join(entry.pool, record.worker_id, record.incarnation)
        entry.drain_events()
        return num_lost

    @staticmethod
    def fingerprint(record: records.Record) -> str:
        """Kind, pool and a hash of the content (a step's ops, a pool's config),
        computed alike for a live request and a replayed record."""
        return fingerprint(record.kind, record.pool, record.subject)

    def run_step(self, entry: PoolEntry, ops: list[Op]) -> StepResult:
        retain = to_retain(ops)  # refused before the step: a bad TTL changes nothing
        freed = freed_prompts(entry, ops) if entry.retain else {}
        result = entry.pool.step(ops)
        if retain or entry.retain:
            track_retained(entry, ops, retain, freed)
        entry.identity.after_step(ops)
        entry.drain_events()
        return entry.identity.result(result)

    def _create_pool(self, config: PoolConfig, incarnation: str) -> PoolStats:
        check_config(config)  # a malformed config is INVALID_ARGUMENT whether or not the name is taken
        if config.name in self.pools:
            raise AlreadyExists(f"pool {shown(config.name)} already exists")
        if not config.tenant:  # a create record written before tenants: the default tenant's
            config = replace(config, tenant=owner_of(config))
        entry = PoolEntry(Pool(config), PoolIncarnations(incarnation))
        self.pools[config.name] = entry
        return entry.stats()

    def _import_pool(self, name: str, state: dict) -> PoolStats:
        """Pool ``name`` from its snapshot form (another group's, handed over in a move)."""
        if name in self.pools:
            raise AlreadyExists(f"pool {shown(name)} already exists here: it cannot be imported over")
        try:
            entry = PoolEntry.load(state, 0)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            raise InvalidArgument(f"the state of pool {shown(name)} is not a pool's snapshot form: "
                                  f"{type(err).__name__} {shown(str(err))}") from None
        if entry.pool.config.name != name:
            raise InvalidArgument(f"the state handed over as pool {shown(name)} is pool "
                                  f"{shown(entry.pool.config.name)}'s")
        requests = state.get("requests", [])
        try:
            self.requests.add_entries(requests if isinstance(requests, list) else [requests])
        except ValueError as err:
            raise InvalidArgument(f"the request ids handed over with pool {shown(name)}: {err}") from None
        self.pools[name] = entry
        return entry.stats()

    def _delete_pool(self, name: str) -> None:
        entry = self.entry(name)
        entry.deleted = True
        del self.pools[name]
        self.workers.forget_pool(name)

    # --- lookups ---------------------------------------------------------------------------
    def entry(self, name: str) -> PoolEntry:
        """Pool ``name``, visible to the caller: NOT_FOUND, or PERMISSION_DENIED for another tenant's."""
        entry = self.pools.get(name) if type(name) is str else None
        if entry is None:
            check_name(name, "pool")  # a name no pool can have is the caller's mistake
            raise NotFound(f"no pool named {shown(name)}; list pools to see which exist")
        check_access(entry.pool.config)  # another tenant's pool: PERMISSION_DENIED (nobody's during replay)
        return entry

    def scope(self, name: str) -> str:
        """The incarnation of pool ``name`` now, ``""`` when there is none: a
        request id's answer is valid only while it is the same."""
        entry = self.pools.get(name) if type(name) is str else None
        return entry.identity.incarnation if entry is not None else ""

    def block_size(self, name: str) -> int:
        entry = self.pools.get(name) if type(name) is str else None
        return entry.pool.block_size if entry is not None else 0

    def live_seqs(self, tenant: str) -> int:
        return sum(len(e.pool.seqs) for e in self.pools.values() if owner_of(e.pool.config) == tenant)

    def check_invariants(self) -> None:
        for entry in self.pools.values():
            check_invariants(entry.pool)
