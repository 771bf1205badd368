"""Leader election with fencing (blockd/ha/election.py) against a real etcd.

Checked: one leader among three; terms grow and each leader learns the one
before; resign hands over without waiting for the TTL; a SIGSTOPped leader
process is replaced only after its lease expired, and its last moment of
validity lies before the new leader's first (timestamps on the system-wide
monotonic clock); a leader whose etcd stops answering steps down when its
validity runs out and leads again, in a new term, once etcd is back; a
winner waits for a previous lease that is still alive. No assertion is on
durations except "well under a TTL" with a TTL of 30 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from blockd.cluster.local import ROOT, child_env
from blockd.ha.etcd import EtcdClient
from blockd.ha.group import LeaderPoller, read_leader, read_status
from blockd.ha.keys import LeaderInfo, group_keys
from tests.support.ha_fixtures import the_leader, wait_for

pytest_plugins = ["tests.support.etcd", "tests.support.ha_fixtures"]


def test_etcd_client_leases_and_transactions(etcd_server):
    from blockd.ha.etcd import EtcdUnavailable, cmp_absent, op_put, op_range, parse_endpoints

    kv = EtcdClient(etcd_server.url)
    lease, ttl = kv.grant(2)
    assert ttl >= 2 and kv.keepalive(lease) >= 2 and kv.time_to_live(lease) > 0
    first = kv.txn([cmp_absent("/t/k")], [op_put("/t/k", b"one", lease)], [op_range("/t/k")])
    second = kv.txn([cmp_absent("/t/k")], [op_put("/t/k", b"two", lease)], [op_range("/t/k")])
    assert first.succeeded and not second.succeeded
    assert [(f.value, f.create_revision, f.lease) for f in second.ranges[0]] == [(b"one", first.revision, lease)]
    kv.revoke(lease)
    assert kv.get("/t/k") is None and kv.keepalive(lease) == 0 and kv.time_to_live(lease) == -1
    kv.revoke(lease)  # already gone: not an error
    assert parse_endpoints("127.0.0.1:1, https://h:2") == ["http://127.0.0.1:1", "https://h:2"]
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_endpoints("http://nohost")
    dead = EtcdClient("http://127.0.0.1:1", timeout_s=1.0)
    with pytest.raises(EtcdUnavailable, match=r"127\.0\.0\.1:1"):
        dead.get("/t/k")


def test_one_leader_among_three_and_members_registered(etcd_server, replicas):
    group = [replicas(etcd_server.url, "three", f"r{i}") for i in range(3)]
    leader = wait_for(lambda: the_leader(group), "a leader")
    term = leader.leads().term
    wait_for(lambda: all(r.election.leader() and r.election.leader().term == term for r in group),
             "every replica to see the leader")
    assert [r.election.can_acknowledge() for r in group].count(True) == 1
    assert read_leader(etcd_server.url, "three") == LeaderInfo(leader.election.config.replica_id,
                                                               leader.election.config.address,
                                                               read_leader(etcd_server.url, "three").lease_id, term)
    leader.election.report_progress(applied_lsn=42, lag_records=0)

    def members_settled():
        status = read_status(etcd_server.url, "three")
        roles = sorted((m.replica_id, m.role, m.term) for m in status.members)
        return status if len(roles) == 3 and sorted(r for _, r, _ in roles) == ["follower", "follower", "leader"] \
            and {t for _, _, t in roles} == {term} and status.leader_applied_lsn == 42 else None

    status = wait_for(members_settled, "three member keys with their roles")
    assert status.leader.term == term and status.bad_values == []
    assert status.to_dict()["leader"] == {"replica_id": leader.election.config.replica_id,
                                          "address": leader.election.config.address}


def test_terms_grow_and_resign_hands_over_without_waiting_for_the_ttl(etcd_server, replicas):
    # a TTL of 30 s: a successor that waited for the lease to expire would miss the 15 s below
    group = [replicas(etcd_server.url, "resign", f"r{i}", ttl_s=30) for i in range(3)]
    leader = wait_for(lambda: the_leader(group), "a leader")
    terms = [leader.leads().term]
    for _ in range(2):
        old = leader
        old.election.resign()
        assert not old.election.can_acknowledge()
        assert old.events[-1][0] == "stepped_down" and old.events[-1][3] == "resigned"
        group.remove(old)
        leader = wait_for(lambda: the_leader(group), "the next leader after a resign", timeout_s=15.0)
        won = leader.leads()
        assert won.term > terms[-1] and won.previous_term == terms[-1]
        assert old.events[-1][2] < won.serving_since
        terms.append(won.term)
    keys = group_keys("resign")
    members, _ = EtcdClient(etcd_server.url).get_prefix(keys.members_prefix)
    assert [m.key for m in members] == [keys.member(leader.election.config.replica_id)]  # resigned ones are gone


def test_new_leader_waits_for_a_previous_lease_that_still_lives(etcd_server, replicas):
    """The leader key was deleted by hand while its owner's lease lives on (for 3 s more)."""
    kv = EtcdClient(etcd_server.url)
    keys = group_keys("ghost")
    ghost_lease, _ = kv.grant(3)
    ghost_term = kv.put(keys.last_leader, LeaderInfo("ghost", "ghost.test:1", ghost_lease).encode())
    replica = replicas(etcd_server.url, "ghost", "r0")
    last_alive_asked = 0.0
    while True:
        asked = time.monotonic()
        if kv.time_to_live(ghost_lease) <= 0:
            break
        last_alive_asked = asked  # the lease lived at some moment after this
        time.sleep(0.02)
    won = wait_for(replica.leads, "the leader after the ghost's lease ended")
    assert won.serving_since > last_alive_asked > 0
    assert won.previous_term == ghost_term


