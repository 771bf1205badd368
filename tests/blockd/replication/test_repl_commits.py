"""The leader's commit point shared by threads (blockd/replication/commits.py ``Commits``): waits and etcd writes.

Its rules alone, as plain data, are ``tests/blockd/replication/test_repl_commit_point.py``.

``async`` mode, the lag bound: a step waits while a live follower (one that
acknowledged within ``live_s``) trails its record by more than
``max_lag_records``; a follower that stopped acknowledging does not hold
steps back; the deadline ends the wait; a replica that stops leading
refuses. The in-sync set (etcd) is not used in ``async`` mode: the store
here fails any call to it.

``sync`` mode, joining the set: a follower counts towards ``min_in_sync``
only once etcd holds its entry (a leader paused in between had acknowledged
a step that no replica allowed to lead held, and the group stalled: a CI
failure); one dropped at the deadline while its entry is written ends
outside the set.
"""

from __future__ import annotations

import threading
import time

import pytest

from blockd.core.errors import NotLeader, NotReplicated
from blockd.replication.commits import Commits


class _NoInSyncSet:
    def members(self) -> dict[str, str]:
        return {}

    def add(self, term: int, replica_id: str, lsn: int, log_id: str = "") -> None:
        raise AssertionError("async mode changed the in-sync set")

    def remove(self, term: int, replica_id: str) -> None:
        raise AssertionError("async mode changed the in-sync set")


def _commits(live_s: float = 5.0) -> Commits:
    commits = Commits("r0", "async", 1, _NoInSyncSet(), max_lag_records=10, live_s=live_s)
    commits.begin(3, "")
    commits.opened(3, "r1", "r1:1", 0)
    commits.ack(3, "r1", 5)
    return commits


def test_a_step_waits_while_a_live_follower_trails_beyond_the_bound():
    commits = _commits()
    start = time.monotonic()
    commits.wait(15, 15, start + 5, lambda: True)  # 10 behind: within the bound, at once
    assert time.monotonic() - start < 0.5
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (commits.wait(30, 30, time.monotonic() + 10, lambda: True),
                                              done.set()))
    waiter.start()
    assert not done.wait(0.3), "a step 25 records ahead of a live follower was acknowledged at once"
    commits.ack(3, "r1", 20)
    assert done.wait(5), "the follower caught up to within the bound, but the step still waits"
    waiter.join()


def test_the_deadline_ends_the_wait_and_a_replica_that_stops_leading_refuses():
    commits = _commits()
    start = time.monotonic()
    commits.wait(100, 100, start + 0.3, lambda: True)
    assert 0.25 <= time.monotonic() - start < 3
    with pytest.raises(NotLeader):
        commits.wait(200, 200, time.monotonic() + 5, lambda: False)


def test_a_follower_that_stopped_acknowledging_does_not_hold_steps_back():
    commits = _commits(live_s=0.2)
    time.sleep(0.3)
    start = time.monotonic()
    commits.wait(1000, 1000, start + 5, lambda: True)
    assert time.monotonic() - start < 0.5


class _SlowInSyncSet:
    """An in-sync set whose writes wait for ``release`` (an etcd round trip, stretched)."""

    def __init__(self) -> None:
        self.entries: dict[str, str] = {}
        self.release = threading.Event()
        self.adding = threading.Event()

    def members(self) -> dict[str, str]:
        return dict(self.entries)

    def add(self, term: int, replica_id: str, lsn: int, log_id: str = "") -> None:
        self.adding.set()
        assert self.release.wait(10)
        self.entries[replica_id] = log_id

    def remove(self, term: int, replica_id: str) -> None:
        self.entries.pop(replica_id, None)


def _joining(store: _SlowInSyncSet) -> tuple[Commits, threading.Thread]:
    commits = Commits("r0", "sync", 2, store)
    commits.begin(3, "")
    commits.started(1)
    commits.opened(3, "r1", "r1:1", 0)
    adder = threading.Thread(target=commits.ack, args=(3, "r1", 1))
    adder.start()
    assert store.adding.wait(5)
    return commits, adder


