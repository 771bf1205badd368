"""A worker's KV pool in CUDA memory that another process on the node maps
without a copy: allocated through CuPy, shared as a CUDA IPC handle.

``blockd-worker --ipc-handle PATH`` (a CUDA device and the ``cuda`` extra)
allocates the pool shard with :class:`SharedPool`: one ``cudaMalloc`` of its
own through CuPy (an IPC handle names a whole allocation, so the memory must
not come from torch's or CuPy's caching pools, which hand out pieces of
bigger blocks), viewed as the torch tensor the kernels use through DLPack
(the same memory, no copy), then writes a :class:`PoolHandle` to ``PATH`` as
JSON: the device, the pool's shape and dtype, and the handle's bytes.

Another process on the same node (a model runner beside the worker, a KV
transfer agent, a debugger) calls :func:`open_handle` and gets a torch
tensor over the same memory (``cudaIpcOpenMemHandle``): reads see what the
worker wrote, in the layout of :mod:`worker.layout`. The exporting process
cannot open its own handle (CUDA refuses); the mapping lasts until
:meth:`MappedPool.close` or the process ends, and the worker must outlive it.

Only this module imports CuPy, and only when called: the rest of the worker
runs without it. Tested on a GPU only (the tests skip without one).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from worker.layout import KVGeometry

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError("sharing a pool over CUDA IPC needs CuPy: pip install -e '.[cuda]'") from err
    return cupy


@dataclass(frozen=True)
class PoolHandle:
    """Everything another process needs to map an exported pool."""

    device: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    #: the ``cudaIpcMemHandle_t`` bytes
    handle: bytes
    #: the exporting process (which cannot open its own handle)
    pid: int

    def to_json(self) -> str:
        return json.dumps({"device": self.device, "shape": list(self.shape), "dtype": self.dtype,
                           "nbytes": self.nbytes, "handle": self.handle.hex(), "pid": self.pid})

    @classmethod
    def from_json(cls, text: str) -> PoolHandle:
        data = json.loads(text)
        if data.get("dtype") not in _DTYPES:
            raise ValueError(f"pool handle dtype must be one of {sorted(_DTYPES)}, got {data.get('dtype')!r}")
        return cls(int(data["device"]), tuple(int(d) for d in data["shape"]), data["dtype"], int(data["nbytes"]),
                   bytes.fromhex(data["handle"]), int(data["pid"]))


class SharedPool:
    """Allocates one pool shard through CuPy and exports it; pass
    :meth:`allocate` to :class:`worker.runtime.WorkerRuntime` as ``allocate``."""

    def __init__(self) -> None:
        self._memory: Any = None
        self._tensor: torch.Tensor | None = None

    def allocate(self, geometry: KVGeometry, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A zeroed pool of :attr:`KVGeometry.shape` in its own CUDA allocation."""
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"a pool shared over CUDA IPC lives on a CUDA device, not {dev}")
        if self._memory is not None:
            raise ValueError("this SharedPool already holds a pool")
        cupy = _cupy()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        nbytes = geometry.pool_bytes(dtype)
        with cupy.cuda.Device(index):
            memory = cupy.cuda.Memory(nbytes)  # cudaMalloc: not a piece of a caching pool
            raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        # bytes in CuPy, the pool's dtype and shape in torch (CuPy has no bfloat16)
        tensor = torch.from_dlpack(raw).view(dtype).view(geometry.shape)
        tensor.zero_()
        self._memory, self._tensor = memory, tensor
        return tensor

    def export_handle(self) -> PoolHandle:
        if self._memory is None or self._tensor is None:
            raise ValueError("allocate the pool before exporting it")
        handle = _cupy().cuda.runtime.ipcGetMemHandle(self._memory.ptr)
        return PoolHandle(self._memory.device_id, tuple(self._tensor.shape), _NAMES[self._tensor.dtype],
                          self._memory.size, bytes(handle), os.getpid())

    def write_handle(self, path: str) -> PoolHandle:
        """Export the handle to ``path`` (written whole: a temporary file renamed)."""
        handle = self.export_handle()
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(handle.to_json())
        os.replace(tmp, path)
        return handle


class MappedPool:
    """Another process's pool mapped into this one; ``tensor`` is its memory."""

    def __init__(self, handle: PoolHandle) -> None:
        if handle.pid == os.getpid():
            raise ValueError("a process cannot map the pool it exported; use its tensor directly")
        cupy = _cupy()
        with cupy.cuda.Device(handle.device):
            self._ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle.handle)
            memory = cupy.cuda.UnownedMemory(self._ptr, handle.nbytes, self, handle.device)
            raw = cupy.ndarray((handle.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        self.handle = handle
        self.tensor: torch.Tensor | None = torch.from_dlpack(raw).view(_DTYPES[handle.dtype]).view(handle.shape)

    def close(self) -> None:
        """Unmap (drop every view of :attr:`tensor` first)."""
        if self.tensor is not None:
            self.tensor = None
            _cupy().cuda.runtime.ipcCloseMemHandle(self._ptr)


def open_handle(source: PoolHandle | str) -> MappedPool:
    """Map the pool a :class:`PoolHandle` (or a handle file's path) names."""
    if isinstance(source, str):
        with open(source) as f:
            source = PoolHandle.from_json(f.read())
    return MappedPool(source)
