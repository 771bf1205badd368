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
