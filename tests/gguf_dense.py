"""A tiny dense Llama written as a GGUF file whose tensors each take a chosen format (the
K-quants through tests/kquant_ref.py), laid out as llama.cpp's converter writes them: the
mixes a Q4_K_M or Q5_K_M file holds, at a size a test can run."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf_utils import add_dense_config, add_tokenizer, gguf_name, llama_cpp_rows
from kquant_ref import GGUF_TYPES, quantize
from model_utils import build_tiny_tokenizer
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig


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


def write_gguf(hf_dir: Path, out: Path, formats: dict[str, str]) -> Path:
    """hf_dir's model as a GGUF file; `formats` maps GGUF tensor names to "f16" or a
    packed format name (kquant_ref.GGUF_TYPES); every other tensor is F32. The metadata,
    tokenizer, tensor names and RoPE row order are gguf_utils' (what llama.cpp writes)."""
    config = AutoConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(out, "llama")
    add_dense_config(w, config)
    add_tokenizer(w, hf_dir)
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t = llama_cpp_rows(t, config.num_attention_heads if "q_proj" in name else config.num_key_value_heads)
        g = gguf_name(name)
        fmt, array = formats.get(g), t.float().numpy()
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
