"""Property tests of the host tier against a model of the workers' memory.

Random batches (allocations over shared prefixes, appends, commits, frees,
decode steps, forks, snapshots, failing batches) on small pools with host
tiers of several sizes. After every step the test does what the workers do:
it runs the step's tier ops in order on a fake memory (device and host: block
-> the KV of each slot, here the token prefix that produced it), then the copy
ops, then writes the KV of every token the step handed out to compute. Then
every live sequence's blocks must hold exactly the KV of its tokens, cached
and restored ones included; the invariant checker runs after every step; and
the KV events must describe the hashes cached in both tiers.
"""

import contextlib
import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from blockd.core import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    Allocate,
    Append,
    BlockdError,
    Commit,
    Fork,
    Free,
    Pool,
    PoolConfig,
    check_invariants,
)
from blockd.core.state import dump_pool, load_pool
from blockd.core.types import OFFLOAD, RESTORE, DecodeAppend

B = 2
PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [1, 2, 7, 7], [5, 5, 5, 5, 5], []]
tokens = st.lists(st.integers(0, 6), max_size=5)
#: retention priorities: a block keeps its priority in the host tier and back
priorities = st.sampled_from([4, 4, 0, 7])


def snapshot(pool):
    return json.dumps(dump_pool(pool), sort_keys=True)


class TierMemoryMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool: Pool
        #: the workers' memory: block -> per slot, the token prefix whose KV it holds
        self.device: dict[int, list[tuple[int, ...] | None]] = {}
        self.host: dict[int, list[tuple[int, ...] | None]] = {}
        self.model: dict[str, list[int]] = {}
        self.counter = 0
        self.cached_hashes: set[bytes] = set()
        self.saw = {OFFLOAD: 0, RESTORE: 0}

    @initialize(num_blocks=st.integers(4, 9), num_host_blocks=st.sampled_from([0, 1, 2, 3, 8]))
    def make_pool(self, num_blocks, num_host_blocks):
        self.pool = Pool(PoolConfig("p", num_blocks=num_blocks, block_size=B, num_host_blocks=num_host_blocks,
                                    max_retained_versions=4))

    def _new_id(self):
        self.counter += 1
        return f"s{self.counter}"

    def _step(self, ops):
        """Run a batch as the scheduler and the workers would; None if refused
        (then nothing may have changed)."""
        before = snapshot(self.pool)
        try:
            result = self.pool.step(ops)
        except BlockdError as err:
            assert err.code != "INTERNAL", err
            assert snapshot(self.pool) == before
            return None
        for op in result.tier_ops:  # in order, before the copies
            if op.kind == OFFLOAD:
                assert op.device_block in self.device, "an offload of a block nobody wrote"
                self.host[op.host_block] = list(self.device[op.device_block])
            else:
                assert op.kind == RESTORE and op.host_block in self.host
                self.device[op.device_block] = list(self.host[op.host_block])
            self.saw[op.kind] += 1
        for src, dst in result.copy_ops:
            self.device[dst] = list(self.device[src])
        written = {seq_id: len(toks) for seq_id, toks in self.model.items()}  # KV written before the step
        for op, r in zip(ops, result.results):
            if isinstance(op, Allocate):
                self.model[op.seq_id] = list(op.prompt_token_ids)
                written[op.seq_id] = r.num_cached_tokens
                assert r.num_restored_tokens <= r.num_cached_tokens
            elif isinstance(op, Append):
                self.model[op.seq_id].extend(op.token_ids)
            elif isinstance(op, DecodeAppend):
                for seq_id, tok in zip(op.seq_ids, op.token_ids):
                    self.model[seq_id].append(tok)
            elif isinstance(op, Fork):
                self.model[op.child_seq_id] = list(self.model[op.parent_seq_id])
                written[op.child_seq_id] = written[op.parent_seq_id]
            elif isinstance(op, Free):
                del self.model[op.seq_id]
        for seq_id, toks in self.model.items():  # the model computes what the step handed out
            table = self.pool.block_table(seq_id)
            for pos in range(written[seq_id], len(toks)):
                block = self.device.setdefault(table[pos // B], [None] * B)
                block[pos % B] = tuple(toks[: pos + 1])
        return result

    # --- rules ----------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens, priority=priorities)
    def allocate(self, prefix, suffix, priority):
        self._step([Allocate(self._new_id(), prefix + suffix, priority=priority)])

    @rule(prefix=st.sampled_from(PREFIXES[:-1]), suffix=tokens, free=st.booleans(), priority=priorities)
    def prefill(self, prefix, suffix, free, priority):
        """A prompt computed and committed (the next step), maybe freed: its
        full blocks are cached at the highest priority of their holders, and
        under pressure offloaded (the lowest priority first) with it."""
        seq_id = self._new_id()
        if self._step([Allocate(seq_id, prefix + suffix, priority=priority)]) is not None:
            self._step([Commit(seq_id, len(prefix + suffix))])
            if free:
                self._step([Free(seq_id)])

    @precondition(lambda self: any(self.pool.blocks.ref[self.pool.block_table(s)[-1]] > 1
                                   for s, toks in self.model.items() if len(toks) % B))
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES[:-1]))
    def copy_free_and_restore(self, data, prefix):
        """One batch: copy a shared partial last block on write, free every
        holder of both blocks, then allocate a prompt that may be restored from
        the host tier into one of the blocks just freed."""
        shared = sorted(s for s, toks in self.model.items()
                        if len(toks) % B and self.pool.blocks.ref[self.pool.block_table(s)[-1]] > 1)
        seq_id = data.draw(st.sampled_from(shared))
        last = self.pool.block_table(seq_id)[-1]
        others = [s for s in sorted(self.model) if s != seq_id and last in self.pool.block_table(s)]
        self._step([Append(seq_id, [4]), Free(seq_id), *(Free(s) for s in others),
                    Allocate(self._new_id(), prefix)])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), new=tokens)
    def append(self, data, new):
        self._step([Append(data.draw(st.sampled_from(sorted(self.model))), new)])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def commit_all(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        self._step([Commit(seq_id, len(self.model[seq_id]))])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def decode(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        self._step([DecodeAppend(ids, [3] * len(ids))])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        self._step([Fork(data.draw(st.sampled_from(sorted(self.model))), self._new_id())])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        assert self._step([Free(data.draw(st.sampled_from(sorted(self.model))))]) is not None

    @rule(data=st.data(), fail=st.booleans())
    def mixed_batch(self, data, fail):
        """Several ops in one batch: blocks freed, evicted (offloaded), restored
        and copied on write within one version, a sequence extended twice; or the same with a failing op
        at the end, which must leave nothing (the memory model included: a
        refused step gives the workers nothing to run)."""
        ops = []
        live = sorted(self.model)
        freed = set()
        for _ in range(data.draw(st.integers(1, 4))):
            kind = data.draw(st.sampled_from(["allocate", "append", "decode", "commit", "free"] if live
                                             else ["allocate"]))
            if kind == "allocate":
                prompt = data.draw(st.sampled_from(PREFIXES)) + data.draw(tokens)
                ops.append(Allocate(self._new_id(), prompt))
                continue
            seq_id = data.draw(st.sampled_from(live))
            if seq_id in freed:
                continue
            if kind == "append":
                ops.append(Append(seq_id, data.draw(tokens)))
            elif kind == "decode":  # after an Append of the same batch: implies only what came before the batch
                ops.append(DecodeAppend([seq_id], [data.draw(st.integers(0, 6))]))
            elif kind == "commit":  # only KV written before the step
                ops.append(Commit(seq_id, len(self.model[seq_id])))
            else:
                ops.append(Free(seq_id))
                freed.add(seq_id)
        if not ops:
            return
        if fail:
            before = snapshot(self.pool)
            with contextlib.suppress(BlockdError):
                self.pool.step([*ops, Append("missing", [1])])
            assert snapshot(self.pool) == before
        else:
            self._step(ops)

    @rule()
    def restart_from_snapshot(self):
        """A restarted daemon (same workers, same memory) has the same host index."""
        restored = load_pool(json.loads(json.dumps(dump_pool(self.pool))))
        assert snapshot(restored) == snapshot(self.pool)
        self.pool = restored

    # --- invariants -----------------------------------------------------------
    @invariant()
    def invariants_hold(self):
        check_invariants(self.pool)
        assert set(self.pool.seqs) == set(self.model)

    @invariant()
    def every_block_holds_the_kv_of_its_tokens(self):
        for seq_id, toks in self.model.items():
            table = self.pool.block_table(seq_id)
            for pos in range(len(toks)):
                slot = self.device.get(table[pos // B], [None] * B)[pos % B]
                assert slot == tuple(toks[: pos + 1]), (seq_id, pos, table)

    @invariant()
    def events_describe_the_cached_hashes_of_both_tiers(self):
        host = self.pool.blocks.host
        for event in self.pool.take_events():
            if event.kind == BLOCK_STORED:
                assert event.medium == "device" and event.block_hash not in self.cached_hashes
                self.cached_hashes.add(event.block_hash)
            elif event.kind == BLOCK_REMOVED:
                assert event.medium in ("device", "host")
                assert event.medium == "device" or host is not None
                self.cached_hashes.remove(event.block_hash)
            else:
                assert event.kind == ALL_BLOCKS_CLEARED
                self.cached_hashes.clear()
        in_host = set(host.index) if host is not None else set()
        assert self.cached_hashes == set(self.pool.blocks.index) | in_host

    @invariant()
    def cached_blocks_in_the_host_hold_their_kv(self):
        """A host block holding a hash holds the KV of a full block (what it
        was offloaded with), so a restore brings back written slots."""
        host = self.pool.blocks.host
        if host is not None:
            for hb in host.index.values():
                assert None not in self.host[hb]


TierMemoryMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
TestTierMemoryMachine = TierMemoryMachine.TestCase
