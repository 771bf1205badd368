"""Retention answers to and from protobuf: pins and prefix priorities.

Beside :mod:`blockd.rpc.convert` (which owns pools, steps, tables, events and
workers) so each stays one concern; the same rule holds: bad input from the
wire is refused by the core's checks, not here. Imports the core and the
generated messages only.
"""

from __future__ import annotations

from blockd.core.pool import Pin, PrefixPriority
from blockd.v1 import blockd_pb2 as pb


def pin_to_proto(pin: Pin) -> pb.Pin:
    return pb.Pin(pin_id=pin.pin_id, pool=pin.pool, tenant=pin.tenant, block_ids=list(pin.block_ids),
                  num_tokens=pin.num_tokens, expires_at=pin.expires_at)


def pin_from_proto(msg: pb.Pin) -> Pin:
    return Pin(msg.pin_id, msg.pool, msg.tenant, tuple(msg.block_ids), msg.num_tokens, msg.expires_at)


def prefix_priority_to_proto(done: PrefixPriority) -> pb.SetPrefixPriorityResponse:
    return pb.SetPrefixPriorityResponse(pool=done.pool, tenant=done.tenant, priority=done.priority,
                                        num_tokens=done.num_tokens, num_device_blocks=done.num_device_blocks,
                                        num_host_blocks=done.num_host_blocks)


def prefix_priority_from_proto(msg: pb.SetPrefixPriorityResponse) -> PrefixPriority:
    return PrefixPriority(msg.pool, msg.tenant, msg.priority, msg.num_tokens, msg.num_device_blocks,
                          msg.num_host_blocks)
