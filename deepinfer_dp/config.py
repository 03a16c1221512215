"""The engine's configuration: one dataclass, checked in one place; the rest trusts it.

Each field is declared once, with its type, default, range and help text. The YAML schema
(config_file.DeploymentConfig) and the command-line flags (config_file.add_config_args) are
derived from these declarations, so a new engine option is one line here. Fields marked
`internal` (set by the launchers, e.g. dp_rank) get no flag and no YAML key.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.dataclasses import dataclass

from deepinfer_dp.eplb.config import EPLBConfig, parse_eplb_config
from deepinfer_dp.spec_decode.config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    import torch

def _power_of_two(v: int) -> int:
    if v & (v - 1):
        raise ValueError("must be a power of two")
    return v


def _device_name(v: str) -> str:
    if v not in ("auto", "cpu", "cuda") and not v.startswith("cuda:"):
        raise ValueError("must be auto, cpu or cuda[:N]")
    return v


def _path_as_str(v: Any) -> Any:
    return os.fspath(v) if isinstance(v, os.PathLike) else v


def _internal(default: Any, help: str, **constraints) -> Any:
    """A field the launchers set (no flag, no YAML key)."""
    return Field(default, description=help, json_schema_extra={"internal": True}, **constraints)


@dataclass(config=ConfigDict(extra="forbid", strict=True))
class EngineConfig:
    model: Annotated[str | None, BeforeValidator(_path_as_str)] = Field(
        None, description="Hugging Face directory, .gguf file or Hugging Face repo id (org/name, from the local "
                           "Hugging Face cache, never downloaded) (default: SmolLM2-135M-Instruct)")
    revision: str | None = Field(None, description="the revision of a repo id model: a branch, tag or commit "
                                                   "hash in the local Hugging Face cache (default: main)")
    tokenizer: Annotated[str | None, BeforeValidator(_path_as_str)] = Field(
        None, description="where the tokenizer comes from, if not the model: a Hugging Face directory, repo id "
                          "or .gguf file (its metadata's tokenizer and chat template)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on CUDA")
    device: Annotated[str, AfterValidator(_device_name)] = Field(
        "auto", description="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    max_num_seqs: int = Field(256, ge=1, description="most sequences in one batch")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step (chunked "
                                                                "prefill above it)")
    block_size: Annotated[int, AfterValidator(_power_of_two)] = Field(
        16, ge=1, description="tokens per KV cache block (a power of two)")
    num_kv_blocks: int | None = Field(None, ge=2, description="KV cache blocks (default: as many as "
                                                              "kv_cache_memory_gb holds)")
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="memory for the paged KV cache")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="element type of the KV cache (auto: dtype's); bfloat16 under float32 halves "
                            "the cache and what attention reads, computing in fp32 (not MLA models)")
    max_model_len: int | None = Field(None, ge=2, description="longest prompt + output (default: the "
                                                              "model's, capped at 8192)")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = Field(
        False, description="keep every block of every layer in a model that mixes sliding-window and full "
                           "attention layers (Gemma 3), instead of freeing the sliding layers' blocks "
                           "that left their window")
    zos: bool = Field(True, description="zero-overhead scheduling: post-process a decode step during "
                                        "the next one")
    cpu_linear_kernel: bool = Field(True, description="fp32 on the CPU: decode-sized matrix products "
                                                      "through the C++ kernel")
    batch_invariant: bool = Field(True, description="fp32 on the CPU: every row's floats independent of the "
                                                    "batch (all products and attention in the C++ kernels)")
    packed_weights: bool = Field(True, description="fp32 on the CPU: GGUF Q4_0/Q4_1/Q8_0 and bf16 matrices "
                                                   "stay packed, widened inside the kernels")
    speculative_config: Annotated[SpeculativeConfig | None, BeforeValidator(parse_speculative_config)] = Field(
        None, description='speculative decoding, vLLM\'s keys, e.g. {"method": "ngram", '
                          '"num_speculative_tokens": 3} (JSON on the command line)')
    seed: int = Field(0, description="seed of the global RNG (requests without their own seed)")
    generation_config: str = Field(
        "auto", min_length=1, description='sampling defaults of requests that leave fields unset: "auto" (the '
                                          'model\'s generation_config.json), "vllm" (neutral ones) or a folder '
                                          'holding a generation_config.json')
    torch_threads: int | None = Field(None, ge=1, description="torch threads per rank (default: "
                                                              "$DEEPINFER_DP_TORCH_THREADS or torch's)")
    dp_size: int = Field(1, ge=1, description="data-parallel ranks")
    dp_rank: int = _internal(0, "this process's DP rank", ge=0)
    dp_vote_interval: int = Field(1, ge=1, description="DP ranks vote on whether any still has work every this "
                                                       "many steps of a wave, and assume it between votes "
                                                       "(vLLM: 32); a wave then ends up to this many - 1 "
                                                       "placeholder steps late. Every rank must use the same")
    # Mixture-of-experts models (ignored by dense ones); vLLM's names.
    enable_expert_parallel: bool = Field(False, description="MoE models: each DP rank holds 1/dp_size of the "
                                                            "routed experts; MoE layers dispatch over the DP group")
    all2all_backend: Literal["all_to_all", "allgather_reducescatter"] = Field(
        "all_to_all", description="the expert-parallel dispatcher")
    enable_eplb: bool = Field(False, description="expert-parallel load balancing: replicate and move hot experts "
                                                 "between ranks while serving (needs enable_expert_parallel)")
    eplb_config: Annotated[EPLBConfig, BeforeValidator(parse_eplb_config)] = Field(
        default_factory=EPLBConfig, description='the balancer, vLLM\'s keys, e.g. {"window_size": 1000, '
                                                '"step_interval": 3000, "num_redundant_experts": 2} (JSON on the '
                                                'command line)')

    # Images (vision-language models; ignored by the others); vLLM's names where it has them.
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=lambda: {"image": 4}, description='most items per prompt by modality, e.g. {"image": 2} '
                                                          '(JSON on the command line)')
    allowed_local_media_path: str | None = Field(None, description="local image files (file:// URLs) only under "
                                                                   "this folder (default: none allowed)")
    media_fetch_timeout_s: float = Field(10.0, gt=0, description="whole fetch of one http(s) image")
    max_image_bytes: int = Field(20 * 2**20, ge=1, description="largest encoded image, any source")
    mm_encoder_cache_tokens: int = Field(16384, ge=1, description="image embeddings the encoder cache keeps, in "
                                                                  "placeholder tokens (least recently used out)")
    max_num_encoder_input_tokens: int = Field(
        0, ge=0, description="image tokens the vision encoder may make in one step; a prefill chunk ends before an "
                             "image that does not fit, and the first image of a step always does (0: no limit)")

    @model_validator(mode="after")
    def _rank_in_group(self) -> EngineConfig:
        if self.dp_rank >= self.dp_size:
            raise ValueError(f"dp_rank: must be in [0, dp_size={self.dp_size}) (got {self.dp_rank})")
        return self

    @model_validator(mode="after")
    def _eplb_needs_ep(self) -> EngineConfig:
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb: needs enable_expert_parallel (the balancer moves experts between "
                             "expert-parallel ranks)")
        if self.eplb_config.num_redundant_experts and not self.enable_eplb:
            raise ValueError("eplb_config: num_redundant_experts needs enable_eplb")
        return self

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Like the constructor, but every problem is one ValueError line naming the option."""
        try:
            return cls(**kwargs)
        except ValidationError as e:
            known = list(EngineConfig.__pydantic_fields__)
            raise ValueError("invalid engine option(s): " + describe_errors(e, known)) from None

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def kv_cache_torch_dtype(self) -> torch.dtype:
        import torch

        return self.torch_dtype() if self.kv_cache_dtype == "auto" else getattr(torch, self.kv_cache_dtype)

    def media_limits(self):
        # Lazy, as torch above: media.py imports Pillow, and the config is read by light
        # processes (the API servers' front ends, the CLI) that never fetch an image.
        from deepinfer_dp.multimodal.media import MediaLimits

        return MediaLimits(self.media_fetch_timeout_s, self.max_image_bytes,
                           allowed_local_media_path=self.allowed_local_media_path)

    def resolved_threads(self) -> int | None:
        if self.torch_threads is not None:
            return self.torch_threads
        env = os.environ.get("DEEPINFER_DP_TORCH_THREADS")
        return int(env) if env else None


def engine_fields(include_internal: bool = False) -> dict[str, Any]:
    """name -> pydantic FieldInfo of every EngineConfig option, in declaration order."""
    return {name: f for name, f in EngineConfig.__pydantic_fields__.items()
            if include_internal or not (f.json_schema_extra or {}).get("internal")}


def describe_errors(e: ValidationError, known: list[str] | None = None) -> str:
    """`key: what is wrong (got value)` for every pydantic error, on one line."""
    return "; ".join(_describe(err, known) for err in e.errors())


def _describe(err: dict, known: list[str] | None) -> str:
    msg = err["msg"].removeprefix("Value error, ")
    key = ".".join(str(p) for p in err["loc"])
    if not key:  # a model-level check: its message starts with the key it means
        key, msg = (part.strip() for part in msg.split(":", 1))
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        msg = "unknown key" + (f"; known: {', '.join(known)}" if known else "")
    value = err.get("input")
    bare = err["type"] in ("missing", "extra_forbidden", "unexpected_keyword_argument")
    got = "" if bare or isinstance(value, dict) or not err["loc"] else f" (got {value!r})"
    return f"{key}: {msg}{got}"
