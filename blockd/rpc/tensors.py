"""Tensors on the wire: ``blockd.v1.Tensor`` (dtype, shape, raw bytes) <-> torch.

Raw little-endian bytes, no pickling. bfloat16 has no NumPy type, so tensors
travel as their bytes reinterpreted, never converted. Decoding validates that
the dtype is known, the shape is sane and the byte count matches, raising
:class:`~blockd.core.errors.InvalidArgument` otherwise.
"""

from __future__ import annotations

import math

import torch

from blockd.core.errors import InvalidArgument, shown
from blockd.v1 import worker_pb2 as pb

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_ELEMENTS = 1 << 31


def to_proto(tensor: torch.Tensor) -> pb.Tensor:
    if tensor.dtype not in NAMES:
        raise InvalidArgument(f"cannot send a {tensor.dtype} tensor; use float32, float16 or bfloat16")
    flat = tensor.detach().contiguous().cpu().view(-1)
    raw = flat.view(torch.uint8).numpy().tobytes()
    return pb.Tensor(dtype=NAMES[tensor.dtype], shape=list(tensor.shape), data=raw)


def from_proto(msg: pb.Tensor, name: str) -> torch.Tensor:
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise InvalidArgument(f"{name}.dtype must be one of {sorted(DTYPES)}, got {shown(msg.dtype)}")
    shape = list(msg.shape)
    if any(d < 0 for d in shape) or len(shape) > 8 or math.prod(shape) > MAX_ELEMENTS:
        raise InvalidArgument(f"{name}.shape {shape} is not a valid tensor shape")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(msg.data) != math.prod(shape) * itemsize:
        raise InvalidArgument(f"{name} holds {len(msg.data)} bytes but shape {shape} of {msg.dtype} "
                              f"needs {math.prod(shape) * itemsize}")
    if not msg.data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).view(shape)
