"""The leader's commit point as plain data (:mod:`blockd.replication.commit_point`), by tables of cases.

As etcd's raft tests its quorum: no threads, sockets, clocks or etcd. Each
case sets up the followers' persisted LSNs, the in-sync members and those
joining, the mode and ``min_in_sync``, and checks the commit index, who a
commit waits for, who a waiter drops, who may join, and what a new term
starts with. The threads, waits and etcd writes around it are
``tests/blockd/replication/test_repl_commits.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from blockd.replication.commit_point import Acked, CommitPoint, Joined
from tests.conftest import ROOT

TERM = 3


def _point(mode: str = "sync", min_in_sync: int = 2, members: dict[str, int] | None = None,
           joining: dict[str, int] | None = None, others: dict[str, int] | None = None, acked: int = 0,
           max_members: int = 0, max_lag_records: int = 0, live_s: float = 1.0) -> CommitPoint:
    """A point leading ``TERM``: ``members`` and followers outside the set (``others``) have
    persisted the LSNs given (a member missing from both has opened no feed), and ``joining``
    followers have acknowledged theirs and are having their entry written."""
    point = CommitPoint("r0", mode, min_in_sync, max_lag_records=max_lag_records, live_s=live_s,
                        max_members=max_members)
    members = members or {}
    point.begin(TERM, set(members), dict.fromkeys(members, ""))
    for rid, lsn in {**members, **(others or {})}.items():
        if lsn >= 0:
            assert point.opened(TERM, rid, f"{rid}:1", lsn, "", now=1.0) is None
    point.acknowledged(acked)
    for rid, lsn in (joining or {}).items():
        point.opened(TERM, rid, f"{rid}:1", 0, f"log-{rid}", now=1.0)
        assert point.ack(TERM, rid, lsn, now=1.0).join, f"{rid} did not start joining"
    return point


@pytest.mark.parametrize(("mode", "min_in_sync", "members", "joining", "last_lsn", "commit"), [
    # async: the leader's own record is committed; followers trail
    ("async", 1, {}, {}, 10, 10),
    ("async", 2, {"r1": 3}, {}, 10, 10),
    # sync: the slowest member, at most the leader's last record
    ("sync", 1, {}, {}, 10, 10),  # the leader alone is enough
    ("sync", 2, {}, {}, 10, 0),  # too few: nothing is committed
    ("sync", 2, {"r1": 5}, {}, 10, 5),
    ("sync", 2, {"r1": 12}, {}, 10, 10),
    ("sync", 2, {"r1": 5, "r2": 7}, {}, 10, 5),
    ("sync", 2, {"r1": 9, "r2": 7}, {}, 10, 7),
    ("sync", 3, {"r1": 5}, {}, 10, 0),
    ("sync", 3, {"r1": 5, "r2": 7}, {}, 10, 5),
    ("sync", 2, {"r1": -1}, {}, 10, 0),  # a member that has opened no feed has persisted nothing here
    # joining: waited for, but not counted towards min_in_sync before etcd holds the entry
    ("sync", 2, {"r1": 7}, {"r2": 3}, 10, 3),
    ("sync", 3, {"r1": 7}, {"r2": 9}, 10, 0),
    ("sync", 2, {}, {"r1": 9}, 10, 0),
    ("sync", 1, {}, {"r1": 4}, 10, 4),
])
def test_the_commit_index(mode, min_in_sync, members, joining, last_lsn, commit):
    point = _point(mode, min_in_sync, members, joining)
    assert point.commit_index(last_lsn) == commit
    assert point.view(last_lsn, now=2.0).commit_lsn == commit


def test_a_follower_outside_the_set_does_not_move_the_commit_index():
    point = _point(members={"r1": 8}, others={"r2": 1, "r3": 20})
    assert point.commit_index(10) == 8
    assert point.waited_for() == {"r1"}


@pytest.mark.parametrize(("members", "joining", "lsn", "laggards"), [
    ({"r1": 5, "r2": 9}, {"r3": 7}, 5, []),
    ({"r1": 5, "r2": 9}, {"r3": 7}, 6, ["r1"]),
    ({"r1": 5, "r2": 9}, {"r3": 7}, 8, ["r1", "r3"]),
    ({"r1": 5, "r2": 9}, {"r3": 7}, 10, ["r1", "r2", "r3"]),
    ({"r1": -1}, {}, 1, ["r1"]),
    ({}, {}, 10, []),
])
def test_who_must_ack_and_who_a_waiter_drops(members, joining, lsn, laggards):
    point = _point(members=members, joining=joining)
    assert point.waited_for() == set(members) | set(joining)
    assert point.laggards(lsn) == laggards
    for rid in laggards:
        point.drop(rid)
    assert point.waited_for() == (set(members) | set(joining)) - set(laggards)
    assert not point.laggards(lsn)


@pytest.mark.parametrize(("mode", "members", "others", "acked", "max_members", "ack", "outcome"), [
    # a member's ack wakes the waiters only when the slowest member moves
    ("sync", {"r1": 3, "r2": 5}, {}, 0, 0, ("r1", 4), Acked(wake=True)),
    ("sync", {"r1": 3, "r2": 5}, {}, 0, 0, ("r2", 6), Acked(wake=False)),
    ("sync", {"r1": 3, "r2": 5}, {}, 0, 0, ("r1", 2), Acked(wake=False)),  # an old ack moves nothing back
    # a follower outside the set joins once it holds every acknowledged record
    ("sync", {"r1": 3}, {"r3": 0}, 5, 0, ("r3", 4), Acked()),
    ("sync", {"r1": 3}, {"r3": 0}, 5, 0, ("r3", 5), Acked(join=True, log_id="log-r3")),
    ("sync", {}, {"r3": 0}, 0, 0, ("r3", 0), Acked(join=True, log_id="log-r3")),
    # ... and while the set has a free place (--sync-followers)
    ("sync", {"r1": 3}, {"r3": 0}, 5, 1, ("r3", 6), Acked()),
    ("sync", {"r1": 3}, {"r3": 0}, 5, 2, ("r3", 6), Acked(join=True, log_id="log-r3")),
    # async: every ack wakes (the lag bound), nobody joins
    ("async", {}, {"r3": 0}, 0, 0, ("r3", 6), Acked(wake=True)),
])
def test_what_an_ack_changes(mode, members, others, acked, max_members, ack, outcome):
    point = _point(mode, 2, members, others={}, acked=acked, max_members=max_members)
    for rid, lsn in others.items():
        point.opened(TERM, rid, "", lsn, f"log-{rid}", now=1.0)
    rid, lsn = ack
    assert point.ack(TERM, rid, lsn, now=2.0) == outcome
    assert point.persisted(rid) == max(lsn, {**members, **others}.get(rid, 0))
    assert (rid in point.joining) == outcome.join
    assert point.members == set(members), "an ack alone never makes a member: etcd's entry comes first"


@pytest.mark.parametrize("term", [TERM - 1, TERM + 1, 0])
def test_an_ack_of_another_term_changes_nothing(term):
    point = _point(members={"r1": 3})
    assert point.ack(term, "r1", 9, now=2.0) == Acked()
    assert point.persisted("r1") == 3 and point.commit_index(10) == 3


def test_no_ack_counts_once_the_term_ended():
    point = _point(members={"r1": 3})
    point.end()
    assert point.ack(TERM, "r1", 9, now=2.0) == Acked()


@pytest.mark.parametrize(("meanwhile", "joined", "members"), [
    ("nothing", Joined.MEMBER, {"r1", "r2"}),
    ("dropped", Joined.DROPPED, {"r1"}),  # the caller removes the entry it just wrote
    ("term ended", Joined.TERM_OVER, {"r1"}),
    ("next term", Joined.TERM_OVER, set()),
])
def test_a_joining_follower_becomes_a_member_only_in_its_term_and_if_not_dropped(meanwhile, joined, members):
    point = _point(min_in_sync=3, members={"r1": 5}, joining={"r2": 5}, acked=5)
    assert point.commit_index(5) == 0, "a joining follower counted before etcd held its entry"
    if meanwhile == "dropped":
        point.drop("r2")
    elif meanwhile == "term ended":
        point.end()
    elif meanwhile == "next term":
        point.begin(TERM + 1, set(), {})
    assert point.joined(TERM, "r2", "log-r2") is joined
    assert point.members == members and not point.joining
    if joined is Joined.MEMBER:
        assert point.member_logs["r2"] == "log-r2" and point.commit_index(5) == 5


def test_a_failed_entry_write_leaves_the_follower_outside_and_free_to_try_again():
    point = _point(members={"r1": 5}, joining={"r2": 5}, acked=5)
    point.join_failed("r2")
    assert point.waited_for() == {"r1"}
    assert point.ack(TERM, "r2", 5, now=2.0).join


@pytest.mark.parametrize(("logs", "previous_leader", "max_members", "members", "leaving"), [
    (["r0", "r1", "r2"], "", 0, {"r1", "r2"}, []),
    (["r0", "r1", "r2"], "r1", 0, {"r2"}, ["r1"]),  # it may be dead; it rejoins once caught up
    (["r0", "r1", "r2"], "r0", 0, {"r1", "r2"}, []),  # this replica led the previous term too
    (["r1", "r2"], "r9", 0, {"r1", "r2"}, []),
    (["r0", "r1", "r2", "r3"], "", 1, {"r1"}, ["r2", "r3"]),  # a set kept under a larger limit
    (["r0", "r1", "r2", "r3"], "r1", 1, {"r2"}, ["r1", "r3"]),
    (["r1", "r2"], "", 2, {"r1", "r2"}, []),
    ([], "r1", 0, set(), []),
])
def test_what_a_new_term_starts_with(logs, previous_leader, max_members, members, leaving):
    point = CommitPoint("r0", "sync", 2, max_members=max_members)
    assert point.starting_members(dict.fromkeys(logs, ""), previous_leader) == (members, leaving)


def test_a_new_term_forgets_the_last_ones_followers_and_acknowledgements():
    point = _point(members={"r1": 5}, joining={"r2": 5}, acked=5)
    point.begin(TERM + 1, {"r1"}, {"r1": "log-r1"})
    assert point.term == TERM + 1 and point.members == {"r1"} and not point.joining
    assert point.followers == {} and point.acked == 0 and point.commit_index(9) == 0


@pytest.mark.parametrize(("member", "known", "log_id", "term", "leaves"), [
    (True, "A", "B", TERM, True),  # another copy of its log: its data dir was lost
    (True, "A", "A", TERM, False),
    (True, "", "B", TERM, False),  # the entry names no log (written before log ids)
    (True, "A", "", TERM, False),  # the follower names none
    (True, "A", "B", TERM - 1, False),  # a feed of an older term
    (False, "A", "B", TERM, False),  # not a member: nothing vouched for
])
def test_a_member_whose_log_is_another_copy_must_leave(member, known, log_id, term, leaves):
    point = CommitPoint("r0", "sync", 2)
    point.begin(TERM, {"r1"} if member else set(), {"r1": known})
    assert point.opened(term, "r1", "r1:1", 4, log_id, now=1.0) == (known if leaves else None)
    assert point.persisted("r1") == 4 and point.followers["r1"].log_id == log_id


@pytest.mark.parametrize(("followers", "lsn", "now", "holding_back"), [
    ({"r1": (5, 1.0)}, 15, 1.5, []),  # 10 behind: within the bound
    ({"r1": (5, 1.0)}, 16, 1.5, ["r1"]),
    ({"r1": (5, 1.0)}, 16, 2.5, []),  # its last ack is older than live_s: it stopped counting
    ({"r1": (5, 1.0), "r2": (0, 2.0)}, 16, 2.5, ["r2"]),
    ({"r1": (30, 1.0)}, 16, 1.5, []),
])
def test_async_steps_wait_for_live_followers_beyond_the_lag_bound(followers, lsn, now, holding_back):
    point = CommitPoint("r0", "async", 1, max_lag_records=10, live_s=1.0)
    point.begin(TERM, set(), {})
    for rid, (persisted, at) in followers.items():
        point.opened(TERM, rid, "", 0, "", now=at)
        point.ack(TERM, rid, persisted, now=at)
    assert [f.replica_id for f in point.holding_back(lsn, now)] == holding_back


@pytest.mark.parametrize(("members", "others", "now", "joinable"), [
    ({"r1": 3}, {}, 1.5, False),
    ({"r1": 3}, {"r2": 3}, 1.5, True),  # live, outside the set
    ({"r1": 3}, {"r2": 3}, 2.5, False),  # not live any more
])
def test_a_waiter_gives_a_live_follower_outside_the_set_a_chance(members, others, now, joinable):
    assert _point(members=members, others=others).joinable(now) is joinable


def test_a_step_by_step_walk_through_a_term():
    """etcd's raft style: one sequence, the commit index after every event."""
    point = CommitPoint("r0", "sync", 2)
    point.begin(TERM, set(), {})
    point.acknowledged(1)  # term_start at lsn 1
    steps = [
        (lambda: point.opened(TERM, "r1", "", 0, "L1", now=1.0), 0),
        (lambda: point.ack(TERM, "r1", 1, now=1.1), 0),  # joining: not counted yet
        (lambda: point.joined(TERM, "r1", "L1"), 1),
        (lambda: point.opened(TERM, "r2", "", 0, "L2", now=1.2), 1),
        (lambda: point.ack(TERM, "r1", 3, now=1.3), 3),
        (lambda: point.acknowledged(3), 3),
        (lambda: point.ack(TERM, "r2", 2, now=1.4), 3),  # behind the acknowledged: outside the set
        (lambda: point.ack(TERM, "r2", 3, now=1.5), 3),  # joining now: the next step waits for it
        (lambda: point.ack(TERM, "r1", 5, now=1.6), 3),
        (lambda: point.joined(TERM, "r2", "L2"), 3),
        (lambda: point.ack(TERM, "r2", 4, now=1.7), 4),
        (lambda: point.drop("r2"), 5),  # dropped at a deadline
        (lambda: point.drop("r1"), 0),  # the leader alone is too few
    ]
    for i, (event, commit) in enumerate(steps):
        event()
        assert point.commit_index(5) == commit, f"after event {i}"


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"mode": "quorum"}, "mode"),
    ({"min_in_sync": 0}, "min_in_sync"),
    ({"max_members": -1}, "max_members"),
    ({"max_lag_records": -1}, "max_lag_records"),
])
def test_a_bad_rule_is_an_explicit_error(kwargs, why):
    args = {"replica_id": "r0", "mode": "sync", "min_in_sync": 2, **kwargs}
    with pytest.raises(ValueError, match=why):
        CommitPoint(**args)


def test_the_commit_point_imports_only_the_standard_librarys_data_types():
    path = Path(ROOT) / "blockd" / "replication" / "commit_point.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported <= {"__future__", "enum", "collections.abc", "dataclasses"}, imported
