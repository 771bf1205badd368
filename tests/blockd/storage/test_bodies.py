"""A log record's body (:mod:`blockd.storage.bodies`): the JSON ``json`` reads,
whichever library wrote it, and ``json``'s errors for what is not JSON."""

from __future__ import annotations

import json
import math

import pytest

from blockd.core import Allocate
from blockd.core.types import DecodeAppend
from blockd.engine import records
from blockd.storage import bodies


def test_a_step_body_reads_back_as_json_wrote_it() -> None:
    step = records.Step("pool-é", [DecodeAppend([f"s{i}" for i in range(256)], [7] * 256),
                                   Allocate("a", [1, 2, 3], retain_ttl_s=2.5)])
    body = records.encode(step, "rid-1", 1733363606.123456)
    data = bodies.encode(body)
    assert json.loads(data) == body == bodies.decode(data)
    assert bodies.decode(json.dumps(body).encode()) == body
    back, rid, t = records.decode(bodies.decode(data))
    assert back == step and (rid, t) == ("rid-1", 1733363606.123456)


def test_what_orjson_would_not_write_alike_goes_through_json() -> None:
    # a float json keeps (NaN) and an int past 64 bits, outside a step record
    body = {"kind": "pin_prefix", "ttl_s": math.nan, "tokens": [1 << 70]}
    data = bodies.encode(body)
    assert b"NaN" in data and json.loads(data)["tokens"] == [1 << 70]
    back = bodies.decode(data)  # orjson refuses NaN: json reads it
    assert math.isnan(back["ttl_s"]) and back["tokens"] == [1 << 70]


@pytest.mark.parametrize(("data", "error"), [(b"{not json", json.JSONDecodeError), (b"", json.JSONDecodeError),
                                             (b"{\"a\":\"\xc3\"}", UnicodeDecodeError)])
def test_bytes_that_are_not_json_raise_what_json_raises(data: bytes, error: type) -> None:
    """What the data dir's reader and a follower catch (ValueError and UnicodeDecodeError)."""
    with pytest.raises(error):
        bodies.decode(data)
