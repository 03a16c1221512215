"""A checkpoint's weights as (Hugging Face name, tensor) pairs, read from its safetensors files.

The loader reads a whole model through iterate_weights; a loaded MoE model reads its routed
experts again through it when an expert-parallel group re-forms (moe_models.py), and the
MTP layer reads its own layer (deepseek_mtp.py). Block-scaled fp8 matrices come out widened
(fp8_blocks.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer_dp.models.fp8_blocks import FP8_DTYPES, SCALE_SUFFIX, dequantize, fp8_block_size


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shard files, from the index when the checkpoint is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {str(model_dir)!r}")
    return files


def iterate_weights(model_dir: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) pairs, memory-mapped from the safetensors files; with
    `keep`, only the names it accepts are read at all (another EP rank's experts are not).
    Block-scaled fp8 matrices come out widened to fp32, their scales consumed (fp8_blocks.py)."""
    block = fp8_block_size(model_dir)
    files = safetensors_files(model_dir)
    where = {name: file for file in files for name in _names(file)} if block else {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if (block and name.endswith(SCALE_SUFFIX)) or (keep is not None and not keep(name)):
                    continue
                tensor = f.get_tensor(name)
                if block and tensor.dtype in FP8_DTYPES:
                    tensor = dequantize(name, tensor, _scale_of(name, where), block)
                yield name, tensor


def _names(file: Path) -> list[str]:
    with safe_open(file, framework="pt") as f:
        return list(f.keys())


def _scale_of(name: str, where: dict[str, Path]) -> torch.Tensor:
    scale = name + SCALE_SUFFIX
    if scale not in where:
        raise ValueError(f"checkpoint weight {name!r} is fp8 but the checkpoint has no {scale!r} for it")
    with safe_open(where[scale], framework="pt") as f:
        return f.get_tensor(scale)
