"""``bench/tiers.py --quick`` as a user runs it: one JSON row per host-tier
size, the tier raising the later turns' hit rate, then the pool rows (one
pool holding all conversations, two pools without and with sharing: sharing
raises the hit rate to near one pool's), outputs equal to transformers' in
every row, its run report written, and bad arguments a usage error."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from tests.conftest import ROOT


def test_the_tier_rows_run_and_the_tier_raises_the_hit_rate_with_exact_outputs(tmp_path):
    report = tmp_path / "report"
    out = subprocess.run([sys.executable, "bench/tiers.py", "--quick", "--ratios", "0,4", "--verify", "4",
                          "--report", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    if importlib.util.find_spec("matplotlib") is not None:  # the host-tier rows' run report
        assert f"run report: {report / 'report.html'}" in out.stderr
        assert (report / "no_host_tier_blocks.png").exists() and (report / "host_96_blocks_blocks.png").exists()
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["host_ratio"] for r in rows[:2]] == [0.0, 4.0]
    plain, tiered, one, apart, shared = rows
    # closed-loop clients by default: each pool's client keeps --max-seqs requests in flight
    assert plain["concurrency"]["arrivals"] == "closed" and plain["concurrency"]["in_flight_per_pool"] == 2
    assert plain["restores"] == plain["offloads"] == 0
    assert tiered["restores"] > 0 and tiered["hit_rate_later_turns"] > plain["hit_rate_later_turns"]
    assert tiered["prompt_tokens_computed"] < plain["prompt_tokens_computed"]
    assert all(r["outputs_match_reference"] and r["verified_requests"] == 4 for r in rows)
    assert tiered["ratio_hit_rate_vs_no_tier"] > 1 and tiered["restore_ms_per_block"] is not None
    # two pools: sharing fetches the other pool's prefixes and comes close to one pool holding all
    assert (one["pools"], apart["pools"], shared["pools"]) == (1, 2, 2) and shared["sharing"]
    assert apart["transferred_blocks"] == 0 and shared["transferred_blocks"] > 0, shared
    assert shared["failed_transfers"] == 0 and shared["fetch_ms_per_block"] is not None
    assert shared["hit_rate_later_turns"] > apart["hit_rate_later_turns"], (apart, shared)
    assert shared["ratio_hit_rate_vs_one_pool"] >= 0.95, shared
    assert apart["outputs_match_reference"] and shared["outputs_match_reference"]


def test_bad_arguments_are_a_usage_error():
    for bad in (["--ratios", "4,16"], ["--turns", "1"], ["--arrivals", "poisson"]):
        out = subprocess.run([sys.executable, "bench/tiers.py", *bad], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
