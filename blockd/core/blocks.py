"""Physical block bookkeeping with typed undo entries: the pool's block space.

Owns, per block id: the ref count, how many of its slots hold tokens (``fill``),
its prefix hash and retention priority; pool-wide: the never-used counter, the
free list, the evictable LRU (:class:`~blockd.core.lru.BlockLRU`), the prefix
index (hash -> block id), the host tier (:class:`~blockd.core.lru.HostTier`,
when the pool has one), and what the open batch produced for the pool to
publish: the evictions not yet announced as events and the tier ops.

Every block is in exactly one state:

* **free**: ref count 0, no hash; either never used (id >= ``next_fresh``) or
  in the free list. The free list is FIFO, so ids are handed out in ascending
  order first, then in the order they were released.
* **evictable**: ref count 0, indexed hash, in the LRU at its priority (:mod:`blockd.core.lru`).
* **used**: ref count > 0 (it may or may not carry an indexed hash).

The host tier (exclusive with the device tier: a hash is in at most one) takes
evicted hashes (offload), gives them back (restore), yields to a device block
committed under its hash (supersede): :class:`~blockd.core.lru.HostTier` tells
how, and the order of tier ops in a batch.

While a batch is open (:meth:`BlockSpace.begin`) every mutation appends one
:class:`Undo` entry to the batch's journal; replaying the journal in reverse
(:meth:`Undo.undo` of each) restores the exact previous state, LRU order
included. This is what makes a batch atomic without copying the pool. The
batch itself (:mod:`blockd.core.batch`) owns the journal. Imports only the
standard library.
"""

from __future__ import annotations

from collections import deque

from blockd.core.errors import InvariantViolation
from blockd.core.lru import MIN_PRIORITY, BlockLRU, HostTier, Journal, Undo
from blockd.core.types import OFFLOAD, RESTORE, TierOp

DEVICE = "device"
HOST = "host"

__all__ = ["DEVICE", "HOST", "BlockSpace", "Journal", "Undo"]


