"""The allocator's error types: one class per way a caller can be refused.

Three kinds of failure are kept apart (after vLLM's v1 core):

* a caller's misuse (:class:`InvalidArgument`, :class:`NotFound`,
  :class:`AlreadyExists`, :class:`WrongState`),
* an expected "no room" answer (:class:`NoRoom`),
* a broken invariant, i.e. a bug in blockd (:class:`InvariantViolation`).

Each maps to exactly one gRPC status code in the service layer
(``code`` names it, so the core needs no gRPC import). Every error raised by an
operation leaves the allocator state exactly as it was before the call.
Error messages echo what the caller sent through :func:`shown`, so a
10,000-character id never becomes a 10,000-character message (a gRPC status
travels in metadata, which has a hard size limit). Imports only the standard
library.
"""

from __future__ import annotations

import json
import reprlib

#: how many characters of a caller's value a message shows
SHOWN_CHARS = 64
_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxstring = _REPR.maxother = SHOWN_CHARS
_REPR.maxlist = _REPR.maxtuple = 8


def shown(value: object) -> str:
    """``repr(value)`` for a message, cut to about :data:`SHOWN_CHARS`
    characters: a long string keeps its head and says how long it was
    (``'xxxx…' (10000 characters)``), other values go through :mod:`reprlib`."""
    if isinstance(value, str):
        text = repr(value[:SHOWN_CHARS])
        if len(text) > 2 * SHOWN_CHARS:  # escapes (control characters, surrogates) widen it
            text = text[: 2 * SHOWN_CHARS] + "\u2026"
        return text if len(value) <= SHOWN_CHARS else f"{text}\u2026 ({len(value)} characters)"
    text = _REPR.repr(value)
    return text if len(text) <= 2 * SHOWN_CHARS else text[: 2 * SHOWN_CHARS] + "\u2026"


class BlockdError(Exception):
    """Base class. ``code`` is the gRPC status name the service maps it to."""

    code = "INTERNAL"

    def __init__(self, message: str, *, op_index: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: index of the failing operation inside a batch, if any
        self.op_index = op_index

    def at_op(self, op_index: int, what: str) -> BlockdError:
        """The same error, re-worded to name the failing operation of a batch
        (a copy: what a subclass carries, such as the ids it names, stays)."""
        err = type(self).__new__(type(self))  # no __init__: subclasses take other arguments
        err.__dict__.update(self.__dict__)
        err.message = f"operation {op_index} ({what}): {self.message}"
        err.args, err.op_index = (err.message,), op_index
        return err


class InvalidArgument(BlockdError):
    """Malformed request: negative or absurd sizes, bad token ids, empty names."""

    code = "INVALID_ARGUMENT"


class NotFound(BlockdError):
    """Unknown pool or sequence. An unknown sequence is named in ``metadata``
    (``seq_ids``, ``num_seq_ids``, as KV_LOST names its sequences), so a
    caller knows which of its sequences is gone."""

    code = "NOT_FOUND"

    def __init__(self, message: str, *, op_index: int | None = None, seq_id: str | None = None) -> None:
        super().__init__(message, op_index=op_index)
        # ids are checked (short, printable) before a sequence is looked up; this keeps
        # the trailers bounded should a caller reach here with another
        named = type(seq_id) is str and 0 < len(seq_id) <= 256
        self.metadata = {"seq_ids": json.dumps([seq_id]), "num_seq_ids": "1"} if named else {}


class AlreadyExists(BlockdError):
    """A pool or sequence with that name already exists."""

    code = "ALREADY_EXISTS"


class NoRoom(BlockdError):
    """Not enough free or evictable blocks (beyond the watermark for admissions)."""

    code = "RESOURCE_EXHAUSTED"


class QuotaExceeded(BlockdError):
    """A tenant's quota (:mod:`blockd.auth.quotas`) would be exceeded.

    ``violations`` are ``(subject, description)`` pairs (the service layer
    sends them as a ``google.rpc.QuotaFailure``); ``retry_after_s`` is set
    for a rate limit (sent as a ``google.rpc.RetryInfo``)."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, violations: tuple[tuple[str, str], ...] = (),
                 retry_after_s: float | None = None, *, op_index: int | None = None) -> None:
        super().__init__(message, op_index=op_index)
        self.violations = violations
        self.retry_after_s = retry_after_s


class WrongState(BlockdError):
    """The request is well formed but the current state forbids it."""

    code = "FAILED_PRECONDITION"


class NotLeader(WrongState):
    """This replica does not lead its group (``blockd serve --etcd``): the
    ErrorInfo metadata names the leader to call instead (empty when unknown)."""

    reason = "NOT_LEADER"

    def __init__(self, message: str, *, op_index: int | None = None, leader_id: str = "",
                 leader_address: str = "", term: int = 0) -> None:
        super().__init__(message, op_index=op_index)
        self.metadata = {"leader_id": leader_id, "leader_address": leader_address, "term": str(term)}


class WrongGroup(WrongState):
    """The pool belongs to another daemon group of the cluster (``blockd serve
    --cluster``): the ErrorInfo metadata names its group, the group's address
    (empty when that group is down) and the directory entry's epoch."""

    reason = "WRONG_GROUP"

    def __init__(self, message: str, *, group: str, address: str, epoch: int) -> None:
        super().__init__(message)
        self.metadata = {"owner_group": group, "owner_address": address, "epoch": str(epoch)}


class SourceInOtherGroup(WrongState):
    """An ``Allocate``'s ``source_pool`` belongs to another daemon group of the
    cluster: pools share prefixes only within one group. Not ``WRONG_GROUP``
    (the call's own pool is served here: re-routing it would not help); the
    metadata names the source's group and its address."""

    reason = "SOURCE_IN_OTHER_GROUP"

    def __init__(self, message: str, *, op_index: int, group: str, address: str) -> None:
        super().__init__(message, op_index=op_index)
        self.metadata = {"source_group": group, "source_address": address}


class ExistsOnOtherGroup(AlreadyExists):
    """CreatePool of a name another group of the cluster owns (metadata as :class:`WrongGroup`'s)."""

    reason = "EXISTS_ON_OTHER_GROUP"

    def __init__(self, message: str, *, group: str, address: str, epoch: int) -> None:
        super().__init__(message)
        self.metadata = {"owner_group": group, "owner_address": address, "epoch": str(epoch)}


class Unavailable(BlockdError):
    """Not now, maybe soon: retry (with the same request id)."""

    code = "UNAVAILABLE"


class NoLeader(Unavailable):
    """The group has no leader this replica knows of (an election is under way)."""

    reason = "NO_LEADER"


class NotReplicated(Unavailable):
    """The step is in the leader's log but no in-sync follower confirmed it in
    time; retry with the same request id (it is then answered once committed)."""

    reason = "NOT_REPLICATED"


class InvariantViolation(BlockdError):
    """A bug: the allocator's own bookkeeping disagrees with itself."""

    code = "INTERNAL"
