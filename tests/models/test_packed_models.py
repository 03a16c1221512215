"""Models that run from packed weights (layers/packed.py) against transformers on the same
weights widened to fp32: a bf16 checkpoint kept bf16, GGUF-style Q4_0/Q4_1/Q8_0 matrices
(a tiny model quantized here, its fp32 checkpoint holding the dequantized values, as the
GGUF converter writes it), mixed formats, and the default model's Q4_1/Q8_0 layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from model_utils import build_tiny_model, hf_greedy, prompts_of_lengths, token_ids
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.layers.packed import PackedEmbedding, PackedLinear
from deepinfer_dp.models import load_model
from deepinfer_dp.models.default_model import PACKED_FILE

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
GGUF_TYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
              "q8_0": GGMLQuantizationType.Q8_0}


def ours(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model_dir), decode_sequence=False, max_num_batched_tokens=32, num_kv_blocks=64)
    return token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))


def packed_modules(model) -> dict[str, str]:
    return {name: m.weight_packed.format for name, m in model.named_modules()
            if isinstance(m, (PackedLinear, PackedEmbedding))}


def bf16_copy(kind: str, root) -> str:
    src = build_tiny_model(kind, root / kind)
    dst = root / f"{kind}-bf16"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (dst / f.name).write_bytes(f.read_bytes())
    return str(dst)


def quantized_copy(kind: str, root, formats: dict[str, str]) -> str:
    """The tiny model with each matrix whose name contains a key of `formats` quantized to
    that format: packed bytes in packed/weights.safetensors, the dequantized values in
    model.safetensors (the oracle's weights)."""
    src = build_tiny_model(kind, root / kind)
    dst = root / f"{kind}-{'-'.join(sorted(set(formats.values())))}-{len(formats)}"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors, packed, layout = load_file(src / "model.safetensors"), {}, {}
    for name, t in tensors.items():
        fmt = next((f for key, f in formats.items() if key in name), None)
        if fmt and t.dim() == 2:
            packed[name] = quants.quantize(t.numpy(), GGUF_TYPES[fmt])
            tensors[name] = torch.from_numpy(np.asarray(quants.dequantize(packed[name], GGUF_TYPES[fmt]),
                                                        dtype=np.float32))
            layout[name] = f"{fmt}:{t.shape[1]}"
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / PACKED_FILE).parent.mkdir()
    save_numpy(packed, dst / PACKED_FILE, metadata=layout)
    return str(dst)


@pytest.mark.parametrize("kind", ["llama-tied", "qwen2-bias"])
def test_bf16_checkpoint_runs_bf16_and_matches_transformers(kind, tmp_path):
    model_dir = bf16_copy(kind, tmp_path)
    formats = packed_modules(load_model(model_dir, torch.float32, "cpu").model)
    assert set(formats.values()) == {"bf16"} and "model.layers.0.self_attn.qkv_proj" in formats
    prompts = prompts_of_lengths([3, 17, 70, 9])
    assert ours(model_dir, prompts) == hf_greedy(model_dir, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("kind,formats", [
    ("llama-gqa", {"proj": "q4_1", "embed_tokens": "q8_0", "lm_head": "q8_0"}),
    ("qwen3-qknorm", {"proj": "q4_0", "embed_tokens": "q8_0"}),  # tied: the lm_head is the embedding
    ("qwen2-bias", {"q_proj": "q8_0", "k_proj": "q4_0", "v_proj": "q4_0", "mlp": "q4_1"}),  # mixed q/k/v
])
def test_quantized_checkpoint_matches_transformers_on_dequantized_weights(kind, formats, tmp_path):
    model_dir = quantized_copy(kind, tmp_path, formats)
    model = load_model(model_dir, torch.float32, "cpu").model
    packed = packed_modules(model)
    if kind == "qwen2-bias":  # q/k/v in Q8_0 and Q4_0 run as one Q8_0 matrix (exact), the MLP in Q4_1
        assert packed["model.layers.0.self_attn.qkv_proj"] == "q8_0"
        assert packed["model.layers.0.mlp.gate_up_proj"] == "q4_1"
    else:
        assert packed["model.embed_tokens"] == "q8_0" and packed["lm_head"] == "q8_0"
    prompts = prompts_of_lengths([3, 17, 70, 9])
    assert ours(model_dir, prompts) == hf_greedy(model_dir, prompts, GREEDY.max_tokens)


def test_packed_and_widened_loads_give_the_same_tokens(tmp_path):
    model_dir = quantized_copy("llama-gqa", tmp_path, {"proj": "q4_1"})
    prompts = prompts_of_lengths([5, 40])
    widened = LLM(model_dir, decode_sequence=False, num_kv_blocks=64, packed_weights=False)
    assert not packed_modules(widened.llm_engine.worker.runner.model)
    assert ours(model_dir, prompts) == token_ids(widened.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                                                                   use_tqdm=False))


def test_default_model_runs_from_its_gguf_blocks():
    loaded = load_model(None, torch.float32, "cpu")
    formats = packed_modules(loaded.model)
    assert formats["model.embed_tokens"] == "q8_0" and formats["lm_head"] == "q8_0"
    assert {f for n, f in formats.items() if ".layers." in n} == {"q4_1"}
    assert not any(p.dim() == 2 for p in loaded.model.parameters())  # no fp32 matrix left
