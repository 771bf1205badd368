"""Builds blockd; compiles the allocator core's hot modules with mypyc where it can,
and the log's background fsync thread (``blockd/storage/_fsyncer.c``).

Everything else about the package is in pyproject.toml; this file exists only
for ``ext_modules``, which pyproject.toml cannot declare.

Why mypyc: the daemon's CPU per scheduler step is mostly the core's decode
loop (``bench/rpc.py --part daemon_cost --profile``), and mypyc compiles the
same, already type-annotated modules to C: no second implementation to keep
in step, and the hypothesis state machines test the compiled build (what
``make setup`` installs). ``bench/core.py`` times both builds in one run.

Where it cannot compile (``BLOCKD_PURE_PYTHON=1``, no mypyc, no C compiler or
Python headers) the install goes on and the core runs as Python, as before:
slower, never different. :mod:`blockd.core` checks at import that each
compiled module was built from the source beside it (``COMPILED_FROM``, the
sources' SHA-256 at build time) and runs the sources when one was edited since.
The fsync thread is built on its own (its failure leaves the core compiled),
with its source's SHA-256 inside it; :mod:`blockd.storage.fsyncer` uses a
Python thread where it is missing or stale.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
CORE = HERE / "blockd" / "core"
#: the modules the decode step runs through; the rest of the core is cold
#: (errors, types and validation are also where bad input is told apart, and
#: compiled code would turn a wrongly typed argument into a TypeError)
COMPILED = ("batch", "blocks", "decode", "sequence")
COMPILED_FROM = CORE / "compiled_from.sha256"
FSYNCER = "blockd.storage._fsyncer"
FSYNCER_SOURCE = Path("blockd") / "storage" / "_fsyncer.c"


class OptionalBuildExt(build_ext):
    """``build_ext`` that leaves the core as Python when the compiler fails."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name != FSYNCER:
            super().build_extension(ext)
            return
        try:
            super().build_extension(ext)
        except Exception as err:  # noqa: BLE001 - the log then syncs from a Python thread
            print(f"warning: blockd's fsync thread was not compiled ({err}); a Python thread syncs", file=sys.stderr)

    def run(self) -> None:
        try:
            super().run()
        except Exception as err:  # noqa: BLE001 - any build failure means the same: run as Python
            print(f"warning: blockd's core was not compiled ({err}); it runs as Python", file=sys.stderr)
            COMPILED_FROM.unlink(missing_ok=True)
            self.extensions = []


def fsyncer() -> Extension:
    digest = hashlib.sha256((HERE / FSYNCER_SOURCE).read_bytes()).hexdigest()
    return Extension(FSYNCER, [str(FSYNCER_SOURCE)], define_macros=[("BLOCKD_SOURCE_SHA256", f'"{digest}"')],
                     extra_compile_args=["-O2"])


def ext_modules() -> list:
    COMPILED_FROM.unlink(missing_ok=True)
    if os.environ.get("BLOCKD_PURE_PYTHON") == "1":
        return []
    return [*core_modules(), fsyncer()]


def core_modules() -> list:
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("warning: mypyc is not installed; blockd's core runs as Python", file=sys.stderr)
        return []
    sources = [CORE / f"{name}.py" for name in COMPILED]
    COMPILED_FROM.write_text("".join(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
                                     for path in sources))
    try:  # mypyc type-checks first; a failure there is a build without the compiled core, not no build
        return mypycify([str(path.relative_to(HERE)) for path in sources], opt_level="3")
    except (Exception, SystemExit) as err:  # noqa: BLE001
        print(f"warning: mypyc could not compile blockd's core ({err}); it runs as Python", file=sys.stderr)
        COMPILED_FROM.unlink(missing_ok=True)
        return []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
