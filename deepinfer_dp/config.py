"""The engine's configuration: one dataclass, checked in one place; the rest trusts it."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the default SmolLM2
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill above it)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    enable_prefix_caching: bool = True
    zos: bool = True  # zero-overhead scheduling: defer a decode step's post-processing
    cpu_linear_kernel: bool = True  # fp32 CPU: decode-sized matrix products through the C++ kernel
    seed: int = 0
    torch_threads: int | None = None  # None: leave torch's default
    dp_size: int = 1
    dp_rank: int = 0
    # Mixture-of-experts models: each DP rank holds 1/dp_size of the routed experts and the
    # MoE layers dispatch tokens over the DP group (vLLM's name); ignored by dense models.
    enable_expert_parallel: bool = False
    all2all_backend: str = "all_to_all"  # the EP dispatcher: all_to_all or allgather_reducescatter

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "dp_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineConfig.block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"EngineConfig.num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"EngineConfig.kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"EngineConfig.device must be auto, cpu or cuda[:N], got {self.device!r}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"EngineConfig.dp_rank must be in [0, dp_size={self.dp_size}), got {self.dp_rank}")
        if self.all2all_backend not in ("all_to_all", "allgather_reducescatter"):
            raise ValueError(f"EngineConfig.all2all_backend must be all_to_all or allgather_reducescatter, "
                             f"got {self.all2all_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be at least 2, got {self.max_model_len}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Like the constructor, but an unknown option is a clear error, not a TypeError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def resolved_threads(self) -> int | None:
        if self.torch_threads is not None:
            return self.torch_threads
        env = os.environ.get("DEEPINFER_DP_TORCH_THREADS")
        return int(env) if env else None
