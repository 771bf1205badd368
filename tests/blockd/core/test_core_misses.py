"""Misses explained (issue 28 item 5): every Allocate's prompt tokens not served
from cache, by reason, with exact counts; the miss ledger is state (atomic
batches, snapshots, the invariant checker); and a property test against a
model built from the KV events alone."""

import contextlib
import json
from collections import OrderedDict

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from blockd.core import (
    BLOCK_REMOVED,
    BLOCK_STORED,
    Allocate,
    BlockdError,
    Commit,
    ExtraKeys,
    Free,
    Pool,
    PoolConfig,
    check_invariants,
)
from blockd.core.hashing import NO_EXTRA_DIGEST, NO_EXTRA_KEYS, hash_full_blocks
from blockd.core.lru import MissLedger
from blockd.core.state import dump_pool, load_pool
from blockd.core.types import MISS_REASONS

X = ExtraKeys(model_id="m", adapter_name="lora", adapter_id=2)
Y = ExtraKeys(cache_salt="s")


def make_pool(num_blocks=4, block_size=4, num_host_blocks=0) -> Pool:
    return Pool(PoolConfig("p", num_blocks=num_blocks, block_size=block_size, num_host_blocks=num_host_blocks))


def misses(result) -> dict[str, int]:
    return {reason: getattr(result, f"miss_{reason}") for reason in MISS_REASONS}


def counts(**kw) -> dict[str, int]:
    return {reason: kw.get(reason, 0) for reason in MISS_REASONS}


def cache(pool, seq_id, prompt, extra=NO_EXTRA_KEYS):
    """Allocate, commit and free ``prompt``: its full blocks become evictable."""
    pool.step([Allocate(seq_id, prompt, extra), Commit(seq_id, len(prompt)), Free(seq_id)])


def allocate(pool, seq_id, prompt, extra=NO_EXTRA_KEYS):
    result = pool.step([Allocate(seq_id, prompt, extra)]).results[0]
    check_invariants(pool)
    return result


A = list(range(1, 10))  # 9 tokens: 2 full blocks of 4 and 1 partial


def test_a_fresh_pool_misses_everything_as_never_stored_and_the_tail_as_partial():
    pool = make_pool()
    assert misses(allocate(pool, "a", A)) == counts(never_stored=8, partial=1)
    assert pool.stats().prefix_miss_by_reason == counts(never_stored=8, partial=1)


def test_a_prompt_of_whole_blocks_has_its_last_block_partial():
    """The last token is always computed, so the last full block is never a hit."""
    pool = make_pool()
    cache(pool, "a", A[:8])
    r = allocate(pool, "b", A[:8])
    assert (r.num_cached_tokens, misses(r)) == (4, counts(partial=4))


def test_hashes_dropped_from_the_device_tier_are_evicted_device():
    pool = make_pool()
    cache(pool, "a", A)  # blocks 0, 1 cached
    cache(pool, "b", list(range(100, 116)))  # 4 blocks: evicts 1 then 0
    assert pool.stats().num_evictions == 2
    assert misses(allocate(pool, "c", A)) == counts(evicted_device=8, partial=1)


def test_only_the_evicted_block_counts_after_a_hit():
    pool = make_pool()
    cache(pool, "a", A)  # LRU: 1 (the tail), 0
    allocate(pool, "b", list(range(100, 110)))  # 3 blocks: fresh 3, free 2, evicts 1
    pool.step([Free("b")])
    r = allocate(pool, "c", A)
    assert (r.num_cached_tokens, misses(r)) == (4, counts(evicted_device=4, partial=1))


def test_hashes_dropped_from_the_host_tier_are_evicted_host():
    pool = make_pool(num_host_blocks=1)
    cache(pool, "a", A)
    cache(pool, "b", list(range(100, 116)))  # offloads 1's hash, then 0's, dropping 1's from the host
    r = allocate(pool, "c", A)
    assert (r.num_cached_tokens, r.num_restored_tokens) == (4, 4)
    assert misses(r) == counts(evicted_host=4, partial=1)


