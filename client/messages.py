"""The requests the SDK sends and how it reads the replies: plain functions
shared by :class:`~client.sdk.BlockdClient` and :class:`~client.aio.AsyncBlockdClient`.

The clients differ only in how they wait; each of their methods builds its
request here, calls its stub method, and reads the reply here. The message
<-> dataclass mapping itself is :mod:`blockd.rpc.convert`, the one the
daemon uses. A mutation's request id is the caller's or a fresh one
(:func:`client.channel.new_request_id`).
"""

from __future__ import annotations

from collections.abc import Sequence

from google.rpc import error_details_pb2

from blockd.core.hashing import HASH_SPEC_ID, NO_EXTRA_KEYS, ExtraKeys, HashSpec, HashSpecMismatch
from blockd.core.types import KVEvent, Op, PoolConfig, WorkerInfo
from blockd.rpc import convert
from blockd.v1 import blockd_pb2 as pb
from client.channel import new_request_id
from client.errors import FailedPreconditionError, InvalidArgumentError


def _rid(request_id: str | None) -> str:
    return request_id if request_id else new_request_id()


def extra_or_none(extra_keys: ExtraKeys | None) -> ExtraKeys:
    return extra_keys if extra_keys is not None else NO_EXTRA_KEYS


# --- pools --------------------------------------------------------------------------
def create_pool_request(config: PoolConfig, request_id: str | None) -> pb.CreatePoolRequest:
    return pb.CreatePoolRequest(config=convert.pool_config_to_proto(config), request_id=_rid(request_id))


def delete_pool_request(pool: str, request_id: str | None) -> pb.DeletePoolRequest:
    return pb.DeletePoolRequest(pool=pool, request_id=_rid(request_id))


def reset_prefix_cache_request(pool: str, request_id: str | None) -> pb.ResetPrefixCacheRequest:
    return pb.ResetPrefixCacheRequest(pool=pool, request_id=_rid(request_id))


def pin_prefix_request(pool: str, token_ids: Sequence[int], extra_keys: ExtraKeys | None, ttl_s: float,
                       request_id: str | None) -> pb.PinPrefixRequest:
    try:
        return pb.PinPrefixRequest(pool=pool, token_ids=list(token_ids), ttl_s=ttl_s, request_id=_rid(request_id),
                                   extra_keys=convert.extra_keys_to_proto(extra_or_none(extra_keys)))
    except (TypeError, ValueError) as err:  # a token id or TTL protobuf cannot hold
        raise InvalidArgumentError(f"PinPrefix does not encode: {err}; {_RANGES}, ttl_s a number") from None


def set_prefix_priority_request(pool: str, token_ids: Sequence[int], extra_keys: ExtraKeys | None, priority: int,
                                request_id: str | None) -> pb.SetPrefixPriorityRequest:
    try:
        return pb.SetPrefixPriorityRequest(pool=pool, token_ids=list(token_ids), priority=priority,
                                           request_id=_rid(request_id),
                                           extra_keys=convert.extra_keys_to_proto(extra_or_none(extra_keys)))
    except (TypeError, ValueError) as err:  # a token id or priority protobuf cannot hold
        raise InvalidArgumentError(f"SetPrefixPriority does not encode: {err}; {_RANGES}, priority 0..7") from None


def unpin_prefix_request(pool: str, pin_id: str, request_id: str | None) -> pb.UnpinPrefixRequest:
    return pb.UnpinPrefixRequest(pool=pool, pin_id=pin_id, request_id=_rid(request_id))


# --- steps and reads ------------------------------------------------------------------
#: what the wire types hold, for a refusal that names a value that does not fit
_RANGES = ("token ids are integers in 0..2**32-1, num_tokens in 0..2**64-1, extra_keys.adapter_id a signed "
           "64-bit integer, ids and names strings")


def _bad_op(ops: Sequence[Op], err: Exception) -> InvalidArgumentError:
    """The SDK's refusal of a batch protobuf could not encode, naming the op
    (found again here, off the hot path: only a failed build pays for it)."""
    if not isinstance(ops, (list, tuple)):
        return InvalidArgumentError(f"ops must be a list of operations, got {type(ops).__name__}")
    for index, op in enumerate(ops):
        try:
            convert.op_into_proto(op, pb.Op())
        except (TypeError, ValueError, OverflowError) as op_err:
            return InvalidArgumentError(f"ops[{index}] ({type(op).__name__}): {op_err}; {_RANGES}")
    return InvalidArgumentError(f"the step does not encode: {err}; {_RANGES}")


def step_request(pool: str, ops: Sequence[Op], request_id: str | None, dry_run: bool = False,
                 incarnation: str = "", previous_term: int = 0) -> pb.StepRequest:
    try:
        request = convert.step_request_to_proto(pool, ops, _rid(request_id), incarnation)
        request.dry_run, request.previous_term = dry_run, previous_term
    except (TypeError, ValueError, OverflowError) as err:  # protobuf's "Value out of range: -16" names no field
        raise _bad_op(ops, err) from None
    return request


def tables_reply(reply: pb.GetTablesResponse) -> tuple[int, dict[str, list[int]]]:
    return reply.version, convert.tables_from_proto(reply.tables)


def lookup_prefix_request(token_ids: Sequence[int], extra_keys: ExtraKeys | None,
                          pools: Sequence[str]) -> pb.LookupPrefixRequest:
    return pb.LookupPrefixRequest(token_ids=list(token_ids), pools=list(pools),
                                  extra_keys=convert.extra_keys_to_proto(extra_or_none(extra_keys)))


def lookup_prefix_reply(reply: pb.LookupPrefixResponse, tiers: bool) -> dict:
    """Cached tokens per pool; with ``tiers``, ``(cached, of them in the host tier)``."""
    if not tiers:
        return dict(reply.num_cached_tokens)
    return {name: (n, reply.num_host_tokens.get(name, 0)) for name, n in reply.num_cached_tokens.items()}


def event_reply(reply: pb.EventsResponse) -> KVEvent:
    return convert.event_from_proto(reply.event)


def checked_hash_spec(spec: HashSpec, target: str) -> HashSpec:
    """``spec`` (blockd's at ``target``) if this client hashes blocks the same
    way (:data:`~blockd.core.hashing.HASH_SPEC_ID`); else FailedPreconditionError,
    reason ``HASH_SPEC_MISMATCH``, as blockd refuses a worker of another spec."""
    if spec.spec_id == HASH_SPEC_ID:
        return spec
    message = (f"blockd at {target} hashes blocks by spec {spec.spec_id!r}, this client by {HASH_SPEC_ID!r}: "
               f"the hashes it computes (the scheduler's admission de-duplication) would never match "
               f"blockd's; run a client release built for {spec.spec_id!r} (upgrade the client, or the "
               f"daemon if the client is newer)")
    info = error_details_pb2.ErrorInfo(reason=HashSpecMismatch.reason, domain="blockd",
                                       metadata={"hash_spec": HASH_SPEC_ID, "blockd_hash_spec": spec.spec_id})
    raise FailedPreconditionError(message, details=(info,))


# --- workers --------------------------------------------------------------------------
def register_worker_request(info: WorkerInfo, request_id: str | None,
                            hash_spec: str = HASH_SPEC_ID) -> pb.RegisterWorkerRequest:
    return pb.RegisterWorkerRequest(info=convert.worker_info_to_proto(info), request_id=_rid(request_id),
                                    hash_spec=hash_spec)


def heartbeat_request(worker_id: str, applied_version: int, request_id: str | None) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(worker_id=worker_id, applied_version=applied_version, request_id=_rid(request_id))
