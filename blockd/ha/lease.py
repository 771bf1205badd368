"""One replica's etcd lease, and the time until which it provably lives.

**Validity.** After a keepalive that etcd answered with ``TTL > 0``, the
lease is valid until ``t_send + TTL - margin``, where ``t_send`` is this
host's monotonic time taken *before* the request was sent. Why that is
safe: etcd's lessor (on the etcd leader) sets the lease's expiry to *its*
receipt time + TTL, and it received the request after we sent it, so in
real time the lease cannot end before ``t_send + TTL`` - up to the rate
difference rho between the two clocks (no absolute synchronisation is needed,
only bounded drift: rho ~ 1e-4 with NTP, 5e-4 for free-running quartz). The
``margin`` covers rho*TTL and the time between a check of the validity and
the acknowledgement leaving the process. Measuring from the *reply* would
be unsafe: a reply delayed in the network would stretch our belief past the
real expiry. etcd never ends a lease early: expiry is checked by the etcd
leader (every 500 ms) and revocation goes through raft, so keys bound to the
lease disappear at or after the expiry; a new etcd leader *extends* every
lease to a full TTL, it never shortens one.

A lease that is dropped with ``abandon=True`` (its holder stopped leading:
its validity ran out or its key was taken) is revoked once etcd answers
again, so whoever waits for it does not wait for its TTL.

Used by the election thread only; :attr:`LeaseKeeper.valid_until` is a
float that other threads may read (a stale read is an earlier, smaller,
still valid bound).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from blockd.ha.etcd import EtcdClient

log = logging.getLogger("blockd.ha")


class LeaseKeeper:
    """Grant, keep alive, drop and revoke; see the module docstring."""

    def __init__(self, kv: EtcdClient, ttl_s: int, margin_s: float, clock: Callable[[], float]) -> None:
        self._kv, self._ttl_s, self._margin_s, self._clock = kv, ttl_s, margin_s, clock
        self.lease_id: int | None = None
        self.ttl = ttl_s
        self.valid_until = 0.0
        self.next_keepalive = 0.0
        self._abandoned: list[int] = []

    def due(self) -> bool:
        return self.lease_id is not None and self._clock() >= self.next_keepalive

    def grant(self, timeout_s: float) -> None:
        sent = self._clock()
        lease_id, ttl = self._kv.grant(self._ttl_s, timeout_s)
        self.lease_id, self.ttl = lease_id, ttl
        self._renewed(sent, ttl)
        log.debug("holding lease %x (TTL %d s)", lease_id, ttl)

    def keepalive(self, timeout_s: float, retry_s: float) -> bool:
        """Renew; False when etcd no longer has the lease (it is then dropped).

        On EtcdUnavailable (raised) the next attempt is due in ``retry_s``.
        """
        sent = self._clock()
        if self.lease_id is None:
            return False
        try:
            ttl = self._kv.keepalive(self.lease_id, timeout_s)
        except Exception:
            self.next_keepalive = self._clock() + retry_s
            raise
        if ttl <= 0:
            self.drop(abandon=False)
            return False
        self._renewed(sent, ttl)
        return True

    def _renewed(self, sent: float, ttl: int) -> None:
        self.valid_until = sent + ttl - self._margin_s
        self.next_keepalive = sent + ttl / 3

    def drop(self, abandon: bool) -> None:
        """Stop using the lease; if ``abandon``, revoke it at the next :meth:`revoke_abandoned`."""
        if abandon and self.lease_id is not None:
            self._abandoned.append(self.lease_id)
        self.lease_id = None

    def revoke_abandoned(self, timeout_s: float) -> None:
        while self._abandoned:
            self._kv.revoke(self._abandoned[0], timeout_s)
            self._abandoned.pop(0)

    def take_all(self) -> list[int]:
        """Every lease to revoke on shutdown (the current one and abandoned ones); forgets them."""
        leases = [*self._abandoned, *([self.lease_id] if self.lease_id is not None else [])]
        self._abandoned, self.lease_id = [], None
        return leases
