"""``bench/serve.py`` writes its run report: paging and max-length reservation side by side.

A cheap run as a user would start it (``--model tiny-llama --requests 12``):
a real local cluster, both schemes, the report in a temporary directory. What
the plots show, as a person sees them, is checked by tests/client/test_report.py.
"""

from __future__ import annotations

import json
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
    env.pop("BLOCKD_WORKER_COMPILE", None)  # the workers' default: --compile auto
    done = subprocess.run([sys.executable, "bench/serve.py", "--model", "tiny-llama", "--requests", "12",
                           "--report", str(directory)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run report: {directory / 'report.html'}" in done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    # each row says what the worker chose for its decode buckets, and on what times
    assert len(rows) == 2 and all(row["blockd_compile"] == "auto" for row in rows)
    assert re.match(r"compiled decode forward warmed in [\d.]+ s: 16 rows: (eager|onednn|mkl) \(eager [\d.]+ ms",
                    rows[0]["blockd_compile_warm"]), rows[0]["blockd_compile_warm"]
    # and how greedy steps pick tokens (--greedy-head auto: timed at start)
    assert re.search(r" \| greedy tokens: (bfloat16 screen|float32 LM head) .* at 64 rows\), chosen in [\d.]+ s",
                     rows[0]["blockd_compile_warm"]), rows[0]["blockd_compile_warm"]
    page = (directory / "report.html").read_text(encoding="utf-8")
    ids = re.findall(r"<img class='plot' id='plot-(\w+)'", page)
    assert ids[0] == "comparison" and ids[-1] == "advisor"
    assert {"paging_blocks", "max_reservation_blocks", "paging_latency", "max_reservation_latency"} <= set(ids)
    assert all((directory / f"{key}.png").stat().st_size > 0 for key in ids)
    assert "paging runs" in page and "Recommended: block size" in page
