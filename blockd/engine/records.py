"""The daemon's mutations as typed records, and their form in the write-ahead log.

Every change to the daemon's state is one of eight records; a ninth,
``term_start``, marks where a new leader's term begins (``docs/ha.md``) and
changes nothing. The engine
applies a record the same way whether a caller asked for it or recovery
replays it (:meth:`blockd.engine.machine.Engine.apply`), so the log holds exactly
what the engine ran: a batch is applied in memory, logged, then
acknowledged; a batch that fails is never logged.

In the log a record is a JSON object: its fields (below), then ``kind``, and
for a request that carried an id its ``rid`` and the wall-clock time ``t``
it was stamped with (so replay rebuilds the idempotency table exactly)::

    create_pool         {"config": {...}, "incarnation": "..."}
    delete_pool         {"pool": "..."}
    step                {"pool": "...", "ops": [[kind, ...], ...]}   (ops: blockd.core.state)
    reset_prefix_cache  {"pool": "..."}
    worker_joined       {"pool": "...", "worker_id": "...", "incarnation": "..."}
    pin_prefix          {"pool": "...", "tokens": [...], "extra": [...], "ttl_s": S, "expires_at": T,
                         "seq_id": "..." (only for an Allocate's retain_ttl_s)}
    unpin_prefix        {"pool": "...", "pin_id": "pin-N", "expired": false}
    set_prefix_priority {"pool": "...", "tokens": [...], "extra": [...], "priority": P}
    term_start          {"term": T, "previous_term": P, "leader": "replica id"}

The term that wrote a record is not in its JSON but in its WAL frame
(:mod:`blockd.storage.wal`, format 3), so every record of every kind carries one.

A pin record carries its deadline (``expires_at``, the leader's wall clock
plus ``ttl_s``; 0: none) and an expired pin is let go by an ``unpin_prefix``
record with ``expired`` true that the leader logs when the deadline passes
(:mod:`blockd.engine.retention.pins`), so replay never reads a clock. A pin
the leader makes for an ``Allocate`` with ``retain_ttl_s`` (once the
sequence's prompt is committed) names the sequence (``seq_id``): applying it
ends that sequence's request to retain, whether or not anything could be
pinned, and an empty ``tokens`` is a request given up (over the quota).

A create record written before incarnations existed has none; its pool gets
a stable one derived from its name and LSN (:func:`blockd.engine.incarnations.legacy_incarnation`).
Imports the core and :mod:`blockd.engine.incarnations`.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockd.core.hashing import ExtraKeys
from blockd.core.state import config_to_json, extra_from_json, extra_to_json, op_from_json, op_to_json
from blockd.core.types import Op, PoolConfig
from blockd.engine.incarnations import legacy_incarnation


@dataclass(frozen=True)
class CreatePool:
    config: PoolConfig
    incarnation: str
    kind = "create_pool"

    @property
    def pool(self) -> str:
        return self.config.name

    @property
    def subject(self) -> object:
        """What the request's fingerprint covers besides its kind and pool."""
        return self.config


@dataclass(frozen=True)
class DeletePool:
    pool: str
    kind = "delete_pool"
    subject = None


@dataclass(frozen=True)
class Step:
    pool: str
    ops: list[Op]
    kind = "step"

    @property
    def subject(self) -> object:
        return self.ops


@dataclass(frozen=True)
class ResetPrefixCache:
    pool: str
    kind = "reset_prefix_cache"
    subject = None


@dataclass(frozen=True)
class WorkerJoined:
    """A worker incarnation the pool had not seen registered (:mod:`blockd.engine.incarnations`)."""

    pool: str
    worker_id: str
    incarnation: str
    kind = "worker_joined"
    subject = None


@dataclass(frozen=True)
class PinPrefix:
    """A pin of a prefix (:meth:`blockd.core.Pool.pin_prefix`); ``expires_at``:
    the deadline the leader stamped (0: none), ``ttl_s`` what the caller asked."""

    pool: str
    token_ids: list[int]
    extra_keys: ExtraKeys
    ttl_s: float
    expires_at: float
    seq_id: str = ""
    kind = "pin_prefix"

    @property
    def subject(self) -> object:
        """The request as the caller sent it (a retry has another deadline)."""
        return f"{self.token_ids!r}|{self.extra_keys!r}|{self.ttl_s!r}"


@dataclass(frozen=True)
class UnpinPrefix:
    """A pin let go: by a caller, or by the leader when its deadline passed (``expired``)."""

    pool: str
    pin_id: str
    expired: bool = False
    kind = "unpin_prefix"

    @property
    def subject(self) -> object:
        return self.pin_id


