"""A pool entry's snapshot keeps the host tier (issue 28): the pool's host
index and its retained events' medium survive a dump and load; events kept
before the host tier (no medium) load as the device's."""

import json

from blockd.core import Allocate, Commit, Free, Pool, PoolConfig
from blockd.core.state import dump_pool
from blockd.engine.incarnations import PoolIncarnations
from blockd.engine.pools import PoolEntry


def test_the_host_tier_and_event_media_survive_a_snapshot():
    pool = Pool(PoolConfig("p", num_blocks=4, block_size=2, num_host_blocks=1, tenant="t"))
    entry = PoolEntry(pool, PoolIncarnations("inc"))
    pool.step([Allocate("a", [1, 2, 3, 4, 5]), Commit("a", 5), Free("a")])
    pool.step([Allocate("b", [9] * 7)])  # two offloads into one host block: the first is dropped from the host
    entry.drain_events()
    assert [e.medium for e in entry.events][-1] == "host"
    data = json.loads(json.dumps(entry.dump()))
    loaded = PoolEntry.load(data, lsn=7)
    assert list(loaded.events) == list(entry.events)
    assert dump_pool(loaded.pool) == dump_pool(pool) and loaded.pool.stats() == pool.stats()
    for event in data["events"]:
        del event[6:]
    assert {e.medium for e in PoolEntry.load(data, lsn=7).events} == {"device"}
