"""The model's linear layers on the CPU: weights packed once for oneDNN.

Why: ``nn.Linear`` on the CPU calls MKL's ``sgemm``, which on these AMD
(Zen) machines runs its AVX2 kernel and re-packs the whole weight matrix on
every call (``mkl_blas_def_sgemm_scopy_right16_bdz`` was 21% of a worker's
decode samples, the kernel itself 44%). A decode step's batch is small
(one row per sequence), so that copy is a large share of each projection.
oneDNN's inner product with the weight reordered once into its blocked
layout reads each weight once per call with its AVX-512 kernels; it is what
vLLM's CPU backend does for unquantised linears (``onednn_mm``). Measured in
the model (SmolLM2-135M fp32, 64 decode rows): a forward ~18-25% faster at
1 and 2 threads.

Which oneDNN primitive: the matmul primitive where the ``onednn-cpu-gomp``
wheel's oneDNN is installed (:func:`worker.kernels.native.load_matmul`,
``csrc/onednn_matmul.cpp``), as vLLM's CPU backend runs, else torch's own
inner product (``mkldnn::_linear_pointwise``, torch exposes no other for
float32). The matmul was 4-9% faster over SmolLM2's projections and LM head
at 64 decode rows and 18% at 16, and in the model's decode step 4% and 8%
(AMD EPYC; docs/benchmarks.md);
``--cpu-linear inner-product`` keeps torch's. A packed weight says which it
is (``is_mkldnn``: torch's), so :func:`packed_matmul` serves both.

Exactness: oneDNN sums in another order than MKL, so logits differ from
``nn.Linear``'s by float32 rounding (SmolLM2: at most ~3e-4 on logits of
magnitude ~20); the batched paged forward already differs from
transformers' own ``generate`` by the same order (another batch shape,
another kernel), and greedy tokens are checked against ``generate``
(tests/worker/test_real_model.py, ``make demo``).

:func:`pack_linears` changes the class of every plain ``nn.Linear`` of a
model in place to :class:`PackedLinear` (so forward hooks, such as tensor
parallelism's all-reduce, and the state dict stay as they were); call it
after the model is sharded and on its device, and never change a packed
layer's weight afterwards (the packed copy would be stale).
Imports torch and :mod:`worker.kernels.native`.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.kernels import native

__all__ = ["LINEAR_KERNELS", "PackedLinear", "kernel_of", "matmul_available", "pack", "pack_linears",
           "packed_linears", "packed_matmul", "packing_available", "unpack", "warm_matmuls"]

#: ``--cpu-linear``: ``auto`` packs the weights (:func:`pack_linears`) where
#: :func:`packing_available`, for oneDNN's matmul when :func:`matmul_available`
#: else for its inner product; ``inner-product`` packs them for the inner
#: product always; ``torch`` leaves every ``nn.Linear`` as it is
LINEAR_KERNELS = ("auto", "inner-product", "torch")
#: the row count oneDNN picks the weight layout for: a decode batch's order of magnitude
#: (the layout serves any row count; only its speed depends on this hint)
BATCH_HINT = 64


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward reads a oneDNN-packed copy of its weight."""

    _packed: torch.Tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        return packed_matmul(input, self._packed, self.bias, self.out_features)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ weight.T + bias`` on a weight :func:`pack` packed (``x`` ``[..., in_features]``)."""
    if packed.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if x.dim() == 2:
        return native.matmul_ops().run(x, packed, bias, out_features)
    out = native.matmul_ops().run(x.reshape(-1, x.shape[-1]), packed, bias, out_features)
    return out.view(*x.shape[:-1], out_features)


def matmul_available() -> bool:
    """Whether oneDNN's matmul library loads (:func:`worker.kernels.native.load_matmul`)."""
    return native.backend_setting() != "torch" and native.load_matmul()


def warm_matmuls(model: nn.Module) -> int:
    """Build now the matmul primitives every row count of ``model``'s packed
    linears can use (``blockd_matmul::warm``), so that no step pays for one
    (about 0.6 ms a row count and weight shape); returns how many weight
    shapes (0 where the linears do not run the matmul)."""
    shapes = {(m.out_features, m.in_features, m.bias is not None) for m in packed_linears(model)
              if not m._packed.is_mkldnn}
    for out_features, in_features, bias in sorted(shapes):
        native.matmul_ops().warm(out_features, in_features, bias)
    return len(shapes)


def packed_linears(model: nn.Module) -> list[PackedLinear]:
    """``model``'s packed linears: its submodules and those a module holds as a plain
    attribute (:mod:`worker.model.fused` keeps its joined projections so, unregistered)."""
    found: dict[int, PackedLinear] = {}
    for module in model.modules():
        for obj in (module, *vars(module).values()):
            if isinstance(obj, PackedLinear):
                found[id(obj)] = obj
    return list(found.values())


def kernel_of(model: nn.Module) -> str:
    """Which kernel ``model``'s linears run: ``matmul``, ``inner product`` (oneDNN's) or ``torch``."""
    packed = next((m._packed for m in packed_linears(model)), None)
    return "torch" if packed is None else "inner product" if packed.is_mkldnn else "matmul"


def packing_available(model: nn.Module) -> bool:
    """Whether :func:`pack_linears` applies: oneDNN is built in and the model's
    weights are float32 on the CPU (the only case measured; half precision
    needs CPU support oneDNN may not find)."""
    param = next(model.parameters(), None)
    return (torch.backends.mkldnn.is_available() and param is not None and param.device.type == "cpu"
            and param.dtype == torch.float32)


def pack_linears(model: nn.Module, kernel: str = "auto") -> int:
    """Pack every plain ``nn.Linear`` of ``model`` (see the module docstring) for
    ``kernel`` (``auto`` or ``inner-product``); returns how many. Raises
    ValueError when packing does not apply."""
    if not packing_available(model):
        raise ValueError("packed linears need oneDNN (torch.backends.mkldnn) and float32 weights on the CPU")
    if kernel not in ("auto", "inner-product"):
        raise ValueError(f"kernel must be auto or inner-product, got {kernel!r}")
    matmul = kernel == "auto" and matmul_available()
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            pack(module, matmul)
            count += 1
    return count


def pack(module: nn.Linear, matmul: bool | None = None) -> PackedLinear:
    """Turn one plain float32 CPU ``nn.Linear`` into a :class:`PackedLinear` in place,
    for oneDNN's matmul (``matmul`` True, or None and :func:`matmul_available`) or
    torch's inner product."""
    if matmul is None:
        matmul = matmul_available()
    with torch.no_grad():
        weight = module.weight.detach()
        packed = native.matmul_ops().pack(weight) if matmul else \
            torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
    module.__class__ = PackedLinear
    # a plain attribute, not a buffer: an opaque oneDNN tensor has no
    # storage for state_dict or .to() to handle
    module._packed = packed  # type: ignore[attr-defined]
    return module  # type: ignore[return-value]


def unpack(module: PackedLinear) -> nn.Linear:
    """Back to a plain ``nn.Linear`` (same weight), dropping the packed copy."""
    module.__class__ = nn.Linear
    del module._packed
    return module
