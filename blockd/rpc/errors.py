"""The one way an RPC fails: core errors -> gRPC status with ``google.rpc`` details.

Every servicer method is wrapped by :func:`unary` or :func:`server_stream`:

* a :class:`~blockd.core.errors.BlockdError` leaves with the status its
  ``code`` names, the error's message, and details:
  ``google.rpc.ErrorInfo`` (domain ``blockd``, reason = the error class in
  UPPER_SNAKE_CASE, metadata ``op_index`` for a failing batch operation,
  ``rpc`` for the method, plus the error's own ``metadata`` if it has one,
  e.g. the ``seq_ids`` of KV_LOST) and, for INVALID_ARGUMENT, a ``google.rpc.BadRequest``
  whose field violation names the offending field (``ops[3]``,
  ``config.block_size``, ...); for a tenant's quota (QUOTA_EXCEEDED) a
  ``google.rpc.QuotaFailure``, plus a ``google.rpc.RetryInfo`` for a rate;
* anything else is a bug: it leaves as INTERNAL with an incident id, and the
  traceback is logged under the same id. Nothing ever leaves as UNKNOWN.

A status travels in trailing metadata, which gRPC caps (8 KiB by default; a
bigger one reaches the client as RESOURCE_EXHAUSTED "received metadata size
exceeds hard limit", hiding the real error). So the message and the field
description are cut here to :data:`MAX_MESSAGE_BYTES` and
:data:`MAX_DESCRIPTION_BYTES` of UTF-8 (the message travels twice, once
percent-encoded, once inside the base64 details): whatever an error says,
its metadata stays under about 4.5 KiB.

A request whose bytes do not parse is turned into INVALID_ARGUMENT here too:
:func:`lenient_parser` returns a :class:`MalformedRequest` instead of raising
(gRPC itself would answer INTERNAL and log a traceback), and the wrappers
refuse it; :func:`method_handlers` builds every service's handlers that way.
Imports grpc, grpcio-status and the google.rpc protos; never the engine.
"""

from __future__ import annotations

import functools
import logging
import re
import uuid
from collections.abc import Callable, Iterator

import grpc
from google.protobuf import any_pb2, duration_pb2, message_factory
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from blockd.core.errors import BlockdError, InvalidArgument, InvariantViolation, QuotaExceeded

log = logging.getLogger("blockd.service")

DOMAIN = "blockd"
MAX_MESSAGE_BYTES = 768
MAX_DESCRIPTION_BYTES = 384
_MAX_FIELD_BYTES = 128


def bounded(text: str, limit: int) -> str:
    """``text`` as valid UTF-8 of at most ``limit`` bytes, cut with an ellipsis."""
    data = text.encode("utf-8", "backslashreplace")  # lone surrogates cannot travel
    if len(data) > limit:
        data = data[: limit - 3] + "\u2026".encode()
    return data.decode("utf-8", "ignore")


class BadField(InvalidArgument):
    """A malformed request field found while converting a message; ``field`` is
    its path (``ops[2].allocate.seq_id``) for the BadRequest detail."""

    #: the ErrorInfo reason: the same as the core's InvalidArgument
    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str, *, op_index: int | None = None) -> None:
        super().__init__(f"{field}: {message}", op_index=op_index)
        self.field = field
        self.description = message


class MalformedRequest(BadField):
    """The request bytes are not a valid encoding of the method's message."""

    reason = "MALFORMED_REQUEST"


def lenient_parser(message_cls: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    """A request deserializer that returns :class:`MalformedRequest` instead of
    raising, so the handler can answer INVALID_ARGUMENT rather than gRPC's
    INTERNAL "Exception deserializing request!"."""
    parse = message_cls.FromString
    name = message_cls.DESCRIPTOR.full_name

    def parser(data: bytes) -> Message | MalformedRequest:
        try:
            return parse(data)
        except (DecodeError, ValueError, RuntimeError) as err:
            return MalformedRequest("(request)", f"bytes do not parse as {name}: {err}")

    return parser


def _reason(err: BlockdError) -> str:
    explicit = getattr(type(err), "reason", None)
    if explicit is not None:
        return explicit
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(err).__name__).upper()


