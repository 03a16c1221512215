"""A tiny dense Llama written as a GGUF file whose tensors each take a chosen format (the
K-quants through tests/kquant_ref.py), laid out as llama.cpp's converter writes them: the
mixes a Q4_K_M or Q5_K_M file holds, at a size a test can run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from kquant_ref import GGUF_TYPES, quantize
from model_utils import build_tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig

from deepinfer_dp.layers.rotary import rope_parameters

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def build_kquant_llama(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama whose matrices have 256 or 512 columns (the K-quants' super-blocks)."""
    config = LlamaConfig(vocab_size=400, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, initializer_range=0.05, rope_theta=10000.0,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{suffix}"


def write_gguf(hf_dir: Path, out: Path, formats: dict[str, str]) -> Path:
    """hf_dir's model as a GGUF file; `formats` maps GGUF tensor names to "f16" or a
    packed format name (kquant_ref.GGUF_TYPES); every other tensor is F32."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    w = gguf.GGUFWriter(out, "llama")
    for add, value in ((w.add_context_length, config.max_position_embeddings), (w.add_vocab_size, config.vocab_size),
                       (w.add_embedding_length, config.hidden_size), (w.add_block_count, config.num_hidden_layers),
                       (w.add_feed_forward_length, config.intermediate_size), (w.add_rope_dimension_count, head_dim),
                       (w.add_head_count, config.num_attention_heads),
                       (w.add_head_count_kv, config.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (w.add_rope_freq_base, rope_parameters(config)["rope_theta"])):
        add(value)
    _add_tokenizer(w, hf_dir)
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's RoPE row order
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
        g, fmt = gguf_name(name), formats.get(gguf_name(name))
        array = t.float().numpy()
        if fmt == "f16":
            w.add_tensor(g, array.astype(np.float16))
        elif fmt:
            w.add_tensor(g, quantize(array, fmt), raw_dtype=GGUF_TYPES[fmt])
        else:
            w.add_tensor(g, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, hf_dir: Path) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