def test_the_same_tokens_under_other_extra_keys_are_other_extra_keys():
    pool = make_pool(num_blocks=16)
    cache(pool, "a", A, X)
    assert misses(allocate(pool, "b", A)) == counts(other_extra_keys=8, partial=1)
    assert misses(allocate(pool, "c", A, Y)) == counts(other_extra_keys=8, partial=1)
    assert misses(allocate(pool, "d", A, X)) == counts(partial=1)  # a hit


def test_after_the_first_miss_each_block_has_its_own_reason():
    pool = make_pool(num_blocks=8)
    cache(pool, "a", list(range(1, 14)), X)  # 3 full blocks under X
    prompt = [*range(1, 9), 50, 51, 52, 53, 54]  # the first 2 blocks equal, the third not
    assert misses(allocate(pool, "b", prompt)) == counts(other_extra_keys=8, never_stored=4, partial=1)


def test_a_hash_stored_again_is_no_longer_a_dropped_one():
    pool = make_pool()
    cache(pool, "a", A)
    cache(pool, "b", list(range(100, 116)))
    cache(pool, "c", A)  # stored again
    assert not pool.misses.dropped_device.keys() & set(pool.blocks.index)
    assert misses(allocate(pool, "d", A)) == counts(partial=1)
    check_invariants(pool)


def test_a_failed_or_dry_run_batch_changes_neither_the_ledger_nor_the_counts():
    pool = make_pool()
    cache(pool, "a", A)
    before = json.dumps(dump_pool(pool), sort_keys=True)
    with contextlib.suppress(BlockdError):
        pool.step([Allocate("b", list(range(100, 116))), Commit("b", 16), Free("b"), Free("nope")])
    pool.step([Allocate("b", list(range(100, 116))), Commit("b", 16), Free("b")], dry_run=True)
    assert json.dumps(dump_pool(pool), sort_keys=True) == before
    check_invariants(pool)


def test_a_full_record_forgets_its_oldest_hash_which_then_reads_never_stored():
    ledger = MissLedger(2, NO_EXTRA_DIGEST)
    for h in (b"1" * 16, b"2" * 16, b"3" * 16):
        ledger.dropped(h, from_host=False)
    assert list(ledger.dropped_device) == [b"2" * 16, b"3" * 16]
    assert ledger.explains(b"1" * 16, b"1" * 16, False) == MISS_REASONS.index("never_stored")
    assert ledger.explains(b"3" * 16, b"3" * 16, False) == MISS_REASONS.index("evicted_device")


def test_snapshots_keep_the_ledger_and_old_ones_load_empty():
    pool = make_pool(num_blocks=8, num_host_blocks=1)
    cache(pool, "a", A, X)
    cache(pool, "b", list(range(100, 132)))
    allocate(pool, "c", A)
    data = dump_pool(pool)
    back = load_pool(json.loads(json.dumps(data)))
    check_invariants(back)
    assert json.dumps(dump_pool(back), sort_keys=True) == json.dumps(data, sort_keys=True)
    assert back.misses.variants == pool.misses.variants and back.stats() == pool.stats()
    del data["misses"]
    old = load_pool(data)
    check_invariants(old)
    assert (old.misses.plain_of, old.misses.dropped_host, old.stats().prefix_miss_tokens) == ({}, {}, (0,) * 5)


def test_reset_prefix_cache_empties_the_tokens_only_index():
    pool = make_pool(num_blocks=8)
    cache(pool, "a", A, X)
    pool.reset_prefix_cache()
    assert pool.misses.variants == {}
    assert misses(allocate(pool, "b", A)) == counts(never_stored=8, partial=1)


