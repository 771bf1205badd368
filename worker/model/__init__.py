"""The worker's model runner: a Hugging Face causal LM whose attention runs on
the worker's paged KV pool shard, whole or tensor-parallel.

* :mod:`worker.model.paged`: the attention implementation registered with
  transformers, and the batch it reads;
* :mod:`worker.model.build`: tiny configs, local loading, pool geometry;
* :mod:`worker.model.source`: ``--model`` specs to local files (GGUF conversion cache);
* :mod:`worker.model.runner`: :class:`ModelRunner`, one step over a packed batch;
* :mod:`worker.model.tp`: Megatron-style sharding over a gloo process group.

``python -m worker.model pool-config --model smollm2-135m`` prints the matching
pool as JSON.
"""

from worker.model.build import (
    TINY_MODELS,
    ModelGeometry,
    build_model,
    check_pool,
    load_config,
    model_geometry,
    pool_config_for,
    tiny_config,
)
from worker.model.paged import ATTN_IMPLEMENTATION, PagedBatch
from worker.model.runner import ModelRunner

__all__ = ["ATTN_IMPLEMENTATION", "TINY_MODELS", "ModelGeometry", "ModelRunner", "PagedBatch", "build_model",
           "check_pool", "load_config", "model_geometry", "pool_config_for", "tiny_config"]