def test_a_joining_follower_counts_only_once_etcd_holds_its_entry():
    store = _SlowInSyncSet()
    commits, adder = _joining(store)
    assert commits.commit_lsn(1) == 0, "a step was committed with a member etcd does not know"
    store.release.set()
    adder.join(5)
    assert commits.commit_lsn(1) == 1
    assert set(store.entries) == {"r1"} and commits.view(1).members == {"r1"}


def test_a_follower_dropped_while_joining_ends_outside_the_set():
    store = _SlowInSyncSet()
    commits, adder = _joining(store)
    with pytest.raises(NotReplicated):  # lsn 2 is not on r1: it is dropped, and one replica is too few
        commits.wait(2, 2, time.monotonic() + 0.2, lambda: True)
    store.release.set()
    adder.join(5)
    assert store.entries == {} and commits.view(2).members == frozenset()
    commits.ack(3, "r1", 2)  # it joins again once it holds everything acknowledged
    assert set(store.entries) == {"r1"} and commits.commit_lsn(2) == 2


class _Members:
    """An in-sync set etcd already holds (``r1`` and ``r2``)."""

    def members(self) -> dict[str, str]:
        return {"r1": "", "r2": ""}

    def add(self, term: int, replica_id: str, lsn: int, log_id: str = "") -> None:
        raise AssertionError("the set did not change")

    def remove(self, term: int, replica_id: str) -> None:
        raise AssertionError(f"{replica_id} left the set: a step was not confirmed in time")


def test_sync_steps_read_their_followers_acknowledgements_on_the_replication_port():
    """Four steps wait at once; the acknowledgements arrive on two real sockets. Each
    step returns once both followers confirmed its record, not before, and the
    waiting threads read the acknowledgements themselves (no hand-off)."""
    from blockd.replication.transport import FramesListener, connect
    from blockd.v1 import replication_pb2 as rpb

    listener = FramesListener("127.0.0.1")
    commits = Commits("r0", "sync", 2, _Members())
    commits.begin(3, "")
    commits.use_reader(listener.acks)
    readers: list[int] = []
    followers = {}

    def handle(payload: bytes) -> None:
        request = rpb.StreamAcksRequest.FromString(payload)
        readers.append(threading.get_ident())
        commits.ack(request.term, request.replica_id, request.persisted_lsn)

    try:
        for rid in ("r1", "r2"):
            offer = listener.offer()
            followers[rid] = connect("127.0.0.1:1", offer.port, offer.ticket)
            link = offer.wait(5)
            assert link is not None
            listener.acks.add(link.acks, handle, lambda err: None)
            commits.opened(3, rid, "", 0)
        done: dict[int, float] = {}
        waiters = {lsn: threading.Thread(target=lambda lsn=lsn: (
            commits.wait(lsn, 4, time.monotonic() + 10, lambda: True), done.__setitem__(lsn, time.monotonic())))
            for lsn in (1, 2, 3, 4)}
        for thread in waiters.values():
            thread.start()

        def ack(rid: str, lsn: int) -> None:
            followers[rid].acks.send(rpb.StreamAcksRequest(replica_id=rid, term=3, persisted_lsn=lsn))

        time.sleep(0.2)
        ack("r1", 4)
        time.sleep(0.3)
        assert not done, "a step was acknowledged with one of its two followers' confirmations"
        ack("r2", 2)
        deadline = time.monotonic() + 5
        while len(done) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert sorted(done) == [1, 2]
        ack("r2", 4)
        for thread in waiters.values():
            thread.join(5)
        assert sorted(done) == [1, 2, 3, 4]
        assert {t.ident for t in waiters.values()} & set(readers), "no waiting step read an acknowledgement"
    finally:
        for follower in followers.values():
            follower.close()
        listener.close()