def error_parts(err: BlockdError, rpc: str) -> tuple[str, str, list[Message]]:
    """``(code name, message, details)`` a core error leaves as (see the module
    docstring); an in-process backend raises the SDK's error from these, so it
    fails exactly as a call over gRPC would."""
    metadata = {**getattr(err, "metadata", {}), "rpc": rpc}
    if err.op_index is not None:
        metadata["op_index"] = str(err.op_index)
    details: list[Message] = [error_details_pb2.ErrorInfo(reason=_reason(err), domain=DOMAIN, metadata=metadata)]
    if err.code == "INVALID_ARGUMENT":
        field = getattr(err, "field", None)
        if field is None and err.op_index is not None:
            field = f"ops[{err.op_index}]"
        description = bounded(getattr(err, "description", err.message), MAX_DESCRIPTION_BYTES)
        violation = error_details_pb2.BadRequest.FieldViolation(field=bounded(field or "", _MAX_FIELD_BYTES),
                                                                description=description)
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    details.extend(_quota_details(err))
    code = err.code if hasattr(code_pb2, err.code) else "INTERNAL"
    return code, bounded(err.message, MAX_MESSAGE_BYTES), details


def _quota_details(err: BlockdError) -> list[Message]:
    """``QuotaFailure`` (and ``RetryInfo`` for a rate) of a :class:`QuotaExceeded`."""
    if not isinstance(err, QuotaExceeded):
        return []
    violations = [error_details_pb2.QuotaFailure.Violation(subject=bounded(subject, _MAX_FIELD_BYTES),
                                                           description=bounded(text, MAX_DESCRIPTION_BYTES))
                  for subject, text in err.violations]
    details: list[Message] = [error_details_pb2.QuotaFailure(violations=violations)]
    if err.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(max(1, int(err.retry_after_s * 1e9)))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    return details


def blockd_status(err: BlockdError, rpc: str) -> grpc.Status:
    """The status a core error leaves as (see the module docstring)."""
    code, message, details = error_parts(err, rpc)
    return _status(getattr(code_pb2, code), message, details)


def internal_status(rpc: str, err: BaseException) -> grpc.Status:
    """INTERNAL for a bug; the traceback goes to the log under an incident id."""
    incident = uuid.uuid4().hex[:12]
    log.error("incident %s: %s failed unexpectedly", incident, rpc, exc_info=err)
    message = (f"internal error in blockd while serving {rpc} (incident {incident}); "
               "the request may be retried, and the daemon log has the details")
    info = error_details_pb2.ErrorInfo(reason="INTERNAL", domain=DOMAIN,
                                       metadata={"rpc": rpc, "incident": incident})
    return _status(code_pb2.INTERNAL, message, [info])


def _status(code: int, message: str, details: list[Message]) -> grpc.Status:
    packed = []
    for detail in details:
        item = any_pb2.Any()
        item.Pack(detail)
        packed.append(item)
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=packed))


def status_for(err: BaseException, rpc: str) -> grpc.Status:
    """The status any exception raised while serving ``rpc`` leaves as."""
    if isinstance(err, InvariantViolation):
        log.error("invariant violated while serving %s", rpc, exc_info=err)
        return blockd_status(err, rpc)
    if isinstance(err, BlockdError):
        return blockd_status(err, rpc)
    return internal_status(rpc, err)


def status_bytes(err: BaseException, rpc: str) -> bytes:
    """The serialized ``google.rpc.Status`` of :func:`status_for`: how a
    stream that answers each request (StepStream) carries a refusal without
    ending the call, in the bytes of gRPC's ``grpc-status-details-bin`` trailer."""
    status = status_for(err, rpc)
    for key, value in status.trailing_metadata:
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            return value
    return status_pb2.Status(code=status.code.value[0], message=status.details).SerializeToString()


class CallerGone(Exception):
    """The caller's request stream ended with an error: it cancelled the call, or
    its connection is gone. Nobody is left to answer, and nothing went wrong here."""


