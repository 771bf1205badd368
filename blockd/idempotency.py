"""The idempotency table: a mutating request's id -> its first result.

Bounded (oldest ids are forgotten first, in insertion order, which replay
reproduces) and persisted in snapshots, so a retry after a daemon restart
still gets the first answer. Each entry also keeps a fingerprint of what the
request was (kind and pool), so an id reused for a different request is
refused instead of silently answered with someone else's result.
"""

from __future__ import annotations

from collections import OrderedDict

from blockd.core.types import OpResult, PoolStats, StepResult


def encode_result(result: object) -> object:
    if result is None:
        return None
    if isinstance(result, StepResult):
        return {"step": [result.version, [_op_result(r) for r in result.results],
                         [list(c) for c in result.copy_ops], result.incarnation]}
    if isinstance(result, PoolStats):
        return {"stats": [getattr(result, f) for f in PoolStats.__dataclass_fields__]}
    raise TypeError(f"cannot persist a result of type {type(result).__name__}")


def _op_result(r: OpResult) -> list:
    return [r.seq_id, r.num_tokens, r.num_cached_tokens, list(r.new_block_ids),
            [list(c) for c in r.copy_ops], r.slot_start, list(r.slot_mapping)]


def decode_result(data: object) -> object:
    if data is None:
        return None
    if "step" in data:
        version, results, copies, *incarnation = data["step"]  # no incarnation: written before there were any
        return StepResult(version, tuple(
            OpResult(s, n, c, tuple(new), tuple(tuple(x) for x in cop), start, tuple(slots))
            for s, n, c, new, cop, start, slots in results), tuple(tuple(c) for c in copies), *incarnation)
    return PoolStats(*data["stats"])


class IdempotencyTable:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[str, object]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request_id: str) -> tuple[str, object] | None:
        return self._entries.get(request_id)

    def put(self, request_id: str, fingerprint: str, result: object) -> None:
        self._entries[request_id] = (fingerprint, result)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def dump(self) -> list:
        return [[rid, fp, encode_result(res)] for rid, (fp, res) in self._entries.items()]

    def load(self, data: list) -> None:
        self._entries.clear()
        for rid, fp, res in data:
            self._entries[rid] = (fp, decode_result(res))
