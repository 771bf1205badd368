"""The SDK's exceptions: one class per gRPC status a caller handles differently.

:func:`from_rpc_error` turns a ``grpc.RpcError`` (sync or asyncio) into a
:class:`BlockdClientError` subclass chosen by status code (:func:`error_for`,
which an in-process backend uses too), with the ``google.rpc`` details blockd
attaches unpacked:

* ``details``  - the detail messages (``ErrorInfo``, ``BadRequest``, ...);
* ``reason``   - ``ErrorInfo.reason`` (``NO_ROOM``, ``NOT_FOUND``, ...);
* ``op_index`` - which operation of a step failed, if one did;
* ``field_violations`` - ``(field, description)`` pairs from ``BadRequest``;
* ``metadata`` - the whole ``ErrorInfo.metadata``, and ``seq_ids``, the
  sequences it names (reasons ``KV_LOST`` and ``KV_NOT_WRITTEN``: recompute
  them).
"""

from __future__ import annotations

import json

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

_DETAIL_TYPES = {cls.DESCRIPTOR.full_name: cls for cls in (
    error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo,
    error_details_pb2.QuotaFailure, error_details_pb2.PreconditionFailure,
    error_details_pb2.ResourceInfo, error_details_pb2.DebugInfo,
)}


class BlockdClientError(Exception):
    """A blockd call failed; ``code`` is the gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None,
                 details: tuple[Message, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details

    def _info(self) -> error_details_pb2.ErrorInfo | None:
        return next((d for d in self.details if isinstance(d, error_details_pb2.ErrorInfo)), None)

    @property
    def reason(self) -> str:
        info = self._info()
        return info.reason if info is not None else ""

    @property
    def op_index(self) -> int | None:
        info = self._info()
        if info is None or "op_index" not in info.metadata:
            return None
        return int(info.metadata["op_index"])

    @property
    def metadata(self) -> dict[str, str]:
        info = self._info()
        return dict(info.metadata) if info is not None else {}

    @property
    def seq_ids(self) -> list[str]:
        """The sequences the error names (possibly a prefix of them: the count
        is ``metadata["num_seq_ids"]``); empty when it names none."""
        try:
            ids = json.loads(self.metadata.get("seq_ids", "[]"))
        except ValueError:
            return []
        return [s for s in ids if isinstance(s, str)] if isinstance(ids, list) else []

    @property
    def field_violations(self) -> list[tuple[str, str]]:
        return [(v.field, v.description) for d in self.details
                if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations]

    @property
    def quota_violations(self) -> list[tuple[str, str]]:
        """``(subject, description)`` of each exceeded quota (``google.rpc.QuotaFailure``)."""
        return [(v.subject, v.description) for d in self.details
                if isinstance(d, error_details_pb2.QuotaFailure) for v in d.violations]

    @property
    def retry_after_s(self) -> float | None:
        """How long the server asks the caller to wait (``google.rpc.RetryInfo``; rate limits)."""
        info = next((d for d in self.details if isinstance(d, error_details_pb2.RetryInfo)), None)
        return info.retry_delay.ToNanoseconds() / 1e9 if info is not None else None

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgumentError(BlockdClientError, ValueError):
    """Also a ``ValueError``: the SDK raises it for its own argument checks
    (a bad target, a value out of a field's range) as blockd does for a request."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(BlockdClientError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(BlockdClientError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhaustedError(BlockdClientError):
    """No room (beyond the watermark): free or preempt sequences, or retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(BlockdClientError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class UnavailableError(BlockdClientError):
    """The daemon could not be reached (after the channel's retries)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(BlockdClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(BlockdClientError):
    code = grpc.StatusCode.CANCELLED


class PermissionDeniedError(BlockdClientError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(BlockdClientError):
    code = grpc.StatusCode.UNAUTHENTICATED


class InternalError(BlockdClientError):
    """A bug in blockd; the message carries an incident id found in its log."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgumentError, NotFoundError, AlreadyExistsError, ResourceExhaustedError,
    FailedPreconditionError, UnavailableError, DeadlineExceededError, CancelledError,
    PermissionDeniedError, UnauthenticatedError, InternalError,
)}


def _unpack(status) -> tuple[Message, ...]:
    details = []
    for item in status.details:
        cls = _DETAIL_TYPES.get(item.TypeName())
        if cls is not None:
            message = cls()
            item.Unpack(message)
            details.append(message)
    return tuple(details)


def error_for(code: grpc.StatusCode, message: str, details: tuple[Message, ...] = ()) -> BlockdClientError:
    """The SDK exception for a failure with this status code, message and details."""
    cls = _BY_CODE.get(code, BlockdClientError)
    return cls(message, code=code, details=details)


def from_rpc_error(err: grpc.RpcError) -> BlockdClientError:
    """The SDK exception for a failed call (works for sync and asyncio calls)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = (err.details() if hasattr(err, "details") else None) or str(err)
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]  # a failed call is its RpcError
    except ValueError:  # status details that disagree with the call's code/message
        status = None
    return error_for(code, message, _unpack(status) if status is not None else ())


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def from_status_bytes(data: bytes) -> BlockdClientError:
    """The SDK exception for a refusal carried as a serialized ``google.rpc.Status``
    (a StepStream answer's ``error_status``): the same one the unary call's
    failure would raise."""
    status = status_pb2.Status.FromString(data)
    return error_for(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message, _unpack(status))
