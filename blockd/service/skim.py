"""A Step request's size checked before it is parsed whole.

Parsing a StepRequest of 20,000 ops (about 730 KB) builds 20,000 nested
messages in about 6 ms, holding the GIL all along: every other caller's step
waits for it, even when the batch is then refused for its size. A large
request is therefore first *skimmed*: its bytes are parsed as a message that
declares ``ops`` (field 2) as ``repeated bytes``, which has the same wire form
but builds only byte strings (about 0.5 ms for those 20,000 ops), and is
refused at once when it holds more ops than ``--max-ops-per-step``; only a
request within the bound is then parsed as a ``StepRequest``. Small requests
(a scheduler's usual step) are parsed directly, as before.

The skim message is built at import from a descriptor made here, so the
public ``.proto`` is unchanged. Owns no policy: the bound is the engine's
:class:`blockd.engine.guardrails.Guardrails`.
"""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from blockd.core.errors import BlockdError
from blockd.engine.guardrails import Guardrails
from blockd.rpc.errors import BadField, lenient_parser
from blockd.v1 import blockd_pb2 as pb

#: requests under this many bytes are parsed directly (a skim would only add to them)
SKIM_BYTES = 64 << 10


def _skim_classes() -> tuple[type[Message], type[Message]]:
    fields = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="blockd/internal/step_skim.proto", package="blockd.internal",
                                              syntax="proto3")
    message = file.message_type.add(name="StepRequestSkim")
    message.field.add(name="ops", number=pb.StepRequest.DESCRIPTOR.fields_by_name["ops"].number,
                      type=fields.TYPE_BYTES, label=fields.LABEL_REPEATED)
    # a StepStream request's step as bytes: the same check on the step inside
    message = file.message_type.add(name="StepStreamRequestSkim")
    message.field.add(name="step", number=pb.StepStreamRequest.DESCRIPTOR.fields_by_name["step"].number,
                      type=fields.TYPE_BYTES, label=fields.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()  # its own pool: nothing of blockd's protocol is shadowed
    pool.Add(file)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"blockd.internal.{name}"))
                 for name in ("StepRequestSkim", "StepStreamRequestSkim"))  # type: ignore[return-value]


_Skim, _StreamSkim = _skim_classes()


def step_parser(guardrails: Guardrails) -> Callable[[bytes], Message | BlockdError]:
    """A deserializer of StepRequest that refuses an oversized batch unread."""
    parse = lenient_parser(pb.StepRequest)

    def parser(data: bytes) -> Message | BlockdError:
        if len(data) > SKIM_BYTES:
            try:
                num_ops = len(_Skim.FromString(data).ops)  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - bytes that do not parse: the full parse says how
                return parse(data)
            try:
                guardrails.check_num_ops(num_ops)
            except BlockdError as err:
                return BadField("ops", str(err))
        return parse(data)

    return parser


def step_stream_parser(guardrails: Guardrails) -> Callable[[bytes], Message | BlockdError]:
    """A deserializer of StepStreamRequest that hands the servicer the
    StepRequest inside, checked as :func:`step_parser` checks one."""
    parse_step = step_parser(guardrails)
    parse_whole = lenient_parser(pb.StepStreamRequest)

    def parser(data: bytes) -> Message | BlockdError:
        if len(data) <= SKIM_BYTES:  # a scheduler's usual step: one parse, no skim
            whole = parse_whole(data)
            return whole if isinstance(whole, BlockdError) else whole.step  # type: ignore[attr-defined]
        try:
            step = _StreamSkim.FromString(data).step  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - bytes that do not parse: the full parse says how
            return parse_whole(data)
        return parse_step(step)

    return parser
