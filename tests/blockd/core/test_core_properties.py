"""Property tests: random allocate/append/commit/fork/free/decode batches under
memory pressure, with shared prefixes, extra keys, retention priorities and
reused sequence ids, pins, unpins and priorities of prefixes between them
(an allocation evicts the lowest priority's least recently used blocks
first), and now and then a reset of the
prefix cache; the invariant checker runs after every step, a model of each sequence's tokens is
compared, and the prefix index rebuilt from the KV events must match the pool's."""

import contextlib
import json

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockd.core import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    DEFAULT_PRIORITY,
    Allocate,
    Append,
    BlockdError,
    Commit,
    ExtraKeys,
    Fork,
    Free,
    InvalidArgument,
    NotFound,
    Pool,
    PoolConfig,
    WrongState,
    check_invariants,
    num_blocks_for,
)
from blockd.core.hashing import hash_block
from blockd.core.ops import _digest
from blockd.core.state import dump_pool, load_pool
from blockd.core.types import DecodeAppend

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 50, 60], [7] * 9, []]
EXTRAS = [ExtraKeys(), ExtraKeys(model_id="m", adapter_name="a", adapter_id=3), ExtraKeys(cache_salt="t")]
tokens = st.lists(st.integers(0, 20), max_size=9)
#: retention priorities an allocation asks for: the default most often
priorities = st.sampled_from([DEFAULT_PRIORITY, DEFAULT_PRIORITY, 0, 2, 7])


def snapshot(pool):
    """The pool's whole state; sequence order in the dict carries no meaning."""
    data = dump_pool(pool)
    return json.dumps(data, sort_keys=True)


