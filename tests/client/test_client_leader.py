"""client.leader.Targets: where the SDK resends a call that a replica of a
replicated group refused (the errors are built as blockd's error mapping
builds them, from the daemon's own error classes)."""

from __future__ import annotations

import grpc
import pytest

from blockd.core.errors import NoLeader, NotFound, NotLeader, NotReplicated
from blockd.rpc.errors import error_parts
from client.errors import UnavailableError, error_for
from client.leader import Targets


def as_client_error(err):
    code, message, details = error_parts(err, "Step")
    return error_for(getattr(grpc.StatusCode, code), message, tuple(details))


def test_not_leader_switches_to_the_named_leader_at_once():
    targets = Targets("a:1")
    err = as_client_error(NotLeader("no", leader_id="r2", leader_address="b:2", term=7))
    assert targets.next_attempt(err, "a:1", 0) == ("b:2", 0.0)
    assert targets.current == "b:2" and targets.all == ["a:1", "b:2"]
    assert targets.next_attempt(err, "b:2", 0) is None  # it names itself: give up, not loop


def test_an_election_or_a_slow_follower_retries_the_same_replica_with_backoff():
    targets = Targets("a:1")
    for err in (NoLeader("electing"), NotReplicated("slow")):
        first, later = (targets.next_attempt(as_client_error(err), "a:1", n) for n in (0, 9))
        assert first is not None and later is not None
        assert first[0] == later[0] == "a:1" and 0 < first[1] < later[1] <= 0.5


def test_a_replica_down_moves_to_the_next_only_with_several_targets():
    down = UnavailableError("connection refused", code=grpc.StatusCode.UNAVAILABLE)
    assert Targets("a:1").next_attempt(down, "a:1", 0) is None  # a plain target behaves as before
    targets = Targets("a:1, b:2,c:3")
    assert [targets.next_attempt(down, t, 0)[0] for t in ("a:1", "b:2", "c:3")] == ["b:2", "c:3", "a:1"]
    assert targets.next_attempt(as_client_error(NotFound("no pool")), "a:1", 0) is None


def test_a_target_must_name_an_address():
    with pytest.raises(ValueError, match="names no address"):
        Targets(" , ")
