"""``bench/tiers_vllm.py`` without vLLM: the workload it hands vLLM's process,
the rows it builds from that process's result, how a blockd row is set against
them, and the process's plumbing (the project's venv has no vLLM: its error
comes back as the row's)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench import tiers_vllm
from bench.tiers import conversations
from tests.conftest import ROOT


def _args(**changes):
    args = {"first_tokens": (40, 64), "question_tokens": (8, 16), "output_tokens": 8, "turns": 3,
            "device_blocks": 24, "max_seqs": 2, "max_batched_tokens": 128, "conversations": 3, "seed": 0,
            "vllm_python": None, "model": "tiny-llama", "arrivals": "closed"}
    args.update(changes)
    return SimpleNamespace(**args)


def _work(**changes):
    args = _args(**changes)
    starts, questions = conversations(args.conversations, args.seed, 1000, args.first_tokens, args.question_tokens)
    return tiers_vllm.workload(args, starts, questions, "/models/m", 1024), starts, questions


def test_the_workload_survives_json_and_holds_the_conversations():
    work, starts, questions = _work()
    assert json.loads(json.dumps(work)) == work
    assert work["starts"] == [list(s) for s in starts]
    assert work["questions"] == [[list(q) for q in qs[:3]] for qs in questions]
    # the same tokens of KV as blockd's pool, in vLLM's CPU blocks of 32
    assert work["vllm_num_blocks"] * work["vllm_block_size"] == 24 * 16
    assert work["max_model_len"] >= 64 + 8 + 2 * (16 + 8) and work["max_model_len"] % 16 == 0
    assert work["kv_offloading_gib"] == 16 * 24 * 1024 / (1 << 30)
    # the same arrivals as blockd's rows: at most --max-seqs in flight, or the round at once
    assert work["in_flight"] == 2 and _work(arrivals="backlog")[0]["in_flight"] == 0
    with pytest.raises(SystemExit, match="blocks of 32"):
        _work(device_blocks=25)


def _result(cached_later: int) -> dict:
    requests = [{"id": f"c{c}-t{turn}", "turn": turn, "prompt": [c, turn] * 10, "output": [c] * 4,
                 "prompt_tokens": 20, "num_cached_tokens": cached_later if turn else 0,
                 "ttft_ms": 100.0 * (turn + 1) + c, "tpot_ms": 10.0 + c}
                for turn in range(2) for c in range(2)]
    return {"version": "0.32.0", "versions": {"vllm": "0.32.0"}, "seconds": 2.0, "requests": requests,
            "num_gpu_blocks": 12, "kv_connector": None,
            "counters": {"vllm:prefix_cache_queries": 40, "vllm:prefix_cache_hits": 2 * cached_later}}


def test_a_row_from_the_engines_result():
    work, _, _ = _work()
    row = tiers_vllm.vllm_row(work, _result(16), "prefix_caching")
    assert row["engine"] == "vllm" and row["host_ratio"] == 0.0 and row["kv_offloading_size_gib"] is None
    assert row["hit_rate_later_turns"] == 0.8 == row["hit_rate_later_turns_from_counters"]
    assert row["ttft_p50_ms"] == 200.0 and row["ttft_p99_ms"] == 201.0 and row["tpot_p50_ms"] == 10.0
    assert row["tokens_per_s"] == 8.0 and row["kv_capacity_tokens"] == 12 * 32
    refused = tiers_vllm.vllm_row(work, {"error": "Exception: no"}, "kv_offloading")
    assert refused["error"] == "Exception: no" and refused["host_ratio"] == 16.0
    assert "hit_rate_later_turns" not in refused


def test_a_blockd_row_against_the_same_capacity():
    work, _, _ = _work()
    plain = _result(8)
    vllm = {"prefix_caching": (tiers_vllm.vllm_row(work, plain, "prefix_caching"), plain),
            "kv_offloading": (tiers_vllm.vllm_row(work, {"error": "no"}, "kv_offloading"), {"error": "no"})}
    ours = plain["requests"]
    requests = [SimpleNamespace(request_id=r["id"], prompt_token_ids=tuple(r["prompt"])) for r in ours]
    outputs = [SimpleNamespace(output_token_ids=[r["output"] if i else [9] * 4]) for i, r in enumerate(ours)]
    requests[3] = SimpleNamespace(request_id="c1-t1", prompt_token_ids=(5,))  # another prompt: not compared
    fields = tiers_vllm.against(vllm, {"host_ratio": 0.0, "hit_rate_later_turns": 0.6}, requests, outputs)
    assert fields["ratio_hit_rate_vs_vllm"] == 1.5 and fields["hit_rate_at_or_above_vllm"]
    assert fields["outputs_identical_to_vllm"] == "2/3" and fields["outputs_compared_with"] == "prefix_caching"
    tiered = tiers_vllm.against(vllm, {"host_ratio": 16.0, "hit_rate_later_turns": 0.9}, requests, outputs)
    assert tiered["vllm_row"] == "kv_offloading" and tiered["ratio_hit_rate_vs_vllm"] is None
    assert "hit_rate_at_or_above_vllm" not in tiered and tiered["outputs_compared_with"] == "prefix_caching"
    assert "vllm_row" not in tiers_vllm.against(vllm, {"host_ratio": 4.0, "hit_rate_later_turns": 0.9}, [], [])
    assert tiers_vllm.anchor(_args(), {}, conversations)({}, [], []) == {}


def test_the_engine_process_without_vllm_gives_its_error_as_the_result():
    work, _, _ = _work()
    result = tiers_vllm.run_engine(sys.executable, work, "prefix_caching", timeout_s=300)
    assert result["error"].startswith("ModuleNotFoundError") and "vllm" in result["error"]
    assert tiers_vllm.parse_result("log\n", 3, "a\nb\n") == {"error": "exit code 3", "log_tail": ["a", "b"]}
    out = subprocess.run([sys.executable, "bench/tiers_vllm.py", "x.json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 1 and "usage" in out.stderr


def test_a_model_vllm_cannot_load_is_refused():
    with pytest.raises(SystemExit, match="Hugging Face directory"):
        tiers_vllm.anchor(_args(vllm_python=sys.executable), {}, conversations)
