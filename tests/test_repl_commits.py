"""The leader's commit point in ``async`` mode (blockd/repl_leader.py ``Commits``): the lag bound.

A step waits while a live follower (one that acknowledged within ``live_s``)
trails its record by more than ``max_lag_records``; a follower that stopped
acknowledging does not hold steps back; the deadline ends the wait; a
replica that stops leading refuses. The in-sync set (etcd) is not used in
``async`` mode: the store here fails any call to it.
"""

from __future__ import annotations

import threading
import time

import pytest

from blockd.core.errors import NotLeader
from blockd.repl_leader import Commits


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
