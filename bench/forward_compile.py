"""The decoder's layer math compiled against blockd's fused eager layers (issue
31: what a compiled forward would win on the CPU, and what its compile costs).

    .venv/bin/python bench/forward_compile.py                 # 4 and 64 rows, every mode
    .venv/bin/python bench/forward_compile.py --rows 64 --modes blockd_fused,inductor

One JSON line per mode and row count (``name: forward_compile``): the median
time of one decode step through SmolLM2-135M's decoder layers in float32, the
first call's time (for the compiled modes: tracing, Inductor's compile and C++
build, oneDNN/MKL packing), the ratio against blockd's own layers, and the
largest difference from their output. Modes:

* ``blockd_fused`` (the baseline): what a worker runs by default,
  :class:`worker.model.linear.PackedLinear` projections (q/k/v and gate/up
  joined) and the compiled layer ops of :mod:`worker.model.fused`, eager;
* ``torch_eager``: the same math in plain torch ops and ``nn.Linear``
  (``--cpu-linear torch`` with unfused ops);
* ``inductor``: that plain-torch math through ``torch.compile`` (Inductor,
  ``freezing`` on, so weights are constants it may pack), one graph per row
  count: the shape buckets a compiled worker would warm at start;
* ``inductor_dynamic``: the same with the row count symbolic
  (``dynamic=True``): one compile meant to serve every batch size; its
  ``first_call_s`` at the second row count says whether it really did;
* ``inductor_onednn``: one layer compiled as ``--compile onednn`` runs it
  (:mod:`worker.model.compiled`): blockd's oneDNN-packed weights as
  arguments through the opaque ``blockd::onednn_linear``, shared by the
  layers, one graph per row count. Where MKL's GEMM is slow (AMD's Zen),
  this is the graph a worker's ``--compile auto`` can still keep.

Attention is not timed: it is an opaque op in any compiled graph (a
``torch.library`` custom op), so each layer's stand-in is the same cheap
function of q, k and v in every mode. Imports torch and :mod:`worker.model`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.linears import NUM_LAYERS, SHAPES
from blockd import config_env

MODES = ("blockd_fused", "torch_eager", "inductor", "inductor_dynamic", "inductor_onednn")
#: SmolLM2-135M's attention heads (query, key/value) and head dimension: SHAPES' q/k/v split
HEADS, HEAD_DIM = (9, 3), 64
EPS = 1e-5


def _stand_in(q, k, v):
    """Each layer's attention stand-in: cheap, and reading q, k and v so that no mode drops their work."""
    return q + k.mean(1, keepdim=True) + v.mean(1, keepdim=True)


def _layers(num_layers: int):
    """Random float32 weights of ``num_layers`` decoder layers, SmolLM2-135M's shapes."""
    import torch
    from torch import nn

    def linear(shape):
        inp, out = shape
        layer = nn.Linear(inp, out, bias=False)
        layer.requires_grad_(False)
        return layer

    return [{"qkv": linear(SHAPES["qkv"]), "o": linear(SHAPES["o_proj"]), "gate_up": linear(SHAPES["gate_up"]),
             "down": linear(SHAPES["down"]), "norm1": torch.rand(SHAPES["qkv"][0]) + 0.5,
             "norm2": torch.rand(SHAPES["qkv"][0]) + 0.5} for _ in range(num_layers)]


def _layer(x, cos, sin, weights: dict, ops, project):
    """One decoder layer (attention by :func:`_stand_in`) through ``ops`` (the fused
    module's op table) with ``project(name, x)`` for its projections."""
    h = ops.rms_norm(x, weights["norm1"], EPS)
    q, k, v = ops.rotary(project("qkv", h), cos, sin, *HEADS)
    out = _stand_in(q, k, v).reshape(x.shape[0], -1)
    x, h = ops.add_rms_norm(project("o", out), x, weights["norm2"], EPS)
    return ops.add(x, project("down", ops.silu_mul(project("gate_up", h))))


