"""Operating a replica group: ``blockctl cluster status`` and the election's metrics.

``cluster status`` against a real etcd (a group with a leader and a
follower, a group with none, an etcd that does not answer, a bad group
name) and, without ``--etcd``, against a live daemon; the
:class:`~blockd.ha.metrics.ElectionCollector` values of a leader before and
after it resigns, and of a follower.
"""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from blockd.ha.metrics import ElectionCollector
from client.cli.common import Exit
from tests.support.cli import run
from tests.support.ha_fixtures import the_leader, wait_for

pytest_plugins = ["tests.support.etcd", "tests.support.ha_fixtures", "tests.support.grpc_fixtures"]


def test_cluster_status_from_etcd(etcd_server, replicas, capsys) -> None:
    group = [replicas(etcd_server.url, "ops", rid) for rid in ("r0", "r1")]
    leader = wait_for(lambda: the_leader(group), "a leader")
    leader.election.report_progress(applied_lsn=9)
    follower = next(r for r in group if r is not leader)
    follower.election.report_progress(applied_lsn=4, lag_records=5)

    def settled():
        code, out, _ = run(capsys, "cluster", "status", "--etcd", etcd_server.url, "--group", "ops", "--json")
        status = json.loads(out)
        roles = {m["replica_id"]: (m["role"], m["applied_lsn"], m["behind_leader"]) for m in status["members"]}
        return (code, status) if roles == {leader.election.config.replica_id: ("leader", 9, 0),
                                           follower.election.config.replica_id: ("follower", 4, 5)} else None

    code, status = wait_for(settled, "both members to report their progress")
    assert code == Exit.OK and status["term"] == leader.leads().term
    assert status["leader"]["replica_id"] == leader.election.config.replica_id
    code, out, _ = run(capsys, "cluster", "status", "--etcd", etcd_server.url, "--group", "ops")
    assert code == Exit.OK and f"leader {leader.election.config.replica_id} at" in out and "follower" in out


def test_cluster_status_without_a_leader_or_etcd(etcd_server, capsys) -> None:
    code, out, err = run(capsys, "cluster", "status", "--etcd", etcd_server.url, "--group", "nobody")
    assert code == Exit.UNAVAILABLE and "NO LEADER" in out and "group nobody has no leader" in err
    code, _, err = run(capsys, "cluster", "status", "--etcd", "http://127.0.0.1:1", "--timeout-s", "2")
    assert code == Exit.UNAVAILABLE and "is etcd serving at http://127.0.0.1:1?" in err
    code, _, err = run(capsys, "cluster", "status", "--etcd", etcd_server.url, "--group", "a/b")
    assert code == Exit.USAGE and "group name" in err


def test_cluster_status_of_a_single_daemon(blockd_server, capsys) -> None:
    code, out, _ = run(capsys, "--target", blockd_server.address, "cluster", "status", "--json")
    assert code == Exit.OK
    assert json.loads(out) == {"mode": "single", "target": blockd_server.address, "status": "SERVING"}


def _sample(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name, {"group": "metrics"})


def test_election_metrics(etcd_server, replicas) -> None:
    first = replicas(etcd_server.url, "metrics", "a")
    won = wait_for(first.leads, "a to lead")
    second = replicas(etcd_server.url, "metrics", "b")
    wait_for(second.election.leader, "b to see a lead")
    leader_metrics, follower_metrics = CollectorRegistry(), CollectorRegistry()
    leader_metrics.register(ElectionCollector(first.election))
    follower_metrics.register(ElectionCollector(second.election))
    assert _sample(leader_metrics, "blockd_ha_is_leader") == 1
    assert _sample(leader_metrics, "blockd_ha_term") == won.term == _sample(follower_metrics, "blockd_ha_term")
    assert _sample(leader_metrics, "blockd_ha_lease_validity_seconds") > 0
    assert _sample(leader_metrics, "blockd_ha_elections_won_total") == 1
    assert _sample(follower_metrics, "blockd_ha_is_leader") == 0
    first.election.resign()
    taken = wait_for(second.leads, "b to lead")
    assert _sample(leader_metrics, "blockd_ha_is_leader") == 0
    assert _sample(leader_metrics, "blockd_ha_lease_validity_seconds") == 0
    assert _sample(leader_metrics, "blockd_ha_step_downs_total") == 0  # resigning is not stepping down
    assert _sample(follower_metrics, "blockd_ha_term") == taken.term > won.term
    assert _sample(follower_metrics, "blockd_ha_leader_changes_total") == 2  # a, then itself
    assert _sample(follower_metrics, "blockd_ha_is_leader") == 1