class BlockSpace:
    """Block states of one pool. Callers check capacity before taking blocks."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.fill = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        #: retention priority per block (:mod:`blockd.core.lru` says how it is set)
        self.priority = [MIN_PRIORITY] * num_blocks
        self.index: dict[bytes, int] = {}
        self.next_fresh = 0
        self.free: deque[int] = deque()
        self.lru = BlockLRU(num_blocks)
        self.num_used = 0
        #: sum of ``fill`` over used blocks: distinct token slots in use
        self.filled_slots = 0
        #: cached hashes dropped to make room, from either tier
        self.num_evictions = 0
        #: hashes dropped by evictions since the last drain (for BlockRemoved):
        #: (device or host block, hash, :data:`DEVICE` or :data:`HOST`)
        self.evicted: list[tuple[int, bytes, str]] = []
        self.host = HostTier(num_host_blocks) if num_host_blocks else None
        #: the open batch's offloads and restores, in order (drained by the pool)
        self.tier_ops: list[TierOp] = []
        self.num_offloads = 0
        self.num_restores = 0
        #: the open batch's journal; None outside a batch (nothing is recorded)
        self.journal: Journal | None = None

    # --- batches --------------------------------------------------------
    def begin(self, journal: Journal) -> None:
        """Record every mutation into ``journal`` from now on; its first entry
        puts the counters back, so undoing the whole journal restores them."""
        if self.journal is not None:
            raise InvariantViolation("a batch is already open on this block space")
        journal.append(_Counters(self))
        self.journal = journal

    def end(self) -> None:
        """Stop recording (the batch committed or was undone)."""
        self.journal = None

    # --- queries --------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.num_blocks - self.next_fresh + len(self.free)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free plus evictable."""
        return self.num_blocks - self.next_fresh + len(self.free) + len(self.lru)

    # --- mutations ------------------------------------------------------
    def take(self, fill: int) -> int:
        """Hand out one block with ref count 1 holding ``fill`` tokens.

        Order: never-used ids, then the free list, then evict the least
        recently used evictable block (dropping its hash).
        """
        journal = self.journal
        if self.next_fresh < self.num_blocks:
            block = self.next_fresh
            self.next_fresh += 1
            if journal is not None:
                journal.append(_TookFresh(self, block, self.fill[block], self.priority[block]))
        elif self.free:
            block = self.free.popleft()
            if journal is not None:
                journal.append(_TookFree(self, block, self.fill[block], self.priority[block]))
        else:
            block = self._evict()
        self.ref[block], self.fill[block], self.priority[block] = 1, fill, MIN_PRIORITY  # _hand_out, inline: hot
        self.num_used += 1
        self.filled_slots += fill
        return block

    def _hand_out(self, block: int, fill: int) -> int:
        """``block``, just taken, is used: ref count 1, ``fill`` tokens, the lowest priority."""
        self.ref[block], self.fill[block], self.priority[block] = 1, fill, MIN_PRIORITY
        self.num_used += 1
        self.filled_slots += fill
        return block

    def _evict(self) -> int:
        """Take the least recently used evictable block out of the device tier
        and return it: its hash moves to the host tier (an offload) or, without
        room there, is dropped."""
        block = self.lru.front()
        h = self.hash[block] if block is not None else None
        if block is None or h is None:
            raise InvariantViolation("no free or evictable block left; capacity check missed")
        prev, nxt = self.lru.remove(block)
        if self.journal is not None:
            self.journal.append(_TookEvicted(self, block, self.fill[block], self.priority[block], h, prev, nxt))
        del self.index[h]
        self.hash[block] = None
        if self.host is None or not self._offload(block, h, self.priority[block]):
            self.num_evictions += 1
            self.evicted.append((block, h, DEVICE))
        return block

    def take_clean(self, fill: int, dirty: set[int]) -> int | None:
        """:meth:`take`, but never a block in ``dirty`` (a restore's target must
        not be a copy op's source or destination of the batch, see
        :class:`~blockd.core.lru.HostTier`); None when only such blocks are left."""
        if not dirty or self.next_fresh < self.num_blocks:
            return self.take(fill)
        free = self.free
        at = next((i for i, block in enumerate(free) if block not in dirty), -1)
        if at == 0 or (at < 0 and not free):
            return self.take(fill)
        if at > 0:
            block = free[at]
            del free[at]
            if self.journal is not None:
                self.journal.append(_TookFreeAt(self, block, self.fill[block], self.priority[block], at))
        elif len(self.lru):
            block = self._evict()
        else:
            return None
        return self._hand_out(block, fill)

    # --- the host tier (only called when the pool has one) -------------------
    def _offload(self, block: int, h: bytes, priority: int) -> bool:
        """Move the evicted device ``block``'s hash ``h`` to a host block, at ``priority``."""
        host = self.host
        assert host is not None
        hb, dropped = host.take(self.journal)
        if hb < 0:
            return False
        if dropped is not None:
            self.num_evictions += 1
            self.evicted.append((hb, dropped, HOST))
        host.store(self.journal, hb, h, priority)
        self.tier_ops.append(TierOp(OFFLOAD, block, hb))
        self.num_offloads += 1
        return True

    def pin_host(self, h: bytes) -> int:
        """Pin the host block holding ``h`` for :meth:`restore` (see the module docstring)."""
        assert self.host is not None
        return self.host.pin(self.journal, h)

    def restore(self, hb: int, dirty: set[int]) -> int | None:
        """Bring pinned host block ``hb``'s hash back into a fresh, full device
        block (ref count 1, at the host block's priority) and queue its
        RESTORE; None when no device block outside ``dirty`` is left."""
        host = self.host
        assert host is not None
        block = self.take_clean(self.block_size, dirty)
        if block is None:
            return None
        self.priority[block] = host.priority[hb]  # the take's undo entry restores the old one
        h = host.release(self.journal, hb)
        self.index[h] = block
        self.hash[block] = h
        if self.journal is not None:
            self.journal.append(_Indexed(self, block, h))
        self.tier_ops.append(TierOp(RESTORE, block, hb))
        self.num_restores += 1
        return block

    def acquire(self, block: int) -> None:
        """One more table holds ``block`` (a prefix hit or a fork)."""
        ref = self.ref[block]
        if ref == 0:
            prev, nxt = self.lru.remove(block)
            if self.journal is not None:
                self.journal.append(_Revived(self, block, prev, nxt))
            self.num_used += 1
            self.filled_slots += self.fill[block]
        elif self.journal is not None:
            self.journal.append(_Shared(self, block))
        self.ref[block] = ref + 1

    def release(self, block: int, priority: int = MIN_PRIORITY) -> None:
        """One holder fewer (of ``priority``: ``block`` is raised to it); at 0 it is evictable or free."""
        ref = self.ref[block]
        self.ref[block] = ref - 1
        journal = self.journal
        old = self.priority[block]
        if priority > old:
            self.priority[block] = priority
        if ref > 1:
            if journal is not None:
                journal.append(_Unshared(self, block, old))
            return
        self.num_used -= 1
        self.filled_slots -= self.fill[block]
        if self.hash[block] is not None:
            self.lru.push_back(block, self.priority[block])
            if journal is not None:
                journal.append(_Cached(self, block, old))
        else:
            self.free.append(block)
            if journal is not None:
                journal.append(_Freed(self, block, old))

    def set_priority(self, block: int, priority: int) -> None:
        """Cached ``block`` is at ``priority`` now (evictable: at its back); outside any batch, not journaled."""
        self.priority[block] = priority
        if block in self.lru:
            self.lru.remove(block)
            self.lru.push_back(block, priority)

    def add_fill(self, block: int, count: int) -> None:
        """``count`` more slots of a used, unshared block now hold tokens.

        Not journaled: only a sequence's own last block grows, and its mark
        (:class:`blockd.core.batch.SeqMark`, a decode step's ``DecodeMarks``)
        restores that block's fill from the sequence's old length.
        """
        self.fill[block] += count
        self.filled_slots += count

    def add_fill_each(self, blocks: list[int]) -> None:
        """:meth:`add_fill` of one slot for each listed block (a block listed
        twice gains two): a decode step's growth in one call."""
        fill = self.fill
        for block in blocks:
            fill[block] += 1
        self.filled_slots += len(blocks)

    def index_block(self, block: int, h: bytes) -> bool:
        """Enter a full, committed block under ``h``; whether ``h`` is new to
        the pool's cache (a BlockStored is due). A hash on another device block
        stays there; one in the host tier moves to ``block`` (supersede)."""
        if h in self.index:
            return False
        host = self.host
        superseded = host is not None and h in host.index
        if host is not None and superseded:
            host.drop(self.journal, h)
        self.index[h] = block
        self.hash[block] = h
        if self.journal is not None:
            self.journal.append(_Indexed(self, block, h))
        return not superseded

    def clear_index(self) -> None:
        """Forget every hash; evictable blocks become free (an operator action
        outside any batch, so not journaled)."""
        if self.journal is not None:
            raise InvariantViolation("the prefix index cannot be cleared inside a batch")
        for block in list(self.lru):
            self.lru.remove(block)
            self.free.append(block)
        for block in self.index.values():
            self.hash[block] = None
        self.index.clear()
        if self.host is not None:
            self.host.clear()


