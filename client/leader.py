"""Finding the leader of a replicated blockd group (``blockd serve --etcd``, docs/ha.md).

A client's target may name several replicas, comma-separated
(``"10.0.0.5:50051,10.0.0.6:50051,10.0.0.7:50051"``). :class:`Targets`
holds them and the one in use, and decides, for each failed attempt of a
call, whether and where to try again:

* FAILED_PRECONDITION with reason ``NOT_LEADER``: a follower answered; its
  ErrorInfo names the leader's address: use it, at once;
* UNAVAILABLE with reason ``NO_LEADER`` (an election is under way) or
  ``NOT_REPLICATED`` (the step is logged but no follower confirmed it yet):
  the same replica again, after a backoff;
* UNAVAILABLE otherwise (the replica is down) with several targets: the next
  one, after a backoff.

The caller resends the *same* request, so its request id is the same: a step
the old leader logged is answered from the replicated request table, never
applied twice (docs/ha.md 2.7). A single plain target behaves as before:
nothing but ``NOT_LEADER`` and the two reasons above (which only a
replicated daemon sends) is retried here.
"""

from __future__ import annotations

import threading

from client.errors import BlockdClientError, FailedPreconditionError, UnavailableError

#: first and longest pause between attempts against the same group
BACKOFF_S = (0.05, 0.5)
RETRY_REASONS = ("NO_LEADER", "NOT_REPLICATED")


class Targets:
    """The replicas a client may call and the one it calls now; thread-safe."""

    def __init__(self, target: str) -> None:
        self.all = [t.strip() for t in target.split(",") if t.strip()]
        if not self.all:
            raise ValueError(f"target {target!r} names no address")
        self._lock = threading.Lock()
        self.current = self.all[0]

    def next_attempt(self, err: BlockdClientError, tried_on: str, attempt: int) -> tuple[str, float] | None:
        """``(address, pause in seconds)`` for the next attempt after ``err``
        (the ``attempt``-th failure, from 0, against ``tried_on``), or None:
        give up and raise it."""
        pause = min(BACKOFF_S[0] * 2 ** attempt, BACKOFF_S[1])
        if isinstance(err, FailedPreconditionError) and err.reason == "NOT_LEADER":
            leader = err.metadata.get("leader_address", "")
            if not leader or leader == tried_on:
                return None
            return self._use(leader), 0.0
        if not isinstance(err, UnavailableError):
            return None
        if err.reason in RETRY_REASONS:
            return tried_on, pause
        if len(self.all) < 2:
            return None
        with self._lock:
            if self.current == tried_on:  # another thread may have moved on already
                i = self.all.index(tried_on) if tried_on in self.all else -1
                self.current = self.all[(i + 1) % len(self.all)]
            return self.current, pause

    def _use(self, address: str) -> str:
        with self._lock:
            if address not in self.all:
                self.all.append(address)
            self.current = address
            return address
