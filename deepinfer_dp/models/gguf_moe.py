"""GGUF files of mixture-of-experts models, converted to the Hugging Face names and config
fields of the released checkpoints: Mixtral (llama.cpp's "llama" architecture with experts),
Qwen2-MoE ("qwen2moe") and Qwen3-MoE ("qwen3moe"). (OLMoE GGUF files exist, but transformers
cannot read their config or tokenizer, so they are refused with the other architectures.)

llama.cpp stores a layer's routed experts as one 3D tensor per projection (ffn_gate_exps and
ffn_up_exps [E, I, H], ffn_down_exps [E, H, I]); older Mixtral files store one 2D tensor per
expert (ffn_gate.E). Either becomes the per-expert tensors of the Hugging Face checkpoint.
transformers' GGUF config reader knows neither Mixtral's experts nor the expert sizes of the
Qwen MoE families, so those come from the GGUF metadata here.
"""

from __future__ import annotations

import numpy as np

MOE_GGUF_ARCHS = ("qwen2moe", "qwen3moe")
# llama.cpp name inside blk.N. -> (Mixtral's Hugging Face name, the Qwen families')
_ROUTER = {"ffn_gate_inp": ("block_sparse_moe.gate", "mlp.gate")}
_EXPERTS = {"ffn_gate": ("w1", "gate_proj"), "ffn_up": ("w3", "up_proj"), "ffn_down": ("w2", "down_proj")}
_SHARED = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
           "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def is_moe_gguf(reader, arch: str) -> bool:
    return (_field(reader, f"{arch}.expert_count", 0) or 0) > 0


def moe_config(reader, arch: str, config):
    """The Hugging Face config of a MoE GGUF file, from transformers' reading of it."""
    experts, top_k = _field(reader, f"{arch}.expert_count"), _field(reader, f"{arch}.expert_used_count")
    if arch == "llama":  # Mixtral: transformers reads it as a dense Llama
        from transformers import MixtralConfig

        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
        fields = {k: getattr(config, k) for k in keys if getattr(config, k, None) is not None}
        return MixtralConfig(**fields, num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None)
    config.num_experts, config.num_experts_per_tok = experts, top_k
    config.moe_intermediate_size = _field(reader, f"{arch}.expert_feed_forward_length", config.intermediate_size)
    if arch == "qwen2moe":
        config.shared_expert_intermediate_size = _field(reader, f"{arch}.expert_shared_feed_forward_length", 0)
    config.norm_topk_prob = bool(_field(reader, f"{arch}.expert_weights_norm", arch == "qwen3moe"))
    names = {t.name for t in reader.tensors}
    config.mlp_only_layers = [i for i in range(config.num_hidden_layers)
                              if f"blk.{i}.ffn_gate_inp.weight" not in names]
    config.decoder_sparse_step = 1
    return config


def moe_tensors(gguf_name: str, array: np.ndarray, mixtral: bool) -> list[tuple[str, np.ndarray]] | None:
    """The Hugging Face tensors of one GGUF tensor of a MoE layer; None for any other tensor."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) < 3 or parts[0] != "blk":
        return None
    layer, kind = f"model.layers.{parts[1]}", parts[2]
    family = 0 if mixtral else 1
    if len(parts) == 3 and kind in _ROUTER:
        return [(f"{layer}.{_ROUTER[kind][family]}.{suffix}", array)]
    if len(parts) == 3 and kind in _SHARED:
        return [(f"{layer}.{_SHARED[kind]}.{suffix}", array.reshape(1, -1) if kind == "ffn_gate_inp_shexp" else array)]
    block = "block_sparse_moe" if mixtral else "mlp"
    if len(parts) == 3 and kind.endswith("_exps") and kind.removesuffix("_exps") in _EXPERTS:
        proj = _EXPERTS[kind.removesuffix("_exps")][family]
        return [(f"{layer}.{block}.experts.{e}.{proj}.{suffix}", array[e]) for e in range(array.shape[0])]
    if len(parts) == 4 and kind in _EXPERTS and mixtral:  # older files: blk.N.ffn_gate.E
        return [(f"{layer}.{block}.experts.{int(parts[3])}.{_EXPERTS[kind][0]}.{suffix}", array)]
    return None
