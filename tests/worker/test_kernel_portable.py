"""A portable build of the CPU attention kernel (``BLOCKD_KERNEL_MARCH``, what
deploy/Dockerfile's build stage makes): its cache is not keyed by the CPU it
was built on, and a process without any compiler loads it, as the image's
runtime stage does (tests/deploy/test_containers.py checks the Dockerfile's side);
the greedy head's screen in that build (no AVX-512) gives the exact argmax."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

from worker.kernels import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_portable_build_is_one_cache_entry_for_every_cpu(monkeypatch) -> None:
    monkeypatch.setenv("BLOCKD_KERNEL_MARCH", "x86-64-v2")
    monkeypatch.setattr(native, "_cpu_signature", lambda: "fpu sse2 avx2")
    here = native._build_dir()
    monkeypatch.setattr(native, "_cpu_signature", lambda: "fpu sse2")
    assert native._build_dir() == here  # another CPU finds the same build
    assert "-march=x86-64-v2" in native._cflags()
    monkeypatch.setenv("BLOCKD_KERNEL_MARCH", "x86-64-v3")
    assert native._build_dir() != here  # another level is another build
    monkeypatch.setenv("BLOCKD_KERNEL_MARCH", "native")
    native_build = native._build_dir()
    monkeypatch.setattr(native, "_cpu_signature", lambda: "fpu sse2 avx2")
    assert native._build_dir() != native_build  # a native build stays keyed by its CPU
    monkeypatch.delenv("BLOCKD_KERNEL_MARCH")
    assert native.march_setting() == "native" and "-march=native" in native._cflags()


@pytest.mark.parametrize("bad", ["x86-64 -O0", "-mavx", "a;b"])
def test_the_march_setting_is_one_level_name(monkeypatch, bad) -> None:
    monkeypatch.setenv("BLOCKD_KERNEL_MARCH", bad)
    with pytest.raises(ValueError, match="BLOCKD_KERNEL_MARCH must be native or a -march level"):
        native.march_setting()


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v2 is an x86-64 level")
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build with")
def test_built_for_x86_64_v2_it_loads_where_there_is_no_compiler_and_another_cpu(tmp_path) -> None:
    cache = str(tmp_path / "kernels")
    built = _run(["-m", "worker.kernels"], BLOCKD_KERNEL_MARCH="x86-64-v2", BLOCKD_KERNEL_CACHE=cache)
    assert built.returncode == 0, built.stderr[-3000:]
    report = json.loads(built.stdout.splitlines()[-1])
    assert report["built"] and report["march"] == "x86-64-v2"
    assert report["best_isa"] in ("vec4", "scalar")  # no AVX2 at this level
    for name in os.listdir(report["dir"]):  # what the image keeps: the library alone
        if not name.endswith(".so"):
            os.remove(os.path.join(report["dir"], name))
    # the runtime stage: no compiler on PATH, CXX failing, and the CPU's flags not the builder's
    code = ("from worker.kernels import native\n"
            "native._cpu_signature = lambda: 'another cpu'\n"
            "native.load(required=True)\n"
            # the greedy head's screen without AVX-512: its scalar loops give the exact argmax
            "import torch\n"
            "from worker.model.greedy_head import GreedyHead\n"
            "g = torch.Generator().manual_seed(3)\n"
            "w = torch.randn(300, 40, generator=g); x = torch.randn(5, 40, generator=g)\n"
            "w[:3] = w[-1] * (1 + 1e-5 * torch.randn(3, 1, generator=g)); x[0] = w[-1]\n"
            "head = GreedyHead(torch.nn.Linear(40, 300, bias=False))\n"
            "a = (x.bfloat16() @ w.bfloat16().T).contiguous()\n"
            "got = native.head_ops().screen_argmax(a, x, w, w.double().norm(dim=1).float(), head.coef, head.rel)\n"
            "assert got.tolist() == (x.double() @ w.double().T).argmax(1).tolist(), got\n"
            "print(native.ops().best_isa())\n")
    loaded = _run(["-c", code], BLOCKD_KERNEL_MARCH="x86-64-v2", BLOCKD_KERNEL_CACHE=cache, CXX="false",
                  PATH="/nonexistent")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert int(loaded.stdout.strip()) == native.ISAS[report["best_isa"]]
