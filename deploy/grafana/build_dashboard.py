#!/usr/bin/env python3
"""Builds ``deploy/grafana/dashboards/blockd.json``, the provisionable blockd dashboard.

    python deploy/grafana/build_dashboard.py            # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check    # exit 1 if the JSON is stale

The dashboard is plain dicts rather than grafana-foundation-sdk or grafanalib:
it is a dozen panels of one kind, and a generator with no dependency runs in
CI and in the tests as it is. The panels are declared once in
:data:`SECTIONS`; :func:`panel_queries` lists every PromQL query they run, so
the tests can check each one parses and returns data from a real Prometheus.

Two template variables: ``datasource`` (any Prometheus) and ``pool``
(multi-select, "All" by default, from ``label_values(...)``). Every query
filters on ``pool=~"$pool"``. Imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "blockd.json"
UID = "blockd-overview"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
P = 'pool=~"$pool"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"
    stacked: bool = False
    max: float | None = None
    #: panel width in grid columns (Grafana's grid is 24 wide)
    width: int = 12


def _quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}[{RATE}])))"


_USED = f'blockd_pool_blocks{{state="used",{P}}}'

POOL_PANELS = (
    Panel("Utilisation", "Used blocks / capacity. Evictable cached blocks are reclaimable and do not count.",
          (Query(f"blockd_pool_utilisation_ratio{{{P}}}", "{{pool}}"),), unit="percentunit", max=1),
    Panel("Blocks by state", "Free, used (referenced) and evictable (cached prefix, ref count 0) blocks.",
          (Query(f"sum by (pool, state) (blockd_pool_blocks{{{P}}})", "{{pool}} {{state}}"),), stacked=True),
    Panel("Tail waste", "Token slots left empty in partly filled blocks, in KV bytes.",
          (Query(f"blockd_pool_tail_waste_bytes{{{P}}}", "{{pool}}"),), unit="bytes"),
    Panel("Tail waste share of used slots", "Empty slots / slots of used blocks: high when sequences are "
          "short compared to the block size.",
          (Query(f"blockd_pool_tail_waste_slots{{{P}}} / ignoring(state) "
                 f"({_USED} * ignoring(state) blockd_pool_block_size_slots{{{P}}})", "{{pool}}"),),
          unit="percentunit", max=1),
    Panel("Prefix cache hit rate", "Prompt tokens served from cached blocks / prompt tokens allocated.",
          (Query(f"sum by (pool) (rate(blockd_prefix_hit_tokens_total{{{P}}}[{RATE}])) / "
                 f"sum by (pool) (rate(blockd_prefix_queried_tokens_total{{{P}}}[{RATE}]))", "{{pool}}"),),
          unit="percentunit", max=1),
    Panel("Evictions and copies", "Cached blocks evicted, and copy-on-write copies sent to workers, per second.",
          (Query(f"sum by (pool) (rate(blockd_evictions_total{{{P}}}[{RATE}]))", "{{pool}} evictions"),
           Query(f"sum by (pool) (rate(blockd_cow_copies_total{{{P}}}[{RATE}]))", "{{pool}} copies")),
          unit="ops"),
    Panel("Sequences and tokens", "Live sequences and the tokens they hold.",
          (Query(f"blockd_pool_sequences{{{P}}}", "{{pool}} sequences"),
           Query(f"blockd_pool_tokens{{{P}}}", "{{pool}} tokens"))),
    Panel("Versions per second", "Committed mutation batches per second (the pool version's rate).",
          (Query(f"rate(blockd_pool_version{{{P}}}[{RATE}])", "{{pool}}"),), unit="ops"),
)

LATENCY_PANELS = (
    Panel("Step latency", "Time to apply and log one step batch (p50 and p99).",
          (Query(_quantile(0.5, f"blockd_step_duration_seconds_bucket{{{P}}}", "pool"), "{{pool}} p50"),
           Query(_quantile(0.99, f"blockd_step_duration_seconds_bucket{{{P}}}", "pool"), "{{pool}} p99")),
          unit="s"),
    Panel("Operations by kind and outcome", "Step operations per second; outcome is ok or the status code.",
          (Query(f"sum by (kind, outcome) (rate(blockd_step_operations_total{{{P}}}[{RATE}]))",
                 "{{kind}} {{outcome}}"),), unit="ops", stacked=True),
    Panel("RPC latency p99", "Server-side latency of unary RPCs by method (all pools).",
          (Query(_quantile(0.99, "blockd_rpc_duration_seconds_bucket", "method"), "{{method}}"),), unit="s"),
    Panel("WAL fsync latency", "Write-ahead log fsync time (p50 and p99); empty when fsync is never.",
          (Query(_quantile(0.5, "blockd_wal_sync_duration_seconds_bucket", "instance"), "p50"),
           Query(_quantile(0.99, "blockd_wal_sync_duration_seconds_bucket", "instance"), "p99")), unit="s"),
)

WORKER_PANELS = (
    Panel("Workers up and down", "Workers by heartbeat state, as blockd sees them.",
          (Query(f"sum by (pool, state) (blockd_workers{{{P}}})", "{{pool}} {{state}}"),), stacked=True),
    Panel("Worker replica lag", "Versions each worker's table mirror is behind.",
          (Query(f"max by (pool, instance) (blockd_worker_replica_lag_versions{{{P}}})",
                 "{{pool}} {{instance}}"),)),
    Panel("Worker kernel time p99", "p99 wall time of one kernel call, by kernel.",
          (Query(_quantile(0.99, f"blockd_worker_kernel_duration_seconds_bucket{{{P}}}", "pool, kernel"),
                 "{{pool}} {{kernel}}"),), unit="s"),
    Panel("Worker kernel busy time", "Seconds spent in kernels per second, summed over a pool's workers.",
          (Query(f"sum by (pool, kernel) (rate(blockd_worker_kernel_duration_seconds_sum{{{P}}}[{RATE}]))",
                 "{{pool}} {{kernel}}"),), unit="s", stacked=True),
    Panel("Worker tokens processed", "Query tokens run through attention per second.",
          (Query(f"sum by (pool) (rate(blockd_worker_tokens_processed_total{{{P}}}[{RATE}]))", "{{pool}}"),),
          unit="ops"),
    Panel("Worker pool memory", "KV bytes held by each worker's pool shard.",
          (Query(f"sum by (pool, instance) (blockd_worker_pool_bytes{{{P}}})", "{{pool}} {{instance}}"),),
          unit="bytes"),
)

SECTIONS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Pools", POOL_PANELS), ("Latency", LATENCY_PANELS), ("Workers", WORKER_PANELS))


@dataclass
class _Layout:
    """Places panels left to right, wrapping at Grafana's 24 columns."""

    next_id: int = 1
    x: int = 0
    y: int = 0
    panels: list[dict] = field(default_factory=list)

    def _take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y = 0, self.y + 8
        self.panels.append({"id": self._take_id(), "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def add(self, panel: Panel) -> None:
        if self.x + panel.width > 24:
            self.x, self.y = 0, self.y + 8
        self.panels.append(_panel_json(panel, self._take_id(), {"h": 8, "w": panel.width, "x": self.x,
                                                               "y": self.y}))
        self.x += panel.width


def _panel_json(panel: Panel, panel_id: int, grid: dict) -> dict:
    defaults: dict = {"unit": panel.unit, "min": 0,
                      "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                 "showPoints": "never",
                                 "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"}}}
    if panel.max is not None:
        defaults["max"] = panel.max
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": q.expr,
                "legendFormat": q.legend, "range": True} for i, q in enumerate(panel.queries)]
    return {"id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
            "datasource": DATASOURCE, "gridPos": grid,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": targets}


def _templating() -> dict:
    datasource = {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
                  "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []}
    pool = {"name": "pool", "label": "Pool", "type": "query", "datasource": DATASOURCE,
            "definition": "label_values(blockd_pool_capacity_blocks, pool)",
            "query": {"query": "label_values(blockd_pool_capacity_blocks, pool)", "refId": "PoolVariable"},
            "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "hide": 0, "refresh": 2,
            "regex": "", "sort": 1, "options": []}
    return {"list": [datasource, pool]}


def build() -> dict:
    """The dashboard as a JSON-ready dict."""
    layout = _Layout()
    for title, panels in SECTIONS:
        layout.row(title)
        for panel in panels:
            layout.add(panel)
    return {
        "uid": UID, "title": "blockd", "description": "blockd pools, latency and workers",
        "tags": ["blockd", "kv-cache"], "timezone": "", "editable": True, "graphTooltip": 1,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": _templating(), "panels": layout.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every query of every panel of ``dashboard``."""
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON differs from the build")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"where to write (default {OUTPUT})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run python deploy/grafana/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
