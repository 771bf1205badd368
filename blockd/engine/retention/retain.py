"""Retention asked for per request: an ``Allocate`` whose ``retain_ttl_s`` is set.

The core ignores the field. The engine remembers such a sequence in its pool's
entry (``PoolEntry.retain``: sequence id -> (TTL, the prompt's full-block
tokens)) when the step that allocates it is applied, live or on replay, and
forgets it when a later op allocates its id again or frees it (unless the
batch that frees it committed its prompt: then it waits, with its prompt,
to be pinned). After each
live step the leader looks at the pool's remembered sequences
(:meth:`blockd.engine.retention.pins.CacheCalls.retain_committed`): one whose
prompt is committed up to its last full block gets a ``pin_prefix`` record
naming it, stamped with its deadline then; a freed one's request is dropped
by a record too (empty tokens). Applying such a record ends the sequence's
request whatever happens, pinning what the pool still caches (nothing, if a
reset dropped it), so every replica applies the same records to the same
state and replay never decides anything.

Imports the core and the engine's records and pool entries.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from blockd.core import NO_EXTRA_KEYS, Allocate, ExtraKeys, Free, InvalidArgument, Op, Pin, WrongState
from blockd.core.errors import shown
from blockd.engine import records
from blockd.engine.pools import PoolEntry

#: the longest TTL a pin may ask for (about 31 years); 0 is none
MAX_TTL_S = 1e9


def check_ttl(ttl_s: object, what: str = "ttl_s") -> float:
    """A pin's TTL in seconds: finite, in [0, :data:`MAX_TTL_S`] (0: no TTL)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or not (
            0 <= ttl_s <= MAX_TTL_S):
        raise InvalidArgument(f"{what} must be seconds in [0, {MAX_TTL_S:g}] (0: no TTL), got {shown(ttl_s)}")
    return float(ttl_s)


def to_retain(ops: list[Op]) -> dict[int, float]:
    """Op index -> TTL of each ``Allocate`` asking to retain its prompt,
    checked (INVALID_ARGUMENT naming the op, before anything changes)."""
    wanted: dict[int, float] = {}
    if not isinstance(ops, (list, tuple)):
        return wanted
    for index, op in enumerate(ops):
        if type(op) is Allocate and op.retain_ttl_s:
            try:
                wanted[index] = check_ttl(op.retain_ttl_s, "retain_ttl_s")
            except InvalidArgument as err:
                raise err.at_op(index, f"allocate {op.seq_id!r:.70}") from None
    return wanted


def freed_prompts(entry: PoolEntry, ops: list[Op]) -> dict[str, tuple[list[int], ExtraKeys]]:
    """Before a batch: the prompts of waiting sequences the batch frees (it may
    commit them first, as a scheduler's last step of a request does)."""
    seqs, retain = entry.pool.seqs, entry.retain
    found: dict[str, tuple[list[int], ExtraKeys]] = {}
    for op in ops:
        if isinstance(op, Free) and op.seq_id in retain:
            seq = seqs.get(op.seq_id)
            if seq is not None:
                found[op.seq_id] = (list(seq.token_ids[: retain[op.seq_id][1]]), seq.extra)
    return found


def track_retained(entry: PoolEntry, ops: list[Op], wanted: dict[int, float],
                   freed: dict[str, tuple[list[int], ExtraKeys]]) -> None:
    """Update ``entry.retain`` for an applied batch, op by op in order; a
    sequence freed with its prompt cached in the device tier (``freed``, from
    :func:`freed_prompts`) keeps waiting, with its prompt, to be pinned."""
    retain, pool = entry.retain, entry.pool
    b = pool.block_size
    for index, op in enumerate(ops):
        if type(op) is Free:
            ttl, full = retain.pop(op.seq_id, (0.0, 0))[:2]
            prompt = freed.get(op.seq_id)
            if prompt is not None and len(pool.pinnable(*prompt)) * b >= full:
                retain[op.seq_id] = (ttl, full, *prompt)
        elif type(op) is Allocate:
            full = len(op.prompt_token_ids) // b * b
            if index in wanted and full:
                retain[op.seq_id] = (wanted[index], full)
            else:
                retain.pop(op.seq_id, None)


def due_pins(entry: PoolEntry, now: float) -> Iterator[records.PinPrefix]:
    """The records that settle ``entry``'s sequences ready now: committed ones
    pinned (deadline ``now`` + TTL), vanished ones dropped."""
    pool = entry.pool
    name = pool.config.name
    prompt: list[Any]
    for seq_id, (ttl, full, *prompt) in list(entry.retain.items()):
        seq = pool.seqs.get(seq_id)
        if prompt:  # freed in the batch that committed it
            yield records.PinPrefix(name, prompt[0], prompt[1], ttl, now + ttl, seq_id)
        elif seq is None:
            yield records.PinPrefix(name, [], NO_EXTRA_KEYS, ttl, 0.0, seq_id)
        elif seq.num_committed >= full:
            yield records.PinPrefix(name, list(seq.token_ids[:full]), seq.extra, ttl, now + ttl, seq_id)


def retained_pin(entry: PoolEntry, record: records.PinPrefix) -> Pin | None:
    """Apply a pin record: a caller's pins or refuses; one for a retained
    sequence ends its request and pins what is cached (None: nothing)."""
    if not record.seq_id:
        return entry.pool.pin_prefix(record.token_ids, record.extra_keys, record.expires_at)
    entry.retain.pop(record.seq_id, None)
    if not record.token_ids:
        return None
    try:
        return entry.pool.pin_prefix(record.token_ids, record.extra_keys, record.expires_at)
    except WrongState:  # nothing cached any more (a reset), or the pool's pins are full
        return None

