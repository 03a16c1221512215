"""Which class serves which model: the one table from a checkpoint to its model family.

vLLM's ModelRegistry shape: each entry names a class as (module under deepinfer_dp/models,
class name), and the module is imported only when a model of that type is built. So the
loader imports no family and no family imports the loader; a new family is one new file
plus one line here per model type it serves. The key is the config's `model_type`, which
every config.json carries (a converted GGUF file's too), where vLLM keys by `architectures`.

A family's class is built as `cls(config)`, or `cls(config, expert_shard)` when it sets
`mixture_of_experts` (it holds only an expert-parallel rank's share of the routed experts).
"""

from __future__ import annotations

import importlib

from torch import nn

# model_type -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen3": ("llama", "LlamaForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
    "mixtral": ("moe_models", "MoeForCausalLM"),
    "qwen2_moe": ("moe_models", "MoeForCausalLM"),
    "qwen3_moe": ("moe_models", "MoeForCausalLM"),
    "olmoe": ("moe_models", "MoeForCausalLM"),
    "deepseek_v2": ("deepseek", "DeepseekForCausalLM"),
    "deepseek_v3": ("deepseek", "DeepseekForCausalLM"),
    "llava": ("llava", "LlavaForConditionalGeneration"),
    "idefics3": ("idefics3", "Idefics3ForConditionalGeneration"),
    "qwen2_vl": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
}

# model_type -> (module, function) that attaches the next-n (MTP) layer its checkpoints carry
# to a loaded model (load_model(mtp=True), for speculative_config method "mtp")
_NEXTN_LAYERS: dict[str, tuple[str, str]] = {
    "deepseek_v3": ("deepseek_mtp", "attach_mtp_layer"),
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(_MODELS)


def family_modules() -> tuple[str, ...]:
    """The modules the table names (deepinfer_dp.models.<name>)."""
    return tuple(dict.fromkeys(f"{__package__}.{module}" for module, _ in _MODELS.values()))


def check_supported(config) -> None:
    """Raises ValueError naming the architecture when no family serves this config."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODELS:
        archs = getattr(config, "architectures", None) or [model_type]
        raise ValueError(f"unsupported model architecture {archs[0]!r} (model_type "
                         f"{model_type!r}); supported model types: {', '.join(_MODELS)}")


def model_class(config) -> type[nn.Module]:
    """The class that serves `config`, its family's module imported on first use."""
    check_supported(config)
    module, name = _MODELS[config.model_type]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def attach_nextn_layer(model: nn.Module) -> nn.Module:
    """Builds, loads and attaches the next-n (MTP) layer of a loaded `model` (its family's
    function, imported on first use) and returns it; ValueError when the family has none."""
    entry = _NEXTN_LAYERS.get(model.config.model_type)
    if entry is None:
        raise ValueError("speculative_config method 'mtp' needs a DeepSeek-V3 model (its checkpoint stores the "
                         f"next-n layer); model type {model.config.model_type!r} has none")
    module, name = entry
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)(model)