# --- undo entries: one class per kind of mutation ---------------------------
# Each names what it takes back and keeps only what that needs. They restore
# absolute values where the mutation overwrote one (fills, LRU links) and step
# counts back otherwise; replayed newest first, both give the old state.


class _Counters(Undo):
    """The batch began: put the O(1) counters, the eviction queue and the tier ops back."""

    __slots__ = ("counts", "space")

    def __init__(self, space: BlockSpace) -> None:
        self.space = space
        self.counts = (space.num_used, space.filled_slots, space.num_evictions, space.num_offloads,
                       space.num_restores, len(space.evicted), len(space.tier_ops))

    def undo(self) -> None:
        space = self.space
        (space.num_used, space.filled_slots, space.num_evictions, space.num_offloads, space.num_restores,
         num_evicted, num_tier_ops) = self.counts
        del space.evicted[num_evicted:]
        del space.tier_ops[num_tier_ops:]


class _TookFresh(Undo):
    """A never-used block was handed out."""

    __slots__ = ("block", "fill", "priority", "space")

    def __init__(self, space: BlockSpace, block: int, fill: int, priority: int) -> None:
        self.space, self.block, self.fill, self.priority = space, block, fill, priority

    def undo(self) -> None:
        self.space.next_fresh -= 1
        self._untake()

    def _untake(self) -> None:  # what every take changed of the block itself
        space, block = self.space, self.block
        space.ref[block], space.fill[block], space.priority[block] = 0, self.fill, self.priority


