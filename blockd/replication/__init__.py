"""Log replication of a replica group (``blockd serve --etcd``, ``docs/ha.md``).

* :mod:`blockd.replication.replica` - one replica: role, gate and wiring;
* :mod:`blockd.replication.leader` - the leader's side: the commit point and
  the feeds to followers;
* :mod:`blockd.replication.follower` - a follower's side: stream, apply,
  persist, acknowledge;
* :mod:`blockd.replication.transport` - the framed socket records travel on;
* :mod:`blockd.replication.log_tail` - the leader's retained window of records;
* :mod:`blockd.replication.metrics` - replication's Prometheus metrics.

The election itself is :mod:`blockd.ha` (etcd), below this package.
"""
