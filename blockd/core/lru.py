"""The evictable-block queue: an intrusive doubly linked list over block ids.

Blocks whose ref count fell to 0 but which still hold a full, committed,
hashed prefix block wait here until either a prefix hit revives them (taken
out of the middle in O(1)) or the pool runs out of free blocks and evicts the
least recently used one (taken from the front in O(1)).

Eviction order: front = least recently released. When a sequence is freed its
blocks are released tail first, so a freed sequence's tail blocks are evicted
before its head blocks (a later request is more likely to share the head).

The links live in two flat lists indexed by block id, with one sentinel at
index ``num_blocks``; nothing is allocated per operation. Unlike an
``OrderedDict``, a removed block can be linked back between its old
neighbours, which is what lets a failed batch roll back exactly
(:meth:`remove` returns the neighbours, :meth:`relink` puts it back).
Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Iterator

_UNLINKED = -1


class BlockLRU:
    """LRU queue of block ids in ``[0, num_blocks)``."""

    __slots__ = ("_head", "_len", "_next", "_prev")

    def __init__(self, num_blocks: int) -> None:
        self._head = num_blocks  # sentinel: _next[head] is the front, _prev[head] the back
        self._prev = [_UNLINKED] * (num_blocks + 1)
        self._next = [_UNLINKED] * (num_blocks + 1)
        self._prev[self._head] = self._head
        self._next[self._head] = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return self._prev[block_id] != _UNLINKED

    def __iter__(self) -> Iterator[int]:
        """Front (next to evict) to back."""
        node = self._next[self._head]
        while node != self._head:
            yield node
            node = self._next[node]

    def push_back(self, block_id: int) -> None:
        """Mark ``block_id`` as the most recently released."""
        self.relink(block_id, self._prev[self._head], self._head)

    def front(self) -> int | None:
        """The block that would be evicted next, if any."""
        node = self._next[self._head]
        return None if node == self._head else node

    def remove(self, block_id: int) -> tuple[int, int]:
        """Unlink ``block_id``; returns ``(prev, next)`` for :meth:`relink`."""
        prev, nxt = self._prev[block_id], self._next[block_id]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[block_id] = self._next[block_id] = _UNLINKED
        self._len -= 1
        return prev, nxt

    def relink(self, block_id: int, prev: int, nxt: int) -> None:
        """Link ``block_id`` between ``prev`` and ``nxt`` (adjacent right now)."""
        self._prev[block_id] = prev
        self._next[block_id] = nxt
        self._next[prev] = block_id
        self._prev[nxt] = block_id
        self._len += 1
