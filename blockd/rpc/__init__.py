"""What blockd's daemon, its workers and its SDK share to talk over the network.

* :mod:`blockd.rpc.errors` - the one mapping from core errors to gRPC status
  codes (with ``google.rpc`` details), the handler wrappers that let nothing
  leave as UNKNOWN, and the lenient request parser;
* :mod:`blockd.rpc.convert` - protobuf messages <-> the core's dataclasses,
  validating malformed input (the daemon reads requests with it, the SDK
  replies);
* :mod:`blockd.rpc.tensors` - ``blockd.v1.Tensor`` <-> torch (the one module
  here that needs torch: only the worker and its client import it);
* :mod:`blockd.rpc.stock` and :mod:`blockd.rpc.endpoint` - the stock health and
  reflection services and the gRPC endpoint both servers are built on;
* :mod:`blockd.rpc.addresses` - listen and advertised addresses;
* :mod:`blockd.rpc.metrics_http` - the ``/metrics`` HTTP endpoint beside them.

Imports the core, the generated protocol (:mod:`blockd.v1`), grpc, protobuf
and prometheus_client; never the daemon, the SDK or the workers. Nothing is
imported here, so each module costs only what it needs.
"""
