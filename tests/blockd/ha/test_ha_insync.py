"""The in-sync set (blockd/ha/insync.py) and elections that require it, against a real etcd.

Checked: the first leader of a fresh group founds the set; a replica outside
the set never wins, however often it campaigns, while a replica the leader
admitted does; a deposed leader's change to the set is refused by etcd
(FencedOut) and changes nothing; a leader learns who led before it; an entry
earned by another copy of a replica's log (a lost data dir), or by a longer
log than the replica holds now, does not let it lead.
"""

from __future__ import annotations

import pytest

from blockd.ha.etcd import EtcdClient
from blockd.ha.insync import FencedOut, InSyncSet, ineligible
from blockd.ha.keys import InSyncEntry
from tests.support.ha_fixtures import the_leader, wait_for

pytest_plugins = ["tests.support.etcd", "tests.support.ha_fixtures"]


def test_founder_joins_and_only_members_win(etcd_server, replicas):
    url = etcd_server.url
    insync = InSyncSet(EtcdClient(url), "isr")
    a = replicas(url, "isr", "a", require_in_sync=True)
    won = wait_for(a.leads, "the founder to lead")
    assert [(e.replica_id, e.term) for e in insync.members()] == [("a", 0)]
    b = replicas(url, "isr", "b", require_in_sync=True, local_lsn=lambda: 7)
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


def test_an_entry_vouches_only_for_the_log_that_earned_it():
    entry = InSyncEntry("b", 7, 40, "log-b")
    assert ineligible(entry, "log-b", 40) == "" and ineligible(entry, "log-b", 41) == ""
    assert "data dir was lost or replaced" in ineligible(entry, "log-new", 40)
    assert "records it had persisted are missing" in ineligible(entry, "log-b", 39)
    legacy = InSyncEntry("b", 7, 40)  # written before log ids: judged by its lsn
    assert ineligible(legacy, "log-new", 40) == "" and "missing" in ineligible(legacy, "log-new", 0)
    assert InSyncEntry.decode(b'{"replica_id": "b", "term": 7, "lsn": 40}') == legacy


def test_a_replica_with_a_lost_or_short_log_does_not_lead(etcd_server, replicas):
    url = etcd_server.url
    insync = InSyncSet(EtcdClient(url), "lost")
    a = replicas(url, "lost", "a", require_in_sync=True, log_id="log-a")
    won = wait_for(a.leads, "a to found the set")
    assert [(e.replica_id, e.log_id) for e in insync.members()] == [("a", "log-a")]
    insync.add(won.term, "b", lsn=40, log_id="log-b")
    insync.add(won.term, "c", lsn=40, log_id="log-c")
    # b comes back with a new data dir (an empty log, a new id); c with its own log, cut short
    b = replicas(url, "lost", "b", require_in_sync=True, log_id="log-b2", local_lsn=lambda: 0)
    c = replicas(url, "lost", "c", require_in_sync=True, log_id="log-c", local_lsn=lambda: 12)
    wait_for(lambda: b.election.leader() and c.election.leader(), "b and c to see a lead")
    a.election.resign()
    tries = (b.election.campaigns, c.election.campaigns)
    wait_for(lambda: b.election.campaigns >= tries[0] + 10 and c.election.campaigns >= tries[1] + 10,
             "b and c to campaign ten more times")
    assert b.leads() is None and c.leads() is None and c.election.leader() is None
    # c with the whole of its log leads
    c.election.resign()
    whole = replicas(url, "lost", "c", require_in_sync=True, log_id="log-c", local_lsn=lambda: 40)
    assert wait_for(whole.leads, "c with its whole log to lead").previous_leader == "a"
    assert b.leads() is None
