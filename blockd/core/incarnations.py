"""Incarnations and the refusals that name them: shared by the daemon and the workers.

An *incarnation* is a random id that tells one life of a pool (or of a
worker process) from another: versions and written KV are only meaningful
within one. This module owns how an incarnation is made and shown, and the
FAILED_PRECONDITION errors both sides raise when a call names another life
(each carries an ErrorInfo ``reason`` and ``metadata``, which the one error
mapping, :mod:`blockd.rpc.errors`, puts on the wire). Which incarnations a
pool has seen, and what a worker restart loses, is the daemon's
(:mod:`blockd.engine.incarnations`). Imports only the standard library.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable

from blockd.core.errors import WrongState

#: bytes of sequence ids listed in an error's metadata (gRPC trailers are small)
MAX_LISTED_BYTES = 2048


def new_incarnation() -> str:
    return uuid.uuid4().hex


def short(incarnation: str) -> str:
    """What a message shows of an incarnation (enough to tell two apart)."""
    return incarnation[:12] if incarnation else "(none)"


def listed(seq_ids: Iterable[str]) -> dict[str, str]:
    """ErrorInfo metadata naming sequences: ``seq_ids`` (a JSON list, cut to fit
    the trailers) and ``num_seq_ids`` (how many there are in all)."""
    ids, size, total = [], 2, 0
    for seq_id in seq_ids:
        total += 1
        size += len(json.dumps(seq_id)) + 1
        if size <= MAX_LISTED_BYTES:
            ids.append(seq_id)
    return {"seq_ids": json.dumps(ids), "num_seq_ids": str(total)}


class IdentityError(WrongState):
    """A FAILED_PRECONDITION whose ErrorInfo carries ``metadata`` and ``reason``."""

    reason = "FAILED_PRECONDITION"

    def __init__(self, message: str, *, op_index: int | None = None,
                 metadata: dict[str, str] | None = None) -> None:
        super().__init__(message, op_index=op_index)
        self.metadata = metadata or {}


class KVLost(IdentityError):
    """A step names sequences whose KV was lost in a worker restart."""

    reason = "KV_LOST"


class PoolIncarnationMismatch(IdentityError):
    """The caller planned against another (older) incarnation of the pool."""

    reason = "POOL_INCARNATION_MISMATCH"


class PoolIncarnationUnavailable(IdentityError):
    """A worker has not loaded the named pool incarnation (yet)."""

    reason = "POOL_INCARNATION_UNAVAILABLE"


class WorkerIncarnationMismatch(IdentityError):
    """The caller planned against another incarnation of this worker."""

    reason = "WORKER_INCARNATION_MISMATCH"


class KVNotWritten(IdentityError):
    """Attention would read slots the worker has not written in this incarnation."""

    reason = "KV_NOT_WRITTEN"


class TermNotSeen(IdentityError):
    """A call planned on a leader term the worker's table mirror has not
    been served in yet: its tables may still be an older leader's (with
    ``async`` replication, versions the new leader does not have)."""

    reason = "TERM_NOT_SEEN"


class TermChanged(IdentityError):
    """A step planned on what an older leader acknowledged, sent to a leader of
    a group whose failover may lose acknowledged steps (``async``): the
    caller's view of its sequences may be ahead of this leader's."""

    reason = "TERM_CHANGED"


__all__ = [
    "MAX_LISTED_BYTES",
    "IdentityError",
    "KVLost",
    "KVNotWritten",
    "PoolIncarnationMismatch",
    "PoolIncarnationUnavailable",
    "TermChanged",
    "WorkerIncarnationMismatch",
    "listed",
    "new_incarnation",
    "short",
]
