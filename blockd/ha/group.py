"""Read-only views of a replica group for observers: who leads, who is there.

For callers that do not take part in the election: the SDK and workers
finding the leader (:func:`read_leader`, :class:`LeaderPoller`), and
``blockctl cluster status`` (:func:`read_status`). Nothing here writes to
etcd.

The poller polls rather than watches: etcd's gateway watch is a long-lived
HTTP stream that ``etcd3gw`` serves from a thread of its own with no
reconnect, and a leader change is rare; one small read every ``poll_s``
(0.2 s) finds a new leader within that and recovers by itself when etcd
comes back. Callers that hit the old leader learn the new one sooner from
its NOT_LEADER error (see ``docs/ha.md``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blockd.ha.etcd import DEFAULT_TIMEOUT_S, EtcdClient, EtcdUnavailable
from blockd.ha.keys import BadValue, InSyncEntry, LeaderInfo, MemberInfo, group_keys

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("blockd.ha")


@dataclass(frozen=True)
class ClusterStatus:
    """One consistent read of a group (all keys at etcd revision ``revision``).

    ``lag_records`` of a member is what it reported; ``leader_applied_lsn``
    - ``applied_lsn`` is what the leader's own report says it lacks.
    """

    group: str
    leader: LeaderInfo | None
    last_term: int
    members: list[MemberInfo]
    in_sync: list[InSyncEntry]
    revision: int
    bad_values: list[str]

    @property
    def leader_applied_lsn(self) -> int | None:
        for member in self.members:
            if self.leader and member.replica_id == self.leader.replica_id:
                return member.applied_lsn
        return None

    def to_dict(self) -> dict:
        leader_lsn = self.leader_applied_lsn
        return {
            "group": self.group,
            "leader": None if self.leader is None else {"replica_id": self.leader.replica_id,
                                                        "address": self.leader.address},
            "term": self.leader.term if self.leader else 0,
            "last_term": self.last_term,
            "members": [{"replica_id": m.replica_id, "address": m.address, "role": m.role, "term": m.term,
                         "applied_lsn": m.applied_lsn, "lag_records": m.lag_records,
                         "behind_leader": None if leader_lsn is None else max(0, leader_lsn - m.applied_lsn),
                         "in_sync": any(e.replica_id == m.replica_id for e in self.in_sync),
                         "updated_unix_s": m.updated_unix_s} for m in self.members],
            "in_sync": [e.replica_id for e in self.in_sync],
            "revision": self.revision,
            "bad_values": self.bad_values,
        }


def read_status(endpoints: str | list[str], group: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> ClusterStatus:
    """Everything under ``/blockd/<group>/`` in one read; EtcdUnavailable if etcd does not answer."""
    keys = group_keys(group)
    kv = EtcdClient(endpoints, timeout_s)
    try:
        found, revision = kv.get_prefix(keys.prefix)
    finally:
        kv.close()
    leader, last_term, members, in_sync, bad = None, 0, [], [], []
    for item in found:
        try:
            if item.key == keys.leader:
                leader = LeaderInfo.decode(item.value, item.create_revision)
            elif item.key == keys.last_leader:
                last_term = item.mod_revision
            elif item.key.startswith(keys.members_prefix):
                members.append(MemberInfo.decode(item.value))
            elif item.key.startswith(keys.insync_prefix):
                in_sync.append(InSyncEntry.decode(item.value))
        except (BadValue, ValueError) as err:
            bad.append(f"{item.key}: {err}")
    return ClusterStatus(group, leader, last_term, members, in_sync, revision, bad)


def read_leader(endpoints: str | list[str], group: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> LeaderInfo | None:
    """The current leader (with its term), or None while there is none."""
    kv = EtcdClient(endpoints, timeout_s)
    try:
        found = kv.get(group_keys(group).leader)
    finally:
        kv.close()
    return None if found is None else LeaderInfo.decode(found.value, found.create_revision)


class LeaderPoller:
    """Calls ``on_change(leader or None)`` whenever the group's leader (by term) changes.

    ``current`` is the last leader seen. etcd errors are retried every
    ``poll_s``; they do not count as a change (the last leader stands).
    """

    def __init__(self, endpoints: str | list[str], group: str, on_change: Callable[[LeaderInfo | None], None],
                 poll_s: float = 0.2, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self._kv = EtcdClient(endpoints, timeout_s)
        self._key = group_keys(group).leader
        self._on_change, self._poll_s = on_change, poll_s
        self._stop = threading.Event()
        self.current: LeaderInfo | None = None
        self._seen_any = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"leader-poller-{group}")

    def start(self) -> LeaderPoller:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._kv.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                found = self._kv.get(self._key)
                leader = None if found is None else LeaderInfo.decode(found.value, found.create_revision)
            except (EtcdUnavailable, BadValue) as err:
                log.debug("leader poll: %s", err)
            else:
                before = self.current.term if self.current else 0
                if not self._seen_any or before != (leader.term if leader else 0):
                    self._seen_any, self.current = True, leader
                    try:
                        self._on_change(leader)
                    except Exception:
                        log.exception("leader change callback failed")
            self._stop.wait(self._poll_s)
