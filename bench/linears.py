"""The decoder's linear layers on the CPU, kernel against kernel (issue 31: where
a decode step's forward time goes).

    .venv/bin/python bench/linears.py                        # blockd's kernels
    .venv/bin/python bench/linears.py --vllm-python V/bin/python   # and vLLM's onednn_mm, same run

One JSON line per kernel and row count (``name: linears``): the time of one
decode step's projections of SmolLM2-135M in float32 (each layer's q/k/v as
one, o, gate/up as one and down, times the layers, plus the LM head), the best
of three timed loops on the same random tensors, and the ratio against
blockd's own kernel. ``model_step_ms`` is the same step as a model runs it:
every layer with weights of its own, one layer after the other, so the weights
come from memory rather than the cache a single layer's loop keeps them in
(``--quick`` leaves it out). Kernels:

* ``blockd_packed``: :class:`worker.model.linear.PackedLinear` (oneDNN, the
  weight reordered once; ``--cpu-linear auto``, the default: oneDNN's matmul
  primitive where its wheel is installed, else torch's inner product);
* ``blockd_inner_product``: the same on torch's oneDNN inner product
  (``--cpu-linear inner-product``), where the default is the matmul;
* ``torch_linear``: ``nn.Linear`` (MKL's ``sgemm``, ``--cpu-linear torch``);
* ``mkl_packed``: MKL's packed GEMM (``torch.ops.mkl._mkl_linear``), packed
  for exactly the row count timed: it falls back to ``sgemm`` at any other
  count, so it fits a decode batch only padded to a bucket, with a packed
  copy of every weight per bucket;
* ``vllm_onednn_mm`` (with ``--vllm-python``, run in that interpreter): vLLM's
  CPU linear (``create_onednn_mm``/``onednn_mm``).

Imports torch only (and vLLM where it runs); the shapes are SmolLM2-135M's
(:data:`SHAPES`, checked against its config by tests/bench/test_linears.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: SmolLM2-135M: (in, out) of each layer's fused projections, and the LM head
SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = (576, 49152)
NUM_LAYERS = 30
ROWS = (4, 64)


def _best_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - began) / reps * 1e6)
    return best


def kernels(vllm: bool) -> dict:
    """name -> make(weight [out, in], rows) -> forward(x)."""
    import torch
    from torch import nn

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from worker.model.linear import matmul_available, pack

    def blockd_packed(weight, rows, matmul=None):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        layer.weight.data.copy_(weight)
        return pack(layer, matmul)

    def mkl_packed(weight, rows):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)

    found = {"blockd_packed": blockd_packed,
             "torch_linear": lambda weight, rows: (lambda x: torch.nn.functional.linear(x, weight))}
    if matmul_available():
        found["blockd_inner_product"] = lambda weight, rows: blockd_packed(weight, rows, matmul=False)
    if torch._C.has_mkl:
        found["mkl_packed"] = mkl_packed
    if vllm:
        from vllm import _custom_ops as ops

        def vllm_onednn_mm(weight, rows):
            handler = ops.create_onednn_mm(weight.t(), 32)
            return lambda x: ops.onednn_mm(handler, x, None)
        found["vllm_onednn_mm"] = vllm_onednn_mm
    return found


def measure(threads: int, vllm: bool = False, reps: int = 200, model_step: bool = True) -> list[dict]:
    """Each kernel's step time at each row count of :data:`ROWS` (``reps`` calls a timed
    loop; a tenth of them for the LM head), and with ``model_step`` its ``model_step_ms``."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    weights = {name: torch.randn(out, k) for name, (k, out) in {**SHAPES, "lm_head": LM_HEAD}.items()}
    rows_out = []
    for rows in ROWS:
        inputs = {name: torch.randn(rows, w.shape[1]) for name, w in weights.items()}
        reference = {name: torch.nn.functional.linear(inputs[name], w) for name, w in weights.items()}
        for kernel, make in kernels(vllm).items():
            parts, diff = {}, 0.0
            for name, weight in weights.items():
                forward, x = make(weight, rows), inputs[name]
                diff = max(diff, (forward(x) - reference[name]).abs().max().item())
                loops = max(1, reps // 10) if name == "lm_head" else reps
                parts[name] = _best_us(lambda forward=forward, x=x: forward(x), loops)
            layers_us = sum(parts[name] for name in SHAPES) * NUM_LAYERS
            row = {"name": "linears", "kernel": kernel, "rows": rows, "threads": threads,
                   "step_ms": round((layers_us + parts["lm_head"]) / 1e3, 2),
                   "layers_ms": round(layers_us / 1e3, 2), "lm_head_ms": round(parts["lm_head"] / 1e3, 2),
                   "us_per_call": {k: round(v, 1) for k, v in parts.items()},
                   "max_abs_diff_vs_torch": diff, "torch": torch.__version__}
            if model_step:
                row["model_step_ms"] = round(_model_step_us(make, weights, inputs, rows) / 1e3, 2)
            rows_out.append(row)
    for row in rows_out:
        base = next(r for r in rows_out if r["rows"] == row["rows"] and r["kernel"] == "blockd_packed")
        row["ratio_vs_blockd_packed"] = round(row["step_ms"] / base["step_ms"], 3)
        if model_step:
            row["model_step_ratio_vs_blockd_packed"] = round(row["model_step_ms"] / base["model_step_ms"], 3)
    return rows_out


def _model_step_us(make, weights: dict, inputs: dict, rows: int, loops: int = 10) -> float:
    """One decode step's projections as a model runs them: NUM_LAYERS layers, each
    with weights of its own (copies of ``weights``' scaled apart), then the LM head."""
    steps = [make(weights[name] * (1 + layer / NUM_LAYERS), rows)
             for layer in range(NUM_LAYERS) for name in SHAPES]
    steps.append(make(weights["lm_head"], rows))
    xs = [inputs[name] for _ in range(NUM_LAYERS) for name in SHAPES] + [inputs["lm_head"]]

    def step() -> None:
        for forward, x in zip(steps, xs):
            forward(x)
    return _best_us(step, loops)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all)")
    parser.add_argument("--vllm-python", default=None, help="a vLLM venv's python: run there, adding vLLM's kernel")
    parser.add_argument("--quick", action="store_true", help="10 calls a timed loop (a smoke run)")
    parser.add_argument("--in-vllm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.vllm_python:
        try:
            done = subprocess.run([args.vllm_python, os.path.abspath(__file__), "--in-vllm", "--threads",
                                   str(args.threads), *(["--quick"] if args.quick else [])],
                                  capture_output=True, text=True, check=False)
        except OSError as err:
            print(f"bench/linears.py: cannot run {args.vllm_python}: {err}", file=sys.stderr)
            return 1
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(f"bench/linears.py: {args.vllm_python} failed: {done.stderr.strip()[-600:]}", file=sys.stderr)
            return 1
        print("\n".join(lines), flush=True)
        return 0
    for row in measure(args.threads, vllm=args.in_vllm, reps=10 if args.quick else 200, model_step=not args.quick):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