def forwards(num_layers: int, modes: tuple[str, ...]) -> dict:
    """mode -> forward(x, cos, sin), over the same weights."""
    import copy

    import torch
    from torch import nn

    from worker.model.fused import _TorchOps, layer_ops
    from worker.model.linear import pack

    layers = _layers(num_layers)
    found = {}
    packed = [{**w, **{k: pack(copy.deepcopy(w[k])) for k in ("qkv", "o", "gate_up", "down")}} for w in layers]
    if "blockd_fused" in modes:
        ops = layer_ops()

        def fused(x, cos, sin):
            for w in packed:
                x = _layer(x, cos, sin, w, ops, lambda name, h, w=w: w[name](h))
            return x
        found["blockd_fused"] = fused

    class Plain(nn.Module):
        """The layers as one module, so that ``freezing`` sees the weights as parameters."""

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.ModuleDict({k: w[k] for k in ("qkv", "o", "gate_up", "down")})
                                        for w in layers)
            for i, w in enumerate(layers):
                self.register_buffer(f"norm1_{i}", w["norm1"])
                self.register_buffer(f"norm2_{i}", w["norm2"])

        def forward(self, x, cos, sin):
            for i, block in enumerate(self.blocks):
                weights = {"norm1": getattr(self, f"norm1_{i}"), "norm2": getattr(self, f"norm2_{i}")}
                x = _layer(x, cos, sin, weights, _TorchOps, lambda name, h, block=block: block[name](h))
            return x

    plain = Plain().eval()
    if "torch_eager" in modes:
        found["torch_eager"] = plain
    if {"inductor", "inductor_dynamic"} & set(modes):
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights are constants: Inductor may pack them for its GEMMs
    if "inductor" in modes:
        found["inductor"] = torch.compile(plain, dynamic=False)
    if "inductor_dynamic" in modes:
        found["inductor_dynamic"] = torch.compile(plain, dynamic=True)
    if "inductor_onednn" in modes:
        found["inductor_onednn"] = _onednn_graph(packed)
    return found


def _onednn_graph(packed: list[dict]):
    """The ``inductor_onednn`` forward: one compiled layer, the packed weights its arguments."""
    import torch

    from worker.model.compiled import onednn_linear
    from worker.model.fused import _TorchOps

    def one(x, cos, sin, norm1, norm2, linears):
        def project(name, h):
            return onednn_linear(h, *linears[name])
        return _layer(x, cos, sin, {"norm1": norm1, "norm2": norm2}, _TorchOps, project)

    graph = torch.compile(one, dynamic=False)
    args = [(w["norm1"], w["norm2"], {k: (w[k]._packed, None, w[k].out_features)
                                      for k in ("qkv", "o", "gate_up", "down")}) for w in packed]

    def forward(x, cos, sin):
        for norm1, norm2, linears in args:
            x = graph(x, cos, sin, norm1, norm2, linears)
        return x
    return forward


def measure(rows_list: tuple[int, ...], modes: tuple[str, ...], num_layers: int, threads: int,
            reps: int) -> list[dict]:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    found = forwards(num_layers, modes)
    rows_out = []
    with torch.no_grad():
        for rows in rows_list:
            x = torch.randn(rows, SHAPES["qkv"][0])
            cos, sin = torch.randn(rows, HEAD_DIM), torch.randn(rows, HEAD_DIM)
            outputs = {}
            for mode, forward in found.items():
                began = time.perf_counter()
                outputs[mode] = forward(x, cos, sin)
                first = time.perf_counter() - began
                for _ in range(3):
                    forward(x, cos, sin)
                times = []
                for _ in range(reps):
                    began = time.perf_counter()
                    forward(x, cos, sin)
                    times.append(time.perf_counter() - began)
                rows_out.append({"name": "forward_compile", "mode": mode, "rows": rows, "layers": num_layers,
                                 "threads": threads, "step_ms": round(statistics.median(times) * 1e3, 3),
                                 "first_call_s": round(first, 3), "loadavg_1m": round(os.getloadavg()[0], 2),
                                 "torch": torch.__version__})
            base = outputs[modes[0]]
            for row in rows_out[-len(found):]:
                diff = (outputs[row["mode"]] - base).abs().max().item()
                row[f"max_abs_diff_vs_{modes[0]}"] = diff
                row["out_abs_max"] = round(base.abs().max().item(), 3)
    for row in rows_out:
        first = next(r for r in rows_out if r["rows"] == row["rows"] and r["mode"] == modes[0])
        row[f"ratio_vs_{modes[0]}"] = round(row["step_ms"] / first["step_ms"], 3)
    return rows_out


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes are a comma-separated list of {', '.join(MODES)}")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=config_env.positive_int_list, default=(4, 64),
                        help="decode batch sizes (default 4,64)")
    parser.add_argument("--modes", type=_modes, default=MODES,
                        help=f"the first is the baseline of the ratios (default {','.join(MODES)})")
    parser.add_argument("--layers", type=int, default=NUM_LAYERS, help=f"decoder layers (default {NUM_LAYERS})")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all)")
    parser.add_argument("--quick", action="store_true", help="5 timed calls instead of 40 (a smoke run)")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.layers < 1:
        parser.error("--threads and --layers must be at least 1")
    for row in measure(args.rows, args.modes, args.layers, args.threads, 5 if args.quick else 40):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
