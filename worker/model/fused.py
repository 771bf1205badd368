"""Llama/Qwen2 decoder layers in fewer, larger steps on the CPU (the packed
``--cpu-linear auto`` path).

Why: at decode a step's batch is one row per sequence, so transformers' layer
is dominated by per-op costs, not arithmetic: five projections, each RMSNorm
six elementwise ops, RoPE ten, each a pass over the activations and an OpenMP
region (which costs far more than the work when another process holds one of
the cores). :func:`fuse_layers` switches each layer to :class:`FusedLayer`'s
forward, which computes the same function as vLLM's CPU path does:

* q/k/v as one oneDNN-packed projection and gate/up as one (the weights
  concatenated along their outputs; the originals keep their parameters
  for the state dict, but drop their packed copies, so memory stays the same);
* RMSNorm, residual add + RMSNorm, RoPE (+ the q/k/v split into
  token-major tensors), SiLU-and-mul (torch's own kernels, whose vectorised
  exp is faster than a hand-written one, both in one OpenMP region) and
  the closing residual add as one compiled op each (``csrc/layer_ops.cpp``), or
  as the same torch math when the compiled library is unavailable or
  ``BLOCKD_ATTENTION_BACKEND=torch``;
* attention straight through :func:`worker.model.paged.attend`.

The final norm goes through the same RMSNorm op. o_proj and down_proj stay
modules, so tensor parallelism's all-reduce hooks still run; fuse after the
model is sharded and packed. Only the decoder layers' order of float32
operations changes (the concatenated projections' sums may be blocked
differently by oneDNN, the mean of squares is summed in another order), as the
packed linears already do; greedy tokens are checked against transformers'
``generate`` (tests/worker/test_real_model.py, ``make demo``).
Imports torch and :mod:`worker.kernels.native`, :mod:`worker.model.linear`,
:mod:`worker.model.paged`.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.kernels import native
from worker.model.linear import PackedLinear, pack, unpack
from worker.model.paged import PagedBatch, attend

__all__ = ["FusedLayer", "add_rms_norm_torch", "fuse_layers", "layer_ops", "rms_norm_torch", "rotary_torch",
           "silu_mul_torch"]

#: the decoder layer and norm classes whose forward is the one :class:`FusedLayer` reproduces
_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm")


# --- the ops: compiled, and the same math in torch -----------------------------

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm for float32 ``x`` ``[T, H]``."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + x, rms_norm(residual + x))``."""
    total = residual + x
    return total, rms_norm_torch(total, weight, eps)


def rotary_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
                 kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``qkv`` ``[T, (Hq + 2 Hkv) D]`` into contiguous ``q`` ``[T, Hq, D]``,
    ``k``, ``v`` ``[T, Hkv, D]``, q and k rotated as transformers' ``apply_rotary_pos_emb``
    does (``cos``, ``sin``: ``[T, D]``)."""
    tokens, dim = qkv.shape[0], cos.shape[-1]
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (q_heads + kv_heads) * dim :].reshape(tokens, kv_heads, dim)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = dim // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s

    return rotate(q).contiguous(), rotate(k).contiguous(), v.contiguous()


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2I]`` (gate and up side by side)."""
    inter = gate_up.shape[1] // 2
    act = nn.functional.silu(gate_up[:, :inter])
    return act.mul_(gate_up[:, inter:])


class _TorchOps:
    """The fallback, with the compiled ops' signatures."""

    rms_norm = staticmethod(rms_norm_torch)
    add_rms_norm = staticmethod(add_rms_norm_torch)
    rotary = staticmethod(rotary_torch)
    silu_mul = staticmethod(silu_mul_torch)
    add = staticmethod(torch.add)


def layer_ops(compiled: bool | None = None):
    """The ops :class:`FusedLayer` calls: the compiled ones (``compiled`` True, or
    None and they build and ``BLOCKD_ATTENTION_BACKEND`` is not ``torch``) or
    the torch ones. ``compiled=True`` raises when the library cannot be built."""
    if compiled is None:
        compiled = native.backend_setting() != "torch" and native.load()
    if compiled:
        native.load(required=True)
        return native.layer_ops()
    return _TorchOps


# --- the layers -----------------------------------------------------------------

