"""A log record's body: the JSON bytes of its dict (:mod:`blockd.engine.records`).

Written through orjson where it is safe to, read through orjson, with the
standard library's ``json`` as the fallback both ways, so the log stays the
JSON every reader of it (``blockd check-data``, recovery, a follower, an
older blockd) already parses.

Why orjson: a 256-sequence decode step's body (its ids, its tokens) costs
``json.dumps`` about 28 us and orjson about 2; reading it back, 20 us against
7. Every durable step pays the first on the leader and every follower the
second per record, inside the daemon's one core.

Where the two differ, the standard library is used: orjson writes a float
NaN or infinity as ``null`` (``json`` writes ``NaN``, which it reads back), so
only step records go through orjson, whose floats (an ``Allocate``'s
``retain_ttl_s``, the request stamp ``t``) are finite by the time they are
logged; orjson refuses integers past 64 bits and reading ``NaN``, and either
refusal falls back to ``json``, which raises as it always did. Strings go out
as UTF-8 rather than ``\\u`` escapes: the same JSON value.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_STEP = "step"


def encode(body: dict) -> bytes:
    """``body`` as compact JSON bytes."""
    if body.get("kind") == _STEP:
        try:
            return orjson.dumps(body)
        except orjson.JSONEncodeError:
            pass  # json raises its own error, or writes what orjson would not
    return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The JSON value in ``data``; ``ValueError`` (``json``'s) when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
