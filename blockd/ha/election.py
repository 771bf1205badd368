"""Leader election with fencing on etcd: who may acknowledge, and until when.

Each replica of a group runs one :class:`Election`. It holds an etcd lease
(TTL ``ttl_s``), renews it every TTL/3, and campaigns by creating
``/blockd/<group>/leader`` bound to that lease *if absent* (one etcd
transaction, which also reads ``last_leader`` and rewrites it) once a read
of the key every ``poll_s`` finds it absent. The winner's
**term** is the leader key's create revision: etcd's revision only grows, so
every later leader has a larger term, on every replica, without a counter of
ours. Everything here runs on one daemon thread; the engine asks
:meth:`Election.can_acknowledge` (cheap, lock + clock) before it
acknowledges a step, and gets ``on_elected`` / ``on_stepped_down`` calls.

**Lease validity.** A leader may act until ``lease_valid_until = t_send +
TTL - margin``, ``t_send`` being the time *before* it sent the last keepalive
that etcd answered; :mod:`blockd.ha.lease` explains why measuring from the
send time is safe with etcd's server-side expiry and bounded clock drift.

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
leader key is gone or belongs to another term. A term is never resumed: the
lease of a term ends with it (abandoned, revoked once etcd answers) and the
replica campaigns again with a new lease, hence for a new term.

**Resign** (graceful shutdown): leadership ends locally first, then the
lease is revoked, which deletes the key at once: the next leader is elected
within one poll (plus its margin) instead of a TTL.

**Members.** Each replica keeps its member key (:mod:`blockd.ha.members`).

Callbacks run on the election thread (the "resigned" step-down on the
thread that calls :meth:`Election.resign`) and must return quickly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from blockd.ha.election_types import ElectionConfig, Leadership
from blockd.ha.etcd import EtcdClient, EtcdUnavailable, cmp_absent, op_put, op_range
from blockd.ha.insync import campaign_compares, ineligible
from blockd.ha.keys import BadValue, InSyncEntry, LeaderInfo, group_keys
from blockd.ha.lease import LeaseKeeper
from blockd.ha.members import MemberReport

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("blockd.ha")

NOT_A_MEMBER = "it is not in the in-sync set"


@dataclass
class _Pending:
    """Won the key, not serving yet: waiting for the previous lease to end."""

    term: int
    previous_term: int
    previous_leader: str
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
                 local_lsn: Callable[[], int] = lambda: 0,
                 leader_heard: Callable[[int], bool] = lambda term: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._local_lsn = local_lsn
        self._leader_heard = leader_heard
        self.keys = group_keys(config.group)
        self._endpoints = endpoints
        self._kv = EtcdClient(endpoints, config.request_timeout_s)
        self._on_elected, self._on_stepped_down = on_elected, on_stepped_down
        self._on_leader_changed = on_leader_changed
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease = LeaseKeeper(self._kv, config.ttl_s, config.margin_s, clock)
        self._pending: _Pending | None = None
        self._leadership: Leadership | None = None
        self._observed: LeaderInfo | None = None
        self._member = MemberReport(self.keys.member(config.replica_id), config.replica_id, config.address,
                                    config.member_refresh_s, clock)
        self._said_ineligible = ""
        self.campaigns = self.elections_won = self.step_downs = self.leader_changes = self.etcd_errors = 0
        self.quiet_cycles = 0  #: cycles that skipped the leader key's read: the leader was heard

    # what the engine asks ------------------------------------------------------------------------

    def can_acknowledge(self) -> bool:
        """True while this replica leads and its lease is provably valid."""
        with self._lock:
            return self._leadership is not None and self._clock() < self._lease.valid_until

    def lease_valid_until(self) -> float:
        """``clock()`` time until which a leader may act (0.0 when not leading)."""
        with self._lock:
            return self._lease.valid_until if self._leadership is not None else 0.0

    @property
    def last_valid_until(self) -> float:
        """The validity of the lease as last renewed, leading or not (for reports and tests)."""
        return self._lease.valid_until

    @property
    def clock(self) -> Callable[[], float]:
        """The clock that validity times are on (``time.monotonic`` unless injected)."""
        return self._clock

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
        self._member.set_progress(applied_lsn, lag_records)

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
            leases = self._lease.take_all()
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
        self.start()
        return self

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
        lease = self._lease
        if lease.lease_id is None:
            lease.grant(self.config.request_timeout_s)
        elif lease.due() and not lease.keepalive(self._timeout(), min(self.config.poll_s, lease.ttl / 6)):
            self._step_down("etcd no longer has the lease (expired)")
        if lease.lease_id is None or self._stop.is_set():
            return
        lease.revoke_abandoned(self.config.request_timeout_s)
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
            timeout = min(timeout, max(0.05, self._lease.valid_until - self._clock()))
        return timeout

    def _sleep_s(self) -> float:
        now = self._clock()
        wake = now + self.config.poll_s
        if self._lease.lease_id is not None:
            wake = min(wake, self._lease.next_keepalive)
        if self._leadership is not None:
            wake = min(wake, self._lease.valid_until)
        if self._pending is not None:
            wake = min(wake, self._pending.not_before)
        return max(0.0, wake - now)

    # losing it ------------------------------------------------------------------------------------

    def _enforce_validity(self) -> None:
        if (self._leadership is not None or self._pending is not None) and self._clock() >= self._lease.valid_until:
            self._step_down(f"lease validity ran out at {self._lease.valid_until:.3f} (no keepalive answered "
                            "in time)")

    def _step_down(self, reason: str) -> None:
        """Leadership (or the wait for it) ends now; so does the lease of the term."""
        with self._lock:
            was, self._leadership, self._pending = self._leadership, None, None
            if was is not None:
                self.step_downs += 1
            self._lease.drop(abandon=True)
        if was is not None:
            log.warning("replica %s steps down as leader of %s (term %d): %s", self.config.replica_id,
                        self.config.group, was.term, reason)
            self._call(self._on_stepped_down, was, reason)

    # the key --------------------------------------------------------------------------------------

    def _me(self) -> LeaderInfo:
        return LeaderInfo(self.config.replica_id, self.config.address, self._lease.lease_id or 0)

    def _campaign(self) -> None:
        me, keys = self._me(), self.keys
        observed = self._observed
        if observed is not None and self._leader_heard(observed.term):
            # The leader this replica knows streams to it right now (``leader_heard``: a message of
            # its term within the last few heartbeats), so it lives and holds its key: nothing to
            # read. A leader that dies or loses its lease stops streaming at once (it steps down
            # before etcd expires its lease), and the reads below resume long before the key can
            # be gone. A follower's reads were most of its CPU time when idle, and of etcd's.
            self.quiet_cycles += 1
            return
        # A follower finds a live leader on nearly every cycle (five a second): one read says so,
        # where the campaign takes two requests (the in-sync entry, then the transaction); those
        # requests were a follower's largest cost besides its feed, and etcd's. Whoever finds the
        # key absent campaigns as before; the transaction still requires it absent.
        held = self._kv.get(keys.leader, self._timeout())
        if held is not None:
            self._found_holder(LeaderInfo.decode(held.value, held.create_revision))
            return
        ways: list[tuple[list[dict], list[dict]]] = [([], [])]
        why = NOT_A_MEMBER
        if self.config.require_in_sync:
            revision, why = self._membership()
            ways = campaign_compares(keys, me.replica_id, self.config.log_id, revision)
        self.campaigns += 1
        for compares, extra_ops in ways:
            result = self._kv.txn([cmp_absent(keys.leader), *compares],
                                  [op_range(keys.last_leader), op_put(keys.leader, me.encode(), me.lease_id),
                                   op_put(keys.last_leader, me.encode()), *extra_ops],
                                  [op_range(keys.leader)], self._timeout())
            if result.succeeded:
                found = result.ranges[0]
                previous = LeaderInfo.decode(found[0].value, found[0].mod_revision) if found else None
                self._begin_pending(result.revision, previous, previous_known=True)
                return
            found = result.ranges[0]
            if found:
                self._found_holder(LeaderInfo.decode(found[0].value, found[0].create_revision))
                return
        if self.config.require_in_sync:  # no leader, and this replica may lack acknowledged records
            self._observe(None)
            if self._said_ineligible != why and why == NOT_A_MEMBER:
                self._said_ineligible = why
                log.info("replica %s is not in the in-sync set of %s: it will not lead until a leader admits "
                         "it", me.replica_id, self.config.group)
            elif self._said_ineligible != why:
                self._said_ineligible = why
                log.warning("replica %s will not lead %s: %s. It joins the in-sync set again once a leader has "
                            "caught it up. If no replica of the group can lead, the acknowledged steps are gone "
                            "with their data dirs: to start the group afresh, accepting that, delete its keys "
                            "(etcdctl del --prefix %s)", me.replica_id, self.config.group, why, keys.prefix)

    def _membership(self) -> tuple[int, str]:
        """``(mod revision of this replica's in-sync entry, "")`` when the entry vouches for
        its log as it is now, else ``(0, why not)``."""
        found = self._kv.get(self.keys.insync(self.config.replica_id), self._timeout())
        if found is None:
            return 0, NOT_A_MEMBER
        try:
            entry = InSyncEntry.decode(found.value)
        except BadValue as err:
            return 0, f"its in-sync entry cannot be read ({err})"
        why = ineligible(entry, self.config.log_id, self._local_lsn())
        return (0, why) if why else (found.mod_revision, "")

    def _found_holder(self, holder: LeaderInfo) -> None:
        if holder.lease_id == self._lease.lease_id:
            # our own earlier attempt was applied but its answer lost: last_leader was overwritten
            self._begin_pending(holder.term, None, previous_known=False)
        else:
            self._observe(holder)

    def _begin_pending(self, term: int, previous: LeaderInfo | None, previous_known: bool) -> None:
        now = self._clock()
        wait = self.config.margin_s if previous_known else self._lease.ttl + self.config.margin_s
        previous_lease = previous.lease_id if previous and previous.lease_id != self._lease.lease_id else None
        self._pending = _Pending(term, previous.term if previous else 0, previous.replica_id if previous else "",
                                 previous_lease, now + wait)
        self._observe(replace(self._me(), term=term))
        log.info("replica %s won the leader key of %s (term %d, previous term %d); serving after fencing",
                 self.config.replica_id, self.config.group, term, self._pending.previous_term)
        self._advance_pending()

    def _holds_key(self, term: int) -> bool:
        found = self._kv.get(self.keys.leader, self._timeout())
        return found is not None and found.create_revision == term and found.lease == self._lease.lease_id

    def _advance_pending(self) -> None:
        pending = self._pending
        if pending is None:
            return
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
        if now < pending.not_before or now >= self._lease.valid_until:
            return
        leadership = Leadership(pending.term, pending.previous_term, now, pending.previous_leader)
        with self._lock:
            if self._stop.is_set():  # resign() ran meanwhile: it must stay resigned
                return
            self._leadership, self._pending = leadership, None
            self.elections_won += 1
        log.info("replica %s leads %s (term %d, previous term %d)", self.config.replica_id,
                 self.config.group, leadership.term, leadership.previous_term)
        self._call(self._on_elected, leadership)

    def _check_key(self) -> None:
        if self._leadership is None:
            return
        term = self._leadership.term
        found = self._kv.get(self.keys.leader, self._timeout())
        if found is None:
            self._step_down("the leader key is gone (deleted outside blockd)")
        elif found.create_revision != term or found.lease != self._lease.lease_id:
            holder = LeaderInfo.decode(found.value, found.create_revision)
            self._step_down(f"the leader key now names {holder.replica_id} (term {holder.term})")
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
            term = self._observed.term if self._observed else 0
        lease_id = self._lease.lease_id
        if lease_id is None:  # between leases: the member key lapsed with the old one
            return
        self._member.publish(self._kv, lease_id, self._role(), term, self._timeout())

    def _call(self, callback, *args) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # a failing callback must not stop the election thread
            log.exception("election callback %s failed", getattr(callback, "__name__", callback))
