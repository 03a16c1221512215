"""Llama-family models on a paged KV cache, and how to load them."""

from deepinfer_dp.models.default_model import convert_gguf, default_model_path
from deepinfer_dp.models.llama import (
    LlamaForCausalLM,
    allocate_kv_cache,
    head_dim,
    kv_cache_bytes_per_block,
    kv_cache_shape,
    max_context_len,
    num_kv_heads,
    num_layers,
)
from deepinfer_dp.models.loader import LoadedModel, load_model

__all__ = [
    "LlamaForCausalLM", "LoadedModel", "allocate_kv_cache", "convert_gguf",
    "default_model_path", "head_dim", "kv_cache_bytes_per_block", "kv_cache_shape",
    "load_model", "max_context_len", "num_kv_heads", "num_layers",
]
