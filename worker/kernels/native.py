"""The compiled CPU attention kernel (``csrc/paged_attention.cpp``): building, caching, choosing.

The same library holds the decoder layer's fused elementwise ops
(``csrc/layer_ops.cpp``, namespace ``blockd_layer``, used by
:mod:`worker.model.fused`); :func:`layer_ops` hands them out; and the greedy
LM head's screen (``csrc/greedy_head.cpp``, ``blockd_head``), :func:`head_ops`.

The kernel is a torch C++ extension compiled on first use with
``torch.utils.cpp_extension.load`` (needs a C++ compiler and the ``ninja``
package), with ``-march=native`` so its vector code is what this CPU offers
(AVX2+FMA+F16C where present, portable 4-wide vectors or scalar code
otherwise; see the source). It is not built at install time because pip's
build isolation would fetch a second (CUDA) torch to build against.

The build is cached under ``$BLOCKD_KERNEL_CACHE`` (default
``~/.cache/blockd/kernels``), in a directory named by a hash of the sources,
the compiler flags, torch's version and the CPU's flags, so a rebuilt torch,
an edited source or another CPU sharing a home directory never loads a stale
library; concurrent processes wait on torch's lock.

``BLOCKD_KERNEL_MARCH`` (default ``native``) is the build's ``-march``. A named
level (``x86-64-v2``: any x86-64 CPU since ~2009, the vec4 path;
``x86-64-v3``: AVX2+FMA+F16C; ``armv8-a``) makes a portable build: its
cache directory is not keyed by this CPU's flags, so a build made elsewhere
(the container image's build stage, which has the compiler the runtime stage
lacks) loads on any CPU of that level with the same sources, torch and
Python. A process loads the build of the level it is told, so builder and
runner must agree on the variable (deploy/Dockerfile sets it in both). A warm cache loads in
well under a second; a cold build takes ~30-90 s on a small machine
(``python -m worker.kernels`` builds it ahead of time; ``make setup`` does).

Which backend :class:`worker.kernels.PagedAttention` uses on a CPU is chosen
by ``BLOCKD_ATTENTION_BACKEND``:

* ``auto`` (default): the compiled kernel when it builds, else the torch
  kernels (the failure is logged once, with its reason);
* ``native``: the compiled kernel, or raise;
* ``torch``: the torch kernels, nothing is compiled.

``BLOCKD_ATTENTION_ISA`` (``auto``/``avx2``/``vec4``/``scalar``) forces a
code path of the compiled kernel, for tests and comparisons.

A second library, ``csrc/onednn_matmul.cpp`` (namespace ``blockd_matmul``,
used by :mod:`worker.model.linear`), runs the decoder's linears through
oneDNN's matmul primitive. It links the oneDNN of the ``onednn-cpu-gomp``
and ``onednn-devel-cpu-gomp`` wheels (the ``worker`` extra, x86-64 Linux),
found under this interpreter's prefix, so it is built and cached the same
way but on its own: without those wheels :func:`load_matmul` says why and
the linears keep torch's oneDNN inner product; the attention kernel and the
layer ops do not depend on it.

Imports torch only (``torch.utils.cpp_extension`` lazily).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import threading
from pathlib import Path

import torch

__all__ = ["ISAS", "KernelUnavailable", "backend_setting", "head_ops", "isa_setting", "layer_ops", "load",
           "load_matmul", "loaded", "march_setting", "matmul_failure", "matmul_ops", "ops"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
#: one library: the attention kernel, the decoder layer's elementwise ops
#: (``blockd_layer``, used by :mod:`worker.model.fused`) and the greedy LM
#: head's screen (``blockd_head``, used by :mod:`worker.model.greedy_head`)
_SOURCES = (_CSRC / "paged_attention.cpp", _CSRC / "layer_ops.cpp", _CSRC / "greedy_head.cpp")
#: the compiler flags, ``-march`` filled in by :func:`march_setting` (in this order: a native
#: build's cache key is what it was before the setting existed)
_CFLAGS = ("-O3", "-march={march}", "-fopenmp", "-fno-math-errno")
_LDFLAGS = ("-fopenmp",)
BACKENDS = ("auto", "native", "torch")
#: code paths of the compiled kernel, by the ``isa`` argument of its ``run`` op
ISAS = {"auto": 0, "scalar": 1, "vec4": 2, "avx2": 3}

#: the linears' library, linked against the oneDNN wheel's libdnnl (see the module docstring)
_MATMUL_SOURCES = (_CSRC / "onednn_matmul.cpp",)

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_failure: str = ""
_matmul_loaded: bool | None = None
_matmul_failure: str = ""


class KernelUnavailable(RuntimeError):
    """The compiled kernel could not be built or loaded (the message says why)."""


def backend_setting() -> str:
    """``BLOCKD_ATTENTION_BACKEND``, validated: ``auto``, ``native`` or ``torch``."""
    value = os.environ.get("BLOCKD_ATTENTION_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"BLOCKD_ATTENTION_BACKEND must be one of {', '.join(BACKENDS)}, got {value!r}")
    return value


def isa_setting() -> int:
    """``BLOCKD_ATTENTION_ISA`` as the kernel's ``isa`` argument (0 = the best compiled in)."""
    value = os.environ.get("BLOCKD_ATTENTION_ISA", "auto").strip().lower() or "auto"
    if value not in ISAS:
        raise ValueError(f"BLOCKD_ATTENTION_ISA must be one of {', '.join(ISAS)}, got {value!r}")
    return ISAS[value]


