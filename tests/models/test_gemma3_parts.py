"""Gemma 3 whose fused projections mix formats as GGUF files store them (the real 270M
Q4_K_M file's Q5_0 q/k next to a Q8_0 v; a Llama Q4_K_M file's Q4_K q/k next to a Q6_K v): a
converted directory (model.safetensors with the values gguf dequantizes, packed/ with the
blocks, as models/default_model.py writes one) loads with every part in its own format (or,
for Q4_0/Q5_0/Q8_0 mixes, as one Q8_0 matrix the decode stack takes) and nothing widened,
and greedy output equals transformers on the dequantized values."""

from __future__ import annotations

import numpy as np
import torch
from kquant_ref import dequantize, quantize
from model_utils import write_tiny_model
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file
from test_gemma3 import gemma3_config
from test_sliding_window import check_greedy

from deepinfer_dp.layers.packed import PackedLinear
from deepinfer_dp.layers.packed_parts import PackedPartsLinear
from deepinfer_dp.models import load_model
from deepinfer_dp.models.default_model import PACKED_FILE

# Per layer: q, k, v, o, gate, up, down (o's 128 columns fit no K-quant super-block).
LAYER_FORMATS = [
    ("q5_0", "q5_0", "q8_0", "q8_0", "q5_0", "q5_0", "q6_k"),  # as the real file's "more bits" layers
    ("q4_k", "q4_k", "q6_k", "q5_0", "q4_k", "q6_k", "q4_k"),  # K-quant mixes
    ("q5_0", "q5_0", "q5_0", "q4_0", "q5_k", "q5_k", "q5_k"),  # one format each
    ("q8_0", "q4_0", "q5_1", "q5_1", "q8_0", "q8_0", "q8_0"),  # three formats of 32-value blocks
]
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")
FUSED = {
    # Q5_0 q/k with a Q8_0 v become one Q8_0 matrix (exact): Gemma 3 layers run on the one-call
    # decode stack, where one format is one kernel call; the other mixes stay parts. Q5_0 parts
    # alone become Q8_0 too (faster to widen).
    "model.layers.0.self_attn.qkv_proj": "q8_0", "model.layers.0.mlp.gate_up_proj": "q8_0",
    "model.layers.1.self_attn.qkv_proj": "q4_k+q6_k", "model.layers.1.mlp.gate_up_proj": "q4_k+q6_k",
    "model.layers.2.self_attn.qkv_proj": "q8_0", "model.layers.2.mlp.gate_up_proj": "q5_k",
    "model.layers.3.self_attn.qkv_proj": "q8_0+q4_0+q5_1", "model.layers.3.mlp.gate_up_proj": "q8_0",
}


def write_quantized_gemma3(path):
    """A tiny Gemma 3 (256 columns: room for K-quant super-blocks) with its matrices in
    LAYER_FORMATS, laid out as a converted GGUF file."""
    write_tiny_model(lambda v: gemma3_config(v, hidden_size=256, intermediate_size=512), path)
    tensors = load_file(path / "model.safetensors")
    packed, layout = {}, {"format": "np"}
    for i, formats in enumerate(LAYER_FORMATS):
        for proj, fmt in zip(PROJS, formats, strict=True):
            name = f"model.layers.{i}.{proj}.weight"
            data = np.ascontiguousarray(quantize(tensors[name].numpy(), fmt))
            tensors[name] = torch.from_numpy(dequantize(data, fmt))
            packed[name], layout[name] = data, f"{fmt}:{tensors[name].shape[1]}"
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / PACKED_FILE).parent.mkdir()
    save_numpy(packed, path / PACKED_FILE, metadata=layout)
    return path


def test_mixed_fused_projections_stay_packed_and_match_transformers(tmp_path):
    path = write_quantized_gemma3(tmp_path / "gemma3-mixed")
    model = load_model(str(path), torch.float32, "cpu").model
    formats = {name: m.weight_packed.format for name, m in model.named_modules() if name in FUSED}
    assert formats == FUSED
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, PackedPartsLinear)
    assert all(isinstance(m, PackedLinear) for name, m in model.named_modules() if name.endswith("_proj"))
    # 4 KV groups (one a layer): a sequence of 512 positions holds 4 x 128 blocks at most
    check_greedy(path, 4, 24, num_kv_blocks=4 * 128 + 1)
    # bf16 arithmetic: a matrix of parts becomes one bf16 matrix, of its widened values rounded
    bf16 = load_model(str(path), torch.bfloat16, "cpu").model.model.layers[1].self_attn.qkv_proj
    assert type(bf16) is PackedLinear and bf16.weight_packed.format == "bf16_pairs"
    want = model.model.layers[1].self_attn.qkv_proj.weight_packed.widen().to(torch.bfloat16).float()
    assert torch.equal(bf16.weight_packed.widen(), want)


def test_a_fused_projection_with_a_part_not_packed_is_widened_with_a_warning(caplog):
    """A part no packed kernel runs (widened by the converter: F16, IQ formats) leaves its
    projection an fp32 matrix, and the load says which."""
    from torch import nn

    from deepinfer_dp.layers.packed import PackedWeight
    from deepinfer_dp.models import packed_loader

    gate = PackedWeight(np.ascontiguousarray(quantize(np.ones((4, 256), np.float32), "q4_k")), "q4_k", 256)
    weights = {"gate.weight": gate, "up.weight": torch.ones(4, 256)}
    linear, used = nn.Linear(256, 8, bias=False), set()
    with caplog.at_level("WARNING", logger=packed_loader.logger.name):
        assert packed_loader._packed(linear, weights, used, ["gate.weight", "up.weight"]) is linear
    assert not used and "gate.weight + up.weight widened to fp32 at load" in caplog.text
