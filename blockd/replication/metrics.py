"""Prometheus metrics of log replication on one replica (``blockd serve --etcd``), read at scrape time.

:class:`ReplicationCollector` reads a :class:`~blockd.replication.replica.Replica`'s
role, its log position, the leader's view of each follower
(:class:`blockd.replication.commits.Commits`) and the follower loop's state when
Prometheus scrapes; the replication threads never touch a metric.
``blockd serve`` registers it, with the election's
:class:`~blockd.ha.metrics.ElectionCollector`, on the daemon's registry when
both ``--etcd`` and ``--metrics-port`` are given. Labels: ``group``, and
``follower`` (a replica id) on the leader's per-follower series; the target
labels say which replica is reporting. The alerts on these (no leader, lag,
frequent leader changes) are in ``deploy/prometheus/alerts.yml``.

A follower's lag is measured where it is decided: on the leader, as its last
LSN minus what the follower has confirmed persisted
(``blockd_replication_follower_lag_records``; in ``async`` mode this is the
bound the README talks about). A follower reports the leader's commit point
as last received and its own last LSN, so a follower that lost its feed
shows ``blockd_replication_streaming`` 0 rather than a lag it cannot know.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blockd.replication.replica import Replica


class ReplicationCollector(Collector):
    """Role, log position, per-follower lag and in-sync membership, follower feed state."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica

    def describe(self) -> Iterable[Metric]:
        return self._families().values()

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
        g, f = ["group"], ["group", "follower"]
        return {
            "mode": GaugeMetricFamily("blockd_replication_sync_mode",
                                      "1 when the group acknowledges only replicated steps (sync), 0 for async.",
                                      labels=g),
            "leading": GaugeMetricFamily("blockd_replication_leading",
                                         "1 while this replica serves as the leader of its term.", labels=g),
            "last": GaugeMetricFamily("blockd_replication_last_lsn", "Last LSN in this replica's log.", labels=g),
            "commit": GaugeMetricFamily("blockd_replication_commit_lsn",
                                        "Commit point: the leader's own, or the leader's as a follower last "
                                        "received it.", labels=g),
            "streaming": GaugeMetricFamily("blockd_replication_streaming",
                                           "1 while this follower's feed from the leader is open.", labels=g),
            "in_sync": GaugeMetricFamily("blockd_replication_in_sync_replicas",
                                         "Replicas in the in-sync set, the leader included (leader only).",
                                         labels=g),
            "lag": GaugeMetricFamily("blockd_replication_follower_lag_records",
                                     "Records the follower has not confirmed persisted: the leader's last LSN "
                                     "minus the follower's (leader only).", labels=f),
            "member": GaugeMetricFamily("blockd_replication_follower_in_sync",
                                        "1 when the follower is in the in-sync set (leader only).", labels=f),
            "ack_age": GaugeMetricFamily("blockd_replication_follower_last_ack_age_seconds",
                                         "Seconds since the follower's last acknowledgement (leader only).",
                                         labels=f),
            "snapshots": CounterMetricFamily("blockd_replication_snapshots_installed",
                                             "Leader snapshots this follower installed to catch up.", labels=g),
            "truncations": CounterMetricFamily("blockd_replication_truncations",
                                               "Times this follower cut its log's uncommitted tail at a new "
                                               "leader's request.", labels=g),
        }

    def collect(self) -> Iterable[Metric]:
        r = self._replica
        status = r.status()  # the same view GetReplicaStatus answers
        group = status.group
        fam = self._families()
        leading = status.role == "leader"
        fam["mode"].add_metric([group], 1 if status.mode == "sync" else 0)
        fam["leading"].add_metric([group], 1 if leading else 0)
        fam["last"].add_metric([group], status.last_lsn)
        fam["streaming"].add_metric([group], 1 if status.streaming else 0)
        fam["snapshots"].add_metric([group], r.snapshots_installed)
        fam["truncations"].add_metric([group], r.truncations)
        if leading or r.follower is not None:
            fam["commit"].add_metric([group], status.commit_lsn)
        if leading:
            fam["in_sync"].add_metric([group], status.in_sync_replicas)
            for f in status.followers:
                labels = [group, f.replica_id]
                fam["lag"].add_metric(labels, f.lag_records)
                fam["member"].add_metric(labels, 1 if f.in_sync else 0)
                fam["ack_age"].add_metric(labels, f.last_ack_age_s)
        return fam.values()
