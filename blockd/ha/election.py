"""Leader election with fencing on etcd: who may acknowledge, and until when.

Each replica of a group runs one :class:`Election`. It holds an etcd lease
(TTL ``ttl_s``), renews it every TTL/3, and campaigns by creating
``/blockd/<group>/leader`` bound to that lease *if absent* (one etcd
transaction, which also reads ``last_leader`` and rewrites it). The winner's
**term** is the leader key's create revision: etcd's revision only grows, so
every later leader has a larger term, on every replica, without a counter of
ours. Everything here runs on one daemon thread; the engine asks
:meth:`Election.can_acknowledge` (cheap, lock + clock) before it
acknowledges a step, and gets ``on_elected`` / ``on_stepped_down`` calls.

**Lease validity.** A leader may act until ``lease_valid_until = t_send +
TTL - margin``, where ``t_send`` is this host's monotonic time *before* it
sent the last keepalive that etcd answered with ``TTL > 0``. Why that is
safe: etcd's lessor (on the etcd leader) sets the lease's expiry to *its*
receipt time + TTL, and it received the request after we sent it, so in
real time the lease cannot end before ``t_send + TTL`` - up to the rate
difference ρ between the two clocks (no absolute synchronisation is needed,
only bounded drift: ρ ≈ 1e-4 with NTP, 5e-4 for free-running quartz). The
``margin`` covers ρ·TTL and the time between ``can_acknowledge()`` and the
acknowledgement leaving the process. Measuring from the *reply* would be
unsafe: a reply delayed in the network would stretch our belief past the
real expiry. etcd itself never ends a lease early: expiry is checked by the
etcd leader (every 500 ms) and revocation goes through raft, so the key
disappears at or after the expiry; a new etcd leader *extends* every lease
to a full TTL; it never shortens one.

**Fencing a new leader.** A winner does not serve at once. The key was
absent, so the previous leader's lease was revoked (it resigned, having
stopped acknowledging first) or expired (its validity ended strictly
before). The winner reads the previous leader's lease id from ``last_leader``
and, should that lease still live (someone deleted the key by hand), waits
until etcd reports it gone; then it waits one more ``margin`` (grace for
clock rates) before ``on_elected``. Hence the old leader's
``can_acknowledge()`` turns false before the new one's turns true.

**Stepping down** (``on_stepped_down`` at once, ``can_acknowledge()`` false
from that moment): the lease validity ran out (no keepalive answered: etcd
down, or this process was paused), etcd no longer has the lease, or the
leader key is gone or belongs to another term. A term is never resumed: a
lease whose validity ran out is abandoned (revoked once etcd answers again)
and the replica campaigns with a new lease, hence a new term.

**Resign** (graceful shutdown): leadership ends locally first, then the
lease is revoked, which deletes the key at once: the next leader is elected
within one poll (plus its margin) instead of a TTL.

**Members.** Each replica keeps ``members/<replica-id>`` (address, role,
term, applied LSN, lag) under its lease, rewritten when it changes and every
``member_refresh_s``: it vanishes with the replica.

Callbacks run on the election thread and must return quickly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from blockd.ha.etcd import EtcdClient, EtcdUnavailable, cmp_absent, op_put, op_range
from blockd.ha.keys import BadValue, LeaderInfo, MemberInfo, check_name, group_keys

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("blockd.ha")


@dataclass(frozen=True)
class ElectionConfig:
    """One replica's part in a group's election.

    ``address``: what callers dial to reach this replica (advertised gRPC
    address). ``ttl_s``: the lease TTL asked of etcd (it may grant more).
    ``margin_s``: safety margin taken off each lease validity and waited by a
    new leader before serving. ``poll_s``: how often a non-leader campaigns /
    a leader re-reads its key. ``request_timeout_s``: bound on one etcd call.
    """

    group: str
    replica_id: str
    address: str
    ttl_s: int = 2
    margin_s: float = 0.5
    poll_s: float = 0.2
    request_timeout_s: float = 1.0
    member_refresh_s: float = 5.0

    def __post_init__(self) -> None:
        check_name("group name", self.group)
        check_name("replica id", self.replica_id)
        if not self.address:
            raise ValueError("address (what callers dial to reach this replica) must not be empty")
        if not isinstance(self.ttl_s, int) or self.ttl_s < 1:
            raise ValueError(f"ttl_s must be a whole number of seconds >= 1 (etcd leases), got {self.ttl_s!r}")
        if not 0 < self.margin_s <= self.ttl_s / 2:
            raise ValueError(f"margin_s must be in (0, ttl_s/2] = (0, {self.ttl_s / 2}], got {self.margin_s}")
        for name in ("poll_s", "request_timeout_s", "member_refresh_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Leadership:
    """What an elected leader knows: its ``term``, the term before it (0:
    none known) and when (``clock()``) it began to serve."""

    term: int
    previous_term: int
    serving_since: float


@dataclass
class _Pending:
    """Won the key, not serving yet: waiting for the previous lease to end."""

    term: int
    previous_term: int
    previous_lease: int | None
    not_before: float


class Election:
    """Campaign, keep the lease, fence, step down; see the module docstring.

    ``start()`` once; ``resign()`` at shutdown. Thread-safe getters.
    """

    def __init__(self, endpoints: str | list[str], config: ElectionConfig, *,
                 on_elected: Callable[[Leadership], None] | None = None,
                 on_stepped_down: Callable[[Leadership, str], None] | None = None,
                 on_leader_changed: Callable[[LeaderInfo | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.keys = group_keys(config.group)
        self._endpoints = endpoints
        self._kv = EtcdClient(endpoints, config.request_timeout_s)
        self._on_elected, self._on_stepped_down = on_elected, on_stepped_down
        self._on_leader_changed = on_leader_changed
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease_id: int | None = None
        self._ttl = config.ttl_s
        self._valid_until = 0.0
        self._next_keepalive = 0.0
        self._abandoned: list[int] = []
        self._pending: _Pending | None = None
        self._leadership: Leadership | None = None
        self._observed: LeaderInfo | None = None
        self._progress = (0, -1)
        self._member: tuple[MemberInfo, int, float] | None = None  # what was written, under which lease, when
        self.elections_won = self.step_downs = self.leader_changes = self.etcd_errors = 0

    # what the engine asks ------------------------------------------------------------------------

    def can_acknowledge(self) -> bool:
        """True while this replica leads and its lease is provably valid."""
        with self._lock:
            return self._leadership is not None and self._clock() < self._valid_until

    def lease_valid_until(self) -> float:
        """``clock()`` time until which a leader may act (0.0 when not leading)."""
        with self._lock:
            return self._valid_until if self._leadership is not None else 0.0

    @property
    def last_valid_until(self) -> float:
        """The validity of the lease as last renewed, leading or not (for reports and tests)."""
        with self._lock:
            return self._valid_until

    @property
    def leadership(self) -> Leadership | None:
        with self._lock:
            return self._leadership

    def leader(self) -> LeaderInfo | None:
        """The leader as last seen in etcd (this replica's own info while it leads)."""
        with self._lock:
            return self._observed

    def report_progress(self, applied_lsn: int, lag_records: int = -1) -> None:
        """The replica's log position for its member key (written on the next cycle)."""
        if applied_lsn < 0 or lag_records < -1:
            raise ValueError(f"applied_lsn must be >= 0 and lag_records >= -1, got {applied_lsn}, {lag_records}")
        with self._lock:
            self._progress = (applied_lsn, lag_records)

    # lifetime ------------------------------------------------------------------------------------

    def start(self) -> Election:
        if self._thread is not None:
            raise RuntimeError("election already started")
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"election-{self.config.replica_id}")
        self._thread.start()
        return self

    def resign(self, timeout_s: float = 5.0) -> None:
        """Stop; leadership ends here first, then the lease is revoked (its keys go at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            was, self._leadership, self._pending = self._leadership, None, None
            leases = [*self._abandoned, *([self._lease_id] if self._lease_id else [])]
            self._lease_id, self._abandoned = None, []
        if was is not None:
            log.info("replica %s resigns as leader of %s (term %d)", self.config.replica_id,
                     self.config.group, was.term)
            self._call(self._on_stepped_down, was, "resigned")
        kv = EtcdClient(self._endpoints, self.config.request_timeout_s)  # the thread may still hold ours
        try:
            for lease in leases:
                kv.revoke(lease)
        except EtcdUnavailable as err:
            log.warning("could not revoke lease on resign (%s): the next leader waits for its TTL", err)
        finally:
            kv.close()
            if self._thread is None or not self._thread.is_alive():
                self._kv.close()

    close = resign

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.resign()

    # the loop -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._cycle()
            except EtcdUnavailable as err:
                self.etcd_errors += 1
                log.debug("replica %s: %s", self.config.replica_id, err)
            except BadValue as err:
                log.error("group %s: %s; fix or delete that key", self.config.group, err)
            self._enforce_validity()
            self._stop.wait(self._sleep_s())

    def _cycle(self) -> None:
        if self._lease_id is None:
            self._grant()
        elif self._clock() >= self._next_keepalive:
            self._keepalive()
        if self._lease_id is None or self._stop.is_set():
            return
        self._revoke_abandoned()
        if self._leadership is not None:
            self._check_key()
        elif self._pending is not None:
            self._advance_pending()
        else:
            self._campaign()
        self._publish_member()

    def _timeout(self) -> float:
        """A leader's etcd call never outlives its validity (it must step down on time)."""
        timeout = self.config.request_timeout_s
        if self._leadership is not None or self._pending is not None:
            timeout = min(timeout, max(0.05, self._valid_until - self._clock()))
        return timeout

    def _sleep_s(self) -> float:
        now = self._clock()
        wake = now + self.config.poll_s
        if self._lease_id is not None:
            wake = min(wake, self._next_keepalive)
        if self._leadership is not None:
            wake = min(wake, self._valid_until)
        if self._pending is not None:
            wake = min(wake, self._pending.not_before)
        return max(0.0, wake - now)

    # the lease ------------------------------------------------------------------------------------

    def _grant(self) -> None:
        sent = self._clock()
        lease_id, ttl = self._kv.grant(self.config.ttl_s, self.config.request_timeout_s)
        with self._lock:
            self._lease_id, self._ttl = lease_id, ttl
            self._valid_until = sent + ttl - self.config.margin_s
            self._next_keepalive = sent + ttl / 3
        log.debug("replica %s holds lease %x (TTL %d s)", self.config.replica_id, lease_id, ttl)

    def _keepalive(self) -> None:
        sent = self._clock()
        try:
            ttl = self._kv.keepalive(self._lease_id, self._timeout())
        except EtcdUnavailable:
            self._next_keepalive = self._clock() + min(self.config.poll_s, self._ttl / 6)
            raise
        if ttl <= 0:
            self._lose_lease(f"etcd no longer has lease {self._lease_id:x} (expired)")
            return
        with self._lock:
            self._valid_until = sent + ttl - self.config.margin_s
            self._next_keepalive = sent + ttl / 3

    def _lose_lease(self, reason: str, abandon: bool = False) -> None:
        """Forget the lease (revoking it later if ``abandon``); a leader steps down."""
        with self._lock:
            if abandon and self._lease_id is not None:
                self._abandoned.append(self._lease_id)
            self._lease_id, self._pending, self._member = None, None, None
        self._step_down(reason)

    def _revoke_abandoned(self) -> None:
        while self._abandoned:
            self._kv.revoke(self._abandoned[0], self.config.request_timeout_s)
            with self._lock:
                self._abandoned.pop(0)

    def _enforce_validity(self) -> None:
        if (self._leadership is not None or self._pending is not None) and self._clock() >= self._valid_until:
            self._lose_lease(f"lease validity ran out at {self._valid_until:.3f} (no keepalive answered in time)",
                             abandon=True)

    def _step_down(self, reason: str) -> None:
        with self._lock:
            was, self._leadership = self._leadership, None
            if was is not None:
                self.step_downs += 1
        if was is not None:
            log.warning("replica %s steps down as leader of %s (term %d): %s", self.config.replica_id,
                        self.config.group, was.term, reason)
            self._call(self._on_stepped_down, was, reason)

    # the key --------------------------------------------------------------------------------------

    def _me(self) -> LeaderInfo:
        return LeaderInfo(self.config.replica_id, self.config.address, self._lease_id)

    def _campaign(self) -> None:
        me, keys = self._me(), self.keys
        result = self._kv.txn([cmp_absent(keys.leader)],
                              [op_range(keys.last_leader), op_put(keys.leader, me.encode(), me.lease_id),
                               op_put(keys.last_leader, me.encode())],
                              [op_range(keys.leader)], self._timeout())
        if result.succeeded:
            found = result.ranges[0]
            previous = LeaderInfo.decode(found[0].value, found[0].mod_revision) if found else None
            self._begin_pending(result.revision, previous, previous_known=True)
            return
        found = result.ranges[0]
        if not found:
            return  # deleted between compare and read: campaign again next cycle
        holder = LeaderInfo.decode(found[0].value, found[0].create_revision)
        if holder.lease_id == me.lease_id:
            # our own earlier attempt was applied but its answer lost: last_leader was overwritten
            self._begin_pending(holder.term, None, previous_known=False)
        else:
            self._observe(holder)

    def _begin_pending(self, term: int, previous: LeaderInfo | None, previous_known: bool) -> None:
        now = self._clock()
        wait = self.config.margin_s if previous_known else self._ttl + self.config.margin_s
        previous_lease = previous.lease_id if previous and previous.lease_id != self._lease_id else None
        self._pending = _Pending(term, previous.term if previous else 0, previous_lease, now + wait)
        self._observe(replace(self._me(), term=term))
        log.info("replica %s won the leader key of %s (term %d, previous term %d); serving after fencing",
                 self.config.replica_id, self.config.group, term, self._pending.previous_term)
        self._advance_pending()

    def _holds_key(self, term: int) -> bool:
        found = self._kv.get(self.keys.leader, self._timeout())
        return found is not None and found.create_revision == term and found.lease == self._lease_id

    def _advance_pending(self) -> None:
        pending = self._pending
        if not self._holds_key(pending.term):
            log.warning("replica %s lost the leader key of %s before serving (term %d)",
                        self.config.replica_id, self.config.group, pending.term)
            self._pending = None
            return
        if pending.previous_lease is not None:
            if self._kv.time_to_live(pending.previous_lease, self._timeout()) > 0:
                return  # the previous leader may still act: wait for etcd to end its lease
            pending.previous_lease = None
            pending.not_before = max(pending.not_before, self._clock() + self.config.margin_s)
        now = self._clock()
        if now < pending.not_before or now >= self._valid_until:
            return
        leadership = Leadership(pending.term, pending.previous_term, now)
        with self._lock:
            self._leadership, self._pending = leadership, None
            self.elections_won += 1
        log.info("replica %s leads %s (term %d, previous term %d)", self.config.replica_id,
                 self.config.group, leadership.term, leadership.previous_term)
        self._call(self._on_elected, leadership)

    def _check_key(self) -> None:
        term = self._leadership.term
        found = self._kv.get(self.keys.leader, self._timeout())
        # the lease of a term ends with it: a successor waiting for it must not wait for a TTL
        if found is None:
            self._lose_lease("the leader key is gone (deleted outside blockd)", abandon=True)
        elif found.create_revision != term or found.lease != self._lease_id:
            holder = LeaderInfo.decode(found.value, found.create_revision)
            self._lose_lease(f"the leader key now names {holder.replica_id} (term {holder.term})", abandon=True)
            self._observe(holder)

    def _observe(self, leader: LeaderInfo | None) -> None:
        with self._lock:
            before, self._observed = self._observed, leader
            changed = (before.term if before else 0) != (leader.term if leader else 0)
            if changed:
                self.leader_changes += 1
        if changed:
            self._call(self._on_leader_changed, leader)

    # membership -----------------------------------------------------------------------------------

    def _role(self) -> str:
        if self._leadership is not None:
            return "leader"
        if self._pending is not None or self._observed is None:
            return "candidate"
        return "follower"

    def _publish_member(self) -> None:
        with self._lock:
            applied, lag = self._progress
            term = self._observed.term if self._observed else 0
        info = MemberInfo(self.config.replica_id, self.config.address, self._role(), term, applied, lag)
        now = self._clock()
        if self._member is not None:
            written, lease, at = self._member
            if written == info and lease == self._lease_id and now < at + self.config.member_refresh_s:
                return
        stamped = replace(info, updated_unix_s=round(time.time(), 3))
        self._kv.put(self.keys.member(self.config.replica_id), stamped.encode(), self._lease_id, self._timeout())
        self._member = (info, self._lease_id, now)

    def _call(self, callback, *args) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # a failing callback must not stop the election thread
            log.exception("election callback %s failed", getattr(callback, "__name__", callback))