def march_setting() -> str:
    """``BLOCKD_KERNEL_MARCH``, validated: ``native`` or a ``-march`` level name."""
    value = os.environ.get("BLOCKD_KERNEL_MARCH", "native").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", value):
        raise ValueError(f"BLOCKD_KERNEL_MARCH must be native or a -march level such as x86-64-v2, got {value!r}")
    return value


def _cflags() -> tuple[str, ...]:
    march = march_setting()
    return tuple(flag.format(march=march) for flag in _CFLAGS)


def _cpu_signature() -> str:
    """The CPU's feature flags (Linux), so a cache shared by different CPUs keeps one build each."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.machine() + platform.processor()


def _build_dir(prefix: str = "blockd_attention", extra: tuple[str, ...] = ()) -> tuple[str, Path]:
    """The library's name and cache directory; ``extra``: flags beyond the common ones."""
    digest = hashlib.sha256()
    sources = [path.read_bytes() for path in sorted(_CSRC.iterdir()) if path.is_file()]
    # a portable build (a named -march) is one library for every CPU of its level
    cpu = _cpu_signature() if march_setting() == "native" else "portable"
    # (extra is empty for the attention library: its cache key is what it was before the second library)
    for part in (*sources, " ".join(_cflags() + _LDFLAGS + extra).encode(), torch.__version__.encode(),
                 cpu.encode(), sys.version.encode()):
        digest.update(part)
    name = f"{prefix}_" + digest.hexdigest()[:16]
    root = Path(os.environ.get("BLOCKD_KERNEL_CACHE") or Path.home() / ".cache" / "blockd" / "kernels")
    return name, root / name


