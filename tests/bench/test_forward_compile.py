"""``bench/forward_compile.py``: every mode timed at each row count, the compiled
modes computing blockd's fused layers' function (to float32 rounding) and
paying their compile on the first call, and bad arguments a usage error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _run(*args: str, cache: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"TORCHINDUCTOR_CACHE_DIR": cache} if cache else {})}  # Inductor's files in the test's dir
    return subprocess.run([sys.executable, "bench/forward_compile.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, check=False, env=env)


def test_every_mode_is_timed_at_each_row_count_and_computes_the_fused_layers_function(tmp_path):
    pytest.importorskip("torch")
    out = _run("--layers", "2", "--rows", "4,7", "--quick", "--threads", "1", cache=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert sorted((r["mode"], r["rows"]) for r in rows) == sorted(
        (m, n) for m in ("blockd_fused", "torch_eager", "inductor", "inductor_dynamic", "inductor_onednn")
        for n in (4, 7))
    for row in rows:
        assert row["name"] == "forward_compile" and row["step_ms"] > 0 and row["layers"] == 2
        # the same function summed in another order: far below the outputs' own size
        assert row["max_abs_diff_vs_blockd_fused"] < 1e-4 * max(1.0, row["out_abs_max"]), row
        if row["mode"] == "blockd_fused":
            assert row["ratio_vs_blockd_fused"] == 1.0
    for mode in ("inductor", "inductor_dynamic", "inductor_onednn"):
        first = next(r for r in rows if r["mode"] == mode and r["rows"] == 4)
        # tracing, Inductor's code generation and its C++ build: far more than a step
        assert first["first_call_s"] > 10 * first["step_ms"] / 1e3, first


@pytest.mark.parametrize("args", [["--modes", "fast"], ["--rows", "0"], ["--rows", "four"], ["--layers", "0"]])
def test_bad_arguments_are_a_usage_error(args):
    out = _run(*args, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stdout == "", out.stderr
