"""Tiny random DeepSeek models for tests, written as Hugging Face directories that our loader
and transformers both read offline.

  * "v3": DeepseekV3 -- q-LoRA, noaux_tc routing (sigmoid + a random e_score_correction_bias)
    over 4 groups of 2 experts, 2 groups kept, norm_topk_prob, routed_scaling_factor 2.5,
    layer 0 dense, YaRN (factor 4, mscale = mscale_all_dim = 1), interleaved rope.
  * "v2-lite": DeepseekV2 in V2-Lite's shape -- no q-LoRA (q_proj), softmax routing limited
    to the best 2 of 4 groups (group_limited_greedy; top-3, so the limit changes the choice),
    two shared experts, layer 0 dense, YaRN with V2-Lite's mscale 0.707.

`with_nextn=True` also stores one random next-n (MTP) layer as DeepSeek does: tensors
model.layers.<num_hidden_layers>.{enorm,hnorm,eh_proj,shared_head.norm,...} beside the
decoder's (transformers ignores them).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from model_utils import build_tiny_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config  # noqa: E402

DEEPSEEK_KINDS = ("v3", "v2-lite")


def tiny_deepseek_config(kind: str, vocab_size: int):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                  qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                  max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if kind == "v3":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
        return DeepseekV3Config(q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                rope_parameters=rope, **common)
    if kind == "v2-lite":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
        return DeepseekV2Config(q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.0,
                                topk_method="group_limited_greedy", norm_topk_prob=False, rope_parameters=rope,
                                **{**common, "num_experts_per_tok": 3})
    raise ValueError(f"unknown tiny DeepSeek kind {kind!r}; choose from {DEEPSEEK_KINDS}")


def build_tiny_deepseek(kind: str, path: str | os.PathLike, seed: int = 0, with_nextn: bool = False) -> Path:
    """Writes a tiny random DeepSeek model of `kind` (weights + tokenizer) to `path`, once."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = build_tiny_tokenizer()
    config = tiny_deepseek_config(kind, len(tokenizer))
    if with_nextn:
        config.num_nextn_predict_layers = 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # transformers sets norms to one, biases and the score correction to zero: randomize
        # them so that those paths are actually tested.
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name and name.endswith("weight"):
                tensor.copy_(1.0 + 0.2 * torch.randn_like(tensor))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.2 * torch.randn_like(tensor))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if with_nextn:
        add_nextn_layer(path, config, seed)
    return path


def nextn_tensors(config, seed: int) -> dict[str, torch.Tensor]:
    """One random next-n layer under DeepSeek's names: a decoder block of the last (MoE)
    kind, its enorm/hnorm/eh_proj and its shared_head norm (the embedding and lm_head are
    the model's, so not stored)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    torch.manual_seed(seed + 1)
    index, hidden = config.num_hidden_layers, config.hidden_size
    block = DeepseekV3DecoderLayer(config, index)
    prefix = f"model.layers.{index}."
    out = {}
    for name, tensor in block.state_dict().items():
        t = torch.randn_like(tensor) * 0.2
        if "norm" in name and name.endswith("weight"):
            t = 1.0 + 0.2 * torch.randn_like(tensor)
        if name.endswith(".experts.gate_up_proj"):  # stored per expert, as the decoder's are
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up.contiguous()
            continue
        if name.endswith(".experts.down_proj"):
            for e, w in enumerate(t):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = w.contiguous()
            continue
        out[prefix + name] = t.contiguous()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{prefix}{norm}.weight"] = 1.0 + 0.2 * torch.randn(hidden)
    out[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.2
    return out


def add_nextn_layer(path: Path, config, seed: int) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    weights.update(nextn_tensors(config, seed))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
