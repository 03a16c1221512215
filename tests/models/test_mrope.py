"""M-RoPE's cos/sin rows equal transformers' Qwen2-VL rotary embedding bit for bit, and rows
whose three positions agree are plain RoPE's (what decode steps and the C++ stack use)."""

from __future__ import annotations

import torch
from transformers import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from deepinfer_dp.layers.rotary import MRotaryEmbedding, RotaryEmbedding, make_rotary, rope_parameters


def config() -> Qwen2VLTextConfig:
    return Qwen2VLTextConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=512,
                             rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, rope_theta=1e6)


def test_three_row_positions_equal_transformers():
    cfg = config()
    ours = make_rotary(128, 512, rope_parameters(cfg))
    assert isinstance(ours, MRotaryEmbedding)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 500, (3, 37), generator=gen)
    cos, sin = ours.rows(positions, torch.device("cpu"), torch.float32)
    ref_cos, ref_sin = Qwen2VLRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_equal_rows_are_plain_rope():
    params = rope_parameters(config())
    mrope, plain = make_rotary(128, 512, params), RotaryEmbedding(128, 512, params)
    p = torch.tensor([0, 5, 311, 499])
    three = mrope.rows(p.expand(3, -1), torch.device("cpu"), torch.float32)
    for a, b, c in zip(three, mrope.rows(p, torch.device("cpu"), torch.float32),
                       plain.rows(p, torch.device("cpu"), torch.float32), strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
