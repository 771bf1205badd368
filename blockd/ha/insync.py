"""The in-sync set of a replica group: the replicas that hold every acknowledged record.

Replication in ``sync`` mode (``docs/ha.md``) keeps one invariant:

    every member of the in-sync set has persisted every acknowledged record.

It is kept by three rules, the first two enforced here, inside etcd:

1. **Only the current leader changes the set**, each change one etcd
   transaction conditioned on the leader key's create revision being the
   caller's term. A deposed leader's change fails (:class:`FencedOut`)
   whatever it believes, because etcd, not the caller, checks the term.
2. **Only a member may win an election** (:func:`campaign_compares`): the
   campaign transaction also requires ``insync/<me>`` to be unchanged since
   the replica read it and found that it vouches for the log it holds now
   (:func:`ineligible`: the same log id, and a log that reaches the entry's
   LSN). An entry outlives the data it was earned with: a replica whose data
   dir was lost, or replaced by an old copy, comes back with an empty or
   short log and must not win with it. A group that never had a leader (no
   ``last_leader`` key) has acknowledged nothing, so its first winner is
   admitted and founds the set in the same transaction.
3. **The leader acknowledges a record only after every other member has
   persisted it**; a member that does not confirm within the ack deadline is
   removed (rule 1) *before* the record is acknowledged without it. A
   follower is added once it has persisted everything up to the leader's
   last record at that moment (it then receives each new record before its
   acknowledgement).

So when a leader dies, any member that wins has every acknowledged record.
The leader itself is always a member (it won as one, or founded the set).
``InSyncEntry.term`` says which leader added an entry, ``lsn`` where the
replica's log stood then, ``log_id`` which copy of its log earned it.
"""

from __future__ import annotations

from blockd.ha.etcd import (
    EtcdClient,
    cmp_absent,
    cmp_create_revision,
    cmp_mod_revision,
    op_delete,
    op_put,
    op_range,
)
from blockd.ha.keys import BadValue, GroupKeys, InSyncEntry, check_name, group_keys


class FencedOut(Exception):
    """The caller's term is no longer the group's current term: it must not act as leader."""


def ineligible(entry: InSyncEntry, log_id: str, local_lsn: int) -> str:
    """Why ``entry`` does not vouch for this replica's log as it is now ("" if it does).

    ``log_id`` names the replica's copy of its log (a new one with every new
    data dir), ``local_lsn`` is the last LSN in it. An entry without a log id
    predates log ids and is judged by its LSN alone.
    """
    if entry.log_id and entry.log_id != log_id:
        return (f"its in-sync entry was earned by another copy of its log (log id {entry.log_id}; this data dir "
                f"holds log {log_id or '(none)'}): the data dir was lost or replaced since")
    if local_lsn < entry.lsn:
        return (f"its log ends at lsn {local_lsn}, before lsn {entry.lsn} where it stood when it joined the "
                "in-sync set: records it had persisted are missing")
    return ""


def campaign_compares(keys: GroupKeys, replica_id: str, log_id: str = "",
                      member_revision: int = 0) -> list[tuple[list[dict], list[dict]]]:
    """The ways ``replica_id`` may win, tried in order: ``(extra compares, extra success ops)``.

    As a member of the set, when ``member_revision`` (the mod revision of its
    entry, which the caller read and checked with :func:`ineligible`) is
    given and the entry is still unchanged; or as the founder of a group that
    never had a leader (which joins the set in the winning transaction, with
    ``log_id``).
    """
    founder = InSyncEntry(replica_id, 0, 0, log_id).encode()
    ways = [([cmp_absent(keys.last_leader)], [op_put(keys.insync(replica_id), founder)])]
    if member_revision:
        ways.insert(0, ([cmp_mod_revision(keys.insync(replica_id), member_revision)], []))
    return ways


class InSyncSet:
    """Reads and (for the leader of ``term``) changes the set; see the module docstring.

    Uses the caller's :class:`EtcdClient` (one per thread).
    """

    def __init__(self, kv: EtcdClient, group: str) -> None:
        self._kv = kv
        self.keys = group_keys(group)

    def members(self) -> list[InSyncEntry]:
        found, _ = self._kv.get_prefix(self.keys.insync_prefix)
        entries = []
        for item in found:
            try:
                entries.append(InSyncEntry.decode(item.value))
            except BadValue as err:
                raise BadValue(f"{item.key}: {err}") from None
        return entries

    def contains(self, replica_id: str) -> bool:
        return self._kv.get(self.keys.insync(replica_id)) is not None

    def add(self, term: int, replica_id: str, lsn: int, log_id: str = "") -> None:
        """Admit ``replica_id`` (its log ``log_id`` holds every record up to ``lsn``); FencedOut if ``term`` is over."""
        check_name("replica id", replica_id)
        if lsn < 0:
            raise ValueError(f"lsn must be >= 0, got {lsn}")
        entry = InSyncEntry(replica_id, term, lsn, log_id)
        self._fenced(term, op_put(self.keys.insync(replica_id), entry.encode()))

    def remove(self, term: int, replica_id: str) -> None:
        """Drop ``replica_id`` before acknowledging without it; FencedOut if ``term`` is over."""
        self._fenced(term, op_delete(self.keys.insync(replica_id)))

    def _fenced(self, term: int, op: dict) -> None:
        if term <= 0:
            raise ValueError(f"term must be > 0, got {term}")
        result = self._kv.txn([cmp_create_revision(self.keys.leader, term)], [op], [op_range(self.keys.leader)])
        if not result.succeeded:
            found = result.ranges[0]
            now = f"term {found[0].create_revision}" if found else "no leader"
            raise FencedOut(f"group {self.keys.group}: term {term} is over ({now}); only the leader changes "
                            "the in-sync set")
