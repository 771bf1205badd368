"""Helpers for tests of blockd/ha against a real etcd (load with
``pytest_plugins = ["tests.support.etcd", "tests.support.ha_fixtures"]``).

* ``replicas`` - a factory: ``replicas(url, group, replica_id, [local_lsn=callable],
  **ElectionConfig fields)`` starts an :class:`~blockd.ha.election.Election` wrapped in a
  :class:`Replica` that records its callbacks; all resign at the end of the test.
* :func:`wait_for` - poll a predicate, bounded (30 s unless told).
* :func:`the_leader` - the one replica of a list that leads (two is a failure).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from blockd.ha.election import Election, ElectionConfig, Leadership

WAIT_S = 30.0


def wait_for(predicate: Callable[[], object], what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class Replica:
    """An :class:`Election` and what its callbacks said, with ``time.monotonic()`` stamps."""

    def __init__(self, url: str, group: str, replica_id: str, local_lsn: Callable[[], int] = lambda: 0,
                 **config) -> None:
        # a TTL of 4 s: a loaded test machine must not make a healthy leader miss its keepalives
        config = {"poll_s": 0.05, "ttl_s": 4, **config}
        self.events: list[tuple[str, Leadership, float, str]] = []
        self.election = Election(url, ElectionConfig(group, replica_id, f"{replica_id}.test:50051", **config),
                                 on_elected=lambda won: self.events.append(("elected", won, time.monotonic(), "")),
                                 on_stepped_down=self._stepped_down, local_lsn=local_lsn)
        self.stepped_down_valid_until = 0.0

    def _stepped_down(self, was: Leadership, reason: str) -> None:
        self.stepped_down_valid_until = self.election.last_valid_until
        self.events.append(("stepped_down", was, time.monotonic(), reason))

    def start(self) -> Replica:
        self.election.start()
        return self

    def leads(self) -> Leadership | None:
        return self.election.leadership


@pytest.fixture
def replicas():
    made: list[Replica] = []

    def make(url: str, group: str, replica_id: str, **config) -> Replica:
        made.append(Replica(url, group, replica_id, **config).start())
        return made[-1]

    yield make
    for replica in made:
        replica.election.resign()


def the_leader(group: list[Replica]) -> Replica | None:
    leading = [r for r in group if r.leads() is not None]
    assert len(leading) <= 1, "two replicas lead at once"
    return leading[0] if leading else None
