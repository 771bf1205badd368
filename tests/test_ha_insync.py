"""The in-sync set (blockd/ha/insync.py) and elections that require it, against a real etcd.

Checked: the first leader of a fresh group founds the set; a replica outside
the set never wins, however often it campaigns, while a replica the leader
admitted does; a deposed leader's change to the set is refused by etcd
(FencedOut) and changes nothing; a leader learns who led before it.
"""

from __future__ import annotations

import pytest

from blockd.ha.etcd import EtcdClient
from blockd.ha.insync import FencedOut, InSyncSet
from tests.ha_fixtures import the_leader, wait_for

pytest_plugins = ["tests.etcd", "tests.ha_fixtures"]


def test_founder_joins_and_only_members_win(etcd_server, replicas):
    url = etcd_server.url
    insync = InSyncSet(EtcdClient(url), "isr")
    a = replicas(url, "isr", "a", require_in_sync=True)
    won = wait_for(a.leads, "the founder to lead")
    assert [(e.replica_id, e.term) for e in insync.members()] == [("a", 0)]
    b = replicas(url, "isr", "b", require_in_sync=True)
    c = replicas(url, "isr", "c", require_in_sync=True)
    wait_for(lambda: b.election.leader() and c.election.leader(), "b and c to see a lead")
    insync.add(won.term, "b", lsn=7)
    assert insync.contains("b") and not insync.contains("c")
    a.election.resign()
    new = wait_for(lambda: the_leader([b, c]), "a member of the set to lead")
    assert new is b and new.leads().previous_leader == "a" and new.leads().previous_term == won.term
    # c campaigns all along and never wins; with b gone no one leads
    b.election.resign()
    tries = c.election.campaigns
    wait_for(lambda: c.election.campaigns >= tries + 10, "c to campaign ten more times")
    assert c.leads() is None and c.election.leader() is None
    assert {(e.replica_id, e.term, e.lsn) for e in insync.members()} == {("a", 0, 0), ("b", won.term, 7)}


def test_a_deposed_leader_cannot_change_the_set(etcd_server, replicas):
    url = etcd_server.url
    insync = InSyncSet(EtcdClient(url), "fenced")
    a = replicas(url, "fenced", "a", require_in_sync=True)
    old_term = wait_for(a.leads, "a to lead").term
    insync.add(old_term, "b", lsn=0)
    b = replicas(url, "fenced", "b", require_in_sync=True)
    wait_for(b.election.leader, "b to see a lead")
    a.election.resign()
    new_term = wait_for(b.leads, "b to lead").term
    before = insync.members()
    with pytest.raises(FencedOut, match=f"term {old_term} is over \\(term {new_term}\\)"):
        insync.add(old_term, "c", lsn=1)
    with pytest.raises(FencedOut):
        insync.remove(old_term, "b")
    assert insync.members() == before
    insync.remove(new_term, "a")  # the new leader drops the old one until it has caught up
    assert [e.replica_id for e in insync.members()] == ["b"]
    with pytest.raises(ValueError, match="replica id"):
        insync.add(new_term, "../leader", lsn=0)
