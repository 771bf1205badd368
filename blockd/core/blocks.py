"""Physical block bookkeeping with an undo journal: the pool's block space.

Owns, per block id: the ref count, how many of its slots hold tokens (``fill``)
and its prefix hash; and, pool-wide: the never-used counter, the free list, the
evictable LRU (:class:`~blockd.core.lru.BlockLRU`) and the prefix index
(hash -> block id).

Every block is in exactly one state:

* **free**: ref count 0, no hash; either never used (id >= ``next_fresh``) or
  in the free list. The free list is FIFO, so ids are handed out in ascending
  order first, then in the order they were released.
* **evictable**: ref count 0, indexed hash, in the LRU.
* **used**: ref count > 0 (it may or may not carry an indexed hash).

Every mutation made while a transaction is open is recorded as an undo entry;
:meth:`rollback` replays them in reverse, which restores the exact previous
state, LRU order included. This is what makes a batch atomic without copying
the pool. Imports only the standard library.
"""

from __future__ import annotations

from collections import deque

from blockd.core.errors import InvariantViolation
from blockd.core.lru import BlockLRU


class BlockSpace:
    """Block states of one pool. Callers check capacity before taking blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.fill = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.index: dict[bytes, int] = {}
        self.next_fresh = 0
        self.free: deque[int] = deque()
        self.lru = BlockLRU(num_blocks)
        self.num_used = 0
        #: sum of ``fill`` over used blocks: distinct token slots in use
        self.filled_slots = 0
        self.num_evictions = 0
        #: hashes dropped by evictions since the last drain (for BlockRemoved)
        self.evicted: list[tuple[int, bytes]] = []
        self._undo: list[tuple] | None = None

    # --- transactions -------------------------------------------------
    def begin(self) -> None:
        self._undo = []
        self._saved = (self.num_used, self.filled_slots, self.num_evictions, len(self.evicted))

    def commit(self) -> None:
        self._undo = None

    def journal(self) -> list[tuple]:
        """The open transaction's undo list, for hot loops that append to it
        directly (entries as for :meth:`log`)."""
        if self._undo is None:
            raise InvariantViolation("no transaction is open")
        return self._undo

    def log(self, entry: tuple) -> None:
        """Record an undo entry owned by a caller (see :meth:`rollback`)."""
        if self._undo is not None:
            self._undo.append(entry)

    def rollback(self, undo_other) -> None:
        """Undo everything since :meth:`begin`; foreign entries go to ``undo_other``."""
        entries, self._undo = self._undo or [], None
        for entry in reversed(entries):
            kind = entry[0]
            if kind == "ref":
                self.ref[entry[1]] = entry[2]
            elif kind == "fill":
                self.fill[entry[1]] = entry[2]
            elif kind == "fresh":
                self.next_fresh -= 1
            elif kind == "free_pop":
                self.free.appendleft(entry[1])
            elif kind == "free_push":
                self.free.pop()
            elif kind == "lru_push":
                self.lru.remove(entry[1])
            elif kind == "lru_remove":
                self.lru.relink(entry[1], entry[2], entry[3])
            elif kind == "evict":
                _, block, h, prev, nxt = entry
                self.lru.relink(block, prev, nxt)
                self.hash[block] = h
                self.index[h] = block
            elif kind == "index_add":
                del self.index[entry[1]]
                self.hash[entry[2]] = None
            else:
                undo_other(entry)
        self.num_used, self.filled_slots, self.num_evictions, num_evicted = self._saved
        del self.evicted[num_evicted:]

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
        undo = self._undo
        if self.next_fresh < self.num_blocks:
            block = self.next_fresh
            self.next_fresh += 1
            if undo is not None:
                undo.append(("fresh",))
        elif self.free:
            block = self.free.popleft()
            if undo is not None:
                undo.append(("free_pop", block))
        else:
            block = self.lru.front()
            if block is None:
                raise InvariantViolation("no free or evictable block left; capacity check missed")
            prev, nxt = self.lru.remove(block)
            h = self.hash[block]
            if undo is not None:
                undo.append(("evict", block, h, prev, nxt))
            del self.index[h]
            self.hash[block] = None
            self.num_evictions += 1
            self.evicted.append((block, h))
        if undo is not None:
            undo.append(("ref", block, 0))
            undo.append(("fill", block, self.fill[block]))
        self.ref[block] = 1
        self.fill[block] = fill
        self.num_used += 1
        self.filled_slots += fill
        return block

    def acquire(self, block: int) -> None:
        """One more table holds ``block`` (a prefix hit or a fork)."""
        ref = self.ref[block]
        if self._undo is not None:
            self._undo.append(("ref", block, ref))
        if ref == 0:
            prev, nxt = self.lru.remove(block)
            if self._undo is not None:
                self._undo.append(("lru_remove", block, prev, nxt))
            self.num_used += 1
            self.filled_slots += self.fill[block]
        self.ref[block] = ref + 1

    def release(self, block: int) -> None:
        """One table fewer holds ``block``; at 0 it becomes evictable or free."""
        ref = self.ref[block]
        if self._undo is not None:
            self._undo.append(("ref", block, ref))
        self.ref[block] = ref - 1
        if ref > 1:
            return
        self.num_used -= 1
        self.filled_slots -= self.fill[block]
        if self.hash[block] is not None:
            self.lru.push_back(block)
            if self._undo is not None:
                self._undo.append(("lru_push", block))
        else:
            self.free.append(block)
            if self._undo is not None:
                self._undo.append(("free_push",))

    def add_fill(self, block: int, count: int) -> None:
        """``count`` more slots of a used, unshared block now hold tokens.

        Not journaled: only a sequence's own last block grows, and the
        sequence's undo entry restores that block's fill from its old length.
        """
        self.fill[block] += count
        self.filled_slots += count

    def index_block(self, block: int, h: bytes) -> bool:
        """Enter a full, committed block under ``h``; False if ``h`` is taken."""
        if h in self.index:
            return False
        self.index[h] = block
        self.hash[block] = h
        if self._undo is not None:
            self._undo.append(("index_add", h, block))
        return True

    def clear_index(self) -> None:
        """Forget every hash; evictable blocks become free (not journaled)."""
        for block in list(self.lru):
            self.lru.remove(block)
            self.free.append(block)
        for block in self.index.values():
            self.hash[block] = None
        self.index.clear()
