"""The queues of cached blocks: the evictable-block LRU, the host tier, and
the miss ledger (recently dropped hashes, the tokens-only index).

:class:`BlockLRU` is an intrusive doubly linked list over block ids, used by
the device tier and, over host block ids, by the host tier (:class:`HostTier`).

Blocks whose ref count fell to 0 but which still hold a full, committed,
hashed prefix block wait here until a prefix hit revives them (taken out of
the middle in O(1)) or the pool runs out of free blocks and evicts the front
(O(1)): the least recently released block of the lowest retention priority
that has any (``[0, NUM_PRIORITIES)``, lower first, :data:`DEFAULT_PRIORITY`
when nobody asked). A freed sequence's blocks are released tail first, so
within a priority its tail is evicted before its head (a later request is
more likely to share the head).

A block's priority (``BlockSpace.priority``, and ``HostTier.priority`` for
host blocks): a block handed out starts at :data:`MIN_PRIORITY`, and each
holder that lets it go (``BlockSpace.release``) raises it to its own if that
is higher. So a cached block keeps the highest priority of the sequences
that held it since it was filled, across revivals, and across tiers: an
offload stores it with the host block, a restore brings it back. Only
``BlockSpace.set_priority`` (a caller's per-prefix request) lowers it.

The links live in two flat lists indexed by block id, with one sentinel per
priority at index ``num_blocks + priority`` (each priority is its own
circular list); nothing is allocated per operation. A bit mask of the
non-empty priorities makes :meth:`BlockLRU.front` O(1): a list is empty
exactly when a sentinel is linked to itself, so :meth:`~BlockLRU.remove` and
:meth:`~BlockLRU.relink` keep the mask from the neighbours alone, without
knowing a block's priority. Unlike an ``OrderedDict``, a removed block can be
linked back between its old neighbours, which is what lets a failed batch
roll back exactly (:meth:`remove` returns the neighbours, :meth:`relink` puts
it back, in the same priority's list). Imports only the standard library.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Iterator

_UNLINKED = -1
#: retention priorities: ``0 .. NUM_PRIORITIES - 1``, lower evicted first
NUM_PRIORITIES = 8
#: the priority of a request or prefix that did not ask for one: work can be
#: marked less important than the default as well as more
DEFAULT_PRIORITY = 4
#: the priority a block starts from when it is handed out (its holders raise it)
MIN_PRIORITY = 0
#: mask of non-empty priorities -> the lowest (an index beats ``bit_length`` on the eviction path)
_LOWEST = tuple((mask & -mask).bit_length() - 1 for mask in range(1 << NUM_PRIORITIES))


class Undo(ABC):
    """One journal entry: how to take back one mutation, exactly
    (:mod:`blockd.core.blocks` says how batches use them)."""

    __slots__ = ()

    @abstractmethod
    def undo(self) -> None:
        """Restore what the mutation changed (entries are undone newest first)."""


#: the open batch's undo entries, oldest first
Journal = list[Undo]


class BlockLRU:
    """LRU queues of block ids in ``[0, num_blocks)``, one per priority."""

    __slots__ = ("_base", "_len", "_mask", "_next", "_prev")

    def __init__(self, num_blocks: int) -> None:
        self._base = num_blocks  # sentinel of priority p: num_blocks + p; _next of it is the front, _prev the back
        size = num_blocks + NUM_PRIORITIES
        self._prev = [_UNLINKED] * size
        self._next = [_UNLINKED] * size
        for sentinel in range(num_blocks, size):
            self._prev[sentinel] = self._next[sentinel] = sentinel
        self._len = 0
        #: bit p set: priority p's list is not empty
        self._mask = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return self._prev[block_id] != _UNLINKED

    def __iter__(self) -> Iterator[int]:
        """Front (next to evict) to back: lowest priority first."""
        for priority in range(NUM_PRIORITIES):
            yield from self.at(priority)

    def at(self, priority: int) -> Iterator[int]:
        """The blocks of one priority, front to back."""
        sentinel = self._base + priority
        node = self._next[sentinel]
        while node != sentinel:
            yield node
            node = self._next[node]

    def priorities_in_use(self) -> int:
        """The bit mask of non-empty priorities (for the invariant checker)."""
        return self._mask

    def push_back(self, block_id: int, priority: int) -> None:
        """Mark ``block_id`` as the most recently released of ``priority``
        (:meth:`relink` before the sentinel, inline: the release hot path)."""
        sentinel = self._base + priority
        prev = self._prev[sentinel]
        if prev == sentinel:
            self._mask |= 1 << priority
        self._prev[block_id] = prev
        self._next[block_id] = sentinel
        self._next[prev] = self._prev[sentinel] = block_id
        self._len += 1

    def front(self) -> int | None:
        """The block that would be evicted next, if any."""
        mask = self._mask
        return self._next[self._base + _LOWEST[mask]] if mask else None

    def remove(self, block_id: int) -> tuple[int, int]:
        """Unlink ``block_id``; returns ``(prev, next)`` for :meth:`relink`."""
        prev, nxt = self._prev[block_id], self._next[block_id]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[block_id] = self._next[block_id] = _UNLINKED
        self._len -= 1
        if prev == nxt:  # only the sentinel is left: that priority is empty now
            self._mask &= ~(1 << (prev - self._base))
        return prev, nxt

    def relink(self, block_id: int, prev: int, nxt: int) -> None:
        """Link ``block_id`` between ``prev`` and ``nxt`` (adjacent right now)."""
        if prev == nxt:  # a sentinel alone: its priority was empty
            self._mask |= 1 << (prev - self._base)
        self._prev[block_id] = prev
        self._next[block_id] = nxt
        self._next[prev] = block_id
        self._prev[nxt] = block_id
        self._len += 1


class HostTier:
    """The host-memory tier's index: ``num_blocks`` host blocks, each free or
    holding exactly one cached hash.

    A host block is never in a table: it only keeps a cached block's KV while
    its device block is reused, so it has no ref count. Free host blocks are
    handed out like device ones (never-used ids ascending, then the FIFO free
    list); every host block holding a hash is in :attr:`lru` at its
    :attr:`priority` (the device block's when it was offloaded; front = the
    least recently offloaded of the lowest priority, the one dropped when the
    tier is full), except while an allocation has it pinned for a restore.

    How :class:`~blockd.core.blocks.BlockSpace` uses it: an **offload** (its
    ``take`` evicts a cached device block) moves the hash to a host block
    (never used, then free, then the host LRU's front, whose hash is
    dropped: ``BlockRemoved`` with medium host) and queues ``TierOp(OFFLOAD,
    device, host)``, or drops it if every host block is pinned by the
    allocation in progress; a **restore** (``restore`` after ``pin_host``)
    gives a fresh device block the hash back, queues ``TierOp(RESTORE,
    device, host)`` and frees the host block; a **supersede**: a device
    block committed under a hash the host tier holds takes it over, the host
    block is freed (no event: the hash stays cached).

    Ordering within a batch: workers run the tier ops in the order generated,
    then the copies, then write KV. A device block is handed out only after
    its OFFLOAD is queued, and a host block is freed only after its RESTORE
    is queued, so each tier op reads a block before any later one overwrites
    it. Copies run after every tier op, so a copy's source or destination in
    the batch is never a restore's target (``BlockSpace.take_clean`` skips them). Every mutation journals into the
    ``journal`` it is given (None outside a batch);
    :class:`~blockd.core.blocks.BlockSpace` decides when to call them.
    """

    __slots__ = ("free", "hash", "index", "lru", "next_fresh", "num_blocks", "priority")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        #: the retention priority of each host block's hash (meaningful while it holds one)
        self.priority = [DEFAULT_PRIORITY] * num_blocks
        #: hash -> host block holding it
        self.index: dict[bytes, int] = {}
        self.next_fresh = 0
        self.free: deque[int] = deque()
        self.lru = BlockLRU(num_blocks)

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.next_fresh + len(self.free)

    def take(self, journal: Journal | None) -> tuple[int, bytes | None]:
        """A host block to offload into, and the hash dropped to free it:
        never used, then the free list, then the LRU's front; ``(-1, None)``
        when every host block is pinned."""
        if self.next_fresh < self.num_blocks:
            hb = self.next_fresh
            self.next_fresh += 1
            if journal is not None:
                journal.append(_HostTookFresh(self, hb))
            return hb, None
        if self.free:
            hb = self.free.popleft()
            if journal is not None:
                journal.append(_HostTookFree(self, hb))
            return hb, None
        front = self.lru.front()
        if front is None:
            return -1, None
        hb = front
        old = self.hash[hb]
        assert old is not None, "a host block in the LRU holds a hash"
        prev, nxt = self.lru.remove(hb)
        del self.index[old]
        self.hash[hb] = None
        if journal is not None:
            journal.append(_HostEvicted(self, hb, old, prev, nxt))
        return hb, old

    def store(self, journal: Journal | None, hb: int, h: bytes, priority: int) -> None:
        """Host block ``hb`` (just taken) holds ``h``, most recently offloaded at ``priority``."""
        if journal is not None:
            journal.append(_HostStored(self, hb, h, self.priority[hb]))
        self.hash[hb] = h
        self.index[h] = hb
        self.priority[hb] = priority
        self.lru.push_back(hb, priority)

    def set_priority(self, hb: int, priority: int) -> None:
        """Host block ``hb``'s hash is kept at ``priority`` from now on, the
        most recent of it (outside any batch: not journaled)."""
        self.priority[hb] = priority
        if hb in self.lru:
            self.lru.remove(hb)
            self.lru.push_back(hb, priority)

    def pin(self, journal: Journal | None, h: bytes) -> int:
        """Take the host block holding ``h`` out of the LRU until :meth:`release`."""
        hb = self.index[h]
        prev, nxt = self.lru.remove(hb)
        if journal is not None:
            journal.append(_HostPinned(self, hb, prev, nxt))
        return hb

    def release(self, journal: Journal | None, hb: int) -> bytes:
        """Pinned ``hb`` gives its hash up (restored to the device) and joins
        the back of the free list; returns the hash."""
        h = self.hash[hb]
        assert h is not None, "a pinned host block holds a hash"
        del self.index[h]
        self.hash[hb] = None
        self.free.append(hb)
        if journal is not None:
            journal.append(_HostReleased(self, hb, h))
        return h

    def drop(self, journal: Journal | None, h: bytes) -> None:
        """Forget ``h`` (a device block took it over); its block joins the free list."""
        hb = self.index.pop(h)
        self.hash[hb] = None
        prev, nxt = self.lru.remove(hb)
        self.free.append(hb)
        if journal is not None:
            journal.append(_HostDropped(self, hb, h, prev, nxt))

    def clear(self) -> None:
        """Forget every hash (an operator action outside any batch)."""
        for hb in list(self.lru):
            self.lru.remove(hb)
            self.free.append(hb)
            self.hash[hb] = None
        self.index.clear()

class MissLedger:
    """What explains a prefix miss (:data:`~blockd.core.types.MISS_REASONS`).

    ``dropped_device`` / ``dropped_host``: the hashes most recently dropped
    from each tier (evicted from the device tier with no host tier to take
    them, or from the host tier), oldest first, at most ``limit`` each. They
    are a bounded memory, not a log: past ``limit`` the oldest record is
    forgotten, and a miss on its hash is then reported as never stored.
    ``plain_of``: each cached hash (either tier) *with extra keys* -> its
    tokens-only hash, the same chain over the same tokens and tenant without
    extra keys (``plain_digest``); ``variants``: tokens-only hash -> the cached
    hashes with extra keys and those tokens. A hash without extra keys is its
    own tokens-only hash, so it needs no entry: whether it is cached is asked
    of the tiers' indexes (this keeps a decode step's stores as cheap as
    before). So a miss can tell "these tokens are cached under other extra
    keys". A cached hash may lack an entry (a snapshot from before the
    ledger): it then explains no miss.

    Changed only when a batch commits (:meth:`blockd.core.pool.Pool._publish_events`
    replays the batch's stores and drops in order), so a failed or dry-run
    batch leaves nothing without needing a journal; the operations of a batch
    see the ledger as it was when the batch began (and the tiers' indexes as
    they are).
    """

    __slots__ = ("dropped_device", "dropped_host", "limit", "plain_digest", "plain_of", "variants")

    def __init__(self, limit: int, plain_digest: bytes) -> None:
        self.limit = limit
        self.plain_digest = plain_digest
        self.dropped_device: OrderedDict[bytes, None] = OrderedDict()
        self.dropped_host: OrderedDict[bytes, None] = OrderedDict()
        self.plain_of: dict[bytes, bytes] = {}
        self.variants: dict[bytes, set[bytes]] = {}

    def stored(self, h: bytes, plain: bytes) -> None:
        """``h`` entered the cache; ``plain`` its tokens-only hash, or ``h`` itself without extra keys."""
        if self.dropped_device:
            self.dropped_device.pop(h, None)
        if self.dropped_host:
            self.dropped_host.pop(h, None)
        if plain == h:
            return
        self.plain_of[h] = plain
        variants = self.variants.get(plain)
        if variants is None:
            self.variants[plain] = {h}
        else:
            variants.add(h)

    def dropped(self, h: bytes, from_host: bool) -> None:
        """``h`` left the cache, from the host tier or the device tier."""
        plain = self.plain_of.pop(h, None)
        if plain is not None:
            variants = self.variants[plain]
            variants.discard(h)
            if not variants:
                del self.variants[plain]
        records = self.dropped_host if from_host else self.dropped_device
        records[h] = None
        records.move_to_end(h)
        if len(records) > self.limit:
            records.popitem(last=False)

    def clear_cached(self) -> None:
        """The prefix cache was reset: no cached hash is left to explain a miss."""
        self.plain_of.clear()
        self.variants.clear()

    def explains(self, h: bytes, plain: bytes, plain_cached: bool) -> int:
        """The reason a full block with hash ``h`` missed: its index in
        :data:`~blockd.core.types.MISS_REASONS` (never 3, partial);
        ``plain_cached``: its tokens-only hash ``plain`` (not ``h``) is cached."""
        if h in self.dropped_host:
            return 2
        if h in self.dropped_device:
            return 1
        variants = self.variants.get(plain)
        if plain_cached or (variants and (len(variants) > 1 or h not in variants)):
            return 4
        return 0

# --- undo entries of the host tier ---------------------------------------------


class _HostTookFresh(Undo):
    """A never-used host block was taken for an offload."""

    __slots__ = ("hb", "host")

    def __init__(self, host: HostTier, hb: int) -> None:
        self.host, self.hb = host, hb

    def undo(self) -> None:
        self.host.next_fresh -= 1


class _HostTookFree(_HostTookFresh):
    """The front of the host free list was taken for an offload."""

    __slots__ = ()

    def undo(self) -> None:
        self.host.free.appendleft(self.hb)


class _HostStored(Undo):
    """An offloaded hash entered a host block (at the back of its priority in the host LRU)."""

    __slots__ = ("h", "hb", "host", "priority")

    def __init__(self, host: HostTier, hb: int, h: bytes, priority: int = DEFAULT_PRIORITY) -> None:
        self.host, self.hb, self.h, self.priority = host, hb, h, priority

    def undo(self) -> None:
        host = self.host
        host.lru.remove(self.hb)
        del host.index[self.h]
        host.hash[self.hb] = None
        host.priority[self.hb] = self.priority


class _HostReleased(_HostStored):
    """A pinned host block's hash moved to a device block; the host block joined the free list."""

    __slots__ = ()

    def undo(self) -> None:
        host = self.host
        popped = host.free.pop()
        assert popped == self.hb, "undo out of order: the host free list's back is another block"
        host.hash[self.hb] = self.h
        host.index[self.h] = self.hb


class _HostPinned(Undo):
    """A host block left the host LRU (pinned for a restore)."""

    __slots__ = ("hb", "host", "nxt", "prev")

    def __init__(self, host: HostTier, hb: int, prev: int, nxt: int) -> None:
        self.host, self.hb, self.prev, self.nxt = host, hb, prev, nxt

    def undo(self) -> None:
        self.host.lru.relink(self.hb, self.prev, self.nxt)


class _HostEvicted(Undo):
    """The host LRU's front lost its hash (dropped) to take an offload."""

    __slots__ = ("h", "hb", "host", "nxt", "prev")

    def __init__(self, host: HostTier, hb: int, h: bytes, prev: int, nxt: int) -> None:
        self.host, self.hb, self.h, self.prev, self.nxt = host, hb, h, prev, nxt

    def undo(self) -> None:
        host = self.host
        host.hash[self.hb] = self.h
        host.index[self.h] = self.hb
        host.lru.relink(self.hb, self.prev, self.nxt)


class _HostDropped(_HostEvicted):
    """A device block superseded a host block's hash; the host block joined the free list."""

    __slots__ = ()

    def undo(self) -> None:
        popped = self.host.free.pop()
        assert popped == self.hb, "undo out of order: the host free list's back is another block"
        super().undo()
