"""FP8 checkpoints with block scales, widened at load (DeepSeek-V3 as released).

DeepSeek-V3's safetensors store most matrices as float8_e4m3fn with one fp32 scale per
128 x 128 block, saved beside the matrix as `<name>_scale_inv`; its config says so with
`quantization_config: {"quant_method": "fp8", "weight_block_size": [128, 128]}`. A matrix's
value is each fp8 entry times its block's scale (DeepSeek's own `weight_dequant`). The engine
computes in `dtype`, so the matrices are widened here, once, as they are read; the scales
are consumed and never reach a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(model_dir: Path) -> tuple[int, int] | None:
    """The checkpoint's (rows, cols) scale block when it stores block-scaled fp8 weights."""
    config = model_dir / "config.json"
    quant = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if not quant or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size: fp8 checkpoints are read with one scale per "
                         f"block of weights ([rows, cols]); got {block!r}")
    return block[0], block[1]


def dequantize(name: str, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 `weight` * its block's scale; ValueError naming the tensor when shapes disagree."""
    rows, cols = weight.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"checkpoint weight {name!r} of shape {(rows, cols)} needs a {want} {SCALE_SUFFIX} for "
                         f"{block[0]}x{block[1]} blocks, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale
