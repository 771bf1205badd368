"""A decode step's forward through compiled code (Inductor), one graph per
batch-size bucket, on the CPU.

Why: blockd's fused eager layers (:mod:`worker.model.fused`) pay a fixed cost
per op, run their elementwise work as separate passes, and use oneDNN's
kernel, which serves any row count. MKL's GEMM with the weight packed for
exactly the row count is faster (0.17 ms for SmolLM2's 64x576 by 576x960
q/k/v projection where oneDNN takes 0.29), and Inductor fuses the rest.
``bench/forward_compile.py`` measured a graph per row count at 0.67x of the
fused eager layers' time at 64 rows (0.74-0.84x at 4-256); a single graph
with a symbolic row count, which must keep a shape-generic GEMM, 0.82-0.88x
and 1.06x at 4 rows, so it was not kept.

That was an Intel CPU. On an AMD EPYC (Zen, AVX-512) MKL's packed GEMM
is slower than oneDNN's (1.47 against 1.03 ms for the 64-row gate/up
projection) and the same graph took 1.26x the eager time. So which code a
bucket runs is measured, not assumed: :meth:`CompiledDecode.warm` times, at
each bucket's row count and over no pool, the eager forward, the graph with
oneDNN's GEMM on the weights the eager layers already hold packed (no
memory added) and the graph with MKL's (a packed copy per bucket, tried
only while the copies fit :data:`MKL_MEMORY_SHARE` of the memory the host
has available), and keeps the fastest; a graph must beat eager by
:data:`MARGIN` to be kept. ``kernel="onednn"`` or ``"mkl"`` forces that
graph in every bucket, unmeasured.

So a decode step (one new token per sequence) of ``n`` sequences runs at
the smallest bucket that holds it, if that bucket kept a graph and has at
most ``2n`` rows, its rows padded (token 0 at position 0; their logits are
dropped and their K/V never written). Every other step, prefill and mixed
steps among them, runs eager.

What is compiled: one decoder layer (:func:`_layer`, the fused layers' own
torch math), with its weights as arguments, so the 30 layers of a model
share one graph per bucket: compiling every layer as one frozen graph took
about 20 s a bucket on two cores, this about 1 s, for the same step time
(SmolLM2-135M, 64 rows: 74-85 ms against 83-84, eager 101-114). The
projections are opaque to the compiler: :func:`packed_linear`, MKL's GEMM
on a weight packed per bucket (:meth:`CompiledDecode._pack`; SmolLM2-135M in
float32: 0.56-0.71 GB a bucket), or :func:`onednn_linear` on the eager
layers' own packed weights. The embedding lookup, the rotary tables,
the final norm and the LM head (the same packed GEMM) run eager around it.
:meth:`CompiledDecode.warm` packs and compiles every bucket before the
worker serves, so no step compiles.

Paged attention, with its ``write_kv``, is one opaque op, ``blockd::paged_attend``
(:func:`torch.library.custom_op`): the compiler fuses around it and never
looks inside. Its arguments are tensors and constants only (the layer index
a 0-d tensor, so that layers share the graph), so the step's batch (a
:class:`~worker.model.paged.PagedBatch` of Python objects) reaches it through
:data:`_BATCHES`, keyed by the runner, set for the one forward the runner's
lock lets run at a time (:data:`~worker.model.paged.NO_POOL` while
:meth:`CompiledDecode.warm` runs the graph). It declares no mutated arguments: the KV pool it
writes is not an argument, and each layer reads only what it has just
written, after its own inputs, so data dependencies order it. Imports torch
and :mod:`worker.model.fused`, :mod:`worker.model.paged`.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from worker.model.fused import FusedLayer, FusedNorm, add_rms_norm_torch, rms_norm_torch, rotary_torch, silu_mul_torch
from worker.model.linear import PackedLinear, packed_matmul
from worker.model.paged import NO_POOL, PagedBatch, attend

__all__ = ["DECODER_MODELS", "KERNELS", "CompiledDecode", "compilable", "median_ms"]
#: the model classes whose forward is embed -> decoder layers -> norm -> LM head and nothing else
DECODER_MODELS = ("LlamaForCausalLM", "Qwen2ForCausalLM")
#: what a bucket may run: ``auto`` measures ``eager`` and both graphs at warm-up and keeps the fastest
KERNELS = ("auto", "onednn", "mkl")
#: a graph is kept for a bucket only when it takes at most this share of the eager forward's time
#: (within the timing's noise, eager: no padding, no compiled code to trust)
MARGIN = 0.97
#: MKL's packed copies (one per bucket) may take at most this share of the host's available memory
MKL_MEMORY_SHARE = 0.25
#: resident bytes of a bucket's MKL copies per byte of weights: MKL pads its packed panels
#: (SmolLM2-135M, 0.54 GB of weights: the worker's RSS grew 0.71 GB a bucket on an AMD EPYC,
#: 0.56 on an Intel VM)
MKL_PACK_OVERHEAD = 1.35
#: timed runs per candidate and bucket at warm-up (their median counts), after one untimed run
TIMED_RUNS = 3

#: runner key -> the batch of the forward running now (see the module docstring)
_BATCHES: dict[int, object] = {}
_KEYS = itertools.count(1)
_KEYS_LOCK = threading.Lock()


@torch.library.custom_op("blockd::paged_attend", mutates_args=())
def paged_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, scale: float,
                 runner: int) -> torch.Tensor:
    """One layer's ``write_kv`` and paged attention over the running batch of ``runner``
    (``query`` ``[T, Hq, D]``, ``key``, ``value`` ``[T, Hkv, D]``; ``layer``: a 0-d
    tensor, so that every layer shares one graph); returns ``[T, Hq, D]``."""
    batch = _BATCHES.get(runner)
    if batch is NO_POOL:  # warm-up: the graph's shapes and times, no pool touched
        return torch.zeros_like(query)
    if not isinstance(batch, PagedBatch):
        raise RuntimeError("blockd::paged_attend runs only inside CompiledDecode.forward")
    rows, index = len(batch.seq_ids), int(layer)  # a decode step: a row per sequence; the rest is padding
    if rows == query.shape[0]:
        return attend(batch, index, query, key, value, scale)
    out = query.new_zeros(query.shape)
    out[:rows] = attend(batch, index, query[:rows].contiguous(), key[:rows].contiguous(), value[:rows].contiguous(),
                        scale)
    return out


@paged_attend.register_fake
def _paged_attend_shape(query, key, value, layer, scale, runner):
    return torch.empty_like(query)


@torch.library.custom_op("blockd::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` by MKL's GEMM on ``packed`` (``weight`` packed for
    exactly ``x``'s row count: at any other count MKL falls back to plain sgemm).
    Opaque to the compiler: Inductor lowers ``mkl._mkl_linear`` only for packed
    weights that are graph constants, and here they are inputs."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


@packed_linear.register_fake
def _packed_linear_shape(x, packed, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("blockd::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN on ``packed``, the weight a
    :class:`~worker.model.linear.PackedLinear` holds (the eager layers' own kernel,
    any row count; its matmul or inner product), opaque to the compiler as :func:`packed_linear` is."""
    return packed_matmul(x, packed, bias, out_features)


@onednn_linear.register_fake
def _onednn_linear_shape(x, packed, bias, out_features):
    return x.new_empty((x.shape[0], out_features))


def compilable(model: nn.Module, tp) -> str | None:
    """Why ``model`` cannot run compiled here (None: it can): the CPU, no
    tensor parallelism (its all-reduce hooks run eager), every decoder layer fused."""
    if tp is not None:
        return "tensor parallelism runs eager"
    if type(model).__name__ not in DECODER_MODELS:
        return f"{type(model).__name__} is not one of {', '.join(DECODER_MODELS)}"
    if next(model.parameters()).device.type != "cpu":
        return "the compiled forward is the CPU path (CUDA graphs are not built yet)"
    layers = model.model.layers
    if not all(isinstance(layer, FusedLayer) for layer in layers) or not isinstance(model.model.norm, FusedNorm) \
            or not isinstance(model.lm_head, PackedLinear):
        return "not every decoder layer is fused (packed linears, --cpu-linear auto)"
    return None


def available_memory() -> int:
    """Bytes the host can give without swapping (``MemAvailable``; free pages where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _project(h: torch.Tensor, linear: tuple, kernel: str) -> torch.Tensor:
    if kernel == "mkl":
        return packed_linear(h, *linear)  # (packed for this bucket, weight, bias)
    return onednn_linear(h, *linear)  # (the eager layer's packed weight, bias, out_features)


def _layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: torch.Tensor, norms: tuple,
           linears: tuple, eps: tuple[float, float], heads: tuple[int, int], scale: float,
           runner: int, kernel: str) -> torch.Tensor:
    """One fused decoder layer in torch math (:mod:`worker.model.fused`'s ops), its
    weights as arguments; ``linears``: q/k/v, o, gate/up, down, each as ``kernel`` takes it."""
    qkv, o, gate_up, down = linears
    h = rms_norm_torch(x, norms[0], eps[0])
    q, k, v = rotary_torch(_project(h, qkv, kernel), cos, sin, *heads)
    out = paged_attend(q, k, v, layer, scale, runner)
    x, h = add_rms_norm_torch(_project(out.reshape(x.shape[0], -1), o, kernel), x, norms[1], eps[1])
    return x + _project(silu_mul_torch(_project(h, gate_up, kernel)), down, kernel)


class CompiledDecode:
    """The compiled decode forward of one runner's model (see the module docstring)."""

    def __init__(self, model: nn.Module, buckets: tuple[int, ...], kernel: str = "auto") -> None:
        import torch._dynamo.config as dynamo_config

        if not buckets or min(buckets) < 1:
            raise ValueError(f"compile buckets must be row counts >= 1, got {list(buckets)}")
        if kernel not in KERNELS:
            raise ValueError(f"compile kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if kernel == "mkl" and not torch._C.has_mkl:
            raise ValueError("compile kernel 'mkl' needs a torch built with MKL")
        # a graph per bucket and GEMM of the same layer function: past this limit dynamo would run it eager
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 2 * len(buckets) + 1)
        with _KEYS_LOCK:
            self.key = next(_KEYS)
        self.model = model
        self.kernel = kernel
        self.buckets = tuple(sorted(set(buckets)))
        inner = model.model
        first = inner.layers[0]
        self._heads, self._scale = first._heads, float(first.self_attn.scaling)
        self._layers = [(torch.tensor(layer.self_attn.layer_idx),
                         (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()),
                         (layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon),
                         (layer._qkv, layer.self_attn.o_proj, layer._gate_up, layer.mlp.down_proj))
                        for layer in inner.layers]
        #: bucket -> each layer's four (packed, weight, bias), and the LM head's
        self._packed: dict[int, tuple[list[tuple], tuple]] = {}
        self._onednn = ([tuple((lin._packed, lin.bias, lin.out_features) for lin in linears)
                         for *_, linears in self._layers],
                        (model.lm_head._packed, model.lm_head.bias, model.lm_head.out_features))
        self._compiled = torch.compile(_layer, dynamic=False)
        #: bucket -> what its steps run (``eager``, ``onednn``, ``mkl``); set by :meth:`warm`
        self.kernels: dict[int, str] = {}
        #: bucket -> candidate -> its median warm-up time in ms (measured buckets only)
        self.timings: dict[int, dict[str, float]] = {}
        self.warm_s: float | None = None

    def bucket(self, rows: int) -> int | None:
        """The bucket a decode step of ``rows`` sequences runs at (None: eager): the
        smallest that holds it, if it kept a graph and pads at most to twice the rows."""
        bucket = next((b for b in self.buckets if b >= rows), None)
        if bucket is None or bucket > 2 * rows or self.kernels.get(bucket, "eager") == "eager":
            return None
        return bucket

    def applies(self, query_lens: list[int]) -> bool:
        """Whether a step of these query lengths runs compiled (see :meth:`bucket`)."""
        return all(q == 1 for q in query_lens) and self.bucket(len(query_lens)) is not None

    def forward(self, batch: PagedBatch, token_ids: torch.Tensor, positions: torch.Tensor, *,
                hidden: bool = False) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of a decode step (one token per sequence); ``hidden``:
        the final hidden states ``[rows, hidden]`` instead (the LM head left to the caller)."""
        rows = token_ids.shape[0]
        bucket = self.bucket(rows)
        if bucket is None:
            raise ValueError(f"a decode step of {rows} sequences has no compiled bucket (applies() says so)")
        return self._run(batch, token_ids, positions, bucket, self.kernels[bucket], hidden)

    def _pack(self, bucket: int) -> tuple[list[tuple], tuple]:
        """Every projection's weight packed by MKL for ``bucket`` rows (once per bucket)."""
        if bucket not in self._packed:
            def pack(linear: nn.Linear) -> tuple:
                weight = linear.weight.detach()
                bias = None if linear.bias is None else linear.bias.detach()
                return torch.ops.mkl._mkl_reorder_linear_weight(weight, bucket), weight, bias

            with torch.inference_mode():
                layers = [tuple(pack(linear) for linear in linears) for *_, linears in self._layers]
                self._packed[bucket] = (layers, pack(self.model.lm_head))
        return self._packed[bucket]

    def _mkl_bytes(self) -> int:
        """What one bucket's MKL copies hold: the projections' and the LM head's weights
        times :data:`MKL_PACK_OVERHEAD`."""
        linears = [lin for *_, four in self._layers for lin in four] + [self.model.lm_head]
        return int(MKL_PACK_OVERHEAD * sum(lin.weight.numel() * lin.weight.element_size() for lin in linears))

    def _mkl_gemm_wins(self, rows: int) -> bool:
        """Whether MKL's packed GEMM beats oneDNN's on the largest projection at ``rows``
        rows: where it does not (AMD's Zen), packing and compiling its graph is skipped."""
        linear = self._layers[0][3][2]  # gate/up
        x = torch.randn(rows, linear.in_features)
        with torch.inference_mode():
            packed = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), rows)
            mkl = median_ms(partial(torch.ops.mkl._mkl_linear, x, packed, linear.weight.detach(), None, rows))
            onednn = median_ms(partial(onednn_linear, x, linear._packed, None, linear.out_features))
        return mkl <= onednn

    def _run(self, batch: object, token_ids: torch.Tensor, positions: torch.Tensor, bucket: int,
             kernel: str, hidden: bool = False) -> torch.Tensor:
        rows = token_ids.shape[0]
        if bucket > rows:  # padding rows: token 0 at position 0, their logits dropped below
            token_ids = torch.cat((token_ids, token_ids.new_zeros(bucket - rows)))
            positions = torch.cat((positions, positions.new_zeros(bucket - rows)))
        linears, head = self._pack(bucket) if kernel == "mkl" else self._onednn
        inner = self.model.model
        with torch.inference_mode():
            x = inner.embed_tokens(token_ids.unsqueeze(0))
            cos, sin = (t[0].contiguous() for t in inner.rotary_emb(x, positions.unsqueeze(0)))
            x = x[0]
            _BATCHES[self.key] = batch
            try:
                for (layer, norms, eps, _), four in zip(self._layers, linears):
                    x = self._compiled(x, cos, sin, layer, norms, four, eps, self._heads, self._scale, self.key,
                                       kernel)
            finally:
                _BATCHES[self.key] = None
            x = inner.norm(x)
            return x[:rows] if hidden else _project(x, head, kernel)[:rows]

    def warm(self, eager: Callable[[torch.Tensor, torch.Tensor], object] | None = None) -> float:
        """Compile and run every bucket's graph over no pool (attention answers
        zeros), choosing each bucket's code (see the module docstring) where the
        kernel is ``auto``; ``eager(token_ids, positions)``: the runner's eager
        forward over :data:`~worker.model.paged.NO_POOL`. Returns the seconds it took."""
        began = time.monotonic()
        budget, mkl_bytes = MKL_MEMORY_SHARE * available_memory(), self._mkl_bytes()
        for n in reversed(self.buckets):  # the largest first: MKL's copies go where a step costs most
            tokens, positions = torch.zeros(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
            if self.kernel != "auto":
                self._run(NO_POOL, tokens, positions, n, self.kernel)
                self.kernels[n] = self.kernel
                continue
            if eager is None:
                raise ValueError("kernel 'auto' measures the eager forward: warm() needs it")
            candidates = {"eager": partial(eager, tokens, positions),
                          "onednn": partial(self._run, NO_POOL, tokens, positions, n, "onednn")}
            if torch._C.has_mkl and mkl_bytes <= budget and self._mkl_gemm_wins(n):
                candidates["mkl"] = partial(self._run, NO_POOL, tokens, positions, n, "mkl")
            times = self.timings[n] = {name: median_ms(run) for name, run in candidates.items()}
            best = min(("onednn", "mkl"), key=lambda k: times.get(k, float("inf")))
            self.kernels[n] = best if times[best] <= MARGIN * times["eager"] else "eager"
            if self.kernels[n] == "mkl":
                budget -= mkl_bytes
            else:
                self._packed.pop(n, None)  # its MKL copies are not used: give the memory back
        self.warm_s = time.monotonic() - began
        return self.warm_s

    def describe(self) -> str:
        """Each bucket's code and, where measured, the times it was chosen by."""
        parts = []
        for n in self.buckets:
            times = self.timings.get(n)
            shown = "" if not times else " (" + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items()) + ")"
            parts.append(f"{n} rows: {self.kernels.get(n, 'not warmed')}{shown}")
        return "; ".join(parts)


def median_ms(run: Callable[[], object], runs: int = TIMED_RUNS) -> float:
    """``run``'s median time over ``runs`` calls after an untimed one (the compile), in ms
    (also :mod:`worker.model.greedy_head`'s timing)."""
    run()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3
