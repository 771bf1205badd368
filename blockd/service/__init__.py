"""blockd over gRPC: the service around :class:`blockd.engine.Engine`.

* :mod:`blockd.service.errors` - the one mapping from core errors to gRPC
  status codes (with ``google.rpc`` details), and the handler wrappers that
  guarantee nothing leaves as UNKNOWN;
* :mod:`blockd.service.convert` - protobuf messages <-> core dataclasses, with
  validation of malformed input (shared with the client SDK);
* :mod:`blockd.service.servicer` - thin adapters: convert, call the engine,
  convert back;
* :mod:`blockd.service.server` - the ``grpc.server`` with health, reflection
  and graceful shutdown.

Nothing is imported here, so ``blockd.service.convert`` can be used without
pulling in the server.
"""
