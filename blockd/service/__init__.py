"""blockd over gRPC: the service around :class:`blockd.engine.machine.Engine`.

* :mod:`blockd.service.servicer` - thin adapters: convert the request
  (:mod:`blockd.rpc.convert`), call the engine, convert back; every failure
  leaves through :mod:`blockd.rpc.errors`;
* :mod:`blockd.service.server` - the three services on a
  :class:`blockd.rpc.endpoint.GrpcEndpoint`, with health, reflection and
  graceful shutdown.
"""
