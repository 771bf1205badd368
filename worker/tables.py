"""A worker's mirror of one pool's block tables, advanced version by version.

The mirror receives the pool's Watch stream (ordered
:class:`~blockd.core.types.VersionDelta`\\ s, or a snapshot when it fell too
far behind) into a pending queue and applies it *lazily*: work that names
version V first applies every pending delta up to V -- running each
version's tier ops (offloads to and restores from the host tier), then its
copy ops, on the KV memory before its table updates -- and then runs on
exactly V's tables. Applying lazily matters because KV memory cannot be
rewound: once V+1's copy ops ran, V's blocks may hold other data, so work for
an older version than the applied one is refused as stale.

Versions are comparable only within one pool incarnation. The mirror knows
the incarnation its tables belong to; a snapshot of another incarnation (the
pool was re-created, or blockd restarted without its data) replaces
everything, and the old incarnation is remembered as replaced: work naming it
is refused at once (:class:`~blockd.core.incarnations.PoolIncarnationMismatch`), work
naming one not loaded yet waits for it, bounded
(:class:`~blockd.core.incarnations.PoolIncarnationUnavailable`).

:meth:`trim` applies the oldest pending deltas once more than ``max_pending``
pile up, so an idle worker's memory stays bounded. Pure Python, thread-safe; the copy op
and tier op executors are injected (the torch shard, or lists in tests).

A version whose tier or copy ops fail leaves the KV memory somewhere between
two versions, so the mirror refuses every later call (:class:`MirrorBroken`)
instead of answering over it: the worker must restart.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from blockd.core.errors import InvalidArgument, NotFound, WrongState, shown
from blockd.core.incarnations import PoolIncarnationMismatch, PoolIncarnationUnavailable, TermNotSeen, short
from blockd.core.types import RESTORE, TierOp, VersionDelta

CopyFn = Callable[[Sequence[tuple[int, int]]], None]
TierFn = Callable[[Sequence[TierOp]], None]
#: replaced pool incarnations remembered (to refuse work naming them at once)
MAX_REPLACED = 64


class StaleVersion(WrongState):
    """The work names a version older than the one the mirror has applied."""


class VersionUnavailable(WrongState):
    """The named version did not arrive in time (or never will)."""


class MirrorBroken(WrongState):
    """A version's tier or copy ops failed: the KV memory matches no version."""


