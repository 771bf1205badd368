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

So a decode step (one new token per sequence) of ``n`` sequences, ``min_rows
<= n <= max(buckets)``, runs at the smallest bucket that holds it, its rows
padded (token 0 at position 0; their logits are dropped and their K/V never
written). Prefill and mixed steps run eager.

What is compiled: one decoder layer (:func:`_layer`, the fused layers' own
torch math), with its weights as arguments, so the 30 layers of a model
share one graph per bucket: compiling every layer as one frozen graph took
about 20 s a bucket on two cores, this about 1 s, for the same step time
(SmolLM2-135M, 64 rows: 74-85 ms against 83-84, eager 101-114). The
projections are :func:`packed_linear`, MKL's GEMM on a weight packed per
bucket (:meth:`CompiledDecode._pack`; SmolLM2-135M in float32: about 0.55 GB
a bucket), opaque to the compiler. The embedding lookup, the rotary tables,
the final norm and the LM head (the same packed GEMM) run eager around it.
:meth:`CompiledDecode.warm` packs and compiles every bucket before the
worker serves, so no step compiles.

Paged attention, with its ``write_kv``, is one opaque op, ``blockd::paged_attend``
(:func:`torch.library.custom_op`): the compiler fuses around it and never
looks inside. Its arguments are tensors and constants only (the layer index
a 0-d tensor, so that layers share the graph), so the step's batch (a
:class:`~worker.model.paged.PagedBatch` of Python objects) reaches it through
:data:`_BATCHES`, keyed by the runner, set for the one forward the runner's
lock lets run at a time. It declares no mutated arguments: the KV pool it
writes is not an argument, and each layer reads only what it has just
written, after its own inputs, so data dependencies order it. Imports torch
and :mod:`worker.model.fused`, :mod:`worker.model.paged`.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch
from torch import nn

from worker.model.fused import FusedLayer, FusedNorm, add_rms_norm_torch, rms_norm_torch, rotary_torch, silu_mul_torch
from worker.model.paged import PagedBatch, attend

__all__ = ["CompiledDecode", "compilable"]
#: the model classes whose forward is embed -> decoder layers -> norm -> LM head and nothing else
_MODELS = ("LlamaForCausalLM", "Qwen2ForCausalLM")

#: runner key -> the batch of the forward running now (see the module docstring), or
#: :data:`WARMING` while :meth:`CompiledDecode.warm` runs the graph over no pool
_BATCHES: dict[int, object] = {}
WARMING = object()
_KEYS = itertools.count(1)
_KEYS_LOCK = threading.Lock()


@torch.library.custom_op("blockd::paged_attend", mutates_args=())
def paged_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, scale: float,
                 runner: int) -> torch.Tensor:
    """One layer's ``write_kv`` and paged attention over the running batch of ``runner``
    (``query`` ``[T, Hq, D]``, ``key``, ``value`` ``[T, Hkv, D]``; ``layer``: a 0-d
    tensor, so that every layer shares one graph); returns ``[T, Hq, D]``."""
    batch = _BATCHES.get(runner)
    if batch is WARMING:  # the graph's shapes, no pool touched
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


def compilable(model: nn.Module, tp) -> str | None:
    """Why ``model`` cannot run compiled here (None: it can): the CPU with MKL, no
    tensor parallelism (its all-reduce hooks run eager), every decoder layer fused."""
    if tp is not None:
        return "tensor parallelism runs eager"
    if type(model).__name__ not in _MODELS:
        return f"{type(model).__name__} is not one of {', '.join(_MODELS)}"
    if next(model.parameters()).device.type != "cpu":
        return "the compiled forward is the CPU path (CUDA graphs are not built yet)"
    if not torch._C.has_mkl:
        return "this torch has no MKL (its packed GEMM is what the compiled forward runs)"
    layers = model.model.layers
    if not all(isinstance(layer, FusedLayer) for layer in layers) or not isinstance(model.model.norm, FusedNorm):
        return "not every decoder layer is fused (packed linears, --cpu-linear auto)"
    return None


def _layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: torch.Tensor, norms: tuple,
           linears: tuple, eps: tuple[float, float], heads: tuple[int, int], scale: float,
           runner: int) -> torch.Tensor:
    """One fused decoder layer in torch math (:mod:`worker.model.fused`'s ops), its
    weights as arguments; ``linears``: (packed, weight, bias) of q/k/v, o, gate/up, down."""
    qkv, o, gate_up, down = linears
    h = rms_norm_torch(x, norms[0], eps[0])
    q, k, v = rotary_torch(packed_linear(h, *qkv), cos, sin, *heads)
    out = paged_attend(q, k, v, layer, scale, runner)
    x, h = add_rms_norm_torch(packed_linear(out.reshape(x.shape[0], -1), *o), x, norms[1], eps[1])
    return x + packed_linear(silu_mul_torch(packed_linear(h, *gate_up)), *down)


class CompiledDecode:
    """The compiled decode forward of one runner's model (see the module docstring)."""

    def __init__(self, model: nn.Module, buckets: tuple[int, ...]) -> None:
        import torch._dynamo.config as dynamo_config

        if not buckets or min(buckets) < 1:
            raise ValueError(f"compile buckets must be row counts >= 1, got {list(buckets)}")
        # one graph per bucket of the same layer function: past this limit dynamo would run it eager
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, len(buckets) + 1)
        with _KEYS_LOCK:
            self.key = next(_KEYS)
        self.model = model
        self.buckets = tuple(sorted(set(buckets)))
        # fewer rows than half the smallest bucket: eager (padding would cost more than the graph saves)
        self.min_rows = max(1, self.buckets[0] // 2)
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
        self._compiled = torch.compile(_layer, dynamic=False)
        self.warm_s: float | None = None

    def applies(self, query_lens: list[int]) -> bool:
        """Whether a step of these query lengths runs compiled: decode, half the smallest bucket to the largest."""
        return self.min_rows <= len(query_lens) <= self.buckets[-1] and all(q == 1 for q in query_lens)

    def forward(self, batch: PagedBatch, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of a decode step (one token per sequence)."""
        return self._run(batch, token_ids, positions)

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

    def _run(self, batch: object, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = token_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= rows)
        if bucket > rows:  # padding rows: token 0 at position 0, their logits dropped below
            token_ids = torch.cat((token_ids, token_ids.new_zeros(bucket - rows)))
            positions = torch.cat((positions, positions.new_zeros(bucket - rows)))
        packed, head = self._pack(bucket)
        inner = self.model.model
        with torch.inference_mode():
            x = inner.embed_tokens(token_ids.unsqueeze(0))
            cos, sin = (t[0].contiguous() for t in inner.rotary_emb(x, positions.unsqueeze(0)))
            x = x[0]
            _BATCHES[self.key] = batch
            try:
                for (layer, norms, eps, _), linears in zip(self._layers, packed):
                    x = self._compiled(x, cos, sin, layer, norms, linears, eps, self._heads, self._scale, self.key)
            finally:
                _BATCHES[self.key] = None
            return packed_linear(inner.norm(x), *head)[:rows]

    def warm(self) -> float:
        """Pack, compile and run every bucket's graph over no pool (attention
        answers zeros); returns the seconds it took."""
        began = time.monotonic()
        for n in self.buckets:
            self._run(WARMING, torch.zeros(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64))
        self.warm_s = time.monotonic() - began
        return self.warm_s
