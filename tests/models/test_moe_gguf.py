"""Mixture-of-experts GGUF files (laid out as llama.cpp writes them: 3D expert tensors, q/k rows
in llama.cpp's RoPE order for Mixtral) load into the same model as their Hugging Face
directories: identical logits for Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE, and the
converted directory also loads in transformers. OLMoE files are refused by name."""

from __future__ import annotations

import gguf
import pytest
import torch
from moe_utils import PagedSequences, build_tiny_moe, load_oracle, random_prompts, write_gguf

from deepinfer_dp.models import load_model


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DP_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_moe_gguf_loads_like_its_hf_directory(kind, tmp_path):
    hf_dir = build_tiny_moe(kind, tmp_path / kind)
    from_hf = load_model(str(hf_dir), torch.float32, "cpu")
    from_gguf = load_model(str(write_gguf(kind, hf_dir, tmp_path / f"{kind}.gguf")), torch.float32, "cpu")
    assert from_gguf.hf_config.model_type == from_hf.hf_config.model_type
    prompt = random_prompts(from_hf.hf_config.vocab_size, [23], seed=3)[0]
    ours = PagedSequences(from_gguf).step({0: prompt}, is_prefill=True)[0]
    assert torch.equal(ours, PagedSequences(from_hf).step({0: prompt}, is_prefill=True)[0])
    with torch.inference_mode():
        theirs = load_oracle(from_gguf.model_dir)(torch.tensor([prompt])).logits[0]
    assert (theirs - ours).abs().max().item() < 1e-3


def test_olmoe_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "olmoe.gguf"
    writer = gguf.GGUFWriter(path, "olmoe")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'olmoe'"):
        load_model(str(path), torch.float32, "cpu")