class PoolMachine(RuleBasedStateMachine):
    num_blocks, block_size, watermark_blocks = 24, 3, 2

    def __init__(self):
        super().__init__()
        self.pool = Pool(PoolConfig("p", num_blocks=self.num_blocks, block_size=self.block_size,
                                    watermark_blocks=self.watermark_blocks, max_retained_versions=8))
        self.model: dict[str, list[int]] = {}
        self.committed: dict[str, int] = {}
        self.counter = 0
        self.freed_ids: list[str] = []
        #: the prefix index as the KV events describe it
        self.index_from_events: dict[bytes, int] = {}
        self.last_seq_no = 0
        #: pin id -> the hashes of its blocks when it was made
        self.pins: dict[str, list[bytes | None]] = {}

    def _new_id(self):
        self.counter += 1
        return f"s{self.counter}"

    def _run(self, ops):
        """Apply a batch; on failure the pool must be exactly as before."""
        before = snapshot(self.pool)
        try:
            result = self.pool.step(ops)
        except BlockdError as err:
            assert err.op_index is not None and err.code != "INTERNAL", err
            assert snapshot(self.pool) == before
            return None
        for r in result.results:
            # a written slot is never in a block another table reads, but for the tables
            # of this batch's Allocates that take the writer's blocks (share_seq_id)
            sharers = [self.pool.seqs[op.seq_id].table for op in ops
                       if isinstance(op, Allocate) and op.share_seq_id == r.seq_id and r.seq_id]
            for slot in r.slot_mapping:
                block = slot // self.block_size
                assert self.pool.blocks.ref[block] == 1 + sum(block in table for table in sharers)
        return result

    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens, extra=st.sampled_from(EXTRAS), priority=priorities)
    def allocate(self, prefix, suffix, extra, priority):
        """An allocation at a priority; the blocks it evicts are the front of
        the LRU as it was (lowest priority first, then least recently used),
        less the cached blocks it revives."""
        seq_id = self._new_id()
        prompt = prefix + suffix
        blocks = self.pool.blocks
        before = list(blocks.lru)
        assert [blocks.priority[b] for b in before] == sorted(blocks.priority[b] for b in before)
        hashes = {b: blocks.hash[b] for b in before}
        result = self._run([Allocate(seq_id, prompt, extra, priority=priority)])
        if result is None:
            return
        self.model[seq_id] = list(prompt)
        self.committed[seq_id] = 0
        assert self.pool.seqs[seq_id].priority == priority
        table = self.pool.seqs[seq_id].table
        hits = set(table[: result.results[0].num_cached_tokens // self.block_size])
        revived = {b for b in hits if b in hashes and blocks.hash[b] == hashes[b]}
        left = [b for b in before if b not in revived]
        evicted = [b for b in left if b not in blocks.lru]
        assert evicted == left[: len(evicted)]

    @rule(data=st.data(), suffix=tokens, share_tokens=st.integers(0, 14), same_batch=st.booleans(),
          prefix=st.sampled_from(PREFIXES))
    def allocate_sharing(self, data, suffix, share_tokens, same_batch, prefix):
        """An Allocate taking another sequence's blocks (``share_seq_id``): of the
        one allocated before it in the same batch, or of a live one. Past its
        cache hits it holds that sequence's blocks as far as their prompts agree
        from the first token, within ``share_tokens`` and all but its last
        token; they stay uncommitted (not indexed by the share)."""
        seq_id = self._new_id()
        if same_batch or not self.model:
            owner, owner_tokens = self._new_id(), prefix + data.draw(tokens)
            ops = [Allocate(owner, owner_tokens)]
        else:
            owner = data.draw(st.sampled_from(sorted(self.model)))
            owner_tokens, ops = list(self.model[owner]), []
        prompt = owner_tokens[: data.draw(st.integers(0, len(owner_tokens)))] + suffix
        hashed_before = list(self.pool.blocks.hash)
        result = self._run([*ops, Allocate(seq_id, prompt, share_seq_id=owner, share_tokens=share_tokens)])
        if result is None:
            return
        if ops:
            self.model[owner], self.committed[owner] = list(owner_tokens), 0
        self.model[seq_id], self.committed[seq_id] = list(prompt), 0
        b, seq, theirs = self.block_size, self.pool.seqs[seq_id], self.pool.seqs[owner]
        agree = 0
        while (agree < min(len(prompt), len(owner_tokens)) // b
               and prompt[agree * b : (agree + 1) * b] == owner_tokens[agree * b : (agree + 1) * b]):
            agree += 1
        hits = seq.num_committed // b
        limit = min(agree, share_tokens // b, (len(prompt) - 1) // b if prompt else 0)
        if theirs.extra_digest != seq.extra_digest:  # other extra keys: other K/V
            limit = 0
        shared = result.results[-1].num_cached_tokens // b - hits
        assert shared == max(0, limit - hits), (shared, limit, hits)
        assert seq.table[hits : hits + shared] == theirs.table[hits : hits + shared]
        # The share published nothing. An owner allocated in this batch commits
        # nothing, so its blocks have no hash (one it took from the cached free
        # blocks lost the hash it had before the batch); a live owner's blocks
        # keep theirs (held, so never evicted).
        for block in seq.table[hits : hits + shared]:
            expected = None if ops else hashed_before[block]
            assert self.pool.blocks.hash[block] == expected

    @rule(data=st.data(), prompt=tokens, bad=st.sampled_from(["nope", "", -1, 1 << 30]))
    def allocate_sharing_refused(self, data, prompt, bad):
        """An unknown share_seq_id, or share_tokens out of range: refused, nothing changes."""
        if isinstance(bad, str) and not bad:
            return
        owner = data.draw(st.sampled_from(sorted(self.model) or ["x"]))
        op = (Allocate(self._new_id(), prompt, share_seq_id=bad) if isinstance(bad, str)
              else Allocate(self._new_id(), prompt, share_seq_id=owner, share_tokens=bad))
        assert self._run([op]) is None

    @precondition(lambda self: self.model)
    @rule(data=st.data(), new=tokens)
    def append(self, data, new):
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        if self._run([Append(seq_id, new)]) is not None:
            self.committed[seq_id] = len(self.model[seq_id])
            self.model[seq_id].extend(new)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def decode(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=5))
        toks = data.draw(st.lists(st.integers(0, 20), min_size=len(ids), max_size=len(ids)))
        if self._run([DecodeAppend(ids, toks)]) is not None:
            for seq_id, tok in zip(ids, toks):
                self.committed[seq_id] = len(self.model[seq_id])
                self.model[seq_id].append(tok)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def commit(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        n = data.draw(st.integers(0, len(self.model[seq_id])))
        if self._run([Commit(seq_id, n)]) is not None:
            self.committed[seq_id] = max(self.committed[seq_id], n)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.model)))
        child = self._new_id()
        if self._run([Fork(parent, child)]) is not None:
            self.model[child] = list(self.model[parent])
            self.committed[child] = self.committed[parent]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        assert self._run([Free(seq_id)]) is not None
        del self.model[seq_id], self.committed[seq_id]
        self.freed_ids.append(seq_id)

    @precondition(lambda self: self.freed_ids)
    @rule(data=st.data(), prompt=tokens, fail=st.booleans())
    def reuse_freed_id(self, data, prompt, fail):
        """A freed id allocated again; in a failing batch its tombstone (and
        the tombstones' order) must come back exactly."""
        seq_id = data.draw(st.sampled_from(self.freed_ids))
        if fail:
            before = snapshot(self.pool)
            with contextlib.suppress(BlockdError):
                self.pool.step([Allocate(seq_id, prompt), Free(seq_id), Allocate(seq_id, prompt),
                                Append("missing", [1])])
            assert snapshot(self.pool) == before
        elif self._run([Allocate(seq_id, prompt)]) is not None:
            self.freed_ids.remove(seq_id)
            self.model[seq_id] = list(prompt)
            self.committed[seq_id] = 0

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def failing_decode(self, data):
        """Decode ops (a sequence may recur across them, cross blocks and copy
        on write) followed by a failing op must leave no trace, block fills
        included; one decode op naming a sequence twice is refused."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=6))
        before = snapshot(self.pool)
        with contextlib.suppress(BlockdError):
            self.pool.step([*(DecodeAppend([seq_id], [1]) for seq_id in ids), Append("missing", [1])])
        assert snapshot(self.pool) == before
        if len(set(ids)) < len(ids):
            with pytest.raises(InvalidArgument, match="twice"):
                self.pool.step([DecodeAppend(ids, [1] * len(ids))])
            assert snapshot(self.pool) == before

    @precondition(lambda self: self.model)
    @rule(data=st.data(), new=tokens, prefix=st.sampled_from(PREFIXES))
    def failing_batch(self, data, new, prefix):
        """A multi-op batch whose last op fails must leave no trace."""
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        ops = [Append(seq_id, new), Allocate(self._new_id(), prefix + new), Fork(seq_id, self._new_id()),
               Free(seq_id), Append("missing", [1])]
        before = snapshot(self.pool)
        try:
            self.pool.step(ops)
        except NotFound as err:
            assert err.op_index == 4
        except BlockdError:
            pass  # ran out of room earlier in the batch: also fine, also atomic
        assert snapshot(self.pool) == before

    @precondition(lambda self: self.model)
    @rule(data=st.data(), extra=st.sampled_from(EXTRAS))
    def pin(self, data, extra):
        """Pin a sequence's prompt (under its own or other extra keys): what is
        cached on the device is held, or nothing changes."""
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        prompt = self.model[seq_id]
        before = snapshot(self.pool)
        expected = self.pool.pinnable(prompt, extra)
        try:
            pin = self.pool.pin_prefix(prompt, extra, expires_at=data.draw(st.sampled_from([0, 5.5])))
        except WrongState:
            assert not expected and snapshot(self.pool) == before
            return
        assert list(pin.block_ids) == expected and pin.num_tokens == len(expected) * self.block_size
        self.pins[pin.pin_id] = [self.pool.blocks.hash[block] for block in pin.block_ids]

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        pin_id = data.draw(st.sampled_from(sorted(self.pins)))
        assert self.pool.unpin(pin_id).pin_id == pin_id
        del self.pins[pin_id]
        with pytest.raises(NotFound):
            self.pool.unpin(pin_id)

    @rule(data=st.data(), extra=st.sampled_from(EXTRAS), priority=st.sampled_from([0, 3, 4, 6, 8, -1]))
    def set_prefix_priority(self, data, extra, priority):
        """Set a prompt's priority (a live sequence's or a common prefix): its
        cached blocks take it, evictable ones move to the back of its LRU
        list, tail first; a priority out of range or nothing cached
        changes nothing."""
        prompt = data.draw(st.sampled_from([*(self.model[s] for s in sorted(self.model)), *PREFIXES]))
        before = snapshot(self.pool)
        try:
            done = self.pool.set_prefix_priority(prompt, extra, priority)
        except (InvalidArgument, WrongState) as err:
            assert isinstance(err, InvalidArgument) == (priority not in range(8))
            assert snapshot(self.pool) == before
            return
        blocks, b = self.pool.blocks, self.block_size
        host = blocks.host
        chain = _digest(extra, self.pool.config.tenant)
        parent, evictable = None, []
        for i in range(done.num_tokens // b):
            parent = hash_block(parent, prompt[i * b : (i + 1) * b], chain)
            if parent in blocks.index:
                block = blocks.index[parent]
                assert blocks.priority[block] == priority
                if block in blocks.lru:
                    evictable.append(block)
            else:
                assert host is not None and host.priority[host.index[parent]] == priority
        at = list(blocks.lru.at(priority))
        assert at[len(at) - len(evictable):] == evictable[::-1]  # tail first, as a Free releases
        assert done.num_device_blocks + done.num_host_blocks == done.num_tokens // b > 0

    @precondition(lambda self: self.pins)
    @rule(chance=st.integers(0, 9))
    def reset_prefix_cache(self, chance):
        """Now and then: the cache goes, the pins with it."""
        if chance == 0:
            self.pool.reset_prefix_cache()
            self.pins.clear()
            assert not self.pool.pins and not self.pool.pinned

    @invariant()
    def pinned_blocks_stay_cached(self):
        """Whatever the batches evicted, every pinned block keeps the hash it had."""
        assert set(self.pool.pins) == set(self.pins)
        for pin_id, hashes in self.pins.items():
            pin = self.pool.pins[pin_id]
            assert [self.pool.blocks.hash[block] for block in pin.block_ids] == hashes
            assert all(self.pool.blocks.ref[block] > 0 for block in pin.block_ids)

    @rule()
    def restore_from_snapshot(self):
        data = dump_pool(self.pool)
        restored = load_pool(json.loads(json.dumps(data)))
        assert snapshot(restored) == snapshot(self.pool)
        self.pool = restored

    @invariant()
    def events_describe_the_index(self):
        """Replaying the KV events gives the pool's prefix index: no event of a
        rolled-back batch leaks, none is missing, numbering has no gaps."""
        for event in self.pool.take_events():
            self.last_seq_no += 1
            assert event.seq_no == self.last_seq_no
            if event.kind == BLOCK_STORED:
                assert event.block_hash not in self.index_from_events
                self.index_from_events[event.block_hash] = event.block_id
            elif event.kind == BLOCK_REMOVED:
                assert self.index_from_events.pop(event.block_hash) == event.block_id
            else:
                assert event.kind == ALL_BLOCKS_CLEARED
                self.index_from_events.clear()
        assert self.index_from_events == self.pool.blocks.index

    @invariant()
    def invariants_hold(self):
        check_invariants(self.pool)
        b = self.block_size
        for seq_id, toks in self.model.items():
            seq = self.pool.seqs[seq_id]
            assert seq.token_ids == toks
            assert len(seq.table) == num_blocks_for(len(toks), b)
            assert seq.num_committed >= self.committed[seq_id]
        assert set(self.pool.seqs) == set(self.model)
        stats = self.pool.stats()
        assert stats.num_free_blocks + stats.num_used_blocks + stats.num_evictable_blocks == self.num_blocks


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPoolMachine = PoolMachine.TestCase


class SmallPoolMachine(PoolMachine):
    """The same rules on a pool so small that most batches reuse freed blocks,
    evict, and revive cached blocks from the middle of the LRU, so a rollback
    that restores the free list or the LRU out of order shows."""

    num_blocks, block_size, watermark_blocks = 8, 2, 0


SmallPoolMachine.TestCase.settings = PoolMachine.TestCase.settings
TestSmallPoolMachine = SmallPoolMachine.TestCase


class HostTierPoolMachine(SmallPoolMachine):
    """The same rules on the small pool with a host tier of 3 blocks: evictions
    offload, prefix hits restore, and a full host tier drops its oldest hash.
    Tier moves change no event, so the events describe the hashes cached in
    either tier (their block ids may have moved)."""

    num_host_blocks = 3

    def __init__(self):
        super().__init__()
        self.pool = Pool(PoolConfig("p", num_blocks=self.num_blocks, block_size=self.block_size,
                                    watermark_blocks=self.watermark_blocks, max_retained_versions=8,
                                    num_host_blocks=self.num_host_blocks))

    @invariant()
    def events_describe_the_index(self):
        for event in self.pool.take_events():
            self.last_seq_no += 1
            assert event.seq_no == self.last_seq_no
            if event.kind == BLOCK_STORED:
                assert event.block_hash not in self.index_from_events and event.medium == "device"
                self.index_from_events[event.block_hash] = event.block_id
            elif event.kind == BLOCK_REMOVED:
                self.index_from_events.pop(event.block_hash)
            else:
                assert event.kind == ALL_BLOCKS_CLEARED
                self.index_from_events.clear()
        host = self.pool.blocks.host
        assert set(self.index_from_events) == set(self.pool.blocks.index) | set(host.index)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens, extra=st.sampled_from(EXTRAS), first=st.integers(0, 4))
    def locate(self, prefix, suffix, extra, first):
        """What a cross-pool transfer reads (``Pool.locate_blocks``): from block
        ``first`` on, the run of the prompt's cached full blocks, each the block
        holding its hash in its tier; reading changes nothing."""
        prompt, b = prefix + suffix, self.block_size
        before = snapshot(self.pool)
        found = self.pool.locate_blocks(prompt, extra, first, 64)
        assert snapshot(self.pool) == before
        digest, parent, want = _digest(extra, self.pool.config.tenant), None, []
        blocks, host = self.pool.blocks, self.pool.blocks.host
        for i in range(len(prompt) // b):
            parent = hash_block(parent, prompt[i * b : (i + 1) * b], digest)
            if i < first:
                continue
            if parent in blocks.index:
                want.append(("device", blocks.index[parent]))
                assert blocks.hash[blocks.index[parent]] == parent
            elif parent in host.index:
                want.append(("host", host.index[parent]))
                assert host.hash[host.index[parent]] == parent
            else:
                break
        assert found == want


HostTierPoolMachine.TestCase.settings = PoolMachine.TestCase.settings
TestHostTierPoolMachine = HostTierPoolMachine.TestCase


class OneHostBlockPoolMachine(HostTierPoolMachine):
    """A host tier of one block: nearly every offload drops the previous one."""

    num_host_blocks = 1


OneHostBlockPoolMachine.TestCase.settings = PoolMachine.TestCase.settings
TestOneHostBlockPoolMachine = OneHostBlockPoolMachine.TestCase