def test_leader_steps_down_when_etcd_stops_answering_and_returns_in_a_new_term(own_etcd, replicas):
    server = own_etcd()
    replica = replicas(server.url, "down", "r0")
    first = wait_for(replica.leads, "a leader")
    server.pause()
    try:
        wait_for(lambda: replica.events[-1][0] == "stepped_down", "the step-down while etcd is paused")
        _, was, at, reason = replica.events[-1]
        assert was == first and "validity ran out" in reason
        assert at >= replica.stepped_down_valid_until and not replica.election.can_acknowledge()
    finally:
        server.resume()
    again = wait_for(replica.leads, "leadership again once etcd answers")
    assert again.term > first.term and again.previous_term == first.term


class Candidate:
    """``tests/support/ha_candidate.py`` as a child process; its JSON events, as they come."""

    def __init__(self, url: str, group: str, replica_id: str) -> None:
        self.events: list[dict] = []
        self.popen = subprocess.Popen([sys.executable, "-m", "tests.support.ha_candidate", "--etcd", url,
                                       "--group", group, "--replica-id", replica_id],
                                      cwd=ROOT, env=child_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.output.append(line)
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def find(self, event: str) -> list[dict]:
        return [e for e in list(self.events) if e["event"] == event]

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGCONT)
            self.popen.kill()
        self.popen.wait()


def test_paused_leader_process_is_replaced_only_after_its_lease_expired(etcd_server, replicas):
    old = Candidate(etcd_server.url, "paused", "old")
    try:
        wait_for(lambda: old.find("elected") and old.find("ack"), "the child to lead and acknowledge")
        old_lease = read_leader(etcd_server.url, "paused").lease_id
        new = replicas(etcd_server.url, "paused", "new")
        wait_for(lambda: new.election.leader() and new.election.leader().replica_id == "old",
                 "the second replica to see the first lead")
        os.kill(old.popen.pid, signal.SIGSTOP)
        won = wait_for(new.leads, "the second replica to take over")
        assert EtcdClient(etcd_server.url).time_to_live(old_lease) == -1, "took over before the old lease ended"
        os.kill(old.popen.pid, signal.SIGCONT)
        down = wait_for(lambda: old.find("stepped_down"), "the continued child to step down")[0]
        assert down["valid_until"] < won.serving_since, (down, won)
        acks = wait_for(lambda: old.find("ack")[-1]["value"] is False and old.find("ack"),
                        "the continued child to see that it may not acknowledge")
        assert all(a["at"] < won.serving_since for a in acks if a["value"]), (acks, won)
        assert len(old.find("elected")) == 1 and new.election.can_acknowledge()
        assert won.previous_term == old.find("elected")[0]["term"]
    finally:
        old.kill()
    assert old.popen.returncode is not None, "".join(old.output)


def test_leader_poller_sees_every_change(etcd_server, replicas):
    seen: list[LeaderInfo | None] = []
    with LeaderPoller(etcd_server.url, "poller", seen.append, poll_s=0.05):
        wait_for(lambda: seen == [None], "the poller to report no leader")
        first = replicas(etcd_server.url, "poller", "a")
        wait_for(lambda: len(seen) == 2, "the first leader")
        second = replicas(etcd_server.url, "poller", "b")
        wait_for(lambda: second.election.leader() is not None, "b to see a")
        first.election.resign()
        wait_for(lambda: second.leads() and seen[-1] and seen[-1].replica_id == "b", "the second leader")
        second.election.resign()
        wait_for(lambda: seen[-1] is None, "no leader")
    names = [s.replica_id if s else None for s in seen]
    # between a's resign and b's election the key may be absent for a moment
    assert names in ([None, "a", "b", None], [None, "a", None, "b", None]), names
    assert seen[1].term < seen[-2].term


def test_a_follower_that_hears_its_leader_does_not_read_the_leader_key(etcd_server):
    """While the known leader streams to it (``leader_heard``), a follower's cycles read
    nothing, so it does not see the key go either; once the leader falls silent it reads
    again, finds the key gone and takes over. (In a group the leader's feeds stop before
    its key can go: it steps down first.)"""
    from blockd.ha.election import Election, ElectionConfig

    def config(rid: str) -> ElectionConfig:
        return ElectionConfig(group="heard", replica_id=rid, address=f"{rid}.test:1", ttl_s=2, margin_s=0.2)

    heard = threading.Event()
    leader = Election(etcd_server.url, config("a")).start()
    follower = Election(etcd_server.url, config("b"), leader_heard=lambda term: heard.is_set())
    try:
        term = wait_for(lambda: leader.leadership, "a to lead").term
        follower.start()
        wait_for(lambda: follower.leader() is not None and follower.leader().term == term, "b to see a lead")
        assert follower.quiet_cycles == 0  # nothing heard yet: it read the key every cycle
        heard.set()
        wait_for(lambda: follower.quiet_cycles >= 5, "quiet cycles")
        leader.resign()  # the key goes at once
        time.sleep(1.0)  # five polls
        assert follower.leadership is None and follower.campaigns == 0, "a follower that heard its leader read"
        heard.clear()
        won = wait_for(lambda: follower.leadership, "b to lead once a's stream fell silent")
        assert won.previous_term == term
    finally:
        follower.resign()
        leader.resign()
