"""Which models a worker can run, and how they are made: tiny random-weight
configs built in code (fixed seed, never downloaded) or a trained model from
local files (a Hugging Face directory or a GGUF file, see
:mod:`worker.model.source`), always with attention going through the paged
pool (:data:`~worker.model.paged.ATTN_IMPLEMENTATION`).

Also the one place that derives a pool's geometry from a model config
(:func:`pool_config_for`, :func:`model_geometry`), so a pool and the model
that runs on it cannot disagree on layers, KV heads, head dim or dtype.
Imports torch, transformers and :mod:`blockd.core.types`; no worker state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

from blockd.core.types import PoolConfig
from worker.model import source
from worker.model.paged import ATTN_IMPLEMENTATION

#: architectures whose attention module and tensor-parallel layout are known
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "gpt2")
TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gpt2")
#: wider than the usual 0.02 so random tiny models do not repeat one token
#: forever, which would make greedy-decoding checks vacuous
INIT_RANGE = 0.1
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class ModelGeometry:
    """What a model needs from its KV pool."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def tiny_config(arch: str, *, num_layers: int = 2, vocab_size: int = 512,
                max_positions: int = 256) -> PretrainedConfig:
    """A small fp32 config of ``arch`` (``llama``, ``qwen2`` or ``gpt2``).

    Llama and Qwen2: GQA with 8 query / 2 KV heads of dim 32 (Qwen2 has the
    q/k/v biases); GPT-2: MHA with 8 heads of dim 32 and absolute position
    embeddings. No EOS token, so generation never stops early in tests.
    """
    common = {"vocab_size": vocab_size, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
              "initializer_range": INIT_RANGE}
    if arch in ("llama", "qwen2"):
        cls = LlamaConfig if arch == "llama" else Qwen2Config
        return cls(hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                   max_position_embeddings=max_positions, tie_word_embeddings=False, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=256, n_layer=num_layers, n_head=8, n_positions=max_positions, **common)
    raise ValueError(f"no tiny config for {arch!r}; choose one of llama, qwen2, gpt2")


def build_model(spec: str, *, seed: int = 0, dtype: str = "float32") -> PreTrainedModel:
    """``tiny-llama|tiny-qwen2|tiny-gpt2`` (random weights from ``seed``), or a
    trained model from local files (:mod:`worker.model.source`: a short name
    such as ``smollm2-135m``, a GGUF file, a model directory). The model is in
    eval mode on CPU, in ``dtype``, with the paged attention implementation
    selected."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"model dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    torch_dtype = TORCH_DTYPES[dtype]
    if spec in TINY_MODELS:
        config = tiny_config(spec.removeprefix("tiny-"))
        check_supported(config)
        # Every rank of a tensor-parallel group builds the same weights from the
        # seed; fork_rng keeps the caller's RNG stream untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION,
                                                     dtype=torch_dtype)
    else:
        quiet_progress()
        model = AutoModelForCausalLM.from_pretrained(str(_local_dir(spec)), local_files_only=True,
                                                     dtype=torch_dtype, attn_implementation=ATTN_IMPLEMENTATION)
        check_supported(model.config)
    return model.eval()


def quiet_progress() -> None:
    """No progress bars from transformers in this process: a worker's log and
    the demo's output are read by people, and a 0.2 s load needs no bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_config(spec: str) -> PretrainedConfig:
    """The config of ``spec`` (see :func:`build_model`) without loading weights."""
    if spec in TINY_MODELS:
        return tiny_config(spec.removeprefix("tiny-"))
    return AutoConfig.from_pretrained(str(_local_dir(spec)), local_files_only=True)


def _local_dir(spec: str):
    quiet_progress()
    try:
        return source.model_dir(spec)
    except ValueError as err:
        raise ValueError(f"--model must be one of {', '.join(TINY_MODELS)}, a short name "
                         f"({', '.join(source.PACKAGED_MODELS)}), a GGUF file or a local model directory: "
                         f"{err}") from None


def check_supported(config: PretrainedConfig) -> None:
    """Refuse models whose attention the paged path would compute wrongly."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("sliding-window attention layers are not supported by the paged pool")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("cross-attention models are not supported")


def model_geometry(config: PretrainedConfig) -> ModelGeometry:
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    return ModelGeometry(config.num_hidden_layers, num_q_heads, num_kv_heads, head_dim)


def pool_config_for(model_config: PretrainedConfig, name: str, num_blocks: int, block_size: int, *,
                    dtype: str | torch.dtype | None = None, watermark_blocks: int = 0) -> PoolConfig:
    """The pool that holds this model's KV cache (all layers, all KV heads).
    ``dtype`` defaults to the config's dtype (float32 when it names none)."""
    geometry = model_geometry(model_config)
    dtype = dtype if dtype is not None else getattr(model_config, "dtype", None)
    if isinstance(dtype, torch.dtype):
        dtype = DTYPE_NAMES.get(dtype, str(dtype))
    return PoolConfig(name, num_blocks=num_blocks, block_size=block_size, num_layers=geometry.num_layers,
                      num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
                      dtype=dtype or "float32", watermark_blocks=watermark_blocks)


def check_pool(model: PreTrainedModel, pool: PoolConfig) -> None:
    """Raise ValueError when the pool cannot hold this model's KV cache."""
    geometry = model_geometry(model.config)
    want = (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, DTYPE_NAMES.get(model.dtype))
    have = (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
    if want != have:
        raise ValueError(f"pool {pool.name!r} has (layers, KV heads, head dim, dtype) = {have} but the model "
                         f"needs {want}; create the pool with `python -m worker.model pool-config`")
