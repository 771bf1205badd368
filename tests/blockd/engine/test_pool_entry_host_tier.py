"""A pool entry's snapshot keeps the host tier (issue 28): the pool's host
index and its retained events' medium survive a dump and load; events kept
before the host tier (no medium) load as the device's."""

import json

from blockd.core import Allocate, Commit, Free, Pool, PoolConfig
from blockd.core.state import dump_pool
from blockd.core.types import WorkerInfo
from blockd.engine.incarnations import PoolIncarnations
from blockd.engine.machine import Engine
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


def test_a_new_worker_incarnation_forgets_the_host_tier_too():
    """A restarted worker lost its host pool with its device pool: a prefix
    left only in the host tier must not be restored from memory nobody has."""
    engine = Engine()
    engine.create_pool(PoolConfig("h", num_blocks=2, block_size=2, num_host_blocks=4))
    engine.register_worker(WorkerInfo("w0", "h", "127.0.0.1:1", 0, 1, 0, 1, incarnation="first"))
    engine.step("h", [Allocate("a", [1, 2, 3, 4]), Commit("a", 4), Free("a")])
    engine.step("h", [Allocate("b", [5, 6, 7, 8]), Free("b")])  # a's blocks reused: both offloaded
    stats = engine.get_pool("h")
    assert (stats.num_seqs, stats.num_evictable_blocks, stats.num_host_cached_blocks) == (0, 0, 2)
    engine.register_worker(WorkerInfo("w0", "h", "127.0.0.1:1", 0, 1, 0, 1, incarnation="second"))
    assert engine.get_pool("h").num_host_cached_blocks == 0
    again = engine.step("h", [Allocate("a", [1, 2, 3, 4])])
    assert again.tier_ops == () and again.results[0].num_cached_tokens == 0