class TableMirror:
    def __init__(self, copy_blocks: CopyFn, max_pending: int = 4096, tier_ops: TierFn | None = None,
                 on_snapshot: Callable[[], None] | None = None) -> None:
        """``tier_ops`` runs a version's tier ops in order (None: the shard has no
        host tier, and a version that has tier ops breaks the mirror);
        ``on_snapshot`` is called as a snapshot replaces the tables, before any
        later delta applies: the tier ops of the versions it skips never ran, so
        the host tier holds what no table vouches for."""
        self._copy_blocks = copy_blocks
        self._tier_ops = tier_ops
        self._on_snapshot = on_snapshot
        self.max_pending = max_pending
        self.tables: dict[str, list[int]] = {}
        self.applied_version = 0
        #: highest version received (applied or pending)
        self.received_version = 0
        self.num_snapshots = 0
        self.num_copy_ops = 0
        self.num_tier_ops = 0
        #: why the mirror serves nothing any more ("" while it does)
        self.broken = ""
        #: the pool incarnation the tables belong to ("" until one is known)
        self.incarnation = ""
        #: the newest leader term that served this replica (0: none, or blockd is not replicated)
        self.term = 0
        self.replaced: OrderedDict[str, str] = OrderedDict()  # old -> the one that replaced it
        #: per device block and per host block, the last applied version that gave it
        #: other contents (a table took it, a restore or copy wrote it; an offload wrote
        #: the host block), so a block read for another pool is known unchanged since
        #: the version blockd planned the read at (:meth:`changed_since`)
        self.reassigned: dict[int, int] = {}
        self.host_reassigned: dict[int, int] = {}
        #: the last snapshot's version: which blocks changed before it is not known
        self.reassigned_floor = 0
        self._pending: deque[VersionDelta] = deque()
        self._cond = threading.Condition()

    # --- feeding ---------------------------------------------------------
    def adopt(self, incarnation: str) -> None:
        """Name the incarnation of a replica that holds nothing yet (version 0)."""
        with self._cond:
            if self.incarnation or self.received_version:
                raise WrongState("only an empty replica can adopt a pool incarnation")
            self.incarnation = incarnation
            self._cond.notify_all()

    def load_snapshot(self, version: int, tables: dict[str, list[int]], incarnation: str | None = None) -> None:
        """Replace everything with the tables of ``version`` (copy ops of the
        skipped versions are lost: blockd retains them no longer). With another
        ``incarnation`` than the mirror's, the mirror moves to it."""
        with self._cond:
            if incarnation is not None and incarnation != self.incarnation:
                if self.incarnation:
                    self.replaced[self.incarnation] = incarnation
                    while len(self.replaced) > MAX_REPLACED:
                        self.replaced.popitem(last=False)
                self.replaced.pop(incarnation, None)
                self.incarnation = incarnation
            self.tables = {seq_id: list(t) for seq_id, t in tables.items()}
            self.applied_version = self.received_version = version
            self._pending.clear()
            self.reassigned.clear()
            self.host_reassigned.clear()
            self.reassigned_floor = version
            if self._on_snapshot is not None:
                self._on_snapshot()
            self.num_snapshots += 1
            self._cond.notify_all()

    def check_term(self, term: int) -> None:
        """A Watch message served by the leader of ``term`` (0: not replicated) is about to be
        applied: refuse it when a newer leader has served this replica (a deposed leader's stream)."""
        with self._cond:
            if term and term < self.term:
                raise WrongState(f"a Watch message of leader term {term} after term {self.term}: it comes from a "
                                 "deposed leader; reconnecting to the current one")

    def note_term(self, term: int) -> None:
        """A Watch message of leader ``term`` has been taken in (after :meth:`check_term`): calls
        planned on that term may run (:meth:`wait_term`)."""
        with self._cond:
            if term > self.term:
                self.term = term
                self._cond.notify_all()

    def wait_term(self, term: int, timeout_s: float) -> None:
        """Return once this replica has taken in a Watch message of leader ``term`` or newer
        (0: not replicated, at once); :class:`~blockd.core.incarnations.TermNotSeen` after
        ``timeout_s``. A call planned on a new leader's version must not run on tables an older
        leader served: with ``async`` replication those may hold versions the new leader lacks,
        and the new leader's stream (a snapshot marked resync) is what replaces them."""
        if term <= self.term:  # every call but the first after a failover: no lock, no clock
            return
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while term > self.term:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TermNotSeen(f"the call was planned on leader term {term}, but this worker's tables were "
                                      f"last served in term {self.term} and the new leader's stream has not reached "
                                      f"it within {timeout_s:g} s; retry once the worker follows the new leader")
                self._cond.wait(left)

    def push(self, delta: VersionDelta) -> None:
        """Queue the next delta; it must follow the last one received."""
        with self._cond:
            if delta.version <= self.received_version:
                return  # a duplicate after a reconnect: already have it
            if delta.version != self.received_version + 1:
                raise WrongState(f"version gap: got {delta.version} after {self.received_version}")
            self._pending.append(delta)
            self.received_version = delta.version
            self._cond.notify_all()

    def trim(self) -> None:
        """Apply the oldest pending deltas beyond ``max_pending`` (an idle
        worker's memory stays bounded). The caller must hold whatever lock
        keeps kernels off the KV memory, as for :meth:`advance_to`."""
        with self._cond:
            if len(self._pending) > self.max_pending:
                self._apply_until(self.received_version - self.max_pending // 2)

    # --- using --------------------------------------------------------------
    @property
    def lag(self) -> int:
        """Versions received but not yet applied."""
        return self.received_version - self.applied_version

    def advance_to(self, version: int, timeout_s: float,
                   latest_committed: Callable[[], int] | None = None, incarnation: str | None = None) -> str:
        """Make the mirror sit exactly at ``version`` of ``incarnation`` (None:
        whichever it holds) and return that incarnation (see module docstring).

        Raises :class:`StaleVersion` when already past it, and
        :class:`VersionUnavailable` when it does not arrive within
        ``timeout_s`` -- at once if ``latest_committed()`` says the pool never
        reached it, so a request for a version that can never arrive does not
        hang. A replaced incarnation is refused at once, one not loaded yet
        after ``timeout_s``.
        """
        if type(version) is not int or version < 0:
            raise InvalidArgument(f"version must be a non-negative integer, got {shown(version)}")
        deadline = time.monotonic() + timeout_s
        checked = False
        with self._cond:
            while True:
                if self.broken:
                    raise MirrorBroken(self.broken)
                if incarnation is not None and incarnation != self.incarnation:
                    self._check_incarnation(incarnation, deadline)
                    continue
                if version < self.applied_version:
                    raise StaleVersion(
                        f"version {version} is stale: this worker already applied {self.applied_version}; "
                        "step the pool again and use the new version")
                if version <= self.received_version:
                    self._apply_until(version)
                    return self.incarnation
                if latest_committed is not None and not checked:
                    checked = True
                    self._cond.release()
                    try:
                        latest = latest_committed()
                    finally:
                        self._cond.acquire()
                    if latest < version:
                        raise VersionUnavailable(
                            f"version {version} was never committed: the pool is at {latest}")
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise VersionUnavailable(
                        f"version {version} did not arrive within {timeout_s:.1f}s "
                        f"(replica at {self.applied_version}, received {self.received_version})")
                self._cond.wait(remaining)

    def _check_incarnation(self, incarnation: str, deadline: float) -> None:
        """Refuse ``incarnation`` (not the mirror's), or wait a while for it."""
        if incarnation in self.replaced:
            raise PoolIncarnationMismatch(
                f"pool incarnation {short(incarnation)} was replaced by {short(self.replaced[incarnation])} "
                "(the pool was deleted and re-created, or blockd restarted without its data): its versions "
                "and sequences are gone; plan again against the current pool",
                metadata={"pool_incarnation": self.incarnation, "planned_incarnation": incarnation[:64]})
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PoolIncarnationUnavailable(
                f"this worker's tables belong to pool incarnation {short(self.incarnation)}, not "
                f"{short(incarnation)}; it loads a new incarnation when its Watch stream from blockd "
                "brings one: retry shortly, and check that the worker follows the blockd you stepped on",
                metadata={"pool_incarnation": self.incarnation, "planned_incarnation": incarnation[:64]})
        self._cond.wait(remaining)

    def _apply_until(self, version: int) -> None:
        while self._pending and self._pending[0].version <= version:
            delta = self._pending.popleft()
            try:
                if delta.tier_ops:
                    if self._tier_ops is None:
                        raise WrongState(f"{len(delta.tier_ops)} tier ops, but this worker has no host tier")
                    self._tier_ops(delta.tier_ops)
                    self.num_tier_ops += len(delta.tier_ops)
                if delta.copy_ops:
                    self._copy_blocks(delta.copy_ops)
                    self.num_copy_ops += len(delta.copy_ops)
            except Exception as err:
                self.broken = (f"version {delta.version}'s tier or copy ops failed ({err}), so this worker's KV "
                               "matches no version of the pool; restart the worker")
                self._cond.notify_all()
                raise MirrorBroken(self.broken) from err
            self._note_reassigned(delta)
            for update in delta.updates:
                if update.freed:
                    self.tables.pop(update.seq_id, None)
                else:
                    table = self.tables.get(update.seq_id, [])
                    del table[update.keep:]
                    table.extend(update.block_ids)
                    self.tables[update.seq_id] = table
            self.applied_version = delta.version

    def _note_reassigned(self, delta: VersionDelta) -> None:
        version, device = delta.version, self.reassigned
        for op in delta.tier_ops:
            if op.kind == RESTORE:
                device[op.device_block] = version
            else:
                self.host_reassigned[op.host_block] = version
        for _, dst in delta.copy_ops:
            device[dst] = version
        for update in delta.updates:
            for block in update.block_ids:
                device[block] = version

    def changed_since(self, host: bool, block: int, version: int) -> int:
        """The applied version after ``version`` that gave device (or ``host``)
        block ``block`` other contents, 0 when none did (call under the lock
        that keeps kernels off the KV memory, after the mirror reached ``version``)."""
        with self._cond:
            at = max((self.host_reassigned if host else self.reassigned).get(block, 0), self.reassigned_floor)
            return at if at > version else 0

    def tables_of(self, seq_ids: Sequence[str], version: int | None = None,
                  incarnation: str | None = None) -> list[list[int]]:
        """Tables at the applied version (call right after :meth:`advance_to`;
        ``version`` and ``incarnation``, when given, must still be the applied
        ones: a snapshot may have replaced them meanwhile)."""
        with self._cond:
            if incarnation is not None and incarnation != self.incarnation:
                raise PoolIncarnationMismatch(f"pool incarnation {short(incarnation)} was replaced by "
                                              f"{short(self.incarnation)} while the call ran; plan again")
            if version is not None and version != self.applied_version:
                raise StaleVersion(f"version {version} was replaced by {self.applied_version} while the call "
                                   "ran; step the pool again and use the new version")
            out = []
            for seq_id in seq_ids:
                table = self.tables.get(seq_id)
                if table is None:
                    raise NotFound(f"sequence {shown(seq_id)} has no table at version {self.applied_version}")
                out.append(list(table))
            return out
