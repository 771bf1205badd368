"""High availability on etcd: leader election with fencing, membership, observers.

etcd is the coordination engine (membership, leases, the election); blockd
never runs a consensus of its own. This package owns what lives *in etcd*
for one replica group and nothing of the engine, the log or the service:

* :mod:`blockd.ha.etcd` - a thin, per-thread client over etcd's HTTP/JSON
  gateway (``etcd3gw``): leases, reads, transactions, one error type.
* :mod:`blockd.ha.keys` - the key layout under ``/blockd/<group>/`` and the
  JSON values stored there.
* :mod:`blockd.ha.election` - campaign, keepalive, fencing (``term``,
  ``can_acknowledge``), step-down, resign; the replica's member key.
* :mod:`blockd.ha.group` - read-only views for observers (the SDK finding
  the leader, ``blockctl cluster status``): one-shot reads and a poller.
* :mod:`blockd.ha.insync` - the in-sync replica set, changed only by the
  current leader (fenced by its term inside etcd's transaction).
* :mod:`blockd.ha.metrics` - a Prometheus collector for term and leadership.
* :mod:`blockd.ha.directory` - a cluster's pool directory (which daemon group
  owns which pool), under ``/blockd-clusters/<cluster>/``, and the placement rule.

The daemon without ``--etcd`` or ``--cluster`` never imports this package. ``docs/ha.md``
describes how replication is built on top of it.
"""