def test_the_invariant_checker_catches_a_stale_tokens_only_index():
    pool = make_pool(num_blocks=8)
    cache(pool, "a", A, X)
    pool.misses.variants.clear()
    try:
        check_invariants(pool)
    except BlockdError as err:
        assert "tokens-only index" in str(err)
    else:
        raise AssertionError("a stale tokens-only index passed the checker")


# --- a property test against a model built from the KV events ----------------

PROMPTS = [list(range(1, 14)), [*list(range(1, 9)), 40, 41, 42], [7] * 10, list(range(20, 29)), [1, 2, 3]]
EXTRAS = [ExtraKeys(), X, Y]
BLOCK = 3


class MissMachine(RuleBasedStateMachine):
    """Random allocate/commit/free batches on a small pool with a host tier; every
    Allocate's reasons must equal the model's, which knows only the events and
    which (tokens, extra keys) each hash stands for."""

    def __init__(self):
        super().__init__()
        self.pool = Pool(PoolConfig("p", num_blocks=10, block_size=BLOCK, num_host_blocks=2))
        self.limit = self.pool.misses.limit
        self.meaning: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # hash -> (extra, token prefix)
        for e, extra in enumerate(EXTRAS):
            for prompt in PROMPTS:
                for i, h in enumerate(hash_full_blocks(prompt, BLOCK, extra.digest())):
                    self.meaning[h] = (e, tuple(prompt[: (i + 1) * BLOCK]))
        self.cached: set[bytes] = set()
        self.dropped = {"device": OrderedDict(), "host": OrderedDict()}
        self.live: list[str] = []
        self.counter = 0

    def _expected(self, prompt, e):
        n, max_hit = len(prompt), (len(prompt) - 1) // BLOCK
        hashes = hash_full_blocks(prompt, BLOCK, EXTRAS[e].digest(), limit=max_hit)
        hits = 0
        while hits < len(hashes) and hashes[hits] in self.cached:
            hits += 1
        expected = counts(partial=n - max_hit * BLOCK)
        for i in range(hits, max_hit):
            h, prefix = hashes[i], tuple(prompt[: (i + 1) * BLOCK])
            others = any(self.meaning.get(c) == (o, prefix) for c in self.cached for o in range(3) if o != e)
            reason = ("evicted_host" if h in self.dropped["host"] else "evicted_device"
                      if h in self.dropped["device"] else "other_extra_keys" if others else "never_stored")
            expected[reason] += BLOCK
        return expected

    def _observe(self):
        for event in self.pool.take_events():
            if event.kind == BLOCK_STORED:
                self.cached.add(event.block_hash)
                for records in self.dropped.values():
                    records.pop(event.block_hash, None)
            elif event.kind == BLOCK_REMOVED:
                self.cached.discard(event.block_hash)
                records = self.dropped[event.medium]
                records[event.block_hash] = None
                records.move_to_end(event.block_hash)
                if len(records) > self.limit:
                    records.popitem(last=False)

    @rule(p=st.integers(0, len(PROMPTS) - 1), e=st.integers(0, 2), commit=st.booleans(), free=st.booleans())
    def allocate(self, p, e, commit, free):
        seq_id = f"s{self.counter}"
        self.counter += 1
        prompt = PROMPTS[p]
        expected = self._expected(prompt, e)
        ops = [Allocate(seq_id, prompt, EXTRAS[e])] + ([Commit(seq_id, len(prompt))] if commit else [])
        try:
            result = self.pool.step(ops + ([Free(seq_id)] if free else [])).results[0]
        except BlockdError:
            return
        assert misses(result) == expected
        if not free:
            self.live.append(seq_id)
        self._observe()

    @rule(data=st.data())
    def free(self, data):
        if self.live:
            seq_id = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
            self.pool.step([Free(seq_id)])
            self._observe()

    @invariant()
    def holds(self):
        check_invariants(self.pool)
        s = self.pool.stats()
        assert sum(s.prefix_miss_tokens) == s.prefix_queried_tokens - s.prefix_hit_tokens


TestMisses = MissMachine.TestCase
TestMisses.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])