def unary(method: Callable) -> Callable:
    """Wrap a unary servicer method so every failure leaves through :func:`status_for`."""
    rpc = method.__name__

    @functools.wraps(method)
    def handler(self, request, context: grpc.ServicerContext):
        try:
            if isinstance(request, BlockdError):  # the deserializer's refusal (MalformedRequest, ...)
                raise request
            return method(self, request, context)
        except CallerGone:
            return None  # not an incident: a follower that gave up its feed cancels its acks, for one
        except Exception as err:  # noqa: BLE001 - the one place that classifies failures
            status = status_for(err, rpc)
        # abort raises, so it must run outside the try above
        context.abort_with_status(status)
        return None

    return handler


def answer_each(method: Callable) -> Callable:
    """Serve a stream of requests one answer each: ``method(self, request,
    context)`` answers one request; whatever it raises becomes the stream's
    answer for that request through ``refused(err, rpc)`` on the servicer
    (:func:`status_bytes` wrapped in the RPC's answer message), and the stream
    reads on. Requests that do not parse are refused the same way; the stream
    ends when the caller ends or cancels it."""
    rpc = method.__name__

    @functools.wraps(method)
    def handler(self, requests, context: grpc.ServicerContext):
        try:
            for request in _read(requests):
                try:
                    if isinstance(request, BlockdError):  # the deserializer's refusal (MalformedRequest, ...)
                        raise request
                    answer = method(self, request, context)
                except Exception as err:  # noqa: BLE001 - classified like any call's failure
                    answer = self.refused(err, rpc)
                yield answer
        except CallerGone:
            return  # the caller cancelled or its connection is gone: nobody to answer

    return handler


def _read(requests: Iterator) -> Iterator:
    """A call's request stream; :class:`CallerGone` when it ends with an error."""
    it = iter(requests)
    while True:
        try:
            request = next(it)
        except StopIteration:
            return
        except grpc.RpcError:
            raise CallerGone() from None
        yield request


def server_stream(method: Callable[..., Iterator]) -> Callable[..., Iterator]:
    """Like :func:`unary`, for a servicer method that yields responses."""
    rpc = method.__name__

    @functools.wraps(method)
    def handler(self, request, context: grpc.ServicerContext):
        try:
            if isinstance(request, BlockdError):  # the deserializer's refusal (MalformedRequest, ...)
                raise request
            yield from method(self, request, context)
            return
        except Exception as err:  # noqa: BLE001 - the one place that classifies failures
            status = status_for(err, rpc)
        context.abort_with_status(status)

    return handler


def client_stream(method: Callable) -> Callable:
    """Like :func:`unary`, for a servicer method that reads a stream of
    requests: one that does not parse ends the call as INVALID_ARGUMENT."""
    wrapped = unary(method)

    def parsed(requests: Iterator) -> Iterator:
        for request in _read(requests):
            if isinstance(request, BlockdError):  # the deserializer's refusal (MalformedRequest, ...)
                raise request
            yield request

    @functools.wraps(method)
    def handler(self, requests, context: grpc.ServicerContext):
        return wrapped(self, parsed(requests), context)

    return handler


_HANDLER_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
                  (False, True): grpc.unary_stream_rpc_method_handler,
                  (True, False): grpc.stream_unary_rpc_method_handler,
                  (True, True): grpc.stream_stream_rpc_method_handler}


def method_handlers(service: object, descriptor) -> dict[str, grpc.RpcMethodHandler]:
    """Handlers for every method of the service ``descriptor``, served by
    ``service``'s methods of the same name; requests that do not parse reach
    them as :class:`MalformedRequest` (INVALID_ARGUMENT), not as gRPC's
    INTERNAL. Used for blockd's services, the worker's, health and reflection.

    A service may name its own deserializers in ``request_parsers`` (method
    name -> ``parse(bytes)``), which return a :class:`BlockdError` to refuse a
    request before it is read whole (blockd's Step: an oversized batch)."""
    handlers = {}
    own = getattr(service, "request_parsers", {})
    for method in descriptor.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        make = _HANDLER_KINDS[method.client_streaming, method.server_streaming]
        parse = own.get(method.name) or lenient_parser(request_cls)
        handlers[method.name] = make(getattr(service, method.name),
                                     request_deserializer=parse,
                                     response_serializer=response_cls.SerializeToString)
    return handlers
