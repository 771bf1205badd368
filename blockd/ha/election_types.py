"""What a replica's election is set up with, and what it tells an elected leader.

Plain frozen dataclasses, checked when made: :class:`ElectionConfig` (one
replica's part in a group's election) and :class:`Leadership` (an elected
leader's term, the term before it and who held it). The election itself is
:mod:`blockd.ha.election`.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockd.ha.keys import check_name


@dataclass(frozen=True)
class ElectionConfig:
    """One replica's part in a group's election.

    ``address``: what callers dial to reach this replica (advertised gRPC
    address). ``ttl_s``: the lease TTL asked of etcd (it may grant more).
    ``margin_s``: safety margin taken off each lease validity and waited by a
    new leader before serving. ``poll_s``: how often a non-leader campaigns /
    a leader re-reads its key. ``request_timeout_s``: bound on one etcd call.
    ``require_in_sync``: campaign only as a member of the in-sync set
    (:mod:`blockd.ha.insync`; ``sync`` replication needs it) whose entry
    vouches for this replica's log: ``log_id`` names that log and the
    election's ``local_lsn`` callable says where it ends.
    """

    group: str
    replica_id: str
    address: str
    ttl_s: int = 2
    margin_s: float = 0.5
    poll_s: float = 0.2
    request_timeout_s: float = 1.0
    member_refresh_s: float = 5.0
    require_in_sync: bool = False
    log_id: str = ""

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
    """What an elected leader knows: its ``term``, the term before it and who
    held it (0 and "": none known) and when (``clock()``) it began to serve."""

    term: int
    previous_term: int
    serving_since: float
    previous_leader: str = ""
