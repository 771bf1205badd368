"""Tensor parallelism for a group of workers that each hold a slice of the KV
heads: a gloo process group, Megatron-style sharding of each rank's copy of
the model, and the agreement that keeps the ranks' collectives in step.

Sharding (rank ``r`` of ``W``; every rank first builds the same full model)::

    attention  q/k/v projections: output rows of this rank's heads
               (KV heads [r*Hkv/W, (r+1)*Hkv/W) and their query-head groups)
               o_proj: the matching input columns, then all-reduce
    MLP        gate/up (GPT-2 c_fc): output rows [r*I/W, (r+1)*I/W)
               down (GPT-2 c_proj): the matching input columns, then all-reduce
    replicated embeddings, norms, lm_head

A row-parallel projection's bias is kept on rank 0 only (zeroed elsewhere), so
the all-reduced sum adds it once. Every rank then computes the same logits.

A collective that fails or times out (a peer died, or got another request)
leaves the group unusable: the ranks may pair different collectives from then
on. The group marks itself broken and every later step is refused with
FAILED_PRECONDITION until the pair is restarted.
Imports torch and torch.distributed; knows Llama/Qwen2 and GPT-2 module names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from blockd.core.errors import BlockdError, WrongState
from worker.model.build import model_geometry


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """The KV heads ``[start, end)`` rank ``rank`` holds."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} is not in a group of {world_size}")
    if num_kv_heads % world_size:
        raise ValueError(f"{num_kv_heads} KV heads do not split evenly over {world_size} ranks")
    per_rank = num_kv_heads // world_size
    return rank * per_rank, (rank + 1) * per_rank


