"""Data directories for the integrity tests: written by a real engine, next to
an in-memory reference engine fed the same acknowledged calls."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os

from blockd.core import Allocate, Append, Commit, Fork, Free, PoolConfig
from blockd.engine.config import EngineConfig
from blockd.engine.idempotency_codec import decode_result
from blockd.engine.machine import Engine
from blockd.storage.lock import LOCK_NAME as DAEMON_LOCK
from blockd.storage.wal import COMPACT_LOCK


def workload(engine: Engine, part: int) -> None:
    """Part 0, 1, 2 ... of a deterministic stream of calls (part 0 creates the pool).

    tests/data/legacy-v1 holds parts 0-2 written by the format-1 writer."""
    if part == 0:
        engine.create_pool(PoolConfig("a", num_blocks=32, block_size=4), request_id="create-a")
    for i in range(part * 5, part * 5 + 5):
        engine.step("a", [Allocate(f"s{i}", list(range(i, i + 6))), Commit(f"s{i}", 6)], f"step-{i}")
        if i % 2:
            engine.step("a", [Fork(f"s{i}", f"f{i}"), Append(f"f{i}", [i]), Free(f"s{i - 1}")], f"fork-{i}")


def reference(parts: int) -> Engine:
    ref = Engine()
    for part in range(parts):
        workload(ref, part)
    return ref


def state(engine: Engine, *, requests: bool = True, miss_totals: bool = True, priorities: bool = True) -> str:
    """Everything a snapshot holds: pools (tables, ref counts, prefix index,
    LRU order, versions, retained deltas), events and the idempotency table --
    but for what two engines fed the same calls cannot share: the pools'
    random incarnations and the wall-clock times of the requests.
    ``requests=False`` leaves the idempotency table out; ``miss_totals=False``
    the pools' running miss counts (a snapshot written before blockd counted
    misses cannot know those of the history it covers); ``priorities=False``
    the blocks' retention priorities (one written before priorities loads
    every block at the default, where a live pool's unreleased blocks are at 0)."""
    with engine._lock:
        captured = engine.capture()
    for pool in captured["pools"]:
        pool["identity"]["incarnation"] = "*"
        if not miss_totals:
            pool.get("pool", pool).get("misses", {}).pop("tokens", None)
        if not priorities:
            pool.get("pool", pool).pop("priority", None)
    requests = captured.pop("requests") if not requests else captured["requests"]
    requests["now"] = 0
    for entry in requests["entries"]:
        entry[2] = 0
        if len(entry) > 4 and entry[4]:
            entry[4] = "*"  # the scope is a pool incarnation
        if entry[3] is not None:
            answer = decode_result(base64.b64decode(entry[3]))
            entry[3] = repr(dataclasses.replace(answer, incarnation="*") if hasattr(answer, "incarnation")
                            else answer)
    return json.dumps(captured, sort_keys=True)


def build(data_dir: str) -> Engine:
    """A data dir holding a snapshot (after part 0) and two segments (parts 1
    and 2, one per engine life); returns the reference engine."""
    engine = Engine(EngineConfig(data_dir=data_dir, snapshot_every=1 << 30))
    workload(engine, 0)
    engine.snapshot()
    workload(engine, 1)
    engine.close()
    engine = Engine(EngineConfig(data_dir=data_dir, snapshot_every=1 << 30))
    workload(engine, 2)
    engine.close()
    return reference(3)


def data_files(data_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(data_dir)
                  if os.path.isfile(os.path.join(data_dir, n)) and n not in (COMPACT_LOCK, DAEMON_LOCK))


def segments(data_dir: str) -> list[str]:
    return [n for n in data_files(data_dir) if n.startswith("wal-")]


def digest(data_dir: str) -> dict[str, str]:
    """Name -> sha256 of every file (lock files aside: they are empty)."""
    out = {}
    for root, _dirs, files in os.walk(data_dir):
        for name in files:
            if name in (COMPACT_LOCK, DAEMON_LOCK):
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, data_dir)] = hashlib.sha256(f.read()).hexdigest()
    return out


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
