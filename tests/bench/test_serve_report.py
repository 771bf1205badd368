"""``bench/serve.py`` writes its run report: paging and max-length reservation side by side.

A cheap run as a user would start it (``--model tiny-llama --requests 12``):
a real local cluster, both schemes, the report in a temporary directory. What
the plots show, as a person sees them, is checked by tests/client/test_report.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from blockd.cluster.local import ROOT

pytest.importorskip("matplotlib", reason="the report extra (pip install -e '.[report]') draws the plots")


def test_serve_writes_a_report_of_both_schemes(tmp_path) -> None:
    directory = tmp_path / "serve-report"
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "bench/serve.py", "--model", "tiny-llama", "--requests", "12",
                           "--report", str(directory)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run report: {directory / 'report.html'}" in done.stderr
    page = (directory / "report.html").read_text(encoding="utf-8")
    ids = re.findall(r"<img class='plot' id='plot-(\w+)'", page)
    assert ids[0] == "comparison" and ids[-1] == "advisor"
    assert {"paging_blocks", "max_reservation_blocks", "paging_latency", "max_reservation_latency"} <= set(ids)
    assert all((directory / f"{key}.png").stat().st_size > 0 for key in ids)
    assert "paging runs" in page and "Recommended: block size" in page
