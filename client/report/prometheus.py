"""A pool's past, read back from a Prometheus server that scrapes blockd's ``/metrics``.

blockd keeps no history of its counts; Prometheus does. :func:`pool_history`
asks its HTTP API (``/api/v1/query_range``) for the pool's series over a
window, at one step, and rebuilds a :class:`~blockd.core.types.PoolStats`
at every step where blockd was scraped: blocks by state, sequences, tokens,
tail waste, the prefix cache's queried and hit tokens and the misses by
reason, evictions and copies (the names :mod:`blockd.service.metrics`
exports). The host tier's counts are not exported as metrics, so a report
from here shows the device tier only. Only the standard library (urllib):
no Prometheus client library for five GET requests.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from blockd.core.types import MISS_REASONS, PoolStats

#: most points Prometheus returns per series (its own limit is 11,000)
MAX_POINTS = 2000


class PrometheusError(Exception):
    """Prometheus could not be asked, or refused the query; ``unreachable`` tells which."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True)
class History:
    """Seconds since the window's start, and the pool's stats then."""

    times_s: tuple[float, ...]
    stats: tuple[PoolStats, ...]
    step_s: float


def _series(url: str, expr: str, start: float, end: float, step_s: float, timeout_s: float) -> dict[str, dict]:
    """``{label value of 'state' or 'reason' (or ''): {timestamp: value}}`` of a range query."""
    query = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                    "step": f"{step_s:g}"})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{query}", timeout=timeout_s) as reply:
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as err:  # 400 bad_data, 422, 503: the body says why
        try:
            why = json.loads(err.read()).get("error", err.reason)
        except ValueError:
            why = err.reason
        raise PrometheusError(f"Prometheus at {url} refused {expr!r}: {why}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise PrometheusError(f"cannot query Prometheus at {url}: {getattr(err, 'reason', err)}",
                              unreachable=True) from None
    if answer.get("status") != "success":
        raise PrometheusError(f"Prometheus at {url} answered {answer.get('error', answer)!r} to {expr!r}")
    found: dict[str, dict] = {}
    for series in answer["data"]["result"]:
        label = series["metric"].get("state") or series["metric"].get("reason") or ""
        found.setdefault(label, {}).update({float(t): float(v) for t, v in series["values"]})
    return found


def pool_history(url: str, pool: str, start: float, end: float, step_s: float | None = None, *,
                 timeout_s: float = 10.0) -> History:
    """The pool's stats from ``start`` to ``end`` (Unix seconds), one per step where it was scraped.

    ``step_s`` defaults to the window over :data:`MAX_POINTS`, at least 1 s.
    Raises :class:`PrometheusError` when Prometheus cannot answer, and
    ``LookupError`` when it holds no samples of ``pool`` in the window."""
    if end <= start:
        raise ValueError("the window must end after it starts")
    step = step_s or max(1.0, (end - start) / MAX_POINTS)
    if (end - start) / step > MAX_POINTS * 5:
        raise ValueError(f"a step of {step:g} s gives too many points over {end - start:g} s")
    sel = f'{{pool="{pool}"}}'
    names = {
        "blocks": "blockd_pool_blocks", "capacity": "blockd_pool_capacity_blocks",
        "block_size": "blockd_pool_block_size_slots", "waste_slots": "blockd_pool_tail_waste_slots",
        "waste_bytes": "blockd_pool_tail_waste_bytes", "seqs": "blockd_pool_sequences",
        "tokens": "blockd_pool_tokens", "version": "blockd_pool_version",
        "queried": "blockd_prefix_queried_tokens_total", "hit": "blockd_prefix_hit_tokens_total",
        "missed": "blockd_prefix_miss_tokens_total", "evictions": "blockd_evictions_total",
        "copies": "blockd_cow_copies_total",
    }
    got = {key: _series(url, name + sel, start, end, step, timeout_s) for key, name in names.items()}
    # a step counts when blockd was scraped then: every series has a value at it
    stamps = sorted(set(got["blocks"].get("used", {})).intersection(
        *(got[key].get("", {}) for key in names if key not in ("blocks", "missed"))))
    if len(stamps) < 2:
        raise LookupError(f"Prometheus at {url} holds {len(stamps)} scrape(s) of pool {pool!r} between "
                          f"{start:.0f} and {end:.0f}: is it scraping blockd's /metrics, and was the pool there?")

    def at(key: str, t: float, label: str = "") -> int:
        return int(got[key].get(label, {}).get(t, 0))

    stats = tuple(PoolStats(
        name=pool, num_blocks=at("capacity", t), block_size=at("block_size", t),
        num_free_blocks=at("blocks", t, "free"), num_used_blocks=at("blocks", t, "used"),
        num_evictable_blocks=at("blocks", t, "evictable"), num_seqs=at("seqs", t), num_tokens=at("tokens", t),
        tail_waste_slots=at("waste_slots", t), tail_waste_bytes=at("waste_bytes", t),
        prefix_queried_tokens=at("queried", t), prefix_hit_tokens=at("hit", t), num_evictions=at("evictions", t),
        num_copies=at("copies", t), version=at("version", t), last_event_seq_no=0,
        prefix_miss_tokens=tuple(at("missed", t, reason) for reason in MISS_REASONS)) for t in stamps)
    return History(tuple(t - stamps[0] for t in stamps), stats, step)
