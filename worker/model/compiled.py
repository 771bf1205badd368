"""A decode step's forward as compiled graphs (Inductor), one per batch-size
bucket, on the CPU.

Why: blockd's fused eager layers (:mod:`worker.model.fused`) pay a fixed cost
per op (dispatch, oneDNN primitive creation), run their elementwise work as
separate passes, and use a oneDNN kernel that serves any row count. A graph
compiled for one row count with its weights frozen lets Inductor fuse the
elementwise work and pick MKL's GEMM packed for exactly that count.
``bench/forward_compile.py`` (SmolLM2-135M's layer math) measured 0.67x of the
fused eager layers' time at 64 rows and 0.74-0.84x at 4-256; the real model's
whole decode forward at 64 rows 74-85 ms against 107-114 eager. One graph
with a symbolic row count (``dynamic=True``) was measured too and not kept:
0.82-0.88x from 16 to 256 rows and 0.95x on the real model, because its
GEMMs must serve any count.

So a decode step (one new token per sequence) of ``n`` sequences, ``min_rows
<= n <= max(buckets)``, runs on the smallest bucket that holds it, its rows
padded (token 0 at position 0; their logits are dropped and their K/V never
written). Each bucket's graph holds its own packed weights (SmolLM2-135M in
float32: about 0.6 GB a bucket) and costs about 20 s to compile on two cores,
all of it at :meth:`CompiledDecode.warm`, before the worker serves; no step
compiles. Prefill and mixed steps run eager.

What is compiled: the decoder layers, the final norm and the LM head, in the
fused layers' own torch math (:func:`worker.model.fused.rms_norm_torch` and
the rest), with the projections as plain ``nn.Linear`` over the same weights
(no copy until Inductor packs them). The embedding lookup and the rotary
tables stay eager: a gather and a few small ops.

Paged attention, with its ``write_kv``, is one opaque op, ``blockd::paged_attend``
(:func:`torch.library.custom_op`): the compiler fuses around it and never
looks inside. Its arguments are tensors and constants only, so the step's
batch (a :class:`~worker.model.paged.PagedBatch` of Python objects) reaches it
through :data:`_BATCHES`, keyed by the runner, set for the one forward the
runner's lock lets run at a time. It declares no mutated arguments: the KV
pool it writes is not an argument, and each layer reads only what it has just
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
def paged_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                 runner: int) -> torch.Tensor:
    """One layer's ``write_kv`` and paged attention over the running batch of ``runner``
    (``query`` ``[T, Hq, D]``, ``key``, ``value`` ``[T, Hkv, D]``); returns ``[T, Hq, D]``."""
    batch = _BATCHES.get(runner)
    if batch is WARMING:  # the graph's shapes, no pool touched
        return torch.zeros_like(query)
    if not isinstance(batch, PagedBatch):
        raise RuntimeError("blockd::paged_attend runs only inside CompiledDecode.forward")
    rows = len(batch.seq_ids)  # a decode step: one row per sequence; the rest is the bucket's padding
    if rows == query.shape[0]:
        return attend(batch, layer, query, key, value, scale)
    out = query.new_zeros(query.shape)
    out[:rows] = attend(batch, layer, query[:rows], key[:rows], value[:rows], scale)
    return out


@paged_attend.register_fake
def _paged_attend_shape(query, key, value, layer, scale, runner):
    return torch.empty_like(query)


def compilable(model: nn.Module, tp) -> str | None:
    """Why ``model`` cannot run compiled here (None: it can): the CPU, no tensor
    parallelism (its all-reduce hooks run eager), every decoder layer fused."""
    if tp is not None:
        return "tensor parallelism runs eager"
    if type(model).__name__ not in _MODELS:
        return f"{type(model).__name__} is not one of {', '.join(_MODELS)}"
    if next(model.parameters()).device.type != "cpu":
        return "the compiled forward is the CPU path (CUDA graphs are not built yet)"
    layers = model.model.layers
    if not all(isinstance(layer, FusedLayer) for layer in layers) or not isinstance(model.model.norm, FusedNorm):
        return "not every decoder layer is fused (packed linears, --cpu-linear auto)"
    return None


def _linear(source: nn.Linear) -> nn.Linear:
    """A plain ``nn.Linear`` over ``source``'s own parameters (no copy)."""
    plain = nn.Linear(source.in_features, source.out_features, bias=source.bias is not None, device="meta")
    plain.weight = source.weight
    plain.bias = source.bias
    return plain


