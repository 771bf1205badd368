"""The idempotency table: a mutating request's id -> what a retry of it gets.

A retried request id returns the first answer and changes nothing; an id
reused for a different request (another kind, pool, or content) is refused
with INVALID_ARGUMENT. The table is bounded three ways
(:class:`IdempotencyLimits`; ``blockd serve --max-request-ids``,
``--max-request-bytes``, ``--request-ttl-s``):

* count: at most ``max_entries`` ids; the oldest is forgotten first;
* age: an id is forgotten once it is more than ``ttl_s`` seconds older than
  the newest record (and, on lookup, than the clock);
* bytes: the estimated memory of all entries stays at or under
  ``max_bytes``. Past it the oldest entries lose their *answer* first but
  keep their id and fingerprint, so a retry of such an id is refused with
  FAILED_PRECONDITION ("applied; answer no longer kept") rather than applied
  twice; only if ids alone pass the cap are the oldest ids forgotten.

So a retry is recognised while its id is among the newest ``max_entries``
and younger than ``ttl_s``, and gets its first answer while that answer also
fits the byte cap. A retry of a forgotten id cannot be told from a new
request: it is applied again (an Allocate then fails ALREADY_EXISTS, an
Append appends twice).

An answer belongs to one pool incarnation: each entry keeps its *scope*,
the incarnation of the request's pool right after it was applied (``""``
for a delete). A retry finding the pool deleted or re-created since is
refused with FAILED_PRECONDITION, never answered with the old pool's result
(a step once replayed an old incarnation's answer into a re-created pool).

What is kept per id: the fingerprint (:func:`fingerprint`: kind, pool and a
BLAKE2b-128 of the request's content) and the answer as compact bytes
(:mod:`blockd.engine.idempotency_codec`: a slot mapping as the blocks it runs
through, other ints as packed arrays or runs), with the time the request
was applied.

Determinism: the table is a function of the records put into it, in order,
under the same limits (limits lowered across a restart trim the table).
Each record carries the wall-clock time it was applied at (:meth:`stamp`,
never going backwards; the engine writes it into the log record), and age
eviction compares record times only, never the clock during replay: replaying
a log, or loading a snapshot and replaying the rest, rebuilds the same ids,
order, answers and evictions. The live clock only stamps new records and, on
lookup, makes an expired entry count as absent (changing nothing). Imports
only the standard library and the core.
"""

from __future__ import annotations

import base64
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from blockd.core.errors import InvalidArgument, WrongState, shown
from blockd.engine.idempotency_codec import decode_result, encode_result, fingerprint

log = logging.getLogger("blockd.engine.idempotency")

#: what :meth:`IdempotencyTable.lookup` returns for an id it does not hold
MISSING = object()
#: estimated bytes an id costs besides its own characters (ordered-dict node,
#: entry object, fingerprint and key strings' headers) and an answer besides
#: its bytes; measured with tracemalloc (tests/blockd/engine/test_idempotency.py checks it)
ENTRY_OVERHEAD = 272
ANSWER_OVERHEAD = 112


@dataclass(frozen=True)
class IdempotencyLimits:
    """The three bounds (see the module docstring)."""

    max_entries: int = 16384
    max_bytes: int = 64 << 20
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if type(self.max_entries) is not int or self.max_entries < 1:
            raise ValueError(f"the most request ids kept must be a positive int, got {shown(self.max_entries)}")
        if type(self.max_bytes) is not int or self.max_bytes < 1:
            raise ValueError(f"the idempotency byte cap must be a positive int, got {shown(self.max_bytes)}")
        if not isinstance(self.ttl_s, (int, float)) or not self.ttl_s > 0:
            raise ValueError(f"the request id lifetime must be a positive number of seconds, got {shown(self.ttl_s)}")


@dataclass(frozen=True)
class IdempotencyUsage:
    num_ids: int
    num_answers: int
    num_bytes: int


class _Entry:
    __slots__ = ("fingerprint", "scope", "size", "t")

    def __init__(self, fingerprint: str, t: float, size: int, scope: str | None) -> None:
        self.fingerprint, self.t, self.size, self.scope = fingerprint, t, size, scope


def _chars_bytes(text: str) -> int:
    """Bytes a str's characters take (CPython: 1 each when ASCII, at most 4)."""
    return len(text) if text.isascii() else 4 * len(text)


def _describe(fp: str) -> str:
    kind, rest = fp.split(":", 1)
    return f"a {kind} on pool {shown(rest.rsplit(':', 1)[0])}"


