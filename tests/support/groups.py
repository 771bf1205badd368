"""Two daemon groups of one cluster for tests: ``blockd serve --cluster`` processes on a real etcd.

Load with ``pytest_plugins = ["tests.support.etcd", "tests.support.groups"]``:
``two_groups`` is ``(a ClusterClient of the cluster, [the daemon of g1, the
daemon of g2])``, one cluster per test (named after it and its id), killed at its end.
g2 also serves the step lane (``--step-lane-port 0``), so a ClusterClient's
streams step over gRPC to g1 and over the lane to g2.
"""

from __future__ import annotations

import zlib

import pytest

from client.groups import ClusterClient
from tests.support.procs import start_blockd


def _group(etcd_url: str, cluster: str, group: str):
    # g2 serves the step lane and g1 does not: a pool moved between them moves its stream from one to the other
    lane = ("--step-lane-port", "0") if group == "g2" else ()
    return start_blockd("--cluster", cluster, "--group", group, "--cluster-etcd", etcd_url, "--lease-ttl-s", "2",
                        *lane)


@pytest.fixture
def two_groups(etcd_server, request):
    # the test's name, cut, and a hash of its whole id: parametrized cases of one test get
    # clusters of their own in the session's etcd (a cut name alone would be shared)
    name = request.node.name[:30].replace("[", "-").replace("]", "")
    cluster = f"{name}-{zlib.crc32(request.node.nodeid.encode()):08x}"
    daemons = [_group(etcd_server.url, cluster, g) for g in ("g1", "g2")]
    client = ClusterClient(f"cluster://{etcd_server.url.split('://')[1]}/{cluster}", timeout_s=5)
    yield client, daemons
    client.close()
    for daemon in daemons:
        daemon.kill()