class _TookFree(_TookFresh):
    """The front of the free list was handed out."""

    __slots__ = ()

    def undo(self) -> None:
        self.space.free.appendleft(self.block)
        self._untake()


class _TookFreeAt(_TookFresh):
    """A block from the middle of the free list was handed out (:meth:`BlockSpace.take_clean`)."""

    __slots__ = ("at",)

    def __init__(self, space: BlockSpace, block: int, fill: int, priority: int, at: int) -> None:
        self.space, self.block, self.fill, self.priority, self.at = space, block, fill, priority, at

    def undo(self) -> None:
        self.space.free.insert(self.at, self.block)
        self._untake()


class _TookEvicted(_TookFresh):
    """The front of the LRU (lowest priority, least recently used) lost its hash and was handed out."""

    __slots__ = ("h", "nxt", "prev")

    def __init__(self, space: BlockSpace, block: int, fill: int, priority: int, h: bytes, prev: int, nxt: int) -> None:
        self.space, self.block, self.fill, self.priority = space, block, fill, priority  # no super(): hot
        self.h, self.prev, self.nxt = h, prev, nxt

    def undo(self) -> None:
        space, block = self.space, self.block
        space.lru.relink(block, self.prev, self.nxt)
        space.hash[block], space.index[self.h] = self.h, block
        self._untake()


class _Revived(Undo):
    """A prefix hit took an evictable block out of the middle of the LRU."""

    __slots__ = ("block", "nxt", "prev", "space")

    def __init__(self, space: BlockSpace, block: int, prev: int, nxt: int) -> None:
        self.space, self.block, self.prev, self.nxt = space, block, prev, nxt

    def undo(self) -> None:
        self.space.ref[self.block] = 0
        self.space.lru.relink(self.block, self.prev, self.nxt)


class _Shared(Undo):
    """One more table holds a used block."""

    __slots__ = ("block", "space")

    def __init__(self, space: BlockSpace, block: int) -> None:
        self.space, self.block = space, block

    def undo(self) -> None:
        self.space.ref[self.block] -= 1


class _Unshared(Undo):
    """One table fewer holds a block that stays used (its priority perhaps raised)."""

    __slots__ = ("block", "priority", "space")

    def __init__(self, space: BlockSpace, block: int, priority: int) -> None:
        self.space, self.block, self.priority = space, block, priority

    def undo(self) -> None:
        self.space.ref[self.block] += 1
        self.space.priority[self.block] = self.priority


class _Cached(_Unshared):
    """A hashed block's last holder let go: it joined the back of its priority in the LRU."""

    __slots__ = ()

    def undo(self) -> None:
        self.space.lru.remove(self.block)
        super().undo()  # ref count 0 -> 1, its priority back


class _Freed(_Unshared):
    """An unhashed block's last holder let go: it joined the back of the free list."""

    __slots__ = ()

    def undo(self) -> None:
        popped = self.space.free.pop()
        assert popped == self.block, "undo out of order: the free list's back is another block"
        super().undo()


class _Indexed(Undo):
    """A full, committed block entered the prefix index."""

    __slots__ = ("block", "h", "space")

    def __init__(self, space: BlockSpace, block: int, h: bytes) -> None:
        self.space, self.block, self.h = space, block, h

    def undo(self) -> None:
        del self.space.index[self.h]
        self.space.hash[self.block] = None
