"""bench/core.py's same-run comparison against a git revision runs and reports."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.skipif(shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")),
                    reason="needs git and a git checkout")
def test_decode_step_against_a_revision():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "core.py"), "--against", "HEAD",
                          "--quick", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=300)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["name"] for r in lines] == ["decode_step_vs_rev"]
    result = lines[0]
    assert result["rev"] == "HEAD" and result["us_per_step"] > 0 and result["rev_us_per_step"] > 0
    assert result["ratio_vs_rev"] > 0 and len(result["ratios"]) == 2  # rounds are made even
    assert result["build"].startswith("python")  # the revision runs from source, so this tree does too


def test_the_build_row_times_the_install_against_its_sources():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "core.py"), "--quick"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=300)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["name"] for r in rows] == ["decode_step"] * 2 + ["prefill_alloc"] + ["pool_scaling"] * 2 + [
        "decode_step_build"]
    import blockd.core

    assert {r["build"] for r in rows} == {blockd.core.BUILD}
    build = rows[-1]
    # each child says which build it ran: the install's, and the sources
    assert build["child_builds"][0] == blockd.core.BUILD and build["child_builds"][1].startswith("python")
    assert build["cpu_us_per_step"] > 0 and build["python_cpu_us_per_step"] > 0 and build["rounds"] == 2
    assert build["compiled_modules"] == (list(blockd.core.COMPILED) if blockd.core.BUILD == "compiled" else [])
