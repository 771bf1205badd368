"""Log replication of a replica group (``blockd serve --etcd``, ``docs/ha.md``).

* :mod:`blockd.replication.replica` - one replica: role, gate and wiring;
* :mod:`blockd.replication.commit_point` - the leader's commit point as plain
  data: followers' persisted LSNs, the in-sync set, the quorum rule;
* :mod:`blockd.replication.commits` - that commit point shared by threads:
  the waiting steps and the in-sync set's writes in etcd;
* :mod:`blockd.replication.servicer` - ``ReplicationService`` on the leader:
  opens feeds, takes acknowledgements, answers status;
* :mod:`blockd.replication.feeds` - what a feed sends (records, heartbeats,
  snapshots), on the gRPC stream or the replication port;
* :mod:`blockd.replication.acks` - the one way an acknowledgement reaches the
  commit point, and the carriers that bring them;
* :mod:`blockd.replication.follower` - a follower's side: stream, apply,
  persist, acknowledge;
* :mod:`blockd.replication.transport` - the replication port: tickets, the
  listener, the follower's connect, TLS;
* :mod:`blockd.replication.framing` - the port's frames and one connection's ends;
* :mod:`blockd.replication.ack_reader` - plain-text acknowledgements, read by
  the steps that wait for them;
* :mod:`blockd.replication.log_tail` - the leader's retained window of records;
* :mod:`blockd.replication.metrics` - replication's Prometheus metrics.

The election itself is :mod:`blockd.ha` (etcd), below this package.
"""