class FusedLayer(nn.Module):
    """A Llama/Qwen2 decoder layer's forward with fused projections and ops
    (see the module docstring); set by :func:`fuse_layers` as a subclass of the
    layer's own class, so everything else about the module stays."""

    _qkv: PackedLinear
    _gate_up: PackedLinear
    _ops: object
    _heads: tuple[int, int]

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                blockd_batch: PagedBatch | None = None, **kwargs) -> torch.Tensor:
        if blockd_batch is None or position_embeddings is None:
            raise RuntimeError("a fused decoder layer runs only inside ModelRunner.step, which passes blockd_batch")
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(f"the paged path packs a batch as one row; got {list(hidden_states.shape)}")
        ops, attn, mlp = self._ops, self.self_attn, self.mlp
        shape = hidden_states.shape
        x = hidden_states.reshape(shape[1], shape[2]).contiguous()
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h = ops.rms_norm(x, norm1.weight, norm1.variance_epsilon)  # type: ignore[attr-defined]
        cos, sin = (t.reshape(shape[1], -1).contiguous() for t in position_embeddings)
        q, k, v = ops.rotary(self._qkv(h), cos, sin, *self._heads)  # type: ignore[attr-defined]
        out = attend(blockd_batch, attn.layer_idx, q, k, v, attn.scaling)
        x, h = ops.add_rms_norm(attn.o_proj(out.reshape(shape[1], -1)), x,  # type: ignore[attr-defined]
                                norm2.weight, norm2.variance_epsilon)
        act = ops.silu_mul(self._gate_up(h))  # type: ignore[attr-defined]
        return ops.add(x, mlp.down_proj(act)).view(shape)  # type: ignore[attr-defined]


class FusedNorm(nn.Module):
    """A Llama/Qwen2 RMSNorm through the fused ops (the model's final norm)."""

    _ops: object

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        out = self._ops.rms_norm(hidden_states.reshape(-1, shape[-1]).contiguous(),  # type: ignore[attr-defined]
                                 self.weight, self.variance_epsilon)
        return out.view(shape)


def _subclass(mixin: type, cls: type, cache: dict) -> type:
    if cls not in cache:
        cache[cls] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    return cache[cls]


_CLASSES: dict[type, type] = {}


def _concat(parts: list[nn.Module]) -> PackedLinear | None:
    """One packed projection computing ``parts``' outputs side by side, or None
    when they cannot be joined (another class, a bias on some but not all)."""
    if not all(type(p) is PackedLinear for p in parts):
        return None
    biases = [p.bias for p in parts]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    weight = torch.cat([p.weight.detach() for p in parts])
    joined = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device=weight.device,
                       dtype=weight.dtype)
    with torch.no_grad():
        joined.weight.copy_(weight)
        if joined.bias is not None:
            joined.bias.copy_(torch.cat([b.detach() for b in biases]))  # type: ignore[misc]
    joined.requires_grad_(False)
    return pack(joined, matmul=not parts[0]._packed.is_mkldnn)  # the kernel its parts were packed for


def fuse_layers(model: nn.Module, ops=None) -> int:
    """Switch every Llama/Qwen2 decoder layer whose projections are packed
    (:func:`worker.model.linear.pack_linears`) and whose MLP is SiLU-gated to
    :class:`FusedLayer`, and their RMSNorms to :class:`FusedNorm`; returns how
    many layers. ``ops``: :func:`layer_ops`' choice by default."""
    ops = layer_ops() if ops is None else ops
    count = 0
    for module in list(model.modules()):
        if type(module).__name__ in _NORMS:
            module.__class__ = _subclass(FusedNorm, type(module), _CLASSES)
            module._ops = ops  # type: ignore[assignment]
            continue
        if type(module).__name__ not in _LAYERS:
            continue
        attn, mlp = module.self_attn, module.mlp
        # transformers' "silu" is its own SiLUActivation (F.silu), or nn.SiLU
        act = type(getattr(mlp, "act_fn", None)).__name__
        if act not in ("SiLU", "SiLUActivation") or type(attn.o_proj) is not PackedLinear \
                or type(mlp.down_proj) is not PackedLinear:
            continue
        qkv = _concat([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = _concat([mlp.gate_proj, mlp.up_proj])
        if qkv is None or gate_up is None:
            continue
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            unpack(proj)
        dim = attn.head_dim
        module.__class__ = _subclass(FusedLayer, type(module), _CLASSES)
        # plain attributes, not submodules: the state dict keeps the model's own names
        object.__setattr__(module, "_qkv", qkv)
        object.__setattr__(module, "_gate_up", gate_up)
        module._ops = ops
        module._heads = (attn.q_proj.out_features // dim, attn.k_proj.out_features // dim)
        count += 1
    return count