class _Stack(nn.Module):
    """The decoder layers, final norm and LM head of a fused Llama/Qwen2 model, as plain torch."""

    def __init__(self, model: nn.Module, runner: int) -> None:
        super().__init__()
        self.runner = runner
        self.qkv, self.o, self.gate_up, self.down = (nn.ModuleList() for _ in range(4))
        self.norms: list[tuple[float, float]] = []
        self.attention: list[tuple[int, float]] = []
        for i, layer in enumerate(model.model.layers):
            self.qkv.append(_linear(layer._qkv))
            self.o.append(_linear(layer.self_attn.o_proj))
            self.gate_up.append(_linear(layer._gate_up))
            self.down.append(_linear(layer.mlp.down_proj))
            self.register_buffer(f"norm1_{i}", layer.input_layernorm.weight.detach(), persistent=False)
            self.register_buffer(f"norm2_{i}", layer.post_attention_layernorm.weight.detach(), persistent=False)
            self.norms.append((layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon))
            self.attention.append((layer.self_attn.layer_idx, float(layer.self_attn.scaling)))
        self.heads = model.model.layers[0]._heads
        self.register_buffer("final_norm", model.model.norm.weight.detach(), persistent=False)
        self.final_eps = model.model.norm.variance_epsilon
        self.lm_head = _linear(model.lm_head)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.qkv)):
            eps1, eps2 = self.norms[i]
            layer_idx, scale = self.attention[i]
            h = rms_norm_torch(x, getattr(self, f"norm1_{i}"), eps1)
            q, k, v = rotary_torch(self.qkv[i](h), cos, sin, *self.heads)
            out = paged_attend(q, k, v, layer_idx, scale, self.runner)
            x, h = add_rms_norm_torch(self.o[i](out.reshape(x.shape[0], -1)), x, getattr(self, f"norm2_{i}"), eps2)
            x = x + self.down[i](silu_mul_torch(self.gate_up[i](h)))
        return self.lm_head(rms_norm_torch(x, self.final_norm, self.final_eps))


class CompiledDecode:
    """The compiled decode forward of one runner's model (see the module docstring)."""

    def __init__(self, model: nn.Module, buckets: tuple[int, ...]) -> None:
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        if not buckets or min(buckets) < 1:
            raise ValueError(f"compile buckets must be row counts >= 1, got {list(buckets)}")
        # weights are constants of the graph, so Inductor may pack them for its GEMMs
        inductor_config.freezing = True
        # one graph per bucket of the same forward: past this limit dynamo would run it eager
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, len(buckets) + 1)
        with _KEYS_LOCK:
            self.key = next(_KEYS)
        self.model = model
        self.buckets = tuple(sorted(set(buckets)))
        # fewer rows than half the smallest bucket: eager (padding would cost more than the graph saves)
        self.min_rows = max(1, self.buckets[0] // 2)
        self._stack = _Stack(model, self.key).eval()
        self._compiled = torch.compile(self._stack, dynamic=False)
        self.warm_s: float | None = None

    def applies(self, query_lens: list[int]) -> bool:
        """Whether a step of these query lengths runs compiled: decode, half the smallest bucket to the largest."""
        return self.min_rows <= len(query_lens) <= self.buckets[-1] and all(q == 1 for q in query_lens)

    def forward(self, batch: PagedBatch, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of a decode step (one token per sequence)."""
        return self._run(batch, token_ids, positions)

    def _run(self, batch: object, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = token_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= rows)
        if bucket > rows:  # padding rows: token 0 at position 0, their logits dropped below
            token_ids = torch.cat((token_ids, token_ids.new_zeros(bucket - rows)))
            positions = torch.cat((positions, positions.new_zeros(bucket - rows)))
        inner = self.model.model
        with torch.inference_mode():
            hidden = inner.embed_tokens(token_ids.unsqueeze(0))
            cos, sin = inner.rotary_emb(hidden, positions.unsqueeze(0))
            _BATCHES[self.key] = batch
            try:
                return self._compiled(hidden[0], cos[0].contiguous(), sin[0].contiguous())[:rows]
            finally:
                _BATCHES[self.key] = None

    def warm(self) -> float:
        """Compile and run every bucket's graph over no pool (attention answers
        zeros); returns the seconds it took."""
        began = time.monotonic()
        for n in self.buckets:
            self._run(WARMING, torch.zeros(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64))
        self.warm_s = time.monotonic() - began
        return self.warm_s
