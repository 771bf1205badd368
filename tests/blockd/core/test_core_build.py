"""The core's two builds: compiled by mypyc where the install could (setup.py),
and its sources, which run whenever the compiled build cannot be trusted."""

import ast
import importlib.machinery
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import blockd.core
from tests.conftest import ROOT as _ROOT

ROOT = Path(_ROOT)
COMPILED = blockd.core.BUILD == "compiled"
#: a step whose answer both builds must give: a copy-on-write, a block crossing and a plain append
STEP = (
    "from blockd.core import Allocate, DecodeAppend, Fork, Pool, PoolConfig, check_invariants\n"
    "p = Pool(PoolConfig('x', num_blocks=64, block_size=4))\n"
    "p.step([Allocate('a', [1, 2, 3, 4, 5, 6]), Allocate('b', [9, 9, 9])])\n"
    "p.step([Fork('a', 'c')])\n"
    "r = p.step([DecodeAppend(['a', 'b', 'c'], [7, 8, 9])])\n"
    "check_invariants(p)\n"
    "print(len(r.copy_ops), r.results[0].slot_mapping, sorted(p.tables().items()))\n"
)


def run(code: str, cwd, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, check=True)


def test_setup_and_the_makefile_compile_the_modules_the_core_names():
    tree = ast.parse((ROOT / "setup.py").read_text())
    listed = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", "") == "COMPILED" for t in node.targets))
    assert ast.literal_eval(listed) == blockd.core.COMPILED
    makefile = re.search(r"^COMPILED := \$\(addprefix blockd/core/,(.*)\)$", (ROOT / "Makefile").read_text(), re.M)
    assert makefile is not None and tuple(n.removesuffix(".py") for n in makefile[1].split()) == blockd.core.COMPILED


def test_the_install_runs_the_compiled_core():
    if not COMPILED and os.environ.get("BLOCKD_EXPECT_COMPILED") != "1":
        pytest.skip(f"this install runs the core as {blockd.core.BUILD}; `make setup` compiles it where a C "
                    "compiler and Python's headers are present (BLOCKD_EXPECT_COMPILED=1 makes this a failure)")
    assert blockd.core.BUILD == "compiled"
    for name in blockd.core.COMPILED:
        module = sys.modules.get(f"blockd.core.{name}") or __import__(f"blockd.core.{name}", fromlist=["_"])
        assert module.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), module.__file__


def test_both_builds_give_the_same_answers():
    compiled = run(STEP, ROOT).stdout
    sources = run(STEP + "import blockd.core.decode as d; assert d.__file__.endswith('.py')", ROOT,
                  BLOCKD_PURE_PYTHON="1").stdout
    assert compiled == sources
    assert compiled.startswith("1 ")  # the step copied a's shared last block on write


@pytest.mark.skipif(not COMPILED, reason=f"the core runs as {blockd.core.BUILD}: there is no compiled build to edit")
def test_an_edited_source_runs_from_source_and_says_so(tmp_path):
    """A compiled module built before its source was edited would run the old
    code: blockd.core runs all of them from source instead, and warns."""
    shutil.copytree(ROOT / "blockd", tmp_path / "blockd", ignore=shutil.ignore_patterns("__pycache__"))
    for runtime in ROOT.glob("*__mypyc*"):  # the compiled modules' shared runtime, beside the package
        shutil.copy(runtime, tmp_path)
    with open(tmp_path / "blockd" / "core" / "decode.py", "a") as source:
        source.write("# edited after the build\n")
    code = ("import blockd.core, blockd.core.batch, blockd.core.decode\n"
            "print(blockd.core.BUILD)\n"
            "print(blockd.core.batch.__file__, blockd.core.decode.__file__)\n" + STEP)
    out = run(code, tmp_path, PYTHONPATH=str(tmp_path))
    build, files, answer = out.stdout.split("\n", 2)
    assert build == "python (decode.py changed since it was compiled; `make setup` compiles it again)"
    assert files.split() == [str(tmp_path / "blockd" / "core" / f) for f in ("batch.py", "decode.py")]
    assert "compiled core is stale" in out.stderr and "decode.py" in out.stderr
    assert answer == run(STEP, ROOT).stdout
    # the same tree with its source as built runs compiled
    shutil.copy(ROOT / "blockd" / "core" / "decode.py", tmp_path / "blockd" / "core" / "decode.py")
    assert run("import blockd.core; print(blockd.core.BUILD)", tmp_path, PYTHONPATH=str(tmp_path)).stdout == \
        "compiled\n"
    # a build whose record of its sources is damaged or gone cannot be vouched for: it runs from source
    record = tmp_path / "blockd" / "core" / "compiled_from.sha256"
    for damage in ("not a record\n", b"\xff\xfe", None):
        if damage is None:
            record.unlink()
        elif isinstance(damage, bytes):
            record.write_bytes(damage)
        else:
            record.write_text(damage)
        out = run("import blockd.core; print(blockd.core.BUILD)", tmp_path, PYTHONPATH=str(tmp_path))
        assert out.stdout == ("python (compiled_from.sha256 is missing or damaged, so the build cannot be matched "
                              "to its sources; `make setup` compiles it again)\n"), (damage, out.stdout)
        assert "compiled core is stale" in out.stderr