class IdempotencyTable:
    def __init__(self, limits: IdempotencyLimits | None = None, clock: Callable[[], float] = time.time) -> None:
        self.limits = limits or IdempotencyLimits()
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        #: answers of the entries that still have one, in the same order
        self._answers: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        #: the newest record time put so far
        self.now = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def usage(self) -> IdempotencyUsage:
        return IdempotencyUsage(len(self._entries), len(self._answers), self._bytes)

    def stamp(self) -> float:
        """The time to record for a request applied now (never before the newest)."""
        return max(self._clock(), self.now)

    def _expired(self, t: float, now: float) -> bool:
        return now - t > self.limits.ttl_s

    def holds(self, request_id: str, now: float) -> bool:
        """Whether ``request_id`` is remembered (a new id needs no fingerprint
        until its request succeeds: a failing batch never pays for one)."""
        entry = self._entries.get(request_id)
        return entry is not None and not self._expired(entry.t, now)

    def lookup(self, request_id: str, fp: str, now: float, scope: str | None = None) -> object:
        """The first answer of ``request_id``, or :data:`MISSING`; refuses an id
        used for a different request, one whose answer was dropped, and one
        whose answer belongs to another ``scope`` (the pool's incarnation the
        answer was given in; ``""``: no such pool) than the caller's now."""
        entry = self._entries.get(request_id)
        if entry is None or self._expired(entry.t, now):
            return MISSING
        if entry.fingerprint != fp:
            first = _describe(entry.fingerprint)
            if entry.fingerprint.rsplit(":", 1)[0] == fp.rsplit(":", 1)[0]:
                first += " with different content"
            raise InvalidArgument(f"request_id {shown(request_id)} was already used for {first}; "
                                  "use a fresh id per request")
        if entry.scope is not None and scope is not None and entry.scope != scope:
            then = f"incarnation {entry.scope}" if entry.scope else "none (deleted)"
            now_ = f"incarnation {scope}" if scope else "deleted"
            raise WrongState(
                f"request_id {shown(request_id)} was applied ({_describe(fp)}) when the pool's incarnation was "
                f"{then}; the pool is now {now_}: it was deleted or re-created since, so that answer belongs "
                "to another pool; read the pool's state and send the request with a fresh request_id")
        answer = self._answers.get(request_id)
        if answer is None:
            raise WrongState(
                f"request_id {shown(request_id)} was applied ({_describe(fp)}), but its answer is no longer kept: "
                f"answers are dropped oldest first once the idempotency table passes {self.limits.max_bytes} "
                "bytes; read the current state (GetTables, GetPool) instead of retrying")
        return decode_result(answer)

    def put(self, request_id: str, fp: str, t: float, result: object, block_size: int = 0,
            scope: str | None = None) -> None:
        """Remember ``result`` for ``request_id``, applied at record time ``t``
        (``block_size``: the pool's, so slot mappings are kept as blocks;
        ``scope``: the pool's incarnation after the request, ``""`` when it
        left no pool, None: not checked on a retry)."""
        self._put(request_id, fp, t, encode_result(result, block_size), scope)

    def _put(self, request_id: str, fp: str, t: float, answer: bytes | None, scope: str | None) -> None:
        self._forget(request_id)
        self.now = max(self.now, t)
        while self._entries and self._expired(next(iter(self._entries.values())).t, self.now):
            self._forget(next(iter(self._entries)))
        entry = _Entry(fp, t, ENTRY_OVERHEAD + _chars_bytes(request_id) + _chars_bytes(fp), scope)
        self._entries[request_id] = entry
        self._bytes += entry.size
        if answer is not None:
            self._answers[request_id] = answer
            self._bytes += ANSWER_OVERHEAD + len(answer)
        while len(self._entries) > self.limits.max_entries:
            self._forget(next(iter(self._entries)))
        while self._bytes > self.limits.max_bytes and self._answers:
            self._drop_answer(next(iter(self._answers)))
        while self._bytes > self.limits.max_bytes:
            self._forget(next(iter(self._entries)))

    def _drop_answer(self, request_id: str) -> None:
        answer = self._answers.pop(request_id, None)
        if answer is not None:
            self._bytes -= ANSWER_OVERHEAD + len(answer)

    def _forget(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._drop_answer(request_id)
            self._bytes -= entry.size

    # --- snapshots --------------------------------------------------------------
    def dump(self) -> dict:
        answers = self._answers
        return {"now": self.now, "entries": [
            [rid, e.fingerprint, e.t, base64.b64encode(answers[rid]).decode() if rid in answers else None,
             e.scope]
            for rid, e in self._entries.items()]}

    def dump_scope(self, scope: str) -> list:
        """The entries whose answers belong to ``scope`` (a pool incarnation), as
        :meth:`dump` writes them: what a pool's move to another daemon hands over."""
        return [row for row in self.dump()["entries"] if row[4] == scope]

    def add_entries(self, rows: list) -> None:
        """Add :meth:`dump_scope`'s entries (another daemon's); ValueError (nothing
        added) for rows of another shape; an id already kept here keeps its own."""
        parsed = []
        for row in rows:
            if not isinstance(row, list) or len(row) != 5 or not all(isinstance(v, str) for v in row[:2]) \
                    or not isinstance(row[2], (int, float)) or not isinstance(row[3], (str, type(None))) \
                    or not isinstance(row[4], str):
                raise ValueError(f"a request id entry must be [id, fingerprint, time, answer, scope], got {row!r:.80}")
            parsed.append((row[0], row[1], float(row[2]), None if row[3] is None else base64.b64decode(row[3]),
                           row[4]))
        for rid, fp, t, answer, scope in parsed:
            if rid not in self._entries:
                self._put(rid, fp, t, answer, scope)

    def load(self, data: dict | list) -> None:
        self._entries.clear()
        self._answers.clear()
        self._bytes, self.now = 0, 0.0
        if isinstance(data, list):  # written before answers were kept compactly
            if data:
                log.warning("the snapshot holds %d request ids in an older format; they are forgotten, "
                            "so a retry of one of those requests is applied anew", len(data))
            return
        # entries written before scopes were kept have four fields: their scope is not checked
        for rid, fp, t, answer, *scope in data["entries"]:
            self._put(rid, fp, t, None if answer is None else base64.b64decode(answer), scope[0] if scope else None)
        self.now = data["now"]


__all__ = ["MISSING", "IdempotencyLimits", "IdempotencyTable", "IdempotencyUsage", "fingerprint"]
