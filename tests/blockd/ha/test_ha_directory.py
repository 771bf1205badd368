"""The pool directory of a cluster in a real etcd: claims, compare-and-swap, placement."""

from __future__ import annotations

import pytest

from blockd.ha.directory import Directory, GroupEntry, PoolEntry, place
from blockd.ha.etcd import EtcdClient
from blockd.ha.keys import BadValue

pytest_plugins = ["tests.support.etcd"]


@pytest.fixture
def directory(etcd_server, request):
    etcd = EtcdClient(etcd_server.url)
    yield Directory(etcd, request.node.name[:60].replace("[", "-").replace("]", ""))
    etcd.close()


def test_a_pool_is_claimed_once_and_switched_only_from_the_entry_read(directory) -> None:
    entry, made = directory.claim("llama/7b", "g1", tenant="acme", num_blocks=16, num_bytes=4096)
    assert made and (entry.group, entry.epoch) == ("g1", 1)
    again, made_again = directory.claim("llama/7b", "g2")  # the second creator learns the owner
    assert not made_again and (again.group, again.epoch) == ("g1", 1)
    moved = directory.switch(again, "g2")
    assert moved is not None and (moved.group, moved.epoch) == ("g2", 2)
    assert (moved.tenant, moved.num_blocks, moved.num_bytes) == ("acme", 16, 4096)  # the quota's count moves along
    assert directory.switch(again, "g3") is None  # a stale entry: refused, nothing changed
    assert directory.pool("llama/7b") == moved
    assert not directory.release(again) and directory.release(moved)
    assert directory.pool("llama/7b") is None and directory.pools() == {}


def test_groups_are_listed_with_their_addresses_and_bad_entries_are_refused(directory) -> None:
    lease, _ = directory.etcd.grant(5)
    directory.join(GroupEntry("g1", "127.0.0.1:5001"), lease)
    assert directory.groups() == {"g1": GroupEntry("g1", "127.0.0.1:5001")}
    directory.etcd.revoke(lease)
    assert directory.groups() == {}
    directory.etcd.put(directory.pool_key("p"), b'{"group": "g1", "epoch": 0}')
    with pytest.raises(BadValue, match="epoch >= 1"):
        directory.pools()
    with pytest.raises(ValueError, match="group name"):
        directory.claim("q", "no/slash")


def test_placement_takes_the_live_group_with_the_fewest_pools() -> None:
    pools = [PoolEntry("a", "g1", 1), PoolEntry("b", "g1", 1), PoolEntry("c", "g2", 1), PoolEntry("d", "dead", 3)]
    assert place(["g1", "g2"], pools) == "g2"
    assert place(["g1", "g2", "g3"], pools) == "g3"
    assert place(["g2", "g1"], []) == "g1"  # ties: the first name
    assert place([], pools) is None


def test_a_quota_checked_claim_checks_again_when_a_claim_of_its_tenant_won_the_race(directory) -> None:
    """Two groups creating pools of one tenant at once: the claim whose read
    was overtaken reads again and is refused on what is there now."""
    seen: list[list[str]] = []

    def one_pool_each(held: list[PoolEntry]) -> None:
        seen.append(sorted(e.pool for e in held))
        if held:
            raise ValueError("over the tenant's quota of 1 pool")
        if len(seen) == 1:  # another group's claim of the same tenant commits between this read and this write
            assert directory.claim("b", "g2", tenant="acme", num_blocks=8, admit=lambda _: None)[1]

    with pytest.raises(ValueError, match="quota of 1 pool"):
        directory.claim("a", "g1", tenant="acme", num_blocks=8, admit=one_pool_each)
    assert seen == [[], ["b"]] and set(directory.pools()) == {"b"}  # refused: nothing of "a" was written
    # another tenant's pools never count, and its claims do not guard this tenant's
    entry, made = directory.claim("c", "g1", tenant="other", admit=one_pool_each)
    assert made and entry.tenant == "other" and seen[-1] == []
    # a pool that exists is its owner's, whatever the check would say
    assert directory.claim("b", "g1", tenant="acme", admit=one_pool_each)[0].group == "g2"