def _onednn_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Compiler (include) and linker flags for the oneDNN wheels under this interpreter's
    prefix; raises :class:`KernelUnavailable` saying what is missing."""
    prefix = Path(sys.prefix)
    header, library = prefix / "include" / "oneapi" / "dnnl" / "dnnl.hpp", prefix / "lib" / "libdnnl.so.3"
    if not header.is_file() or not library.is_file():
        raise KernelUnavailable(f"oneDNN's matmul needs the onednn-cpu-gomp and onednn-devel-cpu-gomp wheels "
                                f"(the worker extra, x86-64 Linux): {header if not header.is_file() else library} "
                                "is missing")
    # the soname, not libdnnl.so: the wheel ships every name as a full copy, and one is enough
    return (f"-I{prefix / 'include'}",), (f"-l:{library.name}", f"-L{library.parent}",
                                          f"-Wl,-rpath,{library.parent}")


def _build(prefix: str = "blockd_attention", sources: tuple[Path, ...] = _SOURCES,
           flags: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> None:
    """Build (or load the cached) library; ``flags``: extra compiler and linker flags."""
    from torch.utils import cpp_extension

    cflags, ldflags = flags
    name, directory = _build_dir(prefix, cflags + ldflags)
    library = directory / f"{name}.so"
    if library.exists():  # the directory is named by a hash of everything that went in: it is current
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:  # e.g. a build killed while linking: rebuild below
            pass
    directory.mkdir(parents=True, exist_ok=True)
    # torch runs `ninja` from PATH; the ninja wheel's binary sits beside this
    # interpreter even when the venv is not activated.
    path = os.environ.get("PATH", "")
    try:
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    except ImportError:
        pass
    try:
        # (copies: load() appends to the flag lists it is given)
        cpp_extension.load(name=name, sources=[str(path) for path in sources],
                           extra_cflags=[*_cflags(), *cflags], extra_ldflags=[*_LDFLAGS, *ldflags],
                           build_directory=str(directory), is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path


def load(required: bool = False) -> bool:
    """Build (once per cache) and load the kernel; ``True`` when its ops are registered.

    On failure returns ``False`` (logging the reason once), or raises
    :class:`KernelUnavailable` when ``required``.
    """
    global _loaded, _failure  # noqa: PLW0603 - the build is loaded once per process
    with _lock:
        if _loaded is None:
            try:
                _build()
                _loaded = True
            except Exception as err:  # noqa: BLE001 - no compiler, no ninja, a compile error: all fall back
                _loaded, _failure = False, f"{type(err).__name__}: {err}".strip()[:2000]
                log.warning("compiled CPU attention kernel unavailable, using the torch kernels: %s", _failure)
    if not _loaded and required:
        raise KernelUnavailable(f"the compiled CPU attention kernel could not be built: {_failure}")
    return bool(_loaded)


def load_matmul() -> bool:
    """Build (once per cache) and load the oneDNN matmul library; ``True`` when its ops
    (``blockd_matmul``) are registered. ``False`` when the oneDNN wheels are missing or
    the build fails (:func:`matmul_failure` says why; logged once)."""
    global _matmul_loaded, _matmul_failure  # noqa: PLW0603 - loaded once per process
    with _lock:
        if _matmul_loaded is None:
            try:
                _build("blockd_matmul", _MATMUL_SOURCES, _onednn_flags())
                _matmul_loaded = True
            except Exception as err:  # noqa: BLE001 - no wheel, no compiler: the linears keep torch's kernel
                _matmul_loaded, _matmul_failure = False, f"{type(err).__name__}: {err}".strip()[:2000]
                log.info("oneDNN matmul unavailable, the linears use torch's inner product: %s", _matmul_failure)
    return bool(_matmul_loaded)


def matmul_failure() -> str:
    """Why the last :func:`load_matmul` failed ('' when it did not)."""
    return _matmul_failure


def matmul_ops():
    """The oneDNN matmul ops (``pack``, ``run``, ``version``); call :func:`load_matmul` first."""
    return torch.ops.blockd_matmul


def loaded() -> bool:
    """Whether :func:`load` has loaded the library in this process (never builds it)."""
    return bool(_loaded)


def failure() -> str:
    """Why the last :func:`load` failed ('' when it did not)."""
    return _failure


def ops():
    """The kernel's ops (``plan``, ``run``, ``best_isa``); call :func:`load` first."""
    return torch.ops.blockd_attention


def layer_ops():
    """The fused layer ops (``rms_norm``, ``add_rms_norm``, ``rotary``, ``silu_mul``, ``add``,
    ``copy_rows``, ``argmax_rows``); call :func:`load` first."""
    return torch.ops.blockd_layer


def head_ops():
    """The greedy LM head's screen (``screen_argmax``); call :func:`load` first."""
    return torch.ops.blockd_head


def main() -> None:
    """``python -m worker.kernels``: build the kernel now (set-up, CI); one JSON line says how it went."""
    logging.basicConfig(level=logging.INFO)
    ok = load()
    try:
        march, directory = march_setting(), str(_build_dir()[1])
    except ValueError as err:  # a bad BLOCKD_KERNEL_MARCH: load() said so too
        march, directory = None, None
        ok = False
        log.error("%s", err)
    isa = {v: k for k, v in ISAS.items()}.get(int(ops().best_isa()), "?") if ok else None
    matmul = load_matmul() if ok else False  # optional: the linears fall back without it
    print(json.dumps({"built": ok, "dir": directory, "march": march, "best_isa": isa, "error": _failure or None,
                      "onednn_matmul": matmul, "onednn_matmul_error": _matmul_failure or None}))
    sys.exit(0 if ok else 1)