@dataclass(frozen=True)
class SetPrefixPriority:
    """A prefix's cached blocks kept at a retention priority (:meth:`blockd.core.Pool.set_prefix_priority`)."""

    pool: str
    token_ids: list[int]
    extra_keys: ExtraKeys
    priority: int
    kind = "set_prefix_priority"

    @property
    def subject(self) -> object:
        return f"{self.token_ids!r}|{self.extra_keys!r}|{self.priority!r}"


@dataclass(frozen=True)
class ImportPool:
    """A pool handed over by another group of a cluster, in its exact snapshot
    form (:meth:`blockd.engine.pools.PoolEntry.dump`): incarnation, versions,
    tables and prefix cache continue as they were (:class:`blockd.engine.pools.PoolMoves`)."""

    pool: str
    state: dict
    kind = "import_pool"
    subject = None


@dataclass(frozen=True)
class TermStart:
    """A new leader's first record: its term, the one before, and who leads.

    Applying it changes no state; it makes the log itself tell where each
    term begins (its frame carries ``term`` too), and once the leader's
    followers have persisted it, everything before it is committed."""

    term: int
    previous_term: int
    leader: str
    kind = "term_start"
    pool = ""
    subject = None


Record = (CreatePool | DeletePool | Step | ResetPrefixCache | WorkerJoined | PinPrefix | UnpinPrefix
          | SetPrefixPriority | ImportPool | TermStart)


def encode(record: Record, rid: str = "", t: float = 0.0) -> dict:
    """The log's JSON object for ``record`` (see the module docstring)."""
    if isinstance(record, CreatePool):
        body: dict = {"config": config_to_json(record.config), "incarnation": record.incarnation}
    elif isinstance(record, Step):
        body = {"pool": record.pool, "ops": [op_to_json(op) for op in record.ops]}
    elif isinstance(record, WorkerJoined):
        body = {"pool": record.pool, "worker_id": record.worker_id, "incarnation": record.incarnation}
    elif isinstance(record, PinPrefix):
        body = {"pool": record.pool, "tokens": list(record.token_ids), "extra": extra_to_json(record.extra_keys),
                "ttl_s": record.ttl_s, "expires_at": record.expires_at}
        if record.seq_id:
            body["seq_id"] = record.seq_id
    elif isinstance(record, UnpinPrefix):
        body = {"pool": record.pool, "pin_id": record.pin_id, "expired": record.expired}
    elif isinstance(record, SetPrefixPriority):
        body = {"pool": record.pool, "tokens": list(record.token_ids), "extra": extra_to_json(record.extra_keys),
                "priority": record.priority}
    elif isinstance(record, ImportPool):
        body = {"pool": record.pool, "state": record.state}
    elif isinstance(record, TermStart):
        body = {"term": record.term, "previous_term": record.previous_term, "leader": record.leader}
    else:
        body = {"pool": record.pool}
    body["kind"] = record.kind
    if rid:
        body["rid"], body["t"] = rid, t
    return body


def decode(body: dict) -> tuple[Record, str, float]:
    """``(record, request id or "", its time)`` of a log body; ``ValueError``
    (or ``KeyError``) for one that is not a record."""
    kind = body["kind"]
    record: Record
    if kind == "create_pool":
        config = PoolConfig(**body["config"])
        record = CreatePool(config, body.get("incarnation") or legacy_incarnation(config.name, body.get("lsn", 0)))
    elif kind == "delete_pool":
        record = DeletePool(body["pool"])
    elif kind == "step":
        record = Step(body["pool"], [op_from_json(o) for o in body["ops"]])
    elif kind == "reset_prefix_cache":
        record = ResetPrefixCache(body["pool"])
    elif kind == "worker_joined":
        record = WorkerJoined(body["pool"], body["worker_id"], body["incarnation"])
    elif kind == "pin_prefix":
        record = PinPrefix(body["pool"], body["tokens"], extra_from_json(body["extra"]), body["ttl_s"],
                           body["expires_at"], body.get("seq_id", ""))
    elif kind == "unpin_prefix":
        record = UnpinPrefix(body["pool"], body["pin_id"], bool(body["expired"]))
    elif kind == "set_prefix_priority":
        record = SetPrefixPriority(body["pool"], body["tokens"], extra_from_json(body["extra"]), body["priority"])
    elif kind == "import_pool":
        record = ImportPool(body["pool"], body["state"])
    elif kind == "term_start":
        record = TermStart(int(body["term"]), int(body["previous_term"]), str(body["leader"]))
    else:
        raise ValueError(f"unknown log record kind {kind!r}")
    return record, body.get("rid", ""), body.get("t", 0.0)
