"""GGUF files of the tiny dense models (tests/model_utils.py), written with the `gguf` package
the way llama.cpp's converter lays them out: its tensor names, q/k rows in its RoPE order for
the `llama` architecture (Llama and Mistral), the tokenizer and the chat template in the
metadata, and each matrix in the format asked for (Q4_0, Q4_1, Q8_0, BF16, F16 or F32). Rope
scaling is not written (llama.cpp keeps Llama 3.1's as a rope_freqs tensor, which the engine
refuses): a file's oracle is transformers reading that file, not the directory it came from."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file
from transformers import AutoConfig

from deepinfer_dp.layers.rotary import rope_parameters

# Hugging Face model_type -> the GGUF architecture llama.cpp writes it as
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Every format the engine reads from a GGUF file today, spread over one model's matrices
# (the first key a name contains wins): the attention output F32, q/k/v Q4_0, the MLP's gate
# and up Q8_0, its down Q4_1, the embedding F16, the head BF16 (tied models have none).
MIXED_FORMATS = {"o_proj": "F32", "self_attn": "Q4_0", "down_proj": "Q4_1", "mlp": "Q8_0", "embed_tokens": "F16",
                 "lm_head": "BF16"}


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base in _GGUF_TOP:
        return f"{_GGUF_TOP[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}.{suffix}"


def add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path) -> None:
    """The model directory's byte-level BPE tokenizer and chat template as GGUF metadata."""
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
    template = json.loads((hf_dir / "tokenizer_config.json").read_text()).get("chat_template")
    template = template or (hf_dir / "chat_template.jinja").read_text()
    w.add_chat_template(template)


def add_dense_config(w: gguf.GGUFWriter, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_name(f"Tiny {config.model_type.capitalize()}")  # as released files name themselves
    for add, value in ((w.add_context_length, config.max_position_embeddings), (w.add_vocab_size, config.vocab_size),
                       (w.add_embedding_length, config.hidden_size), (w.add_block_count, config.num_hidden_layers),
                       (w.add_feed_forward_length, config.intermediate_size), (w.add_rope_dimension_count, head_dim),
                       (w.add_head_count, config.num_attention_heads), (w.add_key_length, head_dim),
                       (w.add_head_count_kv, config.num_key_value_heads), (w.add_value_length, head_dim),
                       (w.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (w.add_rope_freq_base, rope_parameters(config)["rope_theta"])):
        add(value)


def llama_cpp_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows in llama.cpp's order for its interleaved RoPE (the converter's permute)."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)


def _add_tensor(w: gguf.GGUFWriter, name: str, t: torch.Tensor, fmt: str) -> None:
    array = t.numpy().astype(np.float32)
    if t.dim() == 1 or fmt == "F32":
        w.add_tensor(name, array)
    elif fmt == "F16":
        w.add_tensor(name, array.astype(np.float16))
    else:
        kind = GGMLQuantizationType[fmt]
        w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def write_dense_gguf(hf_dir: str | Path, out: str | Path, formats: dict[str, str] | None = None,
                     default: str = "F32", sampling: dict[str, float] | None = None) -> Path:
    """A GGUF file of the tiny dense model in `hf_dir`: each matrix whose name contains a key
    of `formats` in that format, the others in `default`; vectors (norms, biases) in F32;
    `sampling` as general.sampling.<key> metadata (temp, top_p, top_k, ...)."""
    hf_dir, out = Path(hf_dir), Path(out)
    config = AutoConfig.from_pretrained(hf_dir)
    arch = GGUF_ARCH[config.model_type]
    w = gguf.GGUFWriter(out, arch)
    add_dense_config(w, config)
    add_tokenizer(w, hf_dir)
    for key, value in (sampling or {}).items():
        getattr(w, f"add_sampling_{key}")(value)
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = llama_cpp_rows(t, config.num_attention_heads if "q_proj" in name else config.num_key_value_heads)
        fmt = next((f for key, f in (formats or {}).items() if key in name), default)
        _add_tensor(w, gguf_name(name), t, fmt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
