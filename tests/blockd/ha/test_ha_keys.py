"""blockd/ha without etcd: names, values and configuration are validated with errors that say why."""

from __future__ import annotations

import pytest

from blockd.ha.election import ElectionConfig
from blockd.ha.keys import BadValue, InSyncEntry, LeaderInfo, MemberInfo, group_keys


def test_names_cannot_reach_into_other_keys() -> None:
    keys = group_keys("main")
    assert (keys.leader, keys.member("r-0.a_b")) == ("/blockd/main/leader", "/blockd/main/members/r-0.a_b")
    for bad in ("", "a/b", "..x/", "x" * 65, "é"):
        with pytest.raises(ValueError, match="group name must be 1-64 characters"):
            group_keys(bad)
        with pytest.raises(ValueError, match="replica id"):
            keys.insync(bad)


def test_values_round_trip_and_garbage_is_refused() -> None:
    leader = LeaderInfo("r0", "10.0.0.5:50051", 7, term=12)
    assert LeaderInfo.decode(leader.encode(), 12) == leader
    member = MemberInfo("r1", "h:1", "follower", 12, 40, 2, 1.5)
    assert MemberInfo.decode(member.encode()) == member
    assert InSyncEntry.decode(InSyncEntry("r1", 12, 40).encode()) == InSyncEntry("r1", 12, 40)
    with pytest.raises(BadValue, match="not JSON"):
        LeaderInfo.decode(b"\xff", 1)
    with pytest.raises(BadValue, match="lacks int field 'lease_id'"):
        LeaderInfo.decode(b'{"replica_id": "r", "address": "a", "lease_id": true}', 1)
    with pytest.raises(BadValue, match="not a JSON object"):
        MemberInfo.decode(b"[]")
    with pytest.raises(BadValue):
        MemberInfo.decode(b'{"replica_id": "r", "address": "a", "role": "king"}')


@pytest.mark.parametrize(("field", "value", "message"), [
    ("ttl_s", 0, "ttl_s must be a whole number"),
    ("ttl_s", 1.5, "ttl_s must be a whole number"),
    ("margin_s", 0, "margin_s must be in"),
    ("margin_s", 1.5, "margin_s must be in"),
    ("poll_s", 0, "poll_s must be > 0"),
    ("address", "", "address"),
    ("replica_id", "a b", "replica id"),
])
def test_election_config_is_validated(field, value, message) -> None:
    fields = {"group": "g", "replica_id": "r", "address": "h:1", field: value}
    with pytest.raises(ValueError, match=message):
        ElectionConfig(**fields)
