"""A worker's pool shared over CUDA IPC (:mod:`worker.ipc`).

Without a GPU and CuPy only the parts that need neither run: the handle's
JSON form, and the refusals that say what is missing. With them, a worker
runtime's pool is allocated through CuPy, written by the runtime, and mapped
by a second process, which reads exactly those bytes and writes some back
that the worker then sees: one memory, no copy either way.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

from blockd.cluster.local import ROOT, child_env
from blockd.core import PoolConfig
from worker.ipc import PoolHandle, SharedPool, open_handle
from worker.layout import KVGeometry
from worker.main import parse_args
from worker.runtime import WorkerRuntime

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and CuPy (the cuda extra)")


def test_handle_round_trips_through_json() -> None:
    handle = PoolHandle(1, (2, 2, 8, 4, 16, 64), "bfloat16", 1 << 20, bytes(range(64)), 4242)
    assert PoolHandle.from_json(handle.to_json()) == handle
    with pytest.raises(ValueError, match="dtype must be one of"):
        PoolHandle.from_json(handle.to_json().replace("bfloat16", "int8"))


def test_a_shared_pool_lives_on_cuda_only() -> None:
    with pytest.raises(ValueError, match="lives on a CUDA device"):
        SharedPool().allocate(KVGeometry(1, 4, 4, 1, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match="allocate the pool before"):
        SharedPool().export_handle()
    with pytest.raises(SystemExit):
        parse_args(["--pool", "p", "--device", "cpu", "--ipc-handle", "/tmp/never"])


@needs_cuda
def test_another_process_maps_the_pool_without_a_copy(tmp_path) -> None:
    config = PoolConfig("m", num_blocks=8, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                        dtype="bfloat16")
    shared = SharedPool()
    runtime = WorkerRuntime(config, device="cuda", allocate=shared.allocate)
    path = str(tmp_path / "pool.json")
    handle = shared.write_handle(path)
    assert handle.shape == tuple(runtime.kv.shape) and handle.nbytes == runtime.pool_bytes
    with pytest.raises(ValueError, match="cannot map the pool it exported"):
        open_handle(path)
    runtime.kv[1, 0, 5].fill_(1.5)  # the worker writes one block of layer 1's keys
    torch.cuda.synchronize()
    child = textwrap.dedent(f"""
        import torch
        from worker.ipc import open_handle
        mapped = open_handle({path!r})
        kv = mapped.tensor
        assert kv.dtype == torch.bfloat16 and tuple(kv.shape) == {tuple(runtime.kv.shape)!r}
        assert bool((kv[1, 0, 5] == 1.5).all()) and float(kv.float().abs().sum()) == 1.5 * kv[1, 0, 5].numel()
        kv[0, 1, 2].fill_(-2.0)  # and writes one block of layer 0's values
        torch.cuda.synchronize()
        print("mapped", kv.data_ptr() != 0)
    """)
    out = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "mapped True" in out.stdout
    assert bool((runtime.kv[0, 1, 2] == -2.0).all())  # what the other process wrote, in place
