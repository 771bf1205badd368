"""The daemon's state machine, and everything it owns in memory.

* :mod:`blockd.engine.machine` - :class:`~blockd.engine.machine.Engine`: every
  pool and the steps that change them, one lock, records applied the same way
  for a request and for recovery;
* :mod:`blockd.engine.config` - how an engine is set up (one frozen dataclass);
* :mod:`blockd.engine.records` - its mutations as typed records and their log form;
* :mod:`blockd.engine.pools` - one pool as the daemon holds it;
* :mod:`blockd.engine.incarnations` - pool and worker incarnations, the KV a
  worker restart loses;
* :mod:`blockd.engine.tenancy` - who owns each pool, visibility, quotas;
* :mod:`blockd.engine.guardrails` - the default bounds on one request;
* :mod:`blockd.engine.idempotency` (with ``idempotency_codec``) - request ids;
* :mod:`blockd.engine.worker_registry` - which worker holds which shard;
* :mod:`blockd.engine.watch` - Watch and Events streams of the pools;
* :mod:`blockd.engine.durability`, :mod:`blockd.engine.snapshots` - the
  engine's data directory (over :mod:`blockd.storage`) and when to snapshot.
* :mod:`blockd.engine.retention` - retention control of the prefix cache:
  pins, their deadlines, the timer that lets expired ones go.

Nothing here imports gRPC; the package imports only :mod:`blockd.storage`
and the layers below it. Import the modules themselves: this file re-exports
nothing, so importing one module never drags in the others.
"""
