"""Prometheus metrics of a replica's election, read at scrape time.

:class:`ElectionCollector` reads an :class:`~blockd.ha.election.Election`'s
state and counters when Prometheus scrapes (the election thread never
touches a metric). Register it on the daemon's registry
(``BlockdMetrics.registry``) when ``blockd serve --etcd`` runs with a
metrics port (beside :class:`blockd.replication.metrics.ReplicationCollector`). The
only label is ``group`` (one per replica group; the target labels say which
replica). Alerts built on these (``deploy/prometheus/alerts.yml``): no leader
in a group (``BlockdNoLeader``), frequent leader changes
(``BlockdLeaderChangesFrequent``).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blockd.ha.election import Election


class ElectionCollector(Collector):
    """Term, leadership, lease validity and the election's counters, for one replica."""

    def __init__(self, election: Election) -> None:
        self._election = election

    def describe(self) -> Iterable[Metric]:
        return self._families()

    @staticmethod
    def _families() -> list[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["group"]
        return [
            GaugeMetricFamily("blockd_ha_term", "Newest leader term this replica knows (0: none yet).",
                              labels=labels),
            GaugeMetricFamily("blockd_ha_is_leader",
                              "1 while this replica leads and may acknowledge (its lease is provably valid).",
                              labels=labels),
            GaugeMetricFamily("blockd_ha_lease_validity_seconds",
                              "Seconds this leader may still act without another keepalive (0 when not leading).",
                              labels=labels),
            CounterMetricFamily("blockd_ha_leader_changes", "Changes of leader (by term) this replica observed.",
                                labels=labels),
            CounterMetricFamily("blockd_ha_elections_won", "Times this replica became leader.", labels=labels),
            CounterMetricFamily("blockd_ha_step_downs",
                                "Times this replica stopped leading other than by resigning.", labels=labels),
            CounterMetricFamily("blockd_ha_etcd_errors", "etcd calls of the election that failed.",
                                labels=labels),
        ]

    def collect(self) -> Iterable[Metric]:
        e = self._election
        group = [e.config.group]
        leader = e.leader()
        validity = max(0.0, e.lease_valid_until() - e.clock()) if e.can_acknowledge() else 0.0
        values = [leader.term if leader else 0, 1 if e.can_acknowledge() else 0, validity,
                  e.leader_changes, e.elections_won, e.step_downs, e.etcd_errors]
        families = self._families()
        for family, value in zip(families, values, strict=True):
            family.add_metric(group, value)
        return families