class TensorParallel:
    """This process's place in a gloo group of ``world_size`` workers.

    Construction blocks until every rank joined ``init_method``
    (``tcp://127.0.0.1:PORT``; rank 0 listens there) or ``timeout_s`` passed.
    """

    def __init__(self, rank: int, world_size: int, init_method: str, *, timeout_s: float = 60.0) -> None:
        kv_head_range(world_size, rank, world_size)  # validates rank and size
        if not init_method.startswith("tcp://"):
            raise ValueError(f"--tp-init must be tcp://HOST:PORT, got {init_method!r}")
        self.rank, self.world_size = rank, world_size
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.broken: str | None = None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        return kv_head_range(num_kv_heads, self.rank, self.world_size)

    # --- stepping together -------------------------------------------------
    @contextmanager
    def collective(self, *, agreed: bool = False) -> Iterator[None]:
        """Run collectives; a failure that can leave the ranks out of step
        breaks the group for good. Before the ranks ``agreed`` on a step, a
        refusal (a :class:`BlockdError` that :meth:`agree` raised on every
        rank) is harmless; after it, any error leaves a peer mid-forward."""
        if self.broken is not None:
            raise WrongState(f"the tensor-parallel group is broken ({self.broken}); restart its workers")
        try:
            yield
        except Exception as err:
            # gloo reports timeouts and lost peers as RuntimeError
            is_collective = isinstance(err, RuntimeError)
            if agreed or is_collective:
                self.broken = f"rank {self.rank} failed mid-step: {err}"
            if is_collective:
                raise WrongState(f"tensor-parallel step failed: {self.broken}") from None
            raise

    def agree(self, error: BlockdError | None, digest: bytes) -> None:
        """Exchange each rank's verdict on a step before any rank runs it, so a
        rank that refuses (stale version, unknown sequence) never leaves its
        peer waiting in the forward pass's all-reduces."""
        verdicts: list = [None] * self.world_size
        dist.all_gather_object(verdicts, (digest, None if error is None else str(error)))
        if error is not None:
            raise error
        refused = [(r, msg) for r, (_, msg) in enumerate(verdicts) if msg is not None]
        if refused:
            rank, msg = refused[0]
            raise WrongState(f"tensor-parallel rank {rank} refused this step: {msg}")
        if len({d for d, _ in verdicts}) != 1:
            raise WrongState("tensor-parallel ranks got different ModelStep requests; send every rank the "
                             "same request, one step at a time")

    def all_reduce_hook(self, module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output)
        return output

    # --- sharding -------------------------------------------------------------
    def shard(self, model: nn.Module) -> nn.Module:
        """Cut ``model`` (a full copy, the same on every rank) down to this rank's shard, in place."""
        geometry = model_geometry(model.config)
        if geometry.num_q_heads % geometry.num_kv_heads:
            raise ValueError("query heads must be a multiple of KV heads")
        kv_start, kv_end = self.kv_head_range(geometry.num_kv_heads)
        group = geometry.num_q_heads // geometry.num_kv_heads
        d = geometry.head_dim
        q_rows = torch.arange(kv_start * group * d, kv_end * group * d)
        kv_rows = torch.arange(kv_start * d, kv_end * d)
        for layer in _decoder_layers(model):
            if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "q_proj"):
                self._shard_llama_layer(layer, q_rows, kv_rows)
            elif hasattr(layer, "attn") and hasattr(layer.attn, "c_attn"):
                self._shard_gpt2_layer(layer, q_rows)
            else:
                raise ValueError(f"no tensor-parallel layout for {type(layer).__name__}")
        return model

    def _mlp_rows(self, width: int) -> torch.Tensor:
        if width % self.world_size:
            raise ValueError(f"MLP width {width} does not split evenly over {self.world_size} ranks")
        part = width // self.world_size
        return torch.arange(self.rank * part, (self.rank + 1) * part)

    def _shard_llama_layer(self, layer: nn.Module, q_rows: torch.Tensor, kv_rows: torch.Tensor) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        _take_outputs(attn.q_proj, q_rows)
        _take_outputs(attn.k_proj, kv_rows)
        _take_outputs(attn.v_proj, kv_rows)
        self._take_inputs(attn.o_proj, q_rows)
        rows = self._mlp_rows(mlp.gate_proj.out_features)
        _take_outputs(mlp.gate_proj, rows)
        _take_outputs(mlp.up_proj, rows)
        self._take_inputs(mlp.down_proj, rows)

    def _shard_gpt2_layer(self, layer: nn.Module, q_rows: torch.Tensor) -> None:
        attn, mlp = layer.attn, layer.mlp
        # c_attn packs [q | k | v] along its outputs; GPT-2 is MHA, so every
        # section takes the same heads.
        width = attn.split_size
        _take_outputs(attn.c_attn, torch.cat([q_rows, q_rows + width, q_rows + 2 * width]))
        attn.split_size = len(q_rows)  # forward splits c_attn's output by split_size
        attn.num_heads = len(q_rows) // attn.head_dim
        self._take_inputs(attn.c_proj, q_rows)
        rows = self._mlp_rows(mlp.c_fc.nf)
        _take_outputs(mlp.c_fc, rows)
        self._take_inputs(mlp.c_proj, rows)

    def _take_inputs(self, proj: nn.Module, cols: torch.Tensor) -> None:
        """Row-parallel: keep input features ``cols``; sum the partial outputs."""
        is_conv = _is_conv1d(proj)
        weight = proj.weight.data
        proj.weight = nn.Parameter(weight[cols].clone() if is_conv else weight[:, cols].clone(),
                                   requires_grad=False)
        if is_conv:
            proj.nx = len(cols)
        else:
            proj.in_features = len(cols)
        if proj.bias is not None and self.rank != 0:
            # Zeroed, not removed: GPT-2's Conv1D always adds its bias.
            proj.bias.data.zero_()
        proj.register_forward_hook(self.all_reduce_hook)


def _is_conv1d(proj: nn.Module) -> bool:
    """GPT-2's Conv1D keeps its weight as [in, out], transposed from nn.Linear."""
    return type(proj).__name__ == "Conv1D"


def _take_outputs(proj: nn.Module, rows: torch.Tensor) -> None:
    """Column-parallel: keep output features ``rows``."""
    is_conv = _is_conv1d(proj)
    weight = proj.weight.data
    kept = weight[:, rows] if is_conv else weight[rows]
    proj.weight = nn.Parameter(kept.clone(), requires_grad=False)
    if proj.bias is not None:
        proj.bias = nn.Parameter(proj.bias.data[rows].clone(), requires_grad=False)
    if is_conv:
        proj.nf = len(rows)
    else:
        proj.out_features = len(rows)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers
